"""``trajstore verify <buffer>`` checks the buffer's priorities (``trajstore.priorities``, issue 15):
a sound sidecar passes, one damaged with plain zarr or by truncating a chunk is reported as faults
under its key, states the protocol produces (rows committed after the last flush, a sidecar never
committed) are notes, and a link in its place is reported without being followed.  Real stores on
disk; damage done with plain zarr and the file system."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from gymnasium.spaces import Box

from trajstore import PrioritizedSampler, ReplayBuffer, verify_store
from trajstore.cli import main
from trajstore.sampling.prioritized import PRIORITIES_DIR
from trajstore.storage.head import HEAD_KEY

SPACE = Box(-np.inf, np.inf, (1,), np.float64)


def _store(path: Path, n: int = 60, capacity: int | None = None) -> Path:
    """A buffer of ``n`` rows whose sampler stored priorities 1..n (unbounded: the sidecar's row r
    is its array's row r)."""
    with ReplayBuffer.create(SPACE, cache_path=str(path), capacity=capacity) as buf:
        buf.extend(np.arange(n, dtype=np.float64)[:, None])
        with PrioritizedSampler(buf) as s:
            s.sample(1, rng=0)
            s.update_priorities(np.arange(len(buf)), np.arange(1, len(buf) + 1, dtype=np.float64))
    return path / PRIORITIES_DIR


def _side_faults(path: Path) -> list:
    rep = verify_store(str(path))
    return [f for f in rep.faults if f.key.startswith(PRIORITIES_DIR)]


def test_a_sound_sidecar_passes_and_a_lagging_tail_is_a_note(tmp_path: Path) -> None:
    side = _store(tmp_path / "b", capacity=40)  # a ring that wrapped: rows 20..59
    rep = verify_store(str(tmp_path / "b"))
    assert rep.ok and not [n for n in rep.notes if PRIORITIES_DIR in n], (rep.faults, rep.notes)
    with ReplayBuffer.load_from(str(tmp_path / "b")) as buf:  # committed without the sampler's flush
        buf.extend(np.zeros((5, 1)))
        buf.flush()
    rep = verify_store(str(tmp_path / "b"))
    assert rep.ok, rep.faults
    assert any("last 5 row(s) have no stored priority yet" in n for n in rep.notes), rep.notes
    assert verify_store(str(side)).ok


@pytest.mark.parametrize("value", [-1.0, np.nan, np.inf])
def test_bad_values_written_with_plain_zarr_are_faults(tmp_path: Path, value: float) -> None:
    side = _store(tmp_path / "b")
    arr = zarr.open_array(str(side / "step_data"), mode="r+")
    arr[[7, 30]] = value
    faults = _side_faults(tmp_path / "b")
    assert len(faults) == 1, faults
    f = faults[0]
    assert f.kind == "priorities" and f.table == "step_data" and f.rows == (7, 31), f
    assert "2 stored priorities are not a finite number >= 0 (first: row 7" in f.message
    # A reader still samples: the bad values count as max_priority.
    with ReplayBuffer.load_from(str(tmp_path / "b"), read_only=True) as ro, PrioritizedSampler(ro) as s:
        assert s.priorities([7, 30]).tolist() == [60.0, 60.0] and s.priorities([8]).tolist() == [9.0]


def test_a_truncated_chunk_and_an_unreadable_record_are_faults(tmp_path: Path) -> None:
    side = _store(tmp_path / "b")
    chunk = side / "step_data" / "c" / "0"
    with open(chunk, "r+b") as fh:
        fh.truncate(chunk.stat().st_size // 2)
    faults = _side_faults(tmp_path / "b")
    assert faults and all(f.kind == "priorities" for f in faults)
    assert any(f.key == f"{PRIORITIES_DIR}/step_data/c/0" and "truncated" in f.message for f in faults), faults
    assert not verify_store(str(tmp_path / "b")).ok

    side = _store(tmp_path / "c")
    (side / HEAD_KEY).write_text("{not json")
    faults = _side_faults(tmp_path / "c")
    assert [f.key for f in faults] == [f"{PRIORITIES_DIR}/{HEAD_KEY}"], faults


def test_rows_the_buffer_never_committed_and_a_bad_max_priority_are_faults(tmp_path: Path) -> None:
    side = _store(tmp_path / "b")
    head = json.loads((side / HEAD_KEY).read_text())
    head["tables"]["step_data"]["end"] += 10  # within the allocated rows, beyond the buffer's 60
    head["state"]["max_priority"] = -3.0
    (side / HEAD_KEY).write_text(json.dumps(head))
    messages = [f.message for f in _side_faults(tmp_path / "b")]
    assert any("max_priority must be a finite number > 0; got -3.0" in m for m in messages), messages
    assert any("holds priorities of rows up to 70, but the buffer commits rows only up to 60" in m
               for m in messages), messages


def test_a_sidecar_never_committed_is_a_note(tmp_path: Path) -> None:
    """A writer killed while it created the sidecar leaves it without a commit record: the store
    still verifies (the next writer's sampler writes the priorities anew)."""
    side = _store(tmp_path / "b")
    (side / HEAD_KEY).unlink()
    (side / "trajstore.head.prev.json").unlink()
    rep = verify_store(str(tmp_path / "b"))
    assert rep.ok, rep.faults
    assert any("holds no committed priorities" in n for n in rep.notes), rep.notes


@pytest.mark.parametrize("what", ["link", "file"])
def test_a_link_or_file_in_its_place_is_reported_and_never_followed(tmp_path: Path, what: str) -> None:
    """The link points at a sidecar whose values are NaN: following it would report them; verify
    names the link instead and reads nothing behind it."""
    side = _store(tmp_path / "b")
    outside = tmp_path / "outside"
    shutil.move(str(side), str(outside))
    zarr.open_array(str(outside / "step_data"), mode="r+")[:] = np.nan
    if what == "link":
        os.symlink(outside, side, target_is_directory=True)
    else:
        side.write_text("not a folder")
    faults = _side_faults(tmp_path / "b")
    assert len(faults) == 1, faults
    assert faults[0].key == PRIORITIES_DIR
    assert ("is a link, which trajstore never follows" if what == "link" else "is not a folder") in faults[0].message
    assert "not a finite number" not in faults[0].message


def test_cli_verify_reports_the_sidecar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    side = _store(tmp_path / "b")
    zarr.open_array(str(side / "step_data"), mode="r+")[3] = -2.0
    code = main(["verify", str(tmp_path / "b"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code != 0 and not out["ok"]
    assert [f["kind"] for f in out["faults"]] == ["priorities"] and out["faults"][0]["rows"] == [3, 4]


def test_a_sidecar_on_an_fsspec_store_is_checked() -> None:
    """memory:// (the remote code path: keys listed, no links): a NaN written into the sidecar's
    raw chunk is a fault; the sound one passes."""
    import fsspec

    url = "memory://prioritized-verify/b"
    with ReplayBuffer.create(SPACE, cache_path=url) as buf:
        buf.extend(np.arange(40, dtype=np.float64)[:, None])
        with PrioritizedSampler(buf) as s:
            s.sample(1, rng=0)
            s.update_priorities(np.arange(40), np.arange(1, 41, dtype=np.float64))
    assert verify_store(url).ok
    fs = fsspec.filesystem("memory")
    chunk = f"/prioritized-verify/b/{PRIORITIES_DIR}/step_data/c/0"
    raw = bytearray(fs.cat_file(chunk))
    raw[3 * 4 : 4 * 4] = np.float32(np.nan).tobytes()
    fs.pipe_file(chunk, bytes(raw))
    faults = [f for f in verify_store(url).faults if f.key.startswith(PRIORITIES_DIR)]
    assert len(faults) == 1 and faults[0].rows == (3, 4), faults
    fs.rm("/prioritized-verify", recursive=True)
