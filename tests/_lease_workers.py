"""Child program of ``test_remote_lease.py``: a remote writer stopped by a real SIGSTOP between
its commit's lease check and its chunk writes (the window of issue 37 section 5).

Row ``i`` written by this writer holds ``[i, i, i, i]``; its log (one ``os.write`` per line, read
with :func:`_kill_workers.parse_log`) says what it acknowledged:

``F <rows>``
    ``flush()`` returned: rows ``0 .. rows - 1`` are committed.
``P 0``
    the next flush passed its lease check and this process is stopping itself now.
``E "<error class>"``
    the flush after the pause raised (the writer then exits without closing).
``C 0``
    ``close()`` returned.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
from gymnasium.spaces import Box


def rows(lo: int, hi: int) -> np.ndarray:
    """Rows ``lo .. hi - 1`` of a writer: ``[i, i, i, i]`` (float32)."""
    return np.repeat(np.arange(lo, hi, dtype=np.float32)[:, None], 4, axis=1)


def pause_after_check(url: str, storage_options: Any, log: str, elsewhere: bool) -> None:
    """Create a ReplayBuffer at ``url`` (chunks of 64 rows), commit rows 0-99, then append rows
    100-199 and flush: right after that flush's lease check passes, SIGSTOP this very process
    (a real stop, as a suspended VM or a debugger would); once continued, finish the flush and
    close.  ``elsewhere``: the lease names another machine (kernel identity), as a writer on
    another host would, so that nobody here can tell whether it is alive."""
    from trajstore import ReplayBuffer
    from trajstore.errors import TrajstoreError
    from trajstore.storage import lease

    if elsewhere:
        lease._kernel_identity = lambda: "another-machine"  # what a lease written on another machine records
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    buf = ReplayBuffer.create(Box(-np.inf, np.inf, (4,), np.float32), cache_path=url, storage_options=storage_options,
                              chunk_rows=64, commit_interval=3600)
    buf.extend(rows(0, 100))
    buf.flush()
    os.write(fd, b"F 100\n")
    real = lease.RemoteLease.check

    def check_then_stop(self: Any, generation: int) -> None:
        real(self, generation)
        lease.RemoteLease.check = real  # type: ignore[method-assign]  (only this one flush stops)
        os.write(fd, b"P 0\n")
        os.kill(os.getpid(), signal.SIGSTOP)

    lease.RemoteLease.check = check_then_stop  # type: ignore[method-assign]
    buf.extend(rows(100, 200))
    try:
        buf.flush()
    except TrajstoreError as e:
        os.write(fd, f'E "{type(e).__name__}"\n'.encode())
        os._exit(0)  # its store is another writer's now: leave without a close that would commit
    os.write(fd, b"F 200\n")
    buf.close()
    os.write(fd, b"C 0\n")
