"""Building stores from other stores, all or nothing: the destinations and sources that
:mod:`trajstore.maintenance.combine` (combine, split, filter) and :mod:`trajstore.interop` (imports,
exports) share.

A destination is a local folder built under a temporary name in its parent folder
(``.<name>.trajstore-partial-<host>-<pid>-<random>``, :func:`partial_path`, :class:`StagedFolders`), verified
(:func:`verify_written`), and only then renamed into place; on any error the temporary folders are
removed and no destination appears.  Sources are read a bounded block of steps at a time
(:data:`BLOCK_BYTES`, :func:`step_blocks`), so a store larger than RAM streams through.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from trajstore.buffers.rows import SelectionRows
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import BadArgumentError, BadOptionError, DamagedStoreError, StoreExistsError
from trajstore.maintenance.verify import verify_store

__all__ = ["BLOCK_BYTES", "local_path", "check_free", "partial_path", "StagedFolders", "not_a_source",
           "verify_written", "open_source", "block_rows", "step_blocks"]

#: Steps are copied in blocks of about this many bytes.
BLOCK_BYTES = 8 << 20


# -- destinations ------------------------------------------------------------------------------------
def local_path(path: Any, what: str) -> str:
    """``path`` as an absolute local folder path; ``what`` names it in errors (a URL or a ``.zip``
    is refused: these destinations are built by rename in their parent folder)."""
    if not isinstance(path, (str, os.PathLike)):
        raise BadArgumentError(f"{what} must be a path (str or os.PathLike); got {type(path).__name__}")
    p = os.fspath(path)
    if "://" in p or "::" in p or p.endswith(".zip"):
        raise BadOptionError(f"{what} {p!r}: combine, split and filter write local folders; copy the result "
                             "elsewhere with `trajstore copy` afterwards")
    return os.path.abspath(p)


def check_free(dst: str, overwrite: bool) -> None:
    """Refuse (:class:`StoreExistsError`) a destination that exists and is not an empty folder,
    unless ``overwrite``."""
    if os.path.lexists(dst) and not overwrite and (not os.path.isdir(dst) or any(os.scandir(dst))):
        raise StoreExistsError(f"{dst}: something already exists there; pass overwrite=True (--overwrite) to replace it")


#: This machine in temporary names (a hash: host names may hold any character).
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def partial_path(dst: str) -> str:
    """A fresh temporary name next to ``dst`` (nothing is created), to be renamed to ``dst``:
    ``.<name>.trajstore-partial-<host>-<pid>-<random>``.

    What a killed operation on this machine left for the same ``dst`` (a temporary name whose
    process is gone) is removed first, so a rerun does not leave two copies on disk.  Names from
    other machines (a shared folder) and from live processes are left alone.
    """
    parent, name = os.path.split(dst)
    _remove_dead_partials(parent, name)
    return os.path.join(parent, f".{name}.trajstore-partial-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")


def _remove_dead_partials(parent: str, name: str) -> None:
    pattern = re.compile(rf"\.{re.escape(name)}\.trajstore-partial-{_HOST}-(\d{{1,7}})-[0-9a-f]{{8}}")
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return  # no parent yet: nothing left there
    for e in entries:
        m = pattern.fullmatch(e.name)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path, ignore_errors=True)  # never follows a link inside
        else:
            with contextlib.suppress(OSError):
                os.unlink(e.path)  # a file, or a link (never followed)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


class StagedFolders:
    """Temporary folders next to their destinations, renamed into place together by :meth:`commit`
    or removed by :meth:`discard`."""

    def __init__(self) -> None:
        self.pairs: list[tuple[str, str]] = []

    def new(self, dst: str) -> str:
        """A fresh temporary folder name next to ``dst`` (not created), to be renamed to ``dst``."""
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = partial_path(dst)
        self.pairs.append((tmp, dst))
        return tmp

    def commit(self, overwrite: bool) -> None:
        """Rename every temporary folder into place (replacing what is there if ``overwrite``)."""
        for tmp, dst in self.pairs:
            if overwrite and os.path.lexists(dst):
                if os.path.isdir(dst) and not os.path.islink(dst):
                    shutil.rmtree(dst)
                else:
                    os.unlink(dst)
            elif os.path.isdir(dst):
                os.rmdir(dst)  # an empty folder (checked before writing)
            os.rename(tmp, dst)
        self.pairs = []

    def discard(self) -> None:
        """Remove every temporary folder; no destination appears."""
        for tmp, _dst in self.pairs:
            shutil.rmtree(tmp, ignore_errors=True)
        self.pairs = []


def not_a_source(dst: str, sources: Sequence[Any]) -> None:
    """A destination must not be one of the stores being read (``overwrite`` would delete it)."""
    for s in sources:
        path = s.cache_path if isinstance(s, TrajectoryReplayBuffer) else s
        if isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)) == dst:
            raise BadOptionError(f"{dst} is both a source and a destination; write to another folder")


def verify_written(path: str, storage_options: dict[str, Any] | None = None, *,
                   error: Callable[[str], Exception] | None = None) -> None:
    """Raise an error naming the first fault if the store just written at ``path`` does not verify
    (:func:`~trajstore.maintenance.verify.verify_store`).

    Parameters
    ----------
    path : str
        The store: a local folder, or a URL with ``storage_options``.
    storage_options : dict, optional
        fsspec options for a URL.
    error : callable, optional
        Builds the exception raised from the first fault's message.  Default: a
        :class:`DamagedStoreError` ``"<path>: the written store does not verify: <fault>"``; the
        CLI's ``copy`` raises its own one-line error instead (``trajstore.cli.shards.verify_copy``).

    Raises
    ------
    DamagedStoreError
        The store has a fault (or what ``error`` builds).
    """
    rep = verify_store(path, storage_options=storage_options)
    if not rep.ok:
        fault = rep.faults[0].message
        raise (error(fault) if error is not None else
               DamagedStoreError(f"{path}: the written store does not verify: {fault}"))


# -- sources -----------------------------------------------------------------------------------------
def open_source(src: Any, what: str) -> tuple[TrajectoryReplayBuffer, bool]:
    """``(buffer, opened here)``: a TrajectoryReplayBuffer as it is, a path opened read-only."""
    if isinstance(src, TrajectoryReplayBuffer):
        return src, False
    if not isinstance(src, (str, os.PathLike)):
        raise BadArgumentError(f"{what} must be a path or a TrajectoryReplayBuffer; got {type(src).__name__}")
    return TrajectoryReplayBuffer.load_from(src, read_only=True), True


def block_rows(row_bytes: int) -> int:
    """Rows per block of about :data:`BLOCK_BYTES` for rows of ``row_bytes`` bytes (at least one)."""
    return max(1, BLOCK_BYTES // max(int(row_bytes), 1))


def step_blocks(buf: TrajectoryReplayBuffer, ids: np.ndarray | None) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
    """``(step leaf arrays, episode ids)`` of the steps of episodes ``ids`` (all with None), in row
    order, a bounded block at a time."""
    buf._sync()
    t = buf._table
    fields = list(range(len(buf._step_plan.leaves))) + [buf._id_field]
    step = block_rows(t.row_bytes)
    if ids is None:
        for lo in range(0, t.count, step):
            *arrays, eids = t.read_contiguous(lo, min(lo + step, t.count), fields)
            yield arrays, eids
        return
    sel = SelectionRows(buf.row_source(), ids)
    n = sel.count
    for lo in range(0, n, step):
        rows = sel.to_parent(np.arange(lo, min(lo + step, n)))
        *arrays, eids = t.gather(rows, fields)
        yield arrays, eids
