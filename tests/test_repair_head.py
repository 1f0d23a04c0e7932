"""A damaged commit record is recovered from the previous one (``trajstore.head.prev.json``).

A local writer keeps a copy of the last commit record next to it (trajstore/head.py,
docs/format.md).  ``repair`` rebuilds a garbage record (random bytes, truncated JSON, JSON of the
wrong types, rows past the data) from that copy, losing at most the rows of the last commit;
``verify`` says so.  Stores without the copy (older trajstore) behave as before, the copy is
hostile input like every file of a store, and a SIGKILL loop shows that whatever instant a
writer dies at, a garbage record afterwards is always recovered to a consistent store that holds
every row acknowledged by ``flush``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _kill_workers as K  # noqa: E402
import _workers as W  # noqa: E402
from test_kill_loops import _acked, _check_append, _kill_round, make_append_store  # noqa: E402

from trajstore import ReplayBuffer, TrajectoryReplayBuffer, repair_store, verify_store  # noqa: E402
from trajstore.cli import main  # noqa: E402
from trajstore.storage.head import HEAD_KEY, PREV_KEY  # noqa: E402

RNG_BYTES = np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8).tobytes()


def _past_data(raw: bytes) -> bytes:
    head = json.loads(raw)
    for t in head["tables"].values():
        t["end"] = t["start"] + t["allocated"] + 64  # more rows than the table holds
    return json.dumps(head).encode()


def _wrong_types(raw: bytes) -> bytes:
    head = json.loads(raw)
    head["generation"] = "7"
    head["tables"] = [1, 2]
    return json.dumps(head).encode()


GARBAGE: dict[str, Callable[[bytes], bytes]] = {
    "random-bytes": lambda raw: RNG_BYTES,
    "truncated-json": lambda raw: raw[: len(raw) // 2],
    "empty": lambda raw: b"",
    "json-null": lambda raw: b"null",
    "wrong-types": _wrong_types,
    "rows-past-data": _past_data,
}


def _replay(path: Path, capacity: int | None, compressor: str | None) -> None:
    with ReplayBuffer.create(W.SPACE, cache_path=path, capacity=capacity, compressor=compressor, chunk_rows=64) as rb:
        rb.extend(W.encode(np.arange(300)))
        rb.flush()
        rb.extend(W.encode(np.arange(300, 450)))


def _trajectory(path: Path, capacity: int | None, compressor: str | None) -> None:
    with TrajectoryReplayBuffer.create(W.SPACE, step_data_capacity=capacity, cache_path=path, compressor=compressor,
                                       episode_data_instance_space=K.EPISODE_SPACE, chunk_rows=64) as rb:
        for e in range(6):
            rb.extend(W.encode(np.arange(e * 70, (e + 1) * 70)))
            rb.set_current_episode_data({"ret": np.float64(rb.current_episode_id)})
            rb.mark_episode_end()


def _content(path: Path) -> Any:
    """Everything a reader sees: rows, offset, episode ids and episode data, buffer state."""
    try:
        rb = TrajectoryReplayBuffer.load_from(path, read_only=True)
    except Exception:
        rb = ReplayBuffer.load_from(path, read_only=True)
    with rb:
        if isinstance(rb, TrajectoryReplayBuffer):
            item, meta = rb.get_at_with_metadata(slice(None))
            return (len(rb), W.decode(item["step_data"])[0].tolist(), np.asarray(meta["episode_ids"]).tolist(),
                    np.asarray(item["episode_data"]["ret"]).tolist(), rb.current_episode_id)
        return len(rb), rb.offset, W.decode(rb[:])[0].tolist()


STORES = {
    "replay-ring-raw": (_replay, 256, None),
    "replay-unbounded-lz4": (_replay, None, "lz4"),
    "trajectory-ring-raw": (_trajectory, 256, None),
    "trajectory-unbounded-raw": (_trajectory, None, None),
}


@pytest.mark.parametrize("garbage", list(GARBAGE))
@pytest.mark.parametrize("store", list(STORES))
def test_repair_recovers_a_garbage_record_from_the_previous_one(tmp_path, store, garbage):
    make, capacity, compressor = STORES[store]
    path = tmp_path / "s"
    make(path, capacity, compressor)
    head_path, prev_path = path / HEAD_KEY, path / PREV_KEY
    good = head_path.read_bytes()
    assert prev_path.read_bytes().rstrip() == good  # the writer keeps a copy of the last commit record
    want = _content(path)
    head_path.write_bytes(GARBAGE[garbage](good))

    rep = verify_store(path)
    assert not rep.ok and any(f.kind.startswith("head") for f in rep.faults)
    assert any(n.startswith(f"`trajstore repair` can recover from the previous commit record {PREV_KEY}")
               for n in rep.notes), rep.notes

    dry = repair_store(path, dry_run=True)
    assert dry.recovered and head_path.read_bytes() == GARBAGE[garbage](good)  # a dry run writes nothing
    rep = repair_store(path)
    assert rep.recovered, rep.problems
    assert any("previous one, trajstore.head.prev.json" in c["why"] for c in rep.changes), rep.changes
    assert "at most the rows of the last commit are lost" in rep.changes[0]["why"]
    assert verify_store(path, deep=True).ok
    assert _content(path) == want
    after = json.loads(head_path.read_bytes())
    assert after["generation"] > json.loads(good)["generation"]  # past any record a reader saw
    assert prev_path.read_bytes().rstrip() == head_path.read_bytes()
    with (TrajectoryReplayBuffer if store.startswith("trajectory") else ReplayBuffer).load_from(path) as w:
        w.extend(W.encode(np.arange(1000, 1010)))  # and it is writable again
    assert verify_store(path, deep=True).ok


def test_previous_record_one_commit_behind_loses_only_the_last_commit(tmp_path):
    """A writer killed between its two renames leaves the record before the last as the copy:
    repair then keeps the rows of every commit but the last."""
    path = tmp_path / "s"
    with ReplayBuffer.create(W.SPACE, cache_path=path, chunk_rows=64) as rb:
        rb.extend(W.encode(np.arange(200)))
        rb.flush()
        older = (path / HEAD_KEY).read_bytes()
        rb.extend(W.encode(np.arange(200, 260)))
    (path / PREV_KEY).write_bytes(older)
    (path / HEAD_KEY).write_bytes(b"{\"generation\": ")
    rep = repair_store(path)
    assert rep.recovered, rep.problems
    assert rep.changes[0]["rows_after"] == {"step_data": [0, 200]}
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        seq, ok = W.decode(ro[:])
        assert ok.all() and seq.tolist() == list(range(200))
    assert verify_store(path, deep=True).ok


def test_a_writer_that_opens_makes_the_copy_current(tmp_path):
    """After a kill between the two renames the copy is one commit behind; the next writer makes
    it the head again before it writes a row (a ring writer reuses slots only the older record
    counts).  A read-only open writes nothing."""
    path = tmp_path / "s"
    with ReplayBuffer.create(W.SPACE, cache_path=path, capacity=128, chunk_rows=64) as rb:
        rb.extend(W.encode(np.arange(100)))
        rb.flush()
        older = (path / PREV_KEY).read_bytes()
        rb.extend(W.encode(np.arange(100, 300)))
    (path / PREV_KEY).write_bytes(older)
    snap = W.tree_snapshot(str(path))
    with ReplayBuffer.load_from(path, read_only=True):
        pass
    assert W.tree_snapshot(str(path)) == snap
    with ReplayBuffer.load_from(path):
        assert (path / PREV_KEY).read_bytes().rstrip() == (path / HEAD_KEY).read_bytes()


def test_stores_without_a_previous_record_open_and_repair_as_before(tmp_path):
    """Stores written before the copy existed: they open (read-only without creating it), a
    garbage record is refused as before (or recovered from a record left in the temp folder),
    and the first writer creates the copy."""
    path = tmp_path / "s"
    _replay(path, None, None)
    good = (path / HEAD_KEY).read_bytes()
    (path / PREV_KEY).unlink()
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        assert len(ro) == 450
    assert not (path / PREV_KEY).exists()
    assert verify_store(path, deep=True).ok
    (path / HEAD_KEY).write_bytes(b"\x00garbage{")
    rep = verify_store(path)
    assert any(n.endswith("there is no previous commit record") for n in rep.notes), rep.notes
    rep = repair_store(path)
    assert not rep.recovered and "no earlier consistent commit record is on disk" in rep.problems[0]
    assert "there is no previous commit record" in rep.problems[0]
    assert (path / HEAD_KEY).read_bytes() == b"\x00garbage{"
    (path / ".trajstore-tmp").mkdir(exist_ok=True)
    (path / ".trajstore-tmp" / "0123abcd").write_bytes(good)
    rep = repair_store(path)
    assert rep.recovered and "left in .trajstore-tmp" in rep.changes[0]["why"]
    with ReplayBuffer.load_from(path) as rb:
        assert len(rb) == 450
    assert (path / PREV_KEY).read_bytes().rstrip() == (path / HEAD_KEY).read_bytes()


def test_a_previous_record_that_does_not_fit_the_data_is_not_used(tmp_path):
    path = tmp_path / "s"
    _replay(path, None, None)
    prev = json.loads((path / PREV_KEY).read_bytes())
    prev["tables"]["step_data"].update(end=4000, allocated=4096)
    (path / PREV_KEY).write_text(json.dumps(prev))
    (path / HEAD_KEY).write_bytes(RNG_BYTES)
    rep = verify_store(path)
    assert any(n.startswith(f"{PREV_KEY}: the previous commit record cannot replace it: it does not fit the data")
               for n in rep.notes), rep.notes
    rep = repair_store(path)
    assert not rep.recovered and (path / HEAD_KEY).read_bytes() == RNG_BYTES


@pytest.mark.parametrize("kind", ["symlink-out", "fifo", "folder", "huge", "garbage"])
def test_a_hostile_previous_record_is_never_followed_or_trusted(tmp_path, kind):
    """The copy is input like every file of a store: a link is never followed (neither read nor
    written through), a FIFO never blocks, a huge file is not read whole; repair refuses, and a
    writer replaces the copy (a regular file again) without touching anything outside."""
    path, outside = tmp_path / "s", tmp_path / "outside"
    outside.mkdir()
    target = outside / "victim.json"
    _replay(path, None, None)
    good = (path / HEAD_KEY).read_bytes()
    target.write_bytes(good)  # a valid record outside: following the link would "work"
    prev = path / PREV_KEY
    prev.unlink()
    if kind == "symlink-out":
        os.symlink(target, prev)
    elif kind == "fifo":
        os.mkfifo(prev)
    elif kind == "folder":
        prev.mkdir()
    elif kind == "huge":
        with open(prev, "wb") as f:
            f.truncate(64 << 20)
    else:
        prev.write_bytes(b"\xff" * 50)
    before = target.read_bytes(), target.stat().st_mtime_ns
    (path / HEAD_KEY).write_bytes(RNG_BYTES)
    rep = verify_store(path)
    assert any(n.startswith(f"{PREV_KEY}: the previous commit record cannot replace it") for n in rep.notes)
    rep = repair_store(path)
    assert not rep.recovered
    (path / HEAD_KEY).write_bytes(good)
    with ReplayBuffer.load_from(path) as rb:
        rb.extend(W.encode(np.arange(450, 460)))
    assert (target.read_bytes(), target.stat().st_mtime_ns) == before
    if kind != "folder":  # a folder is left alone (os.replace cannot replace it): no copy, as in old stores
        assert prev.is_file() and not prev.is_symlink() and prev.read_bytes().rstrip() == (path / HEAD_KEY).read_bytes()
    assert verify_store(path, deep=True).ok


def test_cli_verify_and_repair_and_ls_with_the_previous_record(tmp_path, capsys):
    path = tmp_path / "s"
    _replay(path, 256, None)
    assert main(["verify", str(path)]) == 0
    assert main(["ls", str(path)]) == 0
    capsys.readouterr()
    (path / HEAD_KEY).write_bytes(b"[1, 2")
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAULT head-unreadable" in out and "`trajstore repair` can recover from the previous commit record" in out
    assert main(["repair", str(path)]) == 0
    out = capsys.readouterr().out
    assert "previous one, trajstore.head.prev.json" in out
    assert main(["verify", "--deep", str(path)]) == 0


def test_a_failed_copy_never_outlives_its_commit(tmp_path, monkeypatch):
    """When the copy cannot be written after a commit (full disk...), the commit stands and the
    outdated copy is removed rather than left naming rows a later commit may reuse."""
    import trajstore.storage.head as head_mod
    import trajstore.storage.location as storage

    path = tmp_path / "s"
    rb = ReplayBuffer.create(W.SPACE, cache_path=path, capacity=128, chunk_rows=64)
    rb.extend(W.encode(np.arange(50)))
    rb.flush()
    real = storage.Location.put

    def put(self, key, data, **kw):
        if key == PREV_KEY:
            raise OSError(28, "No space left on device")
        return real(self, key, data, **kw)

    def in_place(loc, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage.Location, "put", put)
    monkeypatch.setattr(head_mod, "_write_prev_in_place", in_place)
    rb.extend(W.encode(np.arange(50, 300)))
    rb.flush()  # no error: the commit is in place
    assert not (path / PREV_KEY).exists()
    monkeypatch.undo()
    rb.extend(W.encode(np.arange(300, 310)))
    rb.flush()
    assert (path / PREV_KEY).read_bytes().rstrip() == (path / HEAD_KEY).read_bytes()
    rb.close()


# ----------------------------------------------------------------------------------------
# SIGKILL at random instants, then a garbage record: repair always recovers
# ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind,capacity,compressor,kills", [
    ("replay", 700, None, 40),
    ("replay", None, "lz4", 20),
    ("trajectory", 700, None, 30),
], ids=["replay-ring-raw", "replay-unbounded-lz4", "trajectory-ring-raw"])
def test_kill_then_garbage_record_is_always_recovered(tmp_path, procs, request, kind, capacity, compressor, kills):
    """Writers (append, extend, flush, episodes) SIGKILLed at random instants, many of them while
    committing (a ring commits every few dozen rows); after half of the kills the commit record is
    replaced by garbage and repaired.  Every repair recovers; the store then verifies deep, every
    row is whole and consecutive, a ring is as full as its commits say, and every row a ``flush``
    acknowledged is there (a flush returns after the copy is written, so nothing acknowledged is
    lost).  The other half of the rounds leave the store as the kill left it, so the next writer
    opens after a kill that may have fallen between the record and its copy."""
    traj = kind == "trajectory"
    store, log, cls = make_append_store(tmp_path, kind, capacity, compressor)
    rng = np.random.default_rng(zlib.crc32(request.node.callspec.id.encode()) + 1)
    max_batch = int(1.5 * capacity) if capacity else 120
    held = 63 if compressor else 0
    garbage = list(GARBAGE.values())
    repaired = 0
    for r in range(kills):
        ready = str(tmp_path / f"ready{r}")
        _kill_round(K.append_program, (store, log, ready, 500 + r, kind, max_batch), procs, rng, ready, 0.08)
        flushed, who = _acked(log), f"round {r}"
        if rng.random() < 0.5:
            head = Path(store, HEAD_KEY)
            head.write_bytes(garbage[int(rng.integers(len(garbage)))](head.read_bytes()))
            rep = repair_store(store)
            assert rep.recovered, f"{who}: repair did not recover: {rep.problems}"
            repaired += 1
            who += " (repaired)"
        rep = verify_store(store, deep=True)
        assert rep.ok, f"{who}: {[f.message for f in rep.faults]}"
        with cls.load_from(store, read_only=True) as ro:
            _check_append(ro, traj, capacity, flushed, who, held)
    assert repaired >= kills // 4
    shutil.rmtree(store, ignore_errors=True)


def test_a_writer_reusing_ring_slots_before_its_first_commit_keeps_the_copy_usable(tmp_path):
    """Why a writer makes the copy current when it opens: a ring's eviction record no longer counts
    rows whose slots the next writer fills before it commits, while a copy one commit behind
    still counts them.  A writer that dies then (no commit) must leave a copy that repair can use."""
    path = tmp_path / "s"
    rb = ReplayBuffer.create(W.SPACE, cache_path=path, capacity=128, chunk_rows=64, commit_interval=3600)
    rb.extend(W.encode(np.arange(128)))
    rb.flush()
    older = (path / HEAD_KEY).read_bytes()  # rows 0..127
    rb.extend(W.encode(np.arange(128, 200)))  # commits eviction records on the way
    rb._store.close()  # the writer dies: no final commit; the last record is an eviction record
    rb._closed = True
    (path / PREV_KEY).write_bytes(older)  # what a kill between the record and its copy leaves
    st = json.loads((path / HEAD_KEY).read_bytes())["tables"]["step_data"]
    free = st["start"] - (st["end"] - 128)  # slots the record no longer counts: filled without a commit
    assert free > 0
    rb = ReplayBuffer.load_from(path, commit_interval=3600)
    seq = K.next_seq(rb)
    rb.extend(W.encode(np.arange(seq, seq + free)))
    assert json.loads((path / HEAD_KEY).read_bytes())["generation"] == json.loads(
        (path / PREV_KEY).read_bytes())["generation"]
    # A shorter record written over a longer copy: padded with JSON whitespace, one write.
    from trajstore.storage.head import _write_prev_in_place
    from trajstore.storage.location import resolve_location
    loc = resolve_location(str(path), read_only=False, must_exist=True)
    assert _write_prev_in_place(loc, (path / HEAD_KEY).read_bytes()[:5] + b"}")  # any bytes: layout only
    assert (path / PREV_KEY).read_bytes().rstrip() == (path / HEAD_KEY).read_bytes()[:5] + b"}"
    assert _write_prev_in_place(loc, (path / HEAD_KEY).read_bytes())
    loc.close()
    rb._store.close()  # and dies too
    rb._closed = True
    (path / HEAD_KEY).write_bytes(RNG_BYTES)
    rep = repair_store(path)
    assert rep.recovered, rep.problems
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        _check_append(ro, False, 128, 0, "repaired")
