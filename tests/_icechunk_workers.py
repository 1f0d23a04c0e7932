"""Child programs of ``test_icechunk_location.py``: writers of an icechunk location that append
until they are killed, stopped or lose a conflict.

What a child has *acknowledged* goes to ``log`` one line per ``os.write`` (``_kill_workers.parse_log``
reads it; a torn last line is ignored):

``F <rows>``
    ``flush()`` returned: rows ``0 .. rows - 1`` (row ``i`` holds ``[i] * 4``) are committed.
``X <rows>``
    ``flush()`` raised ``ConcurrentWriteError``: another writer committed first; nothing of the
    rows after the last ``F`` was published, and the child exits.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from gymnasium.spaces import Box

SPACE = Box(-np.inf, np.inf, (4,), np.float32)
_DEADLINE_S = 60.0  # a child the parent forgot is gone after this


def rows(lo: int, hi: int) -> np.ndarray:
    """Rows ``lo .. hi - 1`` of the append sequence: row ``i`` is ``[i, i, i, i]``."""
    return np.repeat(np.arange(lo, hi, dtype=np.float32)[:, None], 4, axis=1)


def append_loop(url: str, storage_options: Any, log: str, ready: str, block: int) -> None:
    """Open (or create) a ReplayBuffer at ``url`` and append ``block`` rows then flush, forever."""
    from trajstore import ReplayBuffer
    from trajstore.errors import ConcurrentWriteError, StoreNotFoundError

    try:
        buf = ReplayBuffer.load_from(url, storage_options=storage_options, commit_interval=3600)
    except StoreNotFoundError:
        buf = ReplayBuffer.create(SPACE, cache_path=url, storage_options=storage_options, chunk_rows=16,
                                  commit_interval=3600)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    n = len(buf)
    os.write(fd, f"F {n}\n".encode())
    open(ready, "w").close()
    deadline = time.monotonic() + _DEADLINE_S
    while time.monotonic() < deadline:
        buf.extend(rows(n, n + block))
        try:
            buf.flush()
        except ConcurrentWriteError:
            os.write(fd, f"X {n}\n".encode())
            os._exit(0)  # (the exit hook's commit of this buffer would lose the same conflict again)
        n += block
        os.write(fd, f"F {n}\n".encode())


def push_loop(local: str, remote: str, log: str, ready: str) -> None:
    """Push ``local`` to ``remote`` again and again (logging ``P <n>`` after each), appending one
    episode of 40 steps to ``local`` (test_versions.py's space: obs 16, action 4) between pushes,
    until killed."""
    from trajstore import TrajectoryReplayBuffer
    from trajstore.maintenance.push_pull import push

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    open(ready, "w").close()
    deadline = time.monotonic() + _DEADLINE_S
    n = 0
    while time.monotonic() < deadline:
        push(local, remote, progress=False)
        n += 1
        os.write(fd, f"P {n}\n".encode())
        buf = TrajectoryReplayBuffer.load_from(local)
        buf.extend({"obs": np.zeros((40, 16), np.float32), "action": np.zeros((40, 4), np.float32)})
        buf.mark_episode_end()
        buf.close()


def tagged(writer: int, block: int, size: int) -> np.ndarray:
    """Block ``block`` of writer ``writer`` (``size`` rows): row ``i`` is ``[writer * 100000 + block
    * size + i] * 4`` (exact in float32), so a store's rows say whose block they are and where."""
    return rows(writer * 100_000 + block * size, writer * 100_000 + (block + 1) * size)


def retry_appender(url: str, storage_options: Any, log: str, ready: str, go: str, writer: int, blocks: int,
                   size: int) -> None:
    """Open the ReplayBuffer at ``url``, append block 0 (:func:`tagged`), wait for the file ``go``,
    then flush; then append and flush blocks 1 .. ``blocks - 1``.  A flush that loses a conflict
    (``ConcurrentWriteError``) is retried as docs/versions.md says: reopen the store (on the new
    head) and append the same block again.  Logs ``R <block>`` for each lost conflict and
    ``F <block>`` once a block is acknowledged."""
    from trajstore import ReplayBuffer
    from trajstore.errors import ConcurrentWriteError

    def reopen() -> Any:
        return ReplayBuffer.load_from(url, storage_options=storage_options, commit_interval=3600)

    buf = reopen()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    open(ready, "w").close()
    deadline = time.monotonic() + _DEADLINE_S
    for j in range(blocks):
        while time.monotonic() < deadline:
            buf.extend(tagged(writer, j, size))
            while j == 0 and not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.002)  # (the parent lets the other writer commit first)
            try:
                buf.flush()
                break
            except ConcurrentWriteError:
                os.write(fd, f"R {j}\n".encode())
                buf = reopen()  # the loser is dropped unflushed: its exit hook would lose again
        os.write(fd, f"F {j}\n".encode())
    os._exit(0)
