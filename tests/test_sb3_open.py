"""``Zarr*ReplayBuffer.open(path)`` reopens a buffer with the ``optimize_memory_usage`` recorded in
its ``sb3.json`` (issue 37 section 6): no argument has to be repeated, and a contradicting one is
still refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

from gymnasium import spaces  # noqa: E402

from trajstore.errors import SpaceMismatchError  # noqa: E402
from trajstore.sb3 import ZarrReplayBuffer  # noqa: E402

OBS = spaces.Box(-10, 10, (3,), np.float32)
ACT = spaces.Box(-1, 1, (2,), np.float32)


def _fill(path: Path, optimize: bool, n: int = 6) -> None:
    rb = ZarrReplayBuffer(100, OBS, ACT, "cpu", cache_path=path, optimize_memory_usage=optimize,
                          handle_timeout_termination=not optimize)
    for i in range(n):  # obs i, next obs i + 1
        rb.add(np.full((1, 3), i, np.float32), np.full((1, 3), i + 1, np.float32), np.zeros((1, 2), np.float32),
               np.zeros(1), np.zeros(1), [{}])
    rb.close()


@pytest.mark.parametrize("optimize", [True, False], ids=["optimize_memory_usage", "plain"])
def test_open_takes_optimize_memory_usage_from_sb3_json(tmp_path: Path, optimize: bool) -> None:
    _fill(tmp_path / "rb", optimize)
    rb = ZarrReplayBuffer.open(tmp_path / "rb")
    try:
        assert rb.optimize_memory_usage is optimize and rb.size() == 6
        batch = rb.sample(32)
        obs, nxt = batch.observations.numpy()[:, 0], batch.next_observations.numpy()[:, 0]
        np.testing.assert_array_equal(nxt, obs + 1)  # every sampled transition's own next observation
    finally:
        rb.close()
    with pytest.raises(SpaceMismatchError):  # an argument that contradicts sb3.json is still refused
        ZarrReplayBuffer.open(tmp_path / "rb", optimize_memory_usage=not optimize,
                              handle_timeout_termination=optimize)


@pytest.mark.parametrize("bad", ["nested", "fifo", "link", "huge"])
def test_hostile_sb3_json_is_refused_promptly(tmp_path: Path, bad: str) -> None:
    """``sb3.json`` is input, as a store's files are: nested past JSON's depth (a RecursionError
    before), a FIFO (a plain open blocked until a writer came), a link, or more than a record's
    bound raise NotATrajstoreError naming it, at once."""
    import os
    import threading

    from trajstore.errors import NotATrajstoreError

    obs, act = spaces.Box(-1, 1, (3,), np.float32), spaces.Box(-1, 1, (2,), np.float32)
    ZarrReplayBuffer(64, obs, act, cache_path=tmp_path / "b").close()
    record = tmp_path / "b" / "sb3.json"
    record.unlink()
    if bad == "nested":
        record.write_text("[" * 100_000 + "]" * 100_000)
    elif bad == "fifo":
        os.mkfifo(record)
    elif bad == "link":
        (tmp_path / "elsewhere.json").write_text("{}")
        record.symlink_to(tmp_path / "elsewhere.json")
    else:
        record.write_bytes(b" " * (2 << 20) + b"{}")
    got: list[BaseException] = []

    def reopen() -> None:
        try:
            ZarrReplayBuffer(64, obs, act, cache_path=tmp_path / "b", resume=True).close()
        except BaseException as e:  # noqa: BLE001  # handed to the test thread
            got.append(e)

    t = threading.Thread(target=reopen, daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():
        os.close(os.open(record, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reopening blocked on sb3.json")
    assert len(got) == 1 and isinstance(got[0], NotATrajstoreError) and "sb3.json" in str(got[0]), got
