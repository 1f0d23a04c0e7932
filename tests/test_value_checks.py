"""Values outside a space, or that do not fit a field's dtype, are refused before any byte is written.

Covers every write path of ReplayBuffer and TrajectoryReplayBuffer, the messages (field, row,
element, value, what the space allows), what stays accepted (float64 into float32, whole floats
into integer fields, bool into MultiBinary, torch tensors), the opt-in ``check_bounds`` and the
byte-sized steps of ``extend_from``.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from gymnasium.spaces import Box, Dict, Discrete, MultiBinary, MultiDiscrete, Tuple

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.errors import BadArgumentError, BadValueError
from trajstore.spaces import ValuePlan


def _space() -> Dict:
    return Dict(obs=Box(-10, 10, (17,), np.float32), act=Discrete(4), md=MultiDiscrete([2, 3]), mb=MultiBinary(3),
                img=Box(0, 255, (2,), np.uint8))


def _row(act=1, **kw):
    row = {"obs": np.ones(17, np.float32), "act": act, "md": np.array([1, 2]), "mb": np.array([1, 0, 1], np.int8),
           "img": np.array([3, 4], np.uint8)}
    return row | kw


def _batch(n: int, **kw):
    b = {"obs": np.ones((n, 17), np.float32), "act": np.arange(n) % 4, "md": np.tile([1, 2], (n, 1)),
         "mb": np.tile(np.array([1, 0, 1], np.int8), (n, 1)), "img": np.tile(np.array([3, 4], np.uint8), (n, 1))}
    return b | kw


# ---------------------------------------------------------------- refusals and messages


@pytest.mark.parametrize("space, value, match", [
    (Discrete(2), 7, r"^value is 7; expected an integer in \[0, 1\] \(Discrete\(2\)\)$"),
    (Discrete(3, start=-1), 2, r"^value is 2; expected an integer in \[-1, 1\] \(Discrete\(3, start=-1\)\)$"),
    (Discrete(3, start=-1), -2, r"is -2; expected an integer in \[-1, 1\]"),
    (Discrete(2), np.int32(5), r"^value is 5; expected an integer in \[0, 1\]"),
    (Discrete(2), 0.5, r"^value is 0.5; expected a whole number for an integer field of dtype int64 \(got float64"),
    (Discrete(2), float("nan"), r"^value is nan; expected a whole number"),
    (Discrete(2), 3.0, r"^value is 3; expected an integer in \[0, 1\]"),  # whole, but outside
    (Discrete(2), torch.tensor(2), r"^value is 2; expected an integer in \[0, 1\]"),
    (MultiDiscrete([2, 3]), [1, 3], (r"^value element \[1\] is 3; expected an integer in \[0, 2\] at that element "
                                     r"\(MultiDiscrete\(\[2, 3\]\)\)$")),
    (MultiDiscrete([[2, 3]]), [[2, 3]], r"element \[0, 0\] is 2; .* \(2 bad values: 2, 3\)$"),
    (MultiBinary(3), [0, 2, 1], r"^value element \[1\] is 2; expected 0 or 1 \(MultiBinary\(3\)\)$"),
    (MultiBinary(3), np.array([0, -1, 1], np.int8), r"element \[1\] is -1; expected 0 or 1"),
    (Box(0, 255, (2,), np.uint8), [300, 1], (r"^value element \[0\] is 300; expected a value within the range of "
                                             r"uint8 \[0, 255\] \(got int64\)$")),
    (Box(0, 255, (2,), np.uint8), np.array([1, -1]), r"element \[1\] is -1; expected a value within the range of uint8"),
    (Box(-5, 5, (1,), np.int32), np.array([2**40]), r"is 1099511627776; expected a value within the range of int32"),
    (Box(0, 255, (1,), np.uint8), np.array([256.0]), r"is 256.0; expected a value within the range of uint8"),
    (Box(0, 9, (1,), np.int64), np.array([2.0**63]), r"within the range of int64"),
])
def test_append_refuses(space, value, match) -> None:
    rb = ReplayBuffer.create(space)
    with pytest.raises(BadValueError, match=match):
        rb.append(value)
    assert len(rb) == 0


def test_batched_message_names_row_field_and_counts() -> None:
    rb = ReplayBuffer.create(_space())
    act = np.array([0, 1, 9, 3, 9, -1])
    with pytest.raises(BadValueError, match=r"^value at 'act' row 2 is 9; expected an integer in \[0, 3\] "
                                            r"\(Discrete\(4\)\) \(3 bad values in 3 of 6 rows: 9, -1\)$"):
        rb.extend(_batch(6, act=act))
    with pytest.raises(BadValueError, match=r"^value at 'md' row 1, element \[1\] is 3; expected an integer in "
                                            r"\[0, 2\] at that element"):
        rb.extend(_batch(2, md=np.array([[1, 2], [0, 3]])))
    with pytest.raises(BadValueError, match=r"^value at 'img' row 1, element \[0\] is 256; expected a value within "
                                            r"the range of uint8"):
        rb.extend(_batch(2, img=np.array([[1, 2], [256, 2]])))
    with pytest.raises(BadValueError, match=r"^value at 'act' row 1 is 1.5; expected a whole number"):
        rb.extend(_batch(2, act=np.array([1.0, 1.5])))
    assert len(rb) == 0


def test_nested_path_in_message() -> None:
    space = Dict(a=Tuple((Box(0, 1, (2,)), Dict(d=Discrete(3)))))
    rb = ReplayBuffer.create(space)
    with pytest.raises(BadValueError, match=r"^value at 'a/1/d' is 5; expected an integer in \[0, 2\]"):
        rb.append({"a": (np.zeros(2), {"d": 5})})


# ---------------------------------------------------------------- accepted


def test_accepted_values() -> None:
    rb = ReplayBuffer.create(_space())
    rb.append(_row(obs=np.ones(17), act=1.0))  # float64 -> float32, whole float -> Discrete
    rb.append(_row(act=np.float32(3.0), mb=np.array([True, False, True])))  # bool -> MultiBinary
    rb.append(_row(act=torch.tensor(2), obs=torch.ones(17, dtype=torch.float64), md=torch.tensor([1.0, 0.0])))
    rb.append(_row(act=np.array(0), img=[255, 0]))  # Python ints that fit uint8
    rb.extend(_batch(3, act=np.array([1.0, 2.0, 3.0]), obs=np.full((3, 17), 20.0)))  # bounds unchecked by default
    rb.extend(_batch(2, act=torch.tensor([1.0, 0.0]), mb=torch.tensor([[True, False, True]] * 2)))
    assert len(rb) == 9
    assert rb.get_column("act")[:].tolist() == [1, 3, 2, 0, 1, 2, 3, 1, 0]
    assert rb[0]["obs"].dtype == np.float32 and rb[1]["mb"].tolist() == [1, 0, 1]
    assert rb[4]["obs"][0] == 20.0


def test_sb3_style_float_actions() -> None:
    # SB3 hands actions around as float arrays, e.g. np.array([[1.]]) for a Discrete in some paths
    rb = ReplayBuffer.create(Dict(action=Discrete(3), reward=Box(-np.inf, np.inf, (), np.float32)))
    rb.extend({"action": np.array([[1.0]]).reshape(-1), "reward": np.array([0.5])})
    rb.append({"action": np.array([[2.0]])[0, 0], "reward": 1.0})
    assert rb.get_column("action")[:].tolist() == [1, 2]


# ---------------------------------------------------------------- every write path, nothing written


def test_bad_row_in_extend_writes_nothing(tmp_path) -> None:
    path = tmp_path / "rb"
    rb = ReplayBuffer.create(_space(), cache_path=path, capacity=10)
    rb.extend(_batch(8))
    rb.flush()
    before = rb[:]
    act = np.arange(5) % 4
    act[3] = 4  # one bad row in the middle of a batch that would also wrap the ring
    with pytest.raises(BadValueError, match=r"value at 'act' row 3 is 4"):
        rb.extend(_batch(5, act=act))
    assert len(rb) == 8 and rb.offset == 0
    rb.close()
    again = ReplayBuffer.load_from(path, read_only=True)
    assert len(again) == 8
    for k in before:
        assert np.array_equal(again[:][k], before[k])


def test_append_bad_leaf_leaves_row_untouched() -> None:
    rb = ReplayBuffer.create(_space())
    rb.append(_row(act=2))
    # every leaf but the last is fine: nothing of the row may be staged
    with pytest.raises(BadValueError, match="'img'"):
        rb.append(_row(act=3, obs=np.full(17, 5, np.float32), img=np.array([1, 256])))
    assert len(rb) == 1
    rb.append(_row(act=1))
    assert rb.get_column("act")[:].tolist() == [2, 1] and rb[1]["obs"][0] == 1.0


def test_replay_buffer_write_paths() -> None:
    space = Dict(a=Discrete(3), b=Box(0, 255, (2,), np.uint8), c=MultiBinary(2))
    rb = ReplayBuffer.create(space)
    rb.extend({"a": np.array([0, 1]), "b": np.zeros((2, 2), np.uint8), "c": np.zeros((2, 2), np.int8)})
    with pytest.raises(BadValueError, match=r"value at 'a' is 3"):
        rb.set_at(0, {"a": 3, "b": [0, 0], "c": [0, 0]})
    with pytest.raises(BadValueError, match=r"value at 'c' row 1, element \[0\] is 2"):
        rb.set_at(np.array([0, 1]), {"a": np.array([0, 1]), "b": np.zeros((2, 2)), "c": np.array([[0, 1], [2, 0]])})
    # flattened layout: a one-hot (3) | b (2) | c (2)
    with pytest.raises(BadValueError, match=r"value at 'b' row 0, element \[1\] is 300.0; expected a value within"):
        rb.append_flattened(np.array([1, 0, 0, 3, 300, 0, 1], np.float64))
    with pytest.raises(BadValueError, match=r"value at 'c' row 1, element \[0\] is 2"):
        rb.extend_flattened(np.array([[1, 0, 0, 3, 3, 0, 1], [0, 1, 0, 3, 3, 2, 1]]))
    with pytest.raises(BadValueError, match=r"value at 'b' row 0, element \[0\] is 0.5; expected a whole number"):
        rb.extend_flattened(np.array([[1, 0, 0, 0.5, 3, 0, 1]]))
    with pytest.raises(BadValueError, match=r"value at 'b'"):
        rb.set_flattened_at(0, np.array([1, 0, 0, 3, -1, 0, 1]))
    assert len(rb) == 2 and rb.get_column("a")[:].tolist() == [0, 1]
    rb.append_flattened(np.array([0, 0, 1, 3, 255, 0, 1], np.float64))  # whole floats that fit
    assert rb[2]["b"].tolist() == [3, 255] and rb[2]["a"] == 2


def test_flattened_bool_box_takes_zero_and_one() -> None:
    rb = ReplayBuffer.create(Dict(f=Box(0, 1, (2,), np.bool_), x=Box(-1, 1, (1,), np.float32)))
    rb.append_flattened(np.array([1.0, 0.0, 0.5]))
    assert rb[0]["f"].tolist() == [True, False]
    with pytest.raises(BadValueError, match=r"value at 'f' row 0, element \[0\] is 0.5; expected 0 or 1"):
        rb.append_flattened(np.array([0.5, 0.0, 0.5]))


def test_trajectory_write_paths(tmp_path) -> None:
    step = Dict(obs=Box(-1, 1, (3,), np.float32), act=Discrete(2))
    ep = Dict(goal=Discrete(5), flags=MultiBinary(2))
    tb = TrajectoryReplayBuffer.create(step, episode_data_instance_space=ep, cache_path=tmp_path / "t")
    good = {"obs": np.zeros((3, 3), np.float32), "act": np.array([0, 1, 1])}
    tb.extend(good)
    tb.flush()
    with pytest.raises(BadValueError, match=r"value at 'act' is 2"):
        tb.append({"obs": np.zeros(3), "act": 2})
    with pytest.raises(BadValueError, match=r"value at 'act' is 2"):
        tb.append({"step_data": {"obs": np.zeros(3), "act": 2}})
    with pytest.raises(BadValueError, match=r"value at 'act' row 1 is 5"):
        tb.extend({"obs": np.zeros((3, 3)), "act": np.array([0, 5, 1])})
    with pytest.raises(BadValueError, match=r"value at 'goal' row 2 is 7"):
        tb.extend({"step_data": good, "episode_data": {"goal": np.array([1, 1, 7]), "flags": np.zeros((3, 2), np.int8)}})
    with pytest.raises(BadValueError, match=r"value at 'act' row 0 is 1.5"):
        tb.set_at(np.array([0]), {"obs": np.zeros((1, 3)), "act": np.array([1.5])})
    with pytest.raises(BadValueError, match=r"value at 'goal' is 5; expected an integer in \[0, 4\]"):
        tb.set_current_episode_data({"goal": 5, "flags": [0, 1]})
    with pytest.raises(BadValueError, match=r"value at 'flags' element \[1\] is 3"):
        tb.set_episode_data_at(0, {"goal": 1, "flags": [0, 3]})
    # flattened: step_data obs (3) | act one-hot (2) | episode_data flags (2) | goal one-hot (5)
    flat = np.zeros((1, 12))
    flat[0, [3, 5, 7]] = 1
    flat[0, 6] = 2  # flags[1]
    with pytest.raises(BadValueError, match=r"'episode_data/flags'"):
        tb.extend_flattened(flat)
    assert len(tb) == 3 and tb.get_episode(0)["step_data"]["act"].tolist() == [0, 1, 1]
    with pytest.raises(KeyError):
        tb.episode_id_to_episode_data_index(0)  # no episode data was written
    tb.close()
    again = TrajectoryReplayBuffer.load_from(tmp_path / "t", read_only=True)
    assert len(again) == 3 and again.get_column(["step_data", "act"])[:].tolist() == [0, 1, 1]


# ---------------------------------------------------------------- check_bounds


def test_bounds_unchecked_by_default_checked_on_request(tmp_path) -> None:
    space = Dict(obs=Box(np.array([-1, 0], np.float32), np.array([1, np.inf], np.float32)), act=Discrete(2))
    rb = ReplayBuffer.create(space, cache_path=tmp_path / "rb")
    assert rb.check_bounds is False
    rb.append({"obs": np.array([5, -3], np.float32), "act": 0})
    rb.append({"obs": np.array([np.nan, 1], np.float32), "act": 0})
    rb.close()
    rb = ReplayBuffer.load_from(tmp_path / "rb", check_bounds=True)
    assert rb.check_bounds is True
    rb.append({"obs": np.array([1, np.inf], np.float32), "act": 1})  # +inf lies within an infinite bound
    with pytest.raises(BadValueError, match=r"^value at 'obs' element \[1\] is -3.0; expected a value in \[0.0, inf\] "
                                            r"at that element \(the Box's bounds: check_bounds=True"):
        rb.append({"obs": np.array([0, -3], np.float32), "act": 0})
    with pytest.raises(BadValueError, match=r"^value at 'obs' row 1, element \[0\] is nan; expected a value in "
                                            r"\[-1.0, 1.0\] at that element"):
        rb.extend({"obs": np.array([[0, 0], [np.nan, 0]]), "act": np.array([0, 0])})
    with pytest.raises(BadValueError, match=r"element \[0\] is 1.5"):
        rb.set_at(0, {"obs": np.array([1.5, 0]), "act": 0})
    with pytest.raises(BadValueError, match=r"'obs'"):
        rb.append_flattened(np.array([-2, 0, 1, 0]))
    assert len(rb) == 3
    rb.close()
    # the setting belongs to the handle: a plain reopen does not check
    rb = ReplayBuffer.load_from(tmp_path / "rb")
    rb.append({"obs": np.array([9, -9], np.float32), "act": 1})
    assert len(rb) == 4


def test_check_bounds_int_box_and_create_keyword() -> None:
    rb = ReplayBuffer.create(Box(0, 9, (2,), np.uint8), check_bounds=True)
    with pytest.raises(BadValueError, match=r"^value element \[1\] is 10; expected a value in \[0, 9\] \(the Box's bounds"):
        rb.append([1, 10])
    rb.append([0, 9])
    # an integer Box spanning its dtype needs no check beyond the cast
    assert ValuePlan(Box(-np.inf, np.inf, (2,), np.int64), check_bounds=True)._allowed == [None]
    assert ValuePlan(Box(-1, 1, (2,)), check_bounds=False)._allowed == [None]


def test_check_bounds_survives_pickling(tmp_path) -> None:
    rb = ReplayBuffer.create(Box(-1, 1, (2,)), cache_path=tmp_path / "mp", multiprocessing=True, check_bounds=True)
    copy = pickle.loads(pickle.dumps(rb))
    try:
        assert copy.check_bounds
        with pytest.raises(BadValueError, match="is 2.0"):
            copy.append(np.array([2.0, 0.0]))
    finally:
        copy.close()
        rb.close()


def test_trajectory_check_bounds(tmp_path) -> None:
    step, ep = Box(-1, 1, (2,)), Box(0, 1, (1,))
    tb = TrajectoryReplayBuffer.create(step, episode_data_instance_space=ep, cache_path=tmp_path / "t", check_bounds=True)
    with pytest.raises(BadValueError, match=r"row 1, element \[0\] is 3.0"):
        tb.extend(np.array([[0, 0], [3, 0]], np.float32))
    with pytest.raises(BadValueError, match=r"element \[0\] is 2.0; expected a value in \[0.0, 1.0\]"):
        tb.set_current_episode_data(np.array([2.0]))
    tb.append(np.zeros(2))
    tb.set_current_episode_data(np.array([1.0]))
    tb.close()
    tb = TrajectoryReplayBuffer.load_from(tmp_path / "t")
    assert not tb.check_bounds
    tb.append(np.array([5.0, 5.0]))
    tb.close()
    tb = TrajectoryReplayBuffer.load_from(tmp_path / "t", check_bounds=True)
    with pytest.raises(BadValueError):
        tb.append(np.array([5.0, 5.0]))
    assert len(tb) == 2


def test_extend_from_checks_rows_against_destination_bounds() -> None:
    src = ReplayBuffer.create(Box(-1, 1, (2,)))
    src.extend(np.zeros((10, 2)))
    src.set_at(7, np.array([0.0, 4.0]))  # out of bounds, allowed without check_bounds
    dst = ReplayBuffer.create(Box(-1, 1, (2,)), check_bounds=True)
    with pytest.raises(BadValueError, match=r"row 7, element \[1\] is 4.0"):
        dst.extend_from(src, chunk_size=4)
    assert len(dst) == 4  # the steps before the refused one were appended
    dst2 = ReplayBuffer.create(Box(-1, 1, (2,)))
    dst2.extend_from(src)
    assert len(dst2) == 10


# ---------------------------------------------------------------- extend_from steps


def test_extend_from_default_steps_by_bytes(monkeypatch) -> None:
    from trajstore.buffers import replay as rbmod

    src = ReplayBuffer.create(Box(-1, 1, (17,)))
    src.extend(np.random.default_rng(0).uniform(-1, 1, (1000, 17)).astype(np.float32))
    steps = []
    real = rbmod.copy_steps

    def spy(n, row_bytes, chunk_size, tqdm):
        out = real(n, row_bytes, chunk_size, tqdm)
        steps.append((row_bytes, out[0]))
        return out

    monkeypatch.setattr(rbmod, "copy_steps", spy)
    monkeypatch.setattr(rbmod, "COPY_STEP_BYTES", 68 * 300)  # 300 rows of (17,) float32 per step
    dst = ReplayBuffer.create(Box(-1, 1, (17,)))
    dst.extend_from(src)
    assert steps == [(68, 300)]
    assert np.array_equal(dst[:], src[:])
    dst.extend_from(src, chunk_size=7)  # explicit ints still work
    assert steps[-1] == (68, 7) and len(dst) == 2000
    with pytest.raises(BadArgumentError, match="chunk_size must be a positive int"):
        dst.extend_from(src, chunk_size=0)
    assert rbmod.copy_steps(10, 10 << 20, None, False)[0] == 1  # huge rows: at least one per step


def test_trajectory_extend_from_default_steps() -> None:
    src = TrajectoryReplayBuffer.create(Discrete(5), episode_data_instance_space=Discrete(3))
    for e in range(4):
        src.extend(np.full(5 + e, e))
        src.set_current_episode_data(e % 3)
        src.mark_episode_end()
    dst = TrajectoryReplayBuffer.create(Discrete(5), episode_data_instance_space=Discrete(3))
    dst.extend_from(src)
    table = dst.episodes()
    assert table["length"].tolist() == [5, 6, 7, 8]
    got = [(dst.get_episode(int(e))["step_data"].tolist(), int(dst.get_episode(int(e))["episode_data"][0]))
           for e in table["episode_id"]]
    assert got == [([e] * (5 + e), e % 3) for e in range(4)]


def test_progress_auto_only_for_large_copies(monkeypatch) -> None:
    from trajstore.buffers import replay as rbmod

    seen = []
    monkeypatch.setattr(rbmod, "progress_bar", lambda n, desc, enabled, unit: seen.append(enabled))
    rbmod.copy_steps(100, 68, None, None)
    rbmod.copy_steps(10**6, 68, None, None)  # 68 MB: auto (terminal only)
    rbmod.copy_steps(100, 68, None, True)
    rbmod.copy_steps(10**6, 68, None, False)
    assert seen == [False, None, True, False]
