"""trajstore.torchrl.TrajstoreStorage against TorchRL's own components (issue 35, point 1).

The cases of TorchRL's storage tests (test/test_rb.py: get/set, in-place writes, a new key refused,
contains, iteration, state_dict, dumps/loads, the round-robin ring, sampling from an empty storage)
run here against our storage, with TorchRL's LazyMemmapStorage as the reference wherever the two
must agree: the same writes leave the same slots, and the same seed samples the same rows with
RandomSampler, SliceSampler and PrioritizedSampler.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import (
    Bounded,
    Categorical,
    Composite,
    LazyMemmapStorage,
    PrioritizedSampler,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    SliceSampler,
    Unbounded,
)

from trajstore import ReplayBuffer as TrajstoreBuffer
from trajstore import TrajectoryReplayBuffer
from trajstore.errors import (
    BadIndexError,
    IndexOutOfRangeError,
    SpaceMismatchError,
    UnsupportedSpaceError,
)
from trajstore.maintenance.verify import verify_store
from trajstore.torchrl import TrajstoreStorage, space_from_spec

TRAJ = ("collector", "traj_ids")


def _has_segment_trees() -> bool:
    """TorchRL's PrioritizedSampler needs its C++ extension (torchrl 0.14.1's wheel is built for another
    torch than the pinned 2.13.0 and fails to load with an undefined symbol)."""
    from torchrl.data.replay_buffers.samplers import prioritized

    return prioritized.SumSegmentTreeFp32 is not None


def rows(start: int, n: int, episode_len: int | None = 4) -> TensorDict:
    """``n`` rows whose values are their global row numbers ``start ..``, nested like a collector's."""
    i = torch.arange(start, start + n)
    td = TensorDict({"obs": i.float()[:, None].expand(n, 3).clone(), "action": i % 2,
                     "next": {"obs": (i + 1).float()[:, None].expand(n, 3).clone(),
                              "reward": i.float()[:, None], "done": (i % 4 == 3)[:, None]}}, [n])
    if episode_len is not None:
        td.set(TRAJ, i // episode_len)
    return td


def pair(tmp_path, max_size: int = 10, **make):
    """Our storage and TorchRL's memmap storage, each in a ReplayBuffer with its own new components
    (``make``: ``sampler=`` / ``writer=`` factories) and ``batch_size=4``."""
    ours = ReplayBuffer(storage=TrajstoreStorage(tmp_path / "store", max_size=max_size), batch_size=4,
                        **{k: f() for k, f in make.items()})
    ref = ReplayBuffer(storage=LazyMemmapStorage(max_size, scratch_dir=tmp_path / "memmap"), batch_size=4,
                       **{k: f() for k, f in make.items()})
    return ours, ref


def same(a: TensorDict, b: TensorDict) -> None:
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for k in a.keys(True, True):
        assert torch.equal(a.get(k), b.get(k)), k


def test_get_set_and_the_ring_match_lazy_memmap(tmp_path) -> None:
    ours, ref = pair(tmp_path, writer=RoundRobinWriter)
    for start, n in [(0, 6), (6, 3), (9, 7), (16, 12)]:          # wraps twice; the last batch > max_size
        ia, ib = ours.extend(rows(start, n)), ref.extend(rows(start, n))
        assert torch.equal(ia, ib)
        assert len(ours) == len(ref)
        same(ours.storage[:], ref.storage[:])                     # the same rows in the same slots
    assert ours.storage._last_cursor_index == ref.storage._last_cursor_index
    same(ours.storage.get(torch.tensor([3, 0, 9])), ref.storage.get(torch.tensor([3, 0, 9])))
    same(ours.storage[4], ref.storage[4])
    same(ours.storage[2:7], ref.storage[2:7])
    assert ours.storage.buffer.offset == 8 and ours.storage[:]["obs"][:, 0].tolist() == \
        [20, 21, 22, 23, 24, 25, 26, 27, 18, 19]
    assert verify_store(tmp_path / "store").ok


def test_in_place_writes_keep_the_cursor(tmp_path) -> None:
    ours, ref = pair(tmp_path)
    for rb in (ours, ref):
        rb.extend(rows(0, 8))
        rb[2:4] = rows(100, 2)                    # Storage.__setitem__: set_cursor=False
        rb.storage.set(torch.tensor([6]), rows(200, 1), set_cursor=False)
        rb.extend(rows(8, 1))                     # the writer goes on at slot 8
    same(ours.storage[:], ref.storage[:])
    assert ours.storage[:]["obs"][:, 0].tolist() == [0, 1, 100, 101, 4, 5, 200, 7, 8]


def test_a_new_key_or_shape_or_dtype_is_refused_before_a_byte_is_written(tmp_path) -> None:
    ours = ReplayBuffer(storage=TrajstoreStorage(tmp_path / "s", max_size=10))
    ours.extend(rows(0, 4))
    bad = rows(4, 2)
    bad.set("extra", torch.zeros(2))
    with pytest.raises(SpaceMismatchError, match="'extra'"):
        ours.extend(bad)
    bad = rows(4, 2)
    bad.set("obs", torch.zeros(2, 4))
    with pytest.raises(SpaceMismatchError, match=r"'obs' has per-row shape \(4,\), the store's field \(3,\)"):
        ours[0:2] = bad
    bad = rows(4, 2)
    bad.set(("next", "reward"), torch.zeros(2, 1, dtype=torch.float64))
    with pytest.raises(SpaceMismatchError, match=r"\('next', 'reward'\) is float64, the store's field is float32"):
        ours.extend(bad)
    with pytest.raises(SpaceMismatchError, match=r"missing keys \('next', 'done'\)"):
        ours.extend(rows(4, 2).exclude(("next", "done")))
    assert len(ours) == 4 and ours.storage[:]["obs"][:, 0].tolist() == [0, 1, 2, 3]
    assert ours.storage.next_slot() == 4


def spec() -> Composite:
    return Composite(obs=Bounded(-1.0, 1.0, (3,)), action=Categorical(2, ()),
                     next=Composite(obs=Bounded(-1.0, 1.0, (3,)), reward=Unbounded((1,)),
                                    done=Categorical(2, (1,), dtype=torch.bool)))


def test_a_spec_creates_the_store_and_a_spec_that_differs_is_named(tmp_path) -> None:
    st = TrajstoreStorage(tmp_path / "s", max_size=8, spec=spec())
    space = st.buffer.single_space
    assert space["action"].n == 2 and space["obs"].high.tolist() == [1.0, 1.0, 1.0]
    assert space == space_from_spec(spec())
    st.close()
    TrajstoreStorage(tmp_path / "s", spec=spec()).close()           # the same spec reopens
    other = spec()
    other["next", "reward"] = Unbounded((2,))
    with pytest.raises(SpaceMismatchError, match=r"\('next', 'reward'\) has per-row shape \(2,\)"):
        TrajstoreStorage(tmp_path / "s", spec=other)
    other = spec()
    other["action"] = Categorical(2, (), dtype=torch.int32)
    with pytest.raises(SpaceMismatchError, match=r"'action' is int32, the store's field is int64"):
        TrajstoreStorage(tmp_path / "s", spec=other)
    del other["action"]
    with pytest.raises(SpaceMismatchError, match="missing keys 'action'"):
        TrajstoreStorage(tmp_path / "s", spec=other)


def test_stores_without_a_tensordict_layout_are_refused(tmp_path) -> None:
    import gymnasium as gym
    import numpy as np

    TrajstoreBuffer.create(gym.spaces.Tuple([gym.spaces.Discrete(2)]), cache_path=tmp_path / "t").close()
    with pytest.raises(UnsupportedSpaceError, match="Tuple"):
        TrajstoreStorage(tmp_path / "t")
    TrajstoreBuffer.create(gym.spaces.Box(0, 1, (2,), np.float32), cache_path=tmp_path / "b").close()
    with pytest.raises(UnsupportedSpaceError, match="bare Box"):
        TrajstoreStorage(tmp_path / "b")


def test_contains_len_iteration_and_empty(tmp_path) -> None:
    st = TrajstoreStorage(tmp_path / "s", max_size=6)
    rb = ReplayBuffer(storage=st, batch_size=2)
    assert len(st) == 0 and 0 not in st
    with pytest.raises(RuntimeError, match="empty storage"):   # TorchRL's sampler refuses
        rb.sample()
    rb.extend(rows(0, 3))
    assert 2 in st and 3 not in st and -1 in st
    assert st.contains(torch.tensor([0, 5])).tolist() == [True, False]
    assert [int(r["obs"][0]) for r in st] == [0, 1, 2]
    with pytest.raises(IndexOutOfRangeError):
        st[3]
    rb.empty()
    assert len(st) == 0 and len(st.buffer) == 0
    rb.extend(rows(10, 2))                          # the writer starts over at slot 0
    assert st[:]["obs"][:, 0].tolist() == [10, 11]


@pytest.mark.parametrize("make_sampler", [
    lambda: RandomSampler(),
    lambda: SliceSampler(slice_len=2, traj_key=TRAJ),
    lambda: SliceSampler(num_slices=2, end_key=("next", "done")),
    pytest.param(lambda: PrioritizedSampler(max_capacity=12, alpha=0.7, beta=0.5), marks=pytest.mark.skipif(
        not _has_segment_trees(), reason="TorchRL's compiled segment trees do not load against this torch")),
], ids=["random", "slice-traj-key", "slice-end-key", "prioritized"])
def test_samplers_draw_the_same_rows_as_with_lazy_memmap(tmp_path, make_sampler) -> None:
    ours, ref = pair(tmp_path, max_size=12, sampler=make_sampler)
    for rb in (ours, ref):
        rb.extend(rows(0, 9))
        rb.extend(rows(9, 7))                           # wraps the ring of 12
    assert ours.storage.episodes                        # traj ids made a store that records episodes
    for step in range(5):
        torch.manual_seed(step)
        a, ia = ours.sample(return_info=True)
        torch.manual_seed(step)
        b, ib = ref.sample(return_info=True)
        same(a, b)
        if isinstance(ours.sampler, PrioritizedSampler):
            prio = a["obs"][:, 0] + 1.0
            ours.update_priority(ia["index"], prio)
            ref.update_priority(ib["index"], prio)
    if isinstance(ours.sampler, SliceSampler):          # slices never cross an episode
        ids = a.get(TRAJ).reshape(2, -1)
        assert (ids == ids[:, :1]).all()


def test_episode_ids_are_the_trajectory_store_ids(tmp_path) -> None:
    st = TrajstoreStorage(tmp_path / "s", max_size=20)
    rb = ReplayBuffer(storage=st)
    rb.extend(rows(0, 10, episode_len=4))
    st.close()
    tb = TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True)
    assert tb.get_at_with_metadata(slice(None))[1]["episode_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    tb.close()


def test_reopen_needs_the_writer_resumed(tmp_path) -> None:
    rb = ReplayBuffer(storage=TrajstoreStorage(tmp_path / "s", max_size=8))
    rb.extend(rows(0, 5))
    rb.storage.close()
    st = TrajstoreStorage(tmp_path / "s")                 # max_size from the store
    assert st.max_size == 8 and len(st) == 5
    rb = ReplayBuffer(storage=st)
    with pytest.raises(BadIndexError, match="next free slot is 5"):
        rb.extend(rows(5, 2))                             # a fresh writer would overwrite slot 0
    st.resume(rb)
    rb.extend(rows(5, 4))
    assert st[:]["obs"][:, 0].tolist() == [8, 1, 2, 3, 4, 5, 6, 7]


def test_state_dict_round_trip_and_a_foreign_state_is_named(tmp_path) -> None:
    ours, ref = pair(tmp_path, max_size=8)
    for rb in (ours, ref):
        rb.extend(rows(0, 11))
    sd = ours.state_dict()
    ours.storage.close()
    again = ReplayBuffer(storage=TrajstoreStorage(tmp_path / "store"))
    again.load_state_dict(sd)                             # restores the writer's cursor too
    again.extend(rows(11, 3))
    ref.extend(rows(11, 3))
    same(again.storage[:], ref.storage[:])
    other = ReplayBuffer(storage=TrajstoreStorage(tmp_path / "other", max_size=8))
    other.extend(rows(0, 2))
    with pytest.raises(SpaceMismatchError, match="rows: checkpoint 8, store 2"):
        other.load_state_dict(sd)


def test_dumps_and_loads_through_the_replay_buffer(tmp_path) -> None:
    ours, ref = pair(tmp_path, max_size=8)
    for rb in (ours, ref):
        rb.extend(rows(0, 11))
    ours.dumps(tmp_path / "ckpt")
    assert verify_store(tmp_path / "ckpt" / "storage").ok
    fresh = ReplayBuffer(storage=TrajstoreStorage(tmp_path / "fresh", max_size=8))
    fresh.loads(tmp_path / "ckpt")
    same(fresh.storage[:], ours.storage[:])
    fresh.extend(rows(11, 2))
    ref.extend(rows(11, 2))
    same(fresh.storage[:], ref.storage[:])
    assert len(TrajstoreStorage(tmp_path / "ckpt" / "storage", read_only=True)) == 8


def test_tensordict_replay_buffer_and_pickling(tmp_path) -> None:
    """TensorDictReplayBuffer (which adds "index" to its samples) and a storage crossing processes
    by pickle: the copy opens the store by path (read-only here, as a second writer is refused)."""
    import pickle

    from torchrl.data import TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=TrajstoreStorage(tmp_path / "s", max_size=8), batch_size=4)
    rb.extend(rows(0, 5))
    sample = rb.sample()
    assert torch.equal(sample["obs"][:, 0].long(), sample["index"])
    rb.storage.close()
    reader = TrajstoreStorage(tmp_path / "s", read_only=True)
    copy = pickle.loads(pickle.dumps(reader))
    same(copy[:], reader[:])
    assert copy.read_only and len(copy) == 5
