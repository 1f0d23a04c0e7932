"""The reader's watch on the commit record (:class:`trajstore.storage.head.HeadWatch`): every new
record is noticed, also once the record it watches has settled and is asked by ``fstat`` of the
file it holds open instead of ``stat`` of its path; and a sample whose read a commit overlapped
is checked against the newer record.
"""

from __future__ import annotations

import os
import time
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import trajstore.storage.head as head_mod
from trajstore import ReplayBuffer
from trajstore.storage.head import FSTAT_FS, HeadWatch
from trajstore.storage.mounts import fs_type, mounts

pytestmark = pytest.mark.skipif(os.name == "nt", reason="on Windows the watch keeps no file open")

SPACE = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)


def rows(lo: int, n: int) -> np.ndarray:
    """Rows whose values are their absolute row numbers."""
    return np.repeat(np.arange(lo, lo + n, dtype=np.float32)[:, None], 3, axis=1)


class _CountingOs:
    """``os`` for head.py, counting ``stat`` (path) calls."""

    def __init__(self) -> None:
        self.stats = 0

    def stat(self, *a: Any, **k: Any) -> os.stat_result:
        self.stats += 1
        return os.stat(*a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


@pytest.fixture
def counted(monkeypatch) -> _CountingOs:
    c = _CountingOs()
    monkeypatch.setattr(head_mod, "os", c)
    return c


@pytest.fixture
def settled(monkeypatch, tmp_path) -> None:
    """Every record counts as settled: the watch's clock runs 10 s ahead of file timestamps."""
    if fs_type(str(tmp_path), mounts()) not in FSTAT_FS:
        pytest.skip(f"{tmp_path} is not on a filesystem the watch asks by fstat ({sorted(FSTAT_FS)})")
    monkeypatch.setattr(head_mod, "_now_ns", lambda: time.time_ns() + 10 * 10**9)


def _open(tmp_path) -> tuple[ReplayBuffer, ReplayBuffer, HeadWatch]:
    rb = ReplayBuffer.create(SPACE, cache_path=tmp_path / "s")
    ro = ReplayBuffer.load_from(tmp_path / "s", read_only=True)
    return rb, ro, HeadWatch(ro.location)


def test_settled_watch_notices_every_commit(tmp_path, settled, counted):
    """Asked by fstat once settled, the watch still notices each commit, also commits made within
    one timestamp tick of the last (the replaced file's link count drops inside the rename)."""
    rb, ro, watch = _open(tmp_path)
    head = watch.read()
    assert not watch.changed()  # by stat of the path: the record settles
    n = counted.stats
    assert not watch.changed() and counted.stats == n  # by fstat alone
    for i in range(50):
        rb.extend(rows(i, 1))
        rb.flush()
        assert watch.changed(), f"commit {i} not noticed"
        new = watch.read()
        assert new.generation > head.generation
        head = new
        assert not watch.changed()
        n = counted.stats
        assert not watch.changed() and counted.stats == n
        assert len(ro) == i + 1  # the reader's own store, settled alike
    watch.close()
    ro.close()
    rb.close()


def test_young_record_is_asked_by_path(tmp_path, counted):
    """A record whose ctime is recent is asked by stat of its path, every time."""
    rb, ro, watch = _open(tmp_path)
    watch.read()
    for k in range(1, 4):
        assert not watch.changed() and counted.stats == k
    rb.extend(rows(0, 1))
    rb.flush()
    assert watch.changed()
    watch.close()
    ro.close()
    rb.close()


def test_other_filesystems_are_asked_by_path(tmp_path, monkeypatch, settled, counted):
    """On a filesystem outside FSTAT_FS (overlay, network, FUSE) a settled record is still asked by
    stat of its path, and commits are noticed."""
    monkeypatch.setattr(head_mod, "FSTAT_FS", frozenset())
    rb, ro, watch = _open(tmp_path)
    watch.read()
    for i in range(5):
        n = counted.stats
        assert not watch.changed() and counted.stats == n + 1
        rb.extend(rows(i, 1))
        rb.flush()
        assert watch.changed()
        watch.read()
    watch.close()
    ro.close()
    rb.close()


def test_a_link_to_the_record_sends_the_watch_to_the_path(tmp_path, settled, counted):
    """A hard link to a settled record changes its link count and ctime: the watch asks the path
    again (the record was not replaced), and notices the commit that follows, whose rename leaves
    the old file one link instead of two."""
    rb, ro, watch = _open(tmp_path)
    watch.read()
    assert not watch.changed()  # settled
    n = counted.stats
    os.link(tmp_path / "s" / "trajstore.head.json", tmp_path / "record-link.json")
    assert not watch.changed() and counted.stats == n + 1
    assert not watch.changed()  # settled again, at two links
    rb.extend(rows(0, 1))
    rb.flush()
    assert watch.changed()
    watch.close()
    ro.close()
    rb.close()


def test_sample_checks_a_commit_made_while_it_read(tmp_path, settled):
    """A writer evicts ring rows while a settled reader's sample reads: the sample is checked
    against the newer record (its last_read) and returns only rows that record holds."""
    cap = 64
    rb = ReplayBuffer.create(SPACE, cache_path=tmp_path / "s", capacity=cap)
    rb.extend(rows(0, 200))
    rb.flush()
    ro = ReplayBuffer.load_from(tmp_path / "s", read_only=True)
    for _ in range(3):
        ro.sample(8)  # the reader's watch settles
    src = ro.row_source()
    before = src.record.generation
    real, calls = ro._read_rows, []

    def read_during_a_commit(idx: Any, leaves: Any) -> list[np.ndarray]:
        if not calls:  # the first read: a writer turns most of the ring over meanwhile
            rb.extend(rows(200, 40))
            rb.flush()
        calls.append(len(idx))
        return real(idx, leaves)

    ro._read_rows = read_during_a_commit  # type: ignore[method-assign]
    got = ro.sample(256, rng=0)
    assert len(calls) >= 2, "the commit made during the read was not noticed"
    assert src.last_read is not None and src.last_read.generation > before
    first, end = 240 - len(ro), 240
    assert len(ro) <= cap and np.all((got[:, 0] >= first) & (got[:, 0] < end)), got[:, 0]
    ro.close()
    rb.close()
