"""A store's pieces as verify and repair read them, straight from its keys (the store need not
open): array descriptions, metadata files, chunk keys and sizes, committed row runs, orphaned files,
and :class:`Scan`, everything verify learned about a store, which repair reuses."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from trajstore.core.ring import contiguous_runs
from trajstore.errors import DamagedStoreError
from trajstore.maintenance.report import VerifyReport
from trajstore.storage.head import HEAD_KEY, Head, TableState
from trajstore.storage.location import STAGING_DIR, TMP_DIR, Location, resolve_location
from trajstore.storage.schema import TableSchema, load_json

__all__ = ["StoredArray", "read_json_key", "fault_text", "parse_head", "chunk_index", "key_size", "committed_runs",
           "chunk_rows_logical", "fmt_rows", "Scan", "scan_orphans", "locate"]


@dataclass
class StoredArray:
    """One array as its ``zarr.json`` and the schema describe it: ``path``, ``table``, ``shape``
    (rows first), ``chunk_rows``, ``dtype`` and whether it is ``raw`` (uncompressed chunk files)."""

    path: str
    table: str
    shape: tuple[int, ...]
    chunk_rows: int
    dtype: np.dtype
    raw: bool

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one whole chunk (a raw chunk file's size)."""
        return int(np.prod((self.chunk_rows, *self.shape[1:]), dtype=np.int64)) * self.dtype.itemsize

    def chunk_key(self, k: int) -> str:
        """Key of chunk ``k`` (``<path>/c/<k>/0/...``)."""
        return f"{self.path}/c/{k}" + "/0" * (len(self.shape) - 1)


def read_json_key(loc: Location, key: str) -> tuple[Any, str | None]:
    """``(object, None)``, ``(None, None)`` when the key is missing, or ``(None, why)`` when unreadable
    (not a regular file, too large, not JSON, nested too deep)."""
    try:
        raw = loc.get(key)
        if raw is None:
            return None, None
        obj = load_json(raw, str(loc.url), key)
    except DamagedStoreError as e:
        return None, fault_text(e)
    return (obj, None) if obj is not None else (None, "JSON null; expected an object")


def fault_text(e: Exception) -> str:
    """An error's message without the store's path in front (faults name their key)."""
    msg = str(e)
    return msg.split(": ", 1)[1] if ": " in msg else msg


def parse_head(obj: Any, tables: list[str]) -> tuple[Head | None, str | None]:
    """A :class:`Head` from parsed JSON, its values type- and range-checked but without the row
    relations (start <= end, count <= allocated), which verify reports itself."""
    try:
        head = Head.from_obj(obj, "", check_rows=False)
    except DamagedStoreError as e:
        return None, fault_text(e).replace(f"{HEAD_KEY}: ", "", 1)
    missing = [t for t in tables if t not in head.tables]
    if missing:
        return None, f"no entry for table(s) {', '.join(missing)}"
    return head, None


_CHUNK_RE = re.compile(r"([0-9]{1,19})((?:/0)*)\Z")


def chunk_index(key: str, array_path: str, ndim: int = 1) -> int | None:
    """Chunk number of ``key`` (``<path>/c/<k>/0/...``, exactly as zarr names it), else None."""
    m = _CHUNK_RE.match(key[len(array_path) + 3:] if array_path else key[2:])  # after "<path>/c/"
    if m is None or len(m.group(2)) != 2 * (ndim - 1):
        return None
    return int(m.group(1))


def key_size(loc: Location, key: str) -> int:
    """Size of the chunk ``key``; locally it must be a regular file (never a link, FIFO, device).

    Raises
    ------
    DamagedStoreError
        Not a regular file (the message says what it is).
    """
    if loc.local_root is not None:
        fd = loc.open_inside(key, os.O_RDONLY)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)
    from zarr.core.sync import sync

    return int(sync(loc.zstore.getsize(key)))


def committed_runs(st: TableState, capacity: int | None, limit: int) -> list[tuple[int, int, int]]:
    """Physical runs ``(physical start, logical offset, n)`` of committed rows, clipped to ``limit`` rows."""
    out = []
    for p, off, m in contiguous_runs(st.start, st.end, capacity):
        m = max(0, min(m, limit - p))
        if m:
            out.append((p, off, m))
    return out


def chunk_rows_logical(runs: list[tuple[int, int, int]], C: int) -> dict[int, list[tuple[int, int]]]:
    """Chunk number -> logical row ranges of committed rows it holds (a handful of chunks only:
    verify walks runs of chunks, never every chunk of a table)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for p, off, m in runs:
        for k in range(p // C, (p + m - 1) // C + 1):
            lo, hi = max(p, k * C), min(p + m, (k + 1) * C)
            out.setdefault(k, []).append((off + lo - p, off + hi - p))
    return out


def fmt_rows(ranges: list[tuple[int, int]]) -> str:
    """Logical row ranges as a message writes them: ``[0, 5), [9, 12)``."""
    return ", ".join(f"[{a}, {b})" for a, b in ranges)


class Scan:
    """Everything verify learned about a store, reused by repair."""

    def __init__(self) -> None:
        self.attrs: dict[str, Any] | None = None
        self.schema: dict[str, TableSchema] = {}
        self.arrays: dict[str, StoredArray] = {}
        self.tables: dict[str, dict[str, Any]] = {}
        self.head: Head | None = None
        self.head_fault = False
        self.chunks: dict[str, dict[int, str]] = {}  # array path -> chunk number -> key
        self.bad_rows: dict[str, list[tuple[int, int]]] = {}  # table -> damaged logical rows
        self.root_missing = False
        self.stale: dict[str, int] = {}  # array path -> rows its zarr.json shape should record
        self.unlistable: set[str] = set()  # arrays whose chunk folder is a link or special file
        self.pack_bytes = True  # linked video segments: their packs' bytes read and checksummed


def scan_orphans(loc: Location, keys: list[str], head: Head | None, rep: VerifyReport) -> None:
    """Add to ``rep`` the keys among ``keys`` that repair may delete (temp files, staging of a
    rewrite ``head`` does not name, partial zarr writes), with a note per kind."""
    keep = (head.pending or {}).get("prefix") if head is not None else None
    for key in keys:
        if key.startswith(TMP_DIR + "/"):
            rep.removable.append((key, "temp file of a writer"))
        elif key.startswith(STAGING_DIR + "/"):
            parts = key.split("/")
            if keep is None or f"{parts[0]}/{parts[1]}" != keep:
                rep.removable.append((key, "staged chunk of an unfinished rewrite that was never committed"))
        elif key.endswith(".partial"):
            rep.removable.append((key, "partial file of an interrupted zarr write"))
    if head is not None and head.pending:
        rep.notes.append(f"a rewrite is pending ({head.pending.get('prefix')}); the next writer that opens the store "
                         "finishes it")
    if rep.removable:
        n_chunks = sum(1 for _k, w in rep.removable if w.startswith("uncommitted"))
        n_tmp = len(rep.removable) - n_chunks
        if n_tmp:
            rep.notes.append(f"{n_tmp} orphaned temp/staging file(s) (removed by repair or by the next writer)")
        if n_chunks:
            rep.notes.append(f"{n_chunks} chunk(s) hold no committed row (removed by repair)")


def locate(path: Any, storage_options: dict[str, Any] | None, read_only: bool) -> Location:
    """The store at ``path`` as a :class:`Location` (a URL store is reachable even without its
    root ``zarr.json``, so that verify can report it missing)."""
    p = os.fspath(path)
    url = "://" in p or "::" in p
    # A URL store whose zarr.json was removed must still be reachable (to report that).
    return resolve_location(path, read_only=read_only, storage_options=storage_options, must_exist=not url)
