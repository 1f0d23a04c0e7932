"""Checking stores on disk (``trajstore verify``).

:func:`verify_store` reads a store's keys directly (it never needs the store to open) and
checks what the format promises (docs/format.md):

- the root ``zarr.json`` and its ``trajstore`` schema, and each array's ``zarr.json``;
- the commit record ``trajstore.head.json``: readable, an entry per table, committed rows
  that fit the table (capacity) and the arrays (rows allocated);
- chunk presence: every chunk holding a committed row exists; raw chunk files have their full
  size (a shorter one is a truncated file); ``deep=True`` also decodes every such chunk;
- trajectory stores: the episode table (ids unique, every id below ``next_episode_id``).

Each fault names the key or array path and, for row damage, the table and the logical rows
it affects.  Temp files, unreferenced staging folders and chunks beyond the committed rows are
reported as notes: they are harmless, and :func:`trajstore.maintenance.repair.repair_store` removes them.

:mod:`trajstore.repair` acts on what this module finds.
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import zarr

from trajstore.core.ring import contiguous_runs
from trajstore.core.store import ATTRS_KEY, check_attrs
from trajstore.errors import (
    DamagedStoreError,
    NotATrajstoreError,
    StoreNotFoundError,
    TrajstoreError,
)
from trajstore.sampling.priority_store import check_sidecar
from trajstore.spaces import space_from_json
from trajstore.storage.confined import MAX_FILE_BYTES
from trajstore.storage.head import HEAD_KEY, PREV_KEY, Head, TableState, read_prev
from trajstore.storage.location import STAGING_DIR, TMP_DIR, Location, resolve_location
from trajstore.storage.schema import (
    TableSchema,
    _consolidated,
    check_allocation,
    check_array_meta,
    check_pending,
    check_schema,
    load_json,
)

__all__ = ["Fault", "VerifyReport", "verify_store"]


@dataclass
class Fault:
    """One problem: ``kind`` (a short code), the ``key`` or array path, the ``table`` and logical
    ``rows`` ``[lo, hi)`` it damages (None when not about rows), and a one-line ``message``."""

    kind: str
    key: str
    message: str
    table: str | None = None
    rows: tuple[int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        """The fault as a JSON object: ``kind``, ``key``, ``table``, ``rows`` (``[lo, hi]`` or
        null) and ``message``."""
        return {"kind": self.kind, "key": self.key, "table": self.table,
                "rows": list(self.rows) if self.rows else None, "message": self.message}


@dataclass
class VerifyReport:
    """What :func:`verify_store` found: the store is sound when :attr:`ok` (no fault).

    Attributes
    ----------
    url : str
        The store checked, as given.
    deep : bool
        Whether every committed chunk was also decoded.
    faults : list of Fault
        Damage: each names the key or array path and, for rows, the table and logical rows.
    notes : list of str
        Harmless findings, one line each (orphaned temp files, chunks beyond the committed rows,
        a pending rewrite, whether the previous commit record could replace the current one).
    checked : dict
        Counts: ``arrays``, ``chunks`` and ``decoded`` (what was checked), ``rows`` (committed
        rows of every table together) and ``table_rows`` (per table).
    removable : list of (str, str)
        ``(key, why)`` of the keys :func:`~trajstore.maintenance.repair.repair_store` may delete.
    """

    url: str
    deep: bool
    faults: list[Fault] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: ``arrays``, ``chunks``, ``decoded``: what was checked; ``rows``: committed rows of every table
    #: together; ``table_rows``: of each table (step rows and episode-data rows are different things)
    checked: dict[str, Any] = field(default_factory=lambda: {"arrays": 0, "chunks": 0, "decoded": 0, "rows": 0,
                                                             "table_rows": {}})
    #: keys that repair may delete (temp files, unreferenced staging, uncommitted chunks)
    removable: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether no fault was found (notes do not count)."""
        return not self.faults

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON object (what ``trajstore verify --json`` prints).

        Returns
        -------
        dict
            ``path``, ``ok``, ``deep``, ``faults`` (:meth:`Fault.to_json` each), ``notes``,
            ``checked`` and ``removable`` (``{"key", "why"}`` objects).
        """
        return {"path": self.url, "ok": self.ok, "deep": self.deep, "faults": [f.to_json() for f in self.faults],
                "notes": self.notes, "checked": self.checked,
                "removable": [{"key": k, "why": w} for k, w in self.removable]}


# -- reading the pieces ------------------------------------------------------------------------
@dataclass
class _Array:
    path: str
    table: str
    shape: tuple[int, ...]
    chunk_rows: int
    dtype: np.dtype
    raw: bool

    @property
    def chunk_bytes(self) -> int:
        return int(np.prod((self.chunk_rows, *self.shape[1:]), dtype=np.int64)) * self.dtype.itemsize

    def chunk_key(self, k: int) -> str:
        return f"{self.path}/c/{k}" + "/0" * (len(self.shape) - 1)


def _load_json(loc: Location, key: str) -> tuple[Any, str | None]:
    """``(object, None)``, ``(None, None)`` when the key is missing, or ``(None, why)`` when unreadable
    (not a regular file, too large, not JSON, nested too deep)."""
    try:
        raw = loc.get(key)
        if raw is None:
            return None, None
        obj = load_json(raw, str(loc.url), key)
    except DamagedStoreError as e:
        return None, _why(e)
    return (obj, None) if obj is not None else (None, "JSON null; expected an object")


def _why(e: Exception) -> str:
    """An error's message without the store's path in front (faults name their key)."""
    msg = str(e)
    return msg.split(": ", 1)[1] if ": " in msg else msg


def _parse_head(obj: Any, tables: list[str]) -> tuple[Head | None, str | None]:
    """A :class:`Head` from parsed JSON, its values type- and range-checked but without the row
    relations (start <= end, count <= allocated), which verify reports itself."""
    try:
        head = Head.from_obj(obj, "", check_rows=False)
    except DamagedStoreError as e:
        return None, _why(e).replace(f"{HEAD_KEY}: ", "", 1)
    missing = [t for t in tables if t not in head.tables]
    if missing:
        return None, f"no entry for table(s) {', '.join(missing)}"
    return head, None


_CHUNK_RE = re.compile(r"([0-9]{1,19})((?:/0)*)\Z")


def _chunk_index(key: str, array_path: str, ndim: int = 1) -> int | None:
    """Chunk number of ``key`` (``<path>/c/<k>/0/...``, exactly as zarr names it), else None."""
    m = _CHUNK_RE.match(key[len(array_path) + 3:] if array_path else key[2:])  # after "<path>/c/"
    if m is None or len(m.group(2)) != 2 * (ndim - 1):
        return None
    return int(m.group(1))


def _size(loc: Location, key: str) -> int:
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


def _runs(st: TableState, capacity: int | None, limit: int) -> list[tuple[int, int, int]]:
    """Physical runs ``(physical start, logical offset, n)`` of committed rows, clipped to ``limit`` rows."""
    out = []
    for p, off, m in contiguous_runs(st.start, st.end, capacity):
        m = max(0, min(m, limit - p))
        if m:
            out.append((p, off, m))
    return out


def _chunk_rows_logical(runs: list[tuple[int, int, int]], C: int) -> dict[int, list[tuple[int, int]]]:
    """Chunk number -> logical row ranges of committed rows it holds (a handful of chunks only:
    :func:`_check_rows` walks runs of chunks, never every chunk of a table)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for p, off, m in runs:
        for k in range(p // C, (p + m - 1) // C + 1):
            lo, hi = max(p, k * C), min(p + m, (k + 1) * C)
            out.setdefault(k, []).append((off + lo - p, off + hi - p))
    return out


def _fmt_rows(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in ranges)


class _Scan:
    """Everything verify learned about a store, reused by repair."""

    def __init__(self) -> None:
        self.attrs: dict[str, Any] | None = None
        self.schema: dict[str, TableSchema] = {}
        self.arrays: dict[str, _Array] = {}
        self.tables: dict[str, dict[str, Any]] = {}
        self.head: Head | None = None
        self.head_fault = False
        self.chunks: dict[str, dict[int, str]] = {}  # array path -> chunk number -> key
        self.bad_rows: dict[str, list[tuple[int, int]]] = {}  # table -> damaged logical rows
        self.root_missing = False
        self.stale: dict[str, int] = {}  # array path -> rows its zarr.json shape should record
        self.unlistable: set[str] = set()  # arrays whose chunk folder is a link or special file


def _scan(loc: Location, deep: bool, progress: Callable[[int, str], Any] | None,
          storage_options: dict[str, Any] | None = None) -> tuple[VerifyReport, _Scan]:
    rep = VerifyReport(str(loc.url), deep)
    sc = _Scan()
    try:
        keys = loc.list_prefix("")
    except DamagedStoreError as e:
        keys = []
        rep.faults.append(Fault("unlistable", "", f"the store cannot be listed ({_why(e)})"))
    if not keys and not rep.faults:
        raise StoreNotFoundError(f"no store at {loc.url!r}: nothing is stored there")
    root, why = _load_json(loc, "zarr.json")
    if root is None:
        if why is not None:
            rep.faults.append(Fault("root-unreadable", "zarr.json", f"zarr.json: the root metadata is unreadable ({why}); "
                                    "the store cannot be opened"))
        elif HEAD_KEY in keys or any(k.endswith("/zarr.json") for k in keys):
            sc.root_missing = True
            rep.faults.append(Fault("root-missing", "zarr.json", "zarr.json: the root metadata (schema and spaces) is "
                                    "missing; the store cannot be opened"))
        elif not rep.faults:
            raise NotATrajstoreError(f"{loc.url}: not a trajstore store (no zarr.json at its root)")
        _scan_orphans(loc, keys, None, rep)
        return rep, sc
    attrs = (root.get("attributes") or {}).get(ATTRS_KEY) if isinstance(root, dict) and isinstance(
        root.get("attributes"), (dict, type(None))) else None
    try:
        attrs = check_attrs(loc, attrs)  # not a store, or a newer format: raised (not faults of a store)
        sc.attrs = attrs
        if root.get("zarr_format") != 3 or root.get("node_type") != "group":
            raise DamagedStoreError(f"{loc.url}: zarr.json is not zarr v3 group metadata (zarr_format "
                                    f"{root.get('zarr_format')!r:.20}, node_type {root.get('node_type')!r:.20})")
        sc.schema = check_schema(attrs, str(loc.url))
        for name, sj in attrs["spaces"].items():  # what a buffer decodes when it opens (bounds included)
            try:
                space_from_json(sj)
            except TrajstoreError as e:
                raise DamagedStoreError(f"{loc.url}: the space of table {name!r} does not decode ({e})") from None
    except DamagedStoreError as e:
        rep.faults.append(Fault("schema", "zarr.json", f"zarr.json: the trajstore schema is malformed ({_why(e)}); "
                                "the store cannot be opened"))
        _scan_orphans(loc, keys, None, rep)
        return rep, sc
    sc.tables = {name: {"capacity": t.capacity, "fields": [f.path for f in t.fields]} for name, t in sc.schema.items()}
    # Arrays: each one's own zarr.json, and its consolidated entry (what zarr readers use).
    try:
        entries = _consolidated(root, str(loc.url))
    except DamagedStoreError as e:
        entries = None
        rep.faults.append(Fault("array-unreadable", "zarr.json", f"zarr.json: consolidated metadata is malformed ({_why(e)})"))
    for name, t in sc.schema.items():
        for f in t.fields:
            key = f"{f.path}/zarr.json"
            meta, why = _load_json(loc, key)
            if meta is None:
                rep.faults.append(Fault("array-missing", key, f"{key}: array metadata "
                                        f"{'is missing' if why is None else 'is unreadable (' + why + ')'}", name))
                continue
            try:
                rows = check_array_meta(meta, f, str(loc.url), key)
                if entries is not None:
                    if f.path not in entries:
                        raise DamagedStoreError(f"{loc.url}: zarr.json's consolidated metadata has no entry for {f.path}")
                    check_array_meta(entries[f.path], f, str(loc.url), f"zarr.json (consolidated entry {f.path})")
            except DamagedStoreError as e:
                rep.faults.append(Fault("array-unreadable", key, f"{key}: malformed array metadata ({_why(e)})", name))
                continue
            raw = f.layout == "raw" and len(meta["codecs"]) == 1
            sc.arrays[f.path] = _Array(f.path, name, (rows, *f.shape), f.chunk_rows, f.dtype, raw)
            rep.checked["arrays"] += 1
    # Commit record.
    obj, why = _load_json(loc, HEAD_KEY)
    if obj is None:
        sc.head_fault = True
        msg = "is missing" if why is None else f"is unreadable ({why})"
        rep.faults.append(Fault("head-missing" if why is None else "head-unreadable", HEAD_KEY,
                                f"{HEAD_KEY}: the commit record {msg}"))
    else:
        head, why = _parse_head(obj, list(sc.tables))
        if head is not None:
            try:
                check_pending(head.pending, sc.schema, {n: st.allocated for n, st in head.tables.items()}, "")
            except DamagedStoreError as e:
                head, why = None, _why(e)
        if head is None:
            sc.head_fault = True
            rep.faults.append(Fault("head-unreadable", HEAD_KEY, f"{HEAD_KEY}: the commit record is unreadable ({why})"))
        else:
            sc.head = head
    # Chunk listing (one listing per array; only keys named exactly as zarr names chunks count).
    for path, a in sc.arrays.items():
        found: dict[int, str] = {}
        try:
            listed = loc.list_prefix(f"{path}/c")
        except DamagedStoreError as e:
            listed = []
            rep.faults.append(Fault("bad-chunk", f"{path}/c", f"{path}/c: the chunk folder cannot be read ({_why(e)}); "
                                    f"table {a.table!r} rows are unreadable", a.table))
            sc.unlistable.add(path)
        for key in listed:
            k = _chunk_index(key, path, len(a.shape))
            if k is not None:
                found[k] = key
        sc.chunks[path] = found
    if sc.head is not None:
        _check_rows(loc, sc, rep, deep, progress)
        if not any(f.kind.startswith("head") for f in rep.faults):
            _check_episodes(loc, sc, rep, storage_options)
    _scan_orphans(loc, keys, sc.head, rep)
    if sc.head_fault or any(f.kind in ("head-past-data", "head-impossible") for f in rep.faults):
        _note_prev(loc, sc, rep)
    return rep, sc


def probe_head(loc: Location, sc: _Scan, head: Head) -> VerifyReport:
    """verify's row checks as if ``head`` were the commit record (what the scan learned is kept)."""
    probe = VerifyReport(str(loc.url), False)
    saved = sc.head, sc.bad_rows, sc.stale
    sc.head, sc.bad_rows, sc.stale = head, {}, dict(sc.stale)
    try:
        _check_rows(loc, sc, probe, False, None)
    finally:
        sc.head, sc.bad_rows, sc.stale = saved
    return probe


def usable_prev(loc: Location, sc: _Scan) -> tuple[Head | None, str]:
    """The previous commit record (``trajstore.head.prev.json``) when repair can use it: readable,
    an entry for each table and nothing else, a pending rewrite that fits the schema, and every row
    it names present and whole.  Otherwise ``(None, why not)``."""
    head, why = read_prev(loc)
    if head is None:
        return None, why or "it is unreadable"
    if set(head.tables) != set(sc.tables):
        return None, f"it names tables {sorted(head.tables)}, the store has {sorted(sc.tables)}"
    try:
        check_pending(head.pending, sc.schema, {n: st.allocated for n, st in head.tables.items()}, "")
    except DamagedStoreError as e:
        return None, _why(e)
    bad = [f.message for f in probe_head(loc, sc, head).faults if f.kind != "stale-shape"]
    if bad:
        return None, f"it does not fit the data either ({bad[0]})"
    return head, ""


def _note_prev(loc: Location, sc: _Scan, rep: VerifyReport) -> None:
    """Say whether ``trajstore repair`` can recover a damaged commit record from the previous one."""
    if not sc.tables:
        return
    head, why = usable_prev(loc, sc)
    if head is None:
        rep.notes.append(f"{PREV_KEY}: the previous commit record cannot replace it: {why}")
        return
    rows = ", ".join(f"{n} {st.count}" for n, st in head.tables.items())
    rep.notes.append(f"`trajstore repair` can recover from the previous commit record {PREV_KEY} (generation "
                     f"{head.generation}; committed rows: {rows}); at most the rows of the last commit are lost")


def _head_plausible(sc: _Scan, rep: VerifyReport, name: str, st: TableState, cap: int | None) -> bool:
    """The record's allocation for table ``name`` fits the schema (a ring: its capacity) and the
    plausibility bounds; otherwise a ``head-impossible`` fault."""
    problem = None
    if cap is not None and st.allocated != cap:
        problem = f"allocates {st.allocated} rows to a ring of capacity {cap}"
    else:
        try:
            for f in sc.schema[name].fields:
                check_allocation(f, max(st.allocated, st.end if cap is None else 0), "")
        except DamagedStoreError as e:
            problem = _why(e)
    if problem is None:
        return True
    rep.faults.append(Fault("head-impossible", HEAD_KEY, f"{HEAD_KEY}: table {name!r} {problem}", name))
    return False


def _check_rows(loc: Location, sc: _Scan, rep: VerifyReport, deep: bool, progress: Callable[[int, str], Any] | None) -> None:
    """Committed rows against the chunks on disk.  Work grows with the chunk files that exist and
    the runs of missing ones, never with the rows a (possibly hostile) record claims."""
    head = sc.head
    assert head is not None
    pending = head.pending or {}
    staged = {p: set(ks) for p, ks in (pending.get("chunks") or {}).items()}
    prefix = pending.get("prefix")
    todo: list[tuple[_Array, int, list[tuple[int, int]]]] = []
    for name, t in sc.tables.items():
        st, cap = head.tables[name], t["capacity"]
        bad: list[tuple[int, int]] = []
        sc.bad_rows[name] = bad
        if not 0 <= st.start <= st.end:
            rep.faults.append(Fault("head-impossible", HEAD_KEY, f"{HEAD_KEY}: table {name!r} names impossible rows "
                                    f"start={st.start} end={st.end}", name))
            bad.append((0, max(st.end - st.start, 0)))
            continue
        if not _head_plausible(sc, rep, name, st, cap):
            bad.append((0, st.count))
            continue
        if cap is not None and st.count > cap:
            rep.faults.append(Fault("head-past-data", HEAD_KEY, f"{HEAD_KEY}: table {name!r} commits {st.count} rows "
                                    f"but its capacity is {cap}", name, (cap, st.count)))
            bad.append((cap, st.count))
        rep.checked["rows"] += st.count
        rep.checked["table_rows"][name] = st.count
        for path in t["fields"]:
            a = sc.arrays.get(path)
            if a is None or path in sc.unlistable:
                bad.append((0, st.count))
                continue
            C = a.chunk_rows
            found = sc.chunks.get(path, {})
            alloc = a.shape[0]
            limit = alloc if cap is None else cap
            if cap is None and st.end > alloc:
                # The shape lags the commit record (a writer publishes it right after each record:
                # storage/published.py): plain zarr readers see fewer rows.  Chunks are checked
                # against the record; repair (or the next commit) publishes the shape.
                sc.stale[path] = st.end
                rep.notes.append(f"{path}/zarr.json: shape records {alloc} rows but table {name!r} commits "
                                 f"{st.end}: plain zarr readers see only the first {alloc} (repair or the next "
                                 "commit updates it)")
                limit = st.end
            elif cap is not None and alloc < cap:
                rep.faults.append(Fault("schema", f"{path}/zarr.json", f"{path}: holds {alloc} rows; the ring's capacity "
                                        f"is {cap}", name, (0, st.count)))
                bad.append((0, st.count))
            runs = _runs(st, cap, limit)
            ks_sorted = sorted(found)
            # Staged chunks (a pending rewrite) count as present while their staged file exists.
            staged_here = {k for k in staged.get(path, ()) if prefix is not None and loc.exists(f"{prefix}/{a.chunk_key(k)}")}
            present = sorted(set(ks_sorted) | staged_here)
            for k in sorted(staged_here):  # a writer moves these into place: they must be plain files
                key = f"{prefix}/{a.chunk_key(k)}"
                try:
                    _size(loc, key)
                except (DamagedStoreError, FileNotFoundError) as e:
                    rep.faults.append(Fault("bad-chunk", key, f"{key}: staged chunk of the pending rewrite: "
                                            f"{_why(e) if isinstance(e, DamagedStoreError) else 'not a file'}", name))
                    bad.append((0, st.count))
            wanted: list[tuple[int, int]] = []
            for p, off, m in runs:
                k0, k1 = p // C, (p + m - 1) // C
                wanted.append((k0, k1))
                rep.checked["chunks"] += k1 - k0 + 1

                def rows_of(k: int, p: int = p, off: int = off, m: int = m, C: int = C) -> tuple[int, int]:
                    lo, hi = max(p, k * C), min(p + m, (k + 1) * C)
                    return off + lo - p, off + hi - p

                here = present[bisect.bisect_left(present, k0):bisect.bisect_right(present, k1)]
                gaps, nxt = [], k0
                for k in here:
                    if k > nxt:
                        gaps.append((nxt, k - 1))
                    nxt = k + 1
                if nxt <= k1:
                    gaps.append((nxt, k1))
                tail = None
                if cap is None and len(gaps) == 1 and gaps[0][1] == k1 and gaps[0][0] > 0 \
                        and (not ks_sorted or ks_sorted[-1] < gaps[0][0]):
                    # Every chunk from the first missing one to the last committed row is gone, and no
                    # chunk at all exists there: the commit record names rows that were never written.
                    tail = gaps[0][0]
                    lo = rows_of(tail)[0]
                    rep.faults.append(Fault("head-past-data", HEAD_KEY, f"{HEAD_KEY}: table {name!r} commits rows up "
                                            f"to {st.count} but {path} has data only for rows [0, {lo}) (no chunk from "
                                            f"{a.chunk_key(tail)} on)", name, (lo, st.count)))
                    bad.append((lo, st.count))
                else:
                    for g0, g1 in gaps:
                        lo, hi = rows_of(g0)[0], rows_of(g1)[1]
                        what = f"{a.chunk_key(g0)}: chunk missing" if g0 == g1 else \
                            f"{a.chunk_key(g0)}: {g1 - g0 + 1} chunks missing (to {a.chunk_key(g1)})"
                        rep.faults.append(Fault("missing-chunk", a.chunk_key(g0), f"{what}; table {name!r} rows "
                                                f"{_fmt_rows([(lo, hi)])} are lost", name, (lo, hi)))
                        bad.append((lo, hi))
                for k in here:
                    ranges = [rows_of(k)]
                    key = a.chunk_key(k) if k in found else f"{prefix}/{a.chunk_key(k)}"
                    try:
                        size = _size(loc, key)
                    except (DamagedStoreError, FileNotFoundError) as e:
                        rep.faults.append(Fault("bad-chunk", key, f"{key}: {_why(e) if isinstance(e, DamagedStoreError) else 'not a file'}"
                                                f"; table {name!r} rows {_fmt_rows(ranges)} are unreadable", name, ranges[0]))
                        bad.extend(ranges)
                        continue
                    if size > MAX_FILE_BYTES:
                        rep.faults.append(Fault("bad-chunk", key, f"{key}: holds {size} bytes, more than a chunk may "
                                                f"({MAX_FILE_BYTES}); table {name!r} rows {_fmt_rows(ranges)} are "
                                                "unreadable", name, ranges[0]))
                        bad.extend(ranges)
                        continue
                    if (a.raw and size != a.chunk_bytes) or size == 0:
                        what = f"{size} of {a.chunk_bytes} bytes" if a.raw else "0 bytes"
                        rep.faults.append(Fault("truncated-chunk", key, f"{key}: truncated chunk file ({what}); table "
                                                f"{name!r} rows {_fmt_rows(ranges)} are damaged", name, ranges[0]))
                        bad.extend(ranges)
                        continue
                    if deep:
                        todo.append((a, k, ranges))
            # Chunks holding no committed row: left by a writer that died, or beyond the rows in use.
            for k in ks_sorted:
                if not any(k0 <= k <= k1 for k0, k1 in wanted):
                    rep.removable.append((found[k], "uncommitted chunk (holds no committed row)"))
    if deep and todo:
        _decode(loc, sc, rep, todo, progress)


def _decode(loc: Location, sc: _Scan, rep: VerifyReport, todo: list[tuple[_Array, int, list[tuple[int, int]]]],
            progress: Callable[[int, str], Any] | None) -> None:
    bar = progress(len(todo), "decode chunks") if progress else None
    opened: dict[str, Any] = {}
    try:
        for a, k, ranges in todo:
            try:
                z = opened.get(a.path)
                if z is None:
                    z = opened[a.path] = zarr.open_array(loc.zstore, path=a.path, mode="r")
                lo, hi = k * a.chunk_rows, min((k + 1) * a.chunk_rows, a.shape[0])
                if lo < hi:  # chunks past a stale shape cannot be read through zarr
                    z[lo:hi]
                    rep.checked["decoded"] += 1
            except Exception as e:  # any decoder error is a fault of this chunk
                key = a.chunk_key(k)
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                rep.faults.append(Fault("undecodable-chunk", key, f"{key}: chunk does not decode ({msg}); table "
                                        f"{a.table!r} rows {_fmt_rows(ranges)} are damaged", a.table,
                                        (ranges[0][0], ranges[-1][1])))
                sc.bad_rows[a.table].extend(ranges)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _check_opens(loc: Location, sc: _Scan, rep: VerifyReport, storage_options: dict[str, Any] | None) -> Any:
    """Open the store read-only, as a reader would; a store that does not open is a fault.
    Returns the open store (the caller closes it) or None."""
    from trajstore.maintenance.summary import open_store

    if loc.url is None:
        return None
    try:
        return open_store(loc.url, storage_options)
    except TrajstoreError as e:
        rep.faults.append(Fault("open", str(loc.url), f"the store does not open: {_why(e)}"))
    return None


def _check_episodes(loc: Location, sc: _Scan, rep: VerifyReport, storage_options: dict[str, Any] | None) -> None:
    """The store opens (as a reader would), and trajectory stores' episode ids are consistent with
    the commit record's state."""
    if sc.attrs is None or sc.head is None or any(f.kind not in ("missing-chunk", "truncated-chunk", "bad-chunk",
                                                                     "head-past-data") for f in rep.faults):
        return  # what keeps the store from opening is already reported
    store = _check_opens(loc, sc, rep, storage_options)
    if store is None:
        return
    try:
        if sc.attrs.get("kind") != "TrajectoryReplayBuffer" or any(sc.bad_rows.get(t) for t in sc.tables):
            return  # reading damaged rows would only repeat the faults above
        state = store.committed.state
        cur = int(state.get("current_episode_id", 0))
        nxt = int(state.get("next_episode_id", cur + 1))
        if cur >= nxt:
            rep.faults.append(Fault("episodes", HEAD_KEY, f"{HEAD_KEY}: current_episode_id {cur} is not below "
                                    f"next_episode_id {nxt}"))
        t = store.tables["step_data"]
        j = next(i for i, f in enumerate(t.fields) if f.spec.array_path == "step_episode_ids")
        ids = t.read_contiguous(0, t.count, [j])[0]
        over = np.flatnonzero(ids >= nxt)
        if over.size:
            rep.faults.append(Fault("episodes", "step_episode_ids", f"step_episode_ids: {over.size} step(s) carry ids at "
                                    f"or above next_episode_id {nxt} (first at row {int(over[0])})", "step_data",
                                    (int(over[0]), int(over[-1]) + 1)))
        et = store.tables.get("episode_data")
        if et is not None and et.count:
            jj = next(i for i, f in enumerate(et.fields) if f.spec.array_path == "episode_data/_episode_id")
            eids = et.read_contiguous(0, et.count, [jj])[0]
            uniq, counts = np.unique(eids, return_counts=True)
            if (counts > 1).any():
                dup = uniq[counts > 1].tolist()[:5]
                rep.faults.append(Fault("episodes", "episode_data/_episode_id", f"episode_data/_episode_id: episode id(s) "
                                        f"{dup} have more than one episode-data row", "episode_data", (0, et.count)))
            if (eids >= nxt).any():
                rep.faults.append(Fault("episodes", "episode_data/_episode_id", f"episode_data/_episode_id: episode-data "
                                        f"rows carry ids at or above next_episode_id {nxt}", "episode_data", (0, et.count)))
    except TrajstoreError as e:
        rep.faults.append(Fault("open", str(loc.url), f"the store's rows cannot be read: {_why(e)}"))
    finally:
        store.close()


def _scan_orphans(loc: Location, keys: list[str], head: Head | None, rep: VerifyReport) -> None:
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


def _locate(path: Any, storage_options: dict[str, Any] | None, read_only: bool) -> Location:
    p = os.fspath(path)
    url = "://" in p or "::" in p
    # A URL store whose zarr.json was removed must still be reachable (to report that).
    return resolve_location(path, read_only=read_only, storage_options=storage_options, must_exist=not url)


def verify_store(path: Any, *, storage_options: dict[str, Any] | None = None, deep: bool = False,
                 progress: Callable[[int, str], Any] | None = None) -> VerifyReport:
    """Check the store at ``path`` (read-only; nothing is written).

    ``progress(total, description)``, if given, returns a bar with ``update(n)`` and ``close()``
    (used for the deep decode).

    Raises
    ------
    StoreNotFoundError, NotATrajstoreError, FormatVersionError
        Nothing to verify at ``path`` (these are not faults of a store).
    """
    loc = _locate(path, storage_options, read_only=True)
    try:
        rep, sc = _scan(loc, deep, progress, storage_options)
        faults, notes = check_sidecar(loc, sc.head, storage_options, deep, verify_store)  # prioritized replay's
        rep.faults += [Fault(*f) for f in faults]
        rep.notes += notes
    except DamagedStoreError as e:  # whatever the scan could not turn into a finer fault
        rep = VerifyReport(str(loc.url), deep, [Fault("damaged", "", _why(e))])
    finally:
        loc.close()
    return rep
