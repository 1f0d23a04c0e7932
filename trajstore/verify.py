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
reported as notes: they are harmless, and :func:`trajstore.repair.repair_store` removes them.

:mod:`trajstore.repair` acts on what this module finds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import zarr

from .errors import NotATrajstoreError, StoreNotFoundError, TrajstoreError
from .head import HEAD_KEY, Head, TableState
from .ring import contiguous_runs
from .storage import STAGING_DIR, TMP_DIR, Location, resolve_location
from .store import ATTRS_KEY, check_attrs

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
        return {"kind": self.kind, "key": self.key, "table": self.table,
                "rows": list(self.rows) if self.rows else None, "message": self.message}


@dataclass
class VerifyReport:
    url: str
    deep: bool
    faults: list[Fault] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=lambda: {"arrays": 0, "chunks": 0, "decoded": 0, "rows": 0})
    #: keys that repair may delete (temp files, unreferenced staging, uncommitted chunks)
    removable: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.faults

    def to_json(self) -> dict[str, Any]:
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
    """``(object, None)``, ``(None, None)`` when the key is missing, or ``(None, why)`` when unreadable."""
    raw = loc.get(key)
    if raw is None:
        return None, None
    try:
        return json.loads(raw), None
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"{type(e).__name__}: {e}"


def _parse_head(obj: Any, tables: list[str]) -> tuple[Head | None, str | None]:
    """A :class:`Head` from parsed JSON without the core's range checks (verify reports those itself)."""
    try:
        ts = {str(k): TableState(int(v["start"]), int(v["end"]), int(v["allocated"])) for k, v in obj["tables"].items()}
        head = Head(int(obj["generation"]), int(obj.get("epoch", 0)), ts, dict(obj.get("state") or {}), obj.get("pending"))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return None, f"{type(e).__name__}: {e}"
    missing = [t for t in tables if t not in ts]
    if missing:
        return None, f"no entry for table(s) {', '.join(missing)}"
    return head, None


def _chunk_index(key: str, array_path: str) -> int | None:
    rest = key[len(array_path) + 3:] if array_path else key[2:]  # after "<path>/c/"
    try:
        return int(rest.split("/", 1)[0])
    except ValueError:
        return None


def _size(loc: Location, key: str) -> int:
    if loc.local_root is not None:
        return os.stat(loc.path(key)).st_size
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
    """Chunk number -> logical row ranges of committed rows it holds."""
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
        self.arrays: dict[str, _Array] = {}
        self.tables: dict[str, dict[str, Any]] = {}
        self.head: Head | None = None
        self.head_fault = False
        self.chunks: dict[str, dict[int, str]] = {}  # array path -> chunk number -> key
        self.bad_rows: dict[str, list[tuple[int, int]]] = {}  # table -> damaged logical rows
        self.root_missing = False
        self.stale: dict[str, int] = {}  # array path -> rows its zarr.json shape should record


def _scan(loc: Location, deep: bool, progress: Callable[[int, str], Any] | None,
          storage_options: dict[str, Any] | None = None) -> tuple[VerifyReport, _Scan]:
    rep = VerifyReport(str(loc.url), deep)
    sc = _Scan()
    keys = loc.list_prefix("")
    if not keys:
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
        else:
            raise NotATrajstoreError(f"{loc.url}: not a trajstore store (no zarr.json at its root)")
        _scan_orphans(loc, keys, None, rep)
        return rep, sc
    attrs = check_attrs(loc, (root.get("attributes") or {}).get(ATTRS_KEY) if isinstance(root, dict) else None)
    sc.attrs = attrs
    try:
        sc.tables = {name: {"capacity": t["capacity"], "fields": [f["path"] for f in t["fields"]]}
                     for name, t in attrs["tables"].items()}
    except (KeyError, TypeError, AttributeError) as e:
        rep.faults.append(Fault("schema", "zarr.json", f"zarr.json: the trajstore schema is malformed ({e})"))
        return rep, sc
    # Arrays.
    for name, t in sc.tables.items():
        for path in t["fields"]:
            meta, why = _load_json(loc, f"{path}/zarr.json")
            if meta is None:
                rep.faults.append(Fault("array-missing", f"{path}/zarr.json", f"{path}/zarr.json: array metadata "
                                        f"{'is missing' if why is None else 'is unreadable (' + why + ')'}", name))
                continue
            try:
                shape = tuple(int(s) for s in meta["shape"])
                C = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
                dtype = np.dtype(meta["data_type"])
                raw = [c["name"] for c in meta["codecs"]] == ["bytes"]
            except (KeyError, TypeError, ValueError, IndexError) as e:
                rep.faults.append(Fault("array-unreadable", f"{path}/zarr.json", f"{path}/zarr.json: malformed array "
                                        f"metadata ({e})", name))
                continue
            sc.arrays[path] = _Array(path, name, shape, C, dtype, raw)
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
        if head is None:
            sc.head_fault = True
            rep.faults.append(Fault("head-unreadable", HEAD_KEY, f"{HEAD_KEY}: the commit record is unreadable ({why})"))
        else:
            sc.head = head
    # Chunk listing (one listing per array).
    for path in sc.arrays:
        found: dict[int, str] = {}
        for key in loc.list_prefix(f"{path}/c"):
            k = _chunk_index(key, path)
            if k is not None:
                found[k] = key
        sc.chunks[path] = found
    if sc.head is not None:
        _check_rows(loc, sc, rep, deep, progress)
        if not any(f.kind.startswith("head") for f in rep.faults):
            _check_episodes(loc, sc, rep, storage_options)
    _scan_orphans(loc, keys, sc.head, rep)
    return rep, sc


def _check_rows(loc: Location, sc: _Scan, rep: VerifyReport, deep: bool, progress: Callable[[int, str], Any] | None) -> None:
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
        if cap is not None and st.count > cap:
            rep.faults.append(Fault("head-past-data", HEAD_KEY, f"{HEAD_KEY}: table {name!r} commits {st.count} rows "
                                    f"but its capacity is {cap}", name, (cap, st.count)))
            bad.append((cap, st.count))
        rep.checked["rows"] += st.count
        for path in t["fields"]:
            a = sc.arrays.get(path)
            if a is None:
                bad.append((0, st.count))
                continue
            alloc = a.shape[0]
            limit = alloc if cap is None else cap
            if cap is None and st.end > alloc:
                if any(k * a.chunk_rows >= alloc for k in sc.chunks[path]):
                    # Chunks exist past the shape zarr.json records: the rows are there, the metadata
                    # is stale (plain zarr readers see only the first rows).  Repair resizes it.
                    target = max(st.allocated, -(-st.end // a.chunk_rows) * a.chunk_rows)
                    sc.stale[path] = target
                    rep.faults.append(Fault("stale-shape", f"{path}/zarr.json", f"{path}/zarr.json: shape records "
                                            f"{alloc} rows but table {name!r} commits {st.end} (the commit record "
                                            f"allocates {st.allocated}); zarr readers see only the first {alloc} rows",
                                            name))
                    limit = st.end
                else:
                    lo = alloc - st.start
                    rep.faults.append(Fault("head-past-data", HEAD_KEY, f"{HEAD_KEY}: table {name!r} commits rows up "
                                            f"to {st.end} but {path} holds only {alloc} rows (rows [{lo}, {st.count}) "
                                            "have no data)", name, (max(lo, 0), st.count)))
                    bad.append((max(lo, 0), st.count))
            elif cap is not None and alloc < cap:
                rep.faults.append(Fault("schema", f"{path}/zarr.json", f"{path}: holds {alloc} rows; the ring's capacity "
                                        f"is {cap}", name, (0, st.count)))
                bad.append((0, st.count))
            needed = _chunk_rows_logical(_runs(st, cap, limit), a.chunk_rows)
            present = {k for k in needed if k in sc.chunks[path]
                       or (prefix is not None and k in staged.get(path, ()) and loc.exists(f"{prefix}/{a.chunk_key(k)}"))}
            missing = sorted(set(needed) - present)
            tail_from = None
            if cap is None and missing and missing[-1] == max(needed) and len(missing) >= 1:
                # Every chunk from the first missing one to the last committed row is gone, and no
                # chunk at all exists there: the commit record names rows that were never written.
                first = missing[0]
                if missing == list(range(first, max(needed) + 1)) and not any(k >= first for k in sc.chunks[path]) \
                        and first > 0:
                    tail_from = first
            if tail_from is not None:
                lo = needed[tail_from][0][0]
                rep.faults.append(Fault("head-past-data", HEAD_KEY, f"{HEAD_KEY}: table {name!r} commits rows up to "
                                        f"{st.count} but {path} has data only for rows [0, {lo}) (no chunk from "
                                        f"{a.chunk_key(tail_from)} on)", name, (lo, st.count)))
                bad.append((lo, st.count))
            for k, ranges in needed.items():
                rep.checked["chunks"] += 1
                key = a.chunk_key(k)
                in_staging = k in present and k not in sc.chunks[path]
                if k not in present:
                    if tail_from is None:
                        rep.faults.append(Fault("missing-chunk", key, f"{key}: chunk missing; table {name!r} rows "
                                                f"{_fmt_rows(ranges)} are lost", name, (ranges[0][0], ranges[-1][1])))
                        bad.extend(ranges)
                    continue
                if in_staging:
                    key = f"{prefix}/{key}"
                size = _size(loc, key)
                if (a.raw and size != a.chunk_bytes) or size == 0:
                    what = f"{size} of {a.chunk_bytes} bytes" if a.raw else "0 bytes"
                    rep.faults.append(Fault("truncated-chunk", key, f"{key}: truncated chunk file ({what}); table "
                                            f"{name!r} rows {_fmt_rows(ranges)} are damaged", name,
                                            (ranges[0][0], ranges[-1][1])))
                    bad.extend(ranges)
                    continue
                if deep:
                    todo.append((a, k, ranges))
            # Chunks holding no committed row: left by a writer that died, or beyond the rows in use.
            wanted = set(_chunk_rows_logical(_runs(st, cap, limit), a.chunk_rows))
            for k, key in sorted(sc.chunks[path].items()):
                if k not in wanted:
                    rep.removable.append((key, "uncommitted chunk (holds no committed row)"))
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


def _check_episodes(loc: Location, sc: _Scan, rep: VerifyReport, storage_options: dict[str, Any] | None) -> None:
    """Trajectory stores: episode ids consistent with the commit record's state."""
    if sc.attrs is None or sc.attrs.get("kind") != "TrajectoryReplayBuffer" or sc.head is None:
        return
    if any(sc.bad_rows.get(t) for t in sc.tables):
        return  # reading damaged rows would only repeat the faults above
    from .summary import open_store

    try:
        store = open_store(loc.url, storage_options) if loc.url is not None else None
    except TrajstoreError as e:
        rep.faults.append(Fault("open", str(loc.url), f"the store does not open: {e}"))
        return
    if store is None:
        return
    try:
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
        rep, _sc = _scan(loc, deep, progress, storage_options)
    finally:
        loc.close()
    return rep
