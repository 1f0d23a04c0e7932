"""Kill loops (docs/design.md 3.3, 3.8; docs/reliability.md): every write path SIGKILLed at random
instants, about 500 kills per run.

Each round starts a writer child (``_kill_workers``; forked from a server that has already
imported trajstore, so a round costs milliseconds), kills it at a random instant (sometimes
while it is still opening the store, i.e. during crash recovery), then checks, in this process:

* a read-only open changes no file, and every row is whole (its leaves agree) and committed;
* nothing acknowledged is lost: every row committed before a ``flush()`` returned is there;
* a ring is as full as it can be: at least ``capacity - 2 * guard`` rows once that many were
  written (eviction never shows as missing rows, docs/design.md 3.8);
* ``verify_store`` finds no fault: with ``deep=True`` (every chunk decoded) on every third round
  and the last one, a structural verify (metadata, commit record, chunk files) on the others; the
  round's own checks above read and check every row on every round;
* every other round, a writer reopens the store (recovery) and sees the same rows.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _kill_workers as K  # noqa: E402
import _workers as W  # noqa: E402

from trajstore import ReplayBuffer, TrajectoryReplayBuffer, verify_store  # noqa: E402
from trajstore.errors import TrajstoreError  # noqa: E402

#: test_total_kills adds up the kills of the tests before it in this process: a parallel run keeps a
#: file in one worker (``--dist loadfile``, tests/conftest.py).
pytestmark = pytest.mark.slow

KILLS: dict[str, int] = {}  # test id -> kills done (the module's total is asserted at the end)


def _guard(capacity: int) -> int:
    """Rows a ring evicts ahead of its writer (trajstore.core.table.Table.guard)."""
    return max(1, min(capacity // 32, 4096))


def _kill_round(target: Any, args: tuple, procs: list, rng: np.random.Generator, ready: str,
                max_delay: float = 0.08, ctx: Any = None) -> None:
    """Start ``target(*args)``, SIGKILL it at a random instant: 15 % of rounds while it may still
    be opening the store (crash recovery), otherwise 0-``max_delay`` s after it is ready."""
    p = W.start(target, *args, ctx=ctx)
    procs.append(p)
    if rng.random() < 0.15:
        time.sleep(rng.uniform(0.0, 0.03))
    else:
        W.wait_for_file(ready, p)
        time.sleep(rng.uniform(0.0, max_delay))
    W.kill(p)
    procs.remove(p)


def _acked(log: str, tag: str = "F") -> int:
    return max((v for t, v in K.parse_log(log) if t == tag), default=0)


#: A round's deep verify runs on every DEEP_EVERY-th round (and the last); it re-reads and
#: decodes every chunk, which on an unbounded store grows with the rounds, while the row checks of
#: each round already read every committed row.
DEEP_EVERY = 3


def _verify_deep(store: str, who: str) -> None:
    rep = verify_store(store, deep=True)
    assert rep.ok, f"{who}: verify --deep found faults: {[f.message for f in rep.faults]}"


def _verify_round(store: str, who: str, r: int, last: bool = False) -> None:
    """Round ``r``'s verify: deep on every DEEP_EVERY-th round and on the last, structural otherwise."""
    if last or r % DEEP_EVERY == 0:
        _verify_deep(store, who)
        return
    rep = verify_store(store)
    assert rep.ok, f"{who}: verify found faults: {[f.message for f in rep.faults]}"


# ----------------------------------------------------------------------------------------
# append, extend, flush, ring wrap, episodes
# ----------------------------------------------------------------------------------------
def _ring_floor(capacity: int, held: int = 0) -> int:
    """Rows a full ring holds at least, for every reader and after any crash: its eviction records
    run at most 2 guards ahead, and a compressed ring's record may leave out the ``held + 1`` rows
    of the chunk being filled (only while that leaves it at least half full)."""
    return max(capacity - 2 * _guard(capacity) - held, capacity // 2)


def _check_append(ro: Any, traj: bool, capacity: int | None, flushed: int, who: str, held: int = 0) -> int:
    """Rows of an append-only store; returns one past the last row's sequence number."""
    n = len(ro)
    if n == 0:
        assert flushed == 0, f"{who}: the store is empty although {flushed} rows were flushed"
        return 0
    if traj:
        item, meta = ro.get_at_with_metadata(slice(None))
        x, ids = item["step_data"], np.asarray(meta["episode_ids"])
    else:
        x = ro[:]
    seq, ok = W.decode(x)
    assert ok.all(), f"{who}: row {int(np.flatnonzero(~ok)[0])} of {n} is damaged"
    assert (np.diff(seq) == 1).all(), f"{who}: rows are not consecutive"
    first, end = int(seq[0]), int(seq[-1]) + 1
    assert end >= flushed, f"{who}: committed rows lost: the store ends at row {end}, {flushed} were flushed"
    if capacity is None:
        assert first == 0, f"{who}: an unbounded store starts at row {first}"
    else:
        assert n <= capacity and ro.offset == first % capacity
        floor = min(end, _ring_floor(capacity, held))
        assert n >= floor, f"{who}: the ring holds {n} rows after {end} were written (at least {floor} expected)"
    if traj:
        assert (np.diff(ids) >= 0).all(), f"{who}: episode ids go backwards"
        ret = np.asarray(item["episode_data"]["ret"])
        bad = (ret != ids) & (ret != 0)
        assert not bad.any(), f"{who}: episode data of episode {int(ids[bad][0])} is {ret[bad][0]}"
    s, ok = W.decode(ro.sample(64, rng=1)["step_data"] if traj else ro.sample(64, rng=1))
    assert ok.all() and s.min() >= first and s.max() < end, f"{who}: sample returned rows outside the store"
    return end


def make_append_store(tmp_path: Path, kind: str, capacity: int | None,
                      compressor: str | None, chunk_rows: int | None = 64) -> tuple[str, str, type]:
    """The store the append kill loops write (``kind`` "replay" or "trajectory"), holding
    ``capacity`` rows (100 when unbounded) so a ring starts full and every write evicts.
    ``chunk_rows`` None: the default chunks (2 MiB), whose files grow in steps while rows arrive.
    Returns its path, the path of the acknowledgement log and the buffer class."""
    store, log = str(tmp_path / "store"), str(tmp_path / "log")
    if kind == "trajectory":
        rb = TrajectoryReplayBuffer.create(W.SPACE, step_data_capacity=capacity, cache_path=store,
                                           episode_data_instance_space=K.EPISODE_SPACE, compressor=compressor,
                                           chunk_rows=chunk_rows)
    else:
        rb = ReplayBuffer.create(W.SPACE, cache_path=store, capacity=capacity, compressor=compressor,
                                 chunk_rows=chunk_rows)
    with rb:
        rb.extend(W.encode(np.arange(capacity or 100)))
    return store, log, TrajectoryReplayBuffer if kind == "trajectory" else ReplayBuffer


@pytest.mark.parametrize("kind,capacity,compressor,kills,max_delay,chunk_rows", [
    ("replay", 700, None, 80, 0.08, 64),
    ("replay", 700, "lz4", 45, 0.3, 64),  # compressed chunks are written whole: slower writes, longer rounds
    ("replay", None, None, 35, 0.08, 64),
    # Default (2 MiB) chunks: their files get disk blocks in steps as rows arrive (fallocate ahead
    # of the rows, MappedField._make_room); kills land while a file grows.
    ("replay", None, None, 30, 0.3, None),
    ("trajectory", 700, None, 70, 0.08, 64),
    ("trajectory", None, "lz4", 30, 0.08, 64),
], ids=["replay-ring-raw", "replay-ring-lz4", "replay-unbounded", "replay-unbounded-growing", "trajectory-ring",
        "trajectory-unbounded-lz4"])
def test_kill_appends(tmp_path, procs, request, kind, capacity, compressor, kills, max_delay, chunk_rows):
    traj = kind == "trajectory"
    store, log, cls = make_append_store(tmp_path, kind, capacity, compressor, chunk_rows)
    rng = np.random.default_rng(zlib.crc32(request.node.callspec.id.encode()))
    # Batches up to 1.5x the ring (whole-ring replacement in one extend) and many rows between
    # flushes: a ring wraps several times between commits the writer asked for.
    max_batch = int(1.5 * capacity) if capacity else 120
    held = 63 if compressor else 0  # chunk_rows - 1
    end = 0
    # A loaded machine writes fewer rows per round: rounds go on past ``kills`` (at most twice as
    # many) until the ring has wrapped three times or the chunk files have grown, so what the
    # rounds exercise does not depend on the machine's speed.
    enough = 3 * capacity if capacity else (2000 if chunk_rows is None else 0)
    rounds = 0
    for r in range(3 * kills):
        if r >= kills and end > enough:
            break
        rounds = r + 1
        ready = str(tmp_path / f"ready{r}")
        _kill_round(K.append_program, (store, log, ready, r, kind, max_batch), procs, rng, ready, max_delay)
        flushed, who = _acked(log), f"round {r}"
        snap = W.tree_snapshot(store)
        with cls.load_from(store, read_only=True) as ro:
            new_end = _check_append(ro, traj, capacity, flushed, f"{who} (read-only)", held)
        assert W.tree_snapshot(store) == snap, f"{who}: a read-only open changed the store's files"
        assert new_end >= end, f"{who}: the store went back from row {end} to {new_end}"
        end = new_end
        _verify_round(store, who, r, last=r >= kills - 1 and end > enough)
        if r % 2 == 0:
            with cls.load_from(store) as w:
                assert _check_append(w, traj, capacity, flushed, f"{who} (writer)", held) == end
    if capacity:
        assert end > 3 * capacity, f"only {end} rows were written in {rounds} rounds: the ring did not wrap enough"
    if chunk_rows is None:  # the obs file (68-byte rows) grew past 16, 32, 64 and 128 KiB
        assert end > 2000, f"only {end} rows were written in {rounds} rounds: the chunk files hardly grew"
    KILLS[request.node.name] = rounds


# ----------------------------------------------------------------------------------------
# set_at, remove_at, clear: before or after, never a mix
# ----------------------------------------------------------------------------------------
def _content(rb: Any) -> list[list[int]]:
    if len(rb) == 0:
        return []
    key, version, ok = W.decode_kv(rb[:])
    assert ok.all(), f"row {int(np.flatnonzero(~ok)[0])} is damaged"
    return [[int(k), int(v)] for k, v in zip(key, version)]


@pytest.mark.parametrize("compressor,kills", [(None, 60), ("lz4", 40)], ids=["raw", "lz4"])
def test_kill_rewrites(tmp_path, procs, request, compressor, kills):
    store, log = str(tmp_path / "store"), str(tmp_path / "log")
    ReplayBuffer.create(W.SPACE, cache_path=store, compressor=compressor, chunk_rows=32).close()
    rng = np.random.default_rng(7 if compressor else 8)
    state: list[list[int]] = []
    rewrites = 0
    r = -1
    # At least ``kills`` rounds, and more (up to 3x) until ``kills`` rewrites ran: a kill lands at
    # most 0.15 s after the writer is ready, and on a loaded machine a round may run no rewrite.
    while r + 1 < kills or (rewrites < kills and r + 1 < 3 * kills):
        r += 1
        ready = str(tmp_path / f"ready{r}")
        os.unlink(log) if os.path.exists(log) else None
        _kill_round(K.rewrite_program, (store, log, ready, 100 + r), procs, rng, ready, max_delay=0.15)
        entries = K.parse_log(log)
        done = [v for t, v in entries if t == "D"]
        before = done[-1] if done else state
        after = None
        if entries and entries[-1][0] == "I":  # killed while this operation ran
            after = _apply(before, entries[-1][1])
        rewrites += sum(1 for t, v in entries if t == "I" and v[0] != "extend")
        snap = W.tree_snapshot(store)
        with ReplayBuffer.load_from(store, read_only=True) as ro:
            got = _content(ro)
        assert W.tree_snapshot(store) == snap, f"round {r}: a read-only open changed the store's files"
        assert got == before or (after is not None and got == after), (
            f"round {r}: the store holds neither the state before nor after the interrupted operation "
            f"{entries[-1][1] if entries else None}")
        _verify_round(store, f"round {r}", r)
        state = got
    _verify_deep(store, f"round {r} (last)")
    assert rewrites >= kills, f"only {rewrites} rewrites ran in {r + 1} rounds: too few to test"
    KILLS[request.node.name] = r + 1


def _apply(state: list[list[int]], op: list) -> list[list[int]]:
    """The model of ``_kill_workers.rewrite_program``'s operations."""
    if op[0] == "extend":
        return state + [[k, 0] for k in op[1]]
    if op[0] == "set_at":
        return [[k, v + 1] if i in op[1] else [k, v] for i, (k, v) in enumerate(state)]
    if op[0] == "remove_at":
        return [kv for i, kv in enumerate(state) if i not in op[1]]
    return []


# ----------------------------------------------------------------------------------------
# dumps(other path) and `trajstore copy`
# ----------------------------------------------------------------------------------------
def test_kill_copies(tmp_path, procs, request):
    kills = 50
    store, log = str(tmp_path / "store"), str(tmp_path / "log")
    targets = [str(tmp_path / "copy_a"), str(tmp_path / "copy_b.zip"), str(tmp_path / "copy_c")]
    with ReplayBuffer.create(W.SPACE, cache_path=store, chunk_rows=64) as rb:
        rb.extend(W.encode(np.arange(3000)))
    rng = np.random.default_rng(9)
    complete = 0
    for r in range(kills):
        ready = str(tmp_path / f"ready{r}")
        _kill_round(K.copy_program, (store, log, ready, 200 + r, targets), procs, rng, ready, max_delay=0.25)
        flushed = _acked(log)
        with ReplayBuffer.load_from(store, read_only=True) as ro:
            end = _check_append(ro, False, None, flushed, f"round {r}: source")
        _verify_round(store, f"round {r}: source", r, last=r == kills - 1)
        for t in targets:
            if not os.path.exists(t):
                continue
            # A copy is built beside its target and published whole (a folder swapped in, a zip
            # renamed): whatever is at a target is a complete store, never one cut short.
            with ReplayBuffer.load_from(t, read_only=True) as ro:
                assert _check_append(ro, False, None, 0, f"round {r}: copy {t}") <= end
            complete += 1
    assert complete >= kills // 4, f"only {complete} complete copies were checked"
    # And a later dumps to the same targets works whatever a kill left there.
    with ReplayBuffer.load_from(store) as rb:
        for t in targets:
            rb.dumps(t)
            with ReplayBuffer.load_from(t, read_only=True) as ro:
                assert len(ro) == len(rb)
    KILLS[request.node.name] = kills


# ----------------------------------------------------------------------------------------
# repair
# ----------------------------------------------------------------------------------------
def test_kill_repair(tmp_path, procs, request):
    """A store whose commit record names rows past a truncated chunk and that has orphans: a
    repair killed at any instant leaves a store that a repair run to its end mends."""
    from trajstore import repair_store

    kills = 30
    base, store = str(tmp_path / "base"), str(tmp_path / "store")
    with ReplayBuffer.create(W.SPACE, cache_path=base, chunk_rows=64, compressor="lz4") as rb:
        rb.extend(W.encode(np.arange(1000)))
    rng = np.random.default_rng(10)
    for r in range(kills):
        shutil.rmtree(store, ignore_errors=True)
        shutil.copytree(base, store)
        chunk = Path(store, "step_data", "obs", "c", str(int(rng.integers(0, 15))), "0")
        chunk.write_bytes(chunk.read_bytes()[: int(rng.integers(0, 40))])  # damaged: truncated
        Path(store, ".trajstore-tmp").mkdir(exist_ok=True)
        Path(store, ".trajstore-tmp", "orphan").write_bytes(b"x" * 100)
        ready = str(tmp_path / f"ready{r}")
        _kill_round(K.repair_program, (store, str(tmp_path / "log"), ready, r), procs, rng, ready, max_delay=0.1)
        try:  # killed mid-way: it still opens or is still damaged, and a full repair mends it
            verify_store(store, deep=True)
        except TrajstoreError:
            pass
        repair_store(store, deep=True)
        _verify_deep(store, f"round {r}: after a full repair")
        with ReplayBuffer.load_from(store, read_only=True) as ro:
            _check_append(ro, False, None, 0, f"round {r}: repaired")
    KILLS[request.node.name] = kills


# ----------------------------------------------------------------------------------------
# stable-baselines3's add
# ----------------------------------------------------------------------------------------
def test_kill_sb3_add(tmp_path, procs, request):
    pytest.importorskip("stable_baselines3")
    import gymnasium as gym

    from trajstore.sb3 import ZarrReplayBuffer

    kills = 60
    store, log = str(tmp_path / "sb3"), str(tmp_path / "log")
    obs_space = gym.spaces.Box(-np.inf, np.inf, (5,), np.float32)
    act_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    ZarrReplayBuffer(K.SB3_CAPACITY, obs_space, act_space, device="cpu", n_envs=2, cache_path=store).close()
    rng = np.random.default_rng(11)
    cap = K.SB3_CAPACITY // 2
    end = 0
    for r in range(kills):
        ready = str(tmp_path / f"ready{r}")
        # Forked from this process, which has imported torch and stable-baselines3 already (the
        # forkserver has not: each child would import them again).
        _kill_round(K.sb3_program, (store, log, ready, r), procs, rng, ready, max_delay=0.3,
                    ctx=multiprocessing.get_context("fork"))
        flushed = _acked(log)
        _verify_round(os.path.join(store, "transitions"), f"round {r}", r, last=r == kills - 1)  # its trajstore store
        rb = ZarrReplayBuffer(K.SB3_CAPACITY, obs_space, act_space, device="cpu", n_envs=2, cache_path=store,
                              resume=True)
        try:
            n = rb.size()
            obs = np.asarray(rb.observations)
            held = obs[(rb.pos - n + np.arange(n)) % cap]  # oldest first
            seq = held[:, 0, 0].astype(np.int64)
            assert np.array_equal(held, np.array([K.sb3_obs(int(s)) for s in seq]).reshape(held.shape)), (
                f"round {r}: damaged rows")
            assert n == 0 or (np.diff(seq) == 1).all(), f"round {r}: transitions are not consecutive"
            new_end = int(seq[-1]) + 1 if n else 0
            assert new_end >= flushed, f"round {r}: flushed transitions lost ({new_end} < {flushed})"
            assert n >= min(new_end, _ring_floor(cap)), f"round {r}: only {n} transitions after {new_end}"
            assert np.array_equal(rb.rewards[(rb.pos - n + np.arange(n)) % cap, 0], seq.astype(np.float32))
            assert new_end >= end
            end = new_end
        finally:
            rb.close()
    assert end > 2 * cap, f"only {end} transitions were added: the ring did not wrap"
    KILLS[request.node.name] = kills


def test_total_kills():
    """The loops above (when run together, as CI runs them) SIGKILL at least 500 writers."""
    if len(KILLS) < 10:
        pytest.skip(f"only {len(KILLS)} kill-loop tests ran in this session")
    assert sum(KILLS.values()) >= 500, KILLS
