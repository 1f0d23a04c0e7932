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
from typing import Any, Callable

import numpy as np
import zarr

from trajstore.core.store import ATTRS_KEY, check_attrs
from trajstore.errors import (
    DamagedStoreError,
    NotATrajstoreError,
    StoreNotFoundError,
    TrajstoreError,
)
from trajstore.maintenance.pieces import (
    Scan,
    StoredArray,
    chunk_index,
    committed_runs,
    fault_text,
    fmt_rows,
    key_size,
    locate,
    parse_head,
    read_json_key,
    scan_orphans,
)
from trajstore.maintenance.report import Fault, VerifyReport
from trajstore.sampling.priority_store import check_sidecar
from trajstore.spaces import space_from_json
from trajstore.storage.array_meta import check_array_meta, consolidated
from trajstore.storage.confined import MAX_FILE_BYTES
from trajstore.storage.head import HEAD_KEY, PREV_KEY, Head, TableState, read_prev
from trajstore.storage.keys import ROBOT_KEY, RUNS_KEY, STATS_KEY
from trajstore.storage.location import Location
from trajstore.storage.robot_files import load_robot, load_stats
from trajstore.storage.runs_file import RUNS_TABLE, decode_runs, disagreement, runs_limit
from trajstore.storage.schema import (
    check_allocation,
    check_pending,
    check_schema,
)

__all__ = ["Fault", "VerifyReport", "verify_store", "scan_store", "probe_head", "usable_prev"]


def scan_store(loc: Location, deep: bool, progress: Callable[[int, str], Any] | None,
               storage_options: dict[str, Any] | None = None) -> tuple[VerifyReport, Scan]:
    """Verify the store at ``loc``: the report, and the :class:`Scan` of what was learned (which
    repair reuses).  ``progress`` as :func:`verify_store` takes it."""
    rep = VerifyReport(str(loc.url), deep)
    sc = Scan()
    try:
        keys = loc.list_prefix("")
    except DamagedStoreError as e:
        keys = []
        rep.faults.append(Fault("unlistable", "", f"the store cannot be listed ({fault_text(e)})"))
    if not keys and not rep.faults:
        raise StoreNotFoundError(f"no store at {loc.url!r}: nothing is stored there")
    root, why = read_json_key(loc, "zarr.json")
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
        scan_orphans(loc, keys, None, rep)
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
        rep.faults.append(Fault("schema", "zarr.json", f"zarr.json: the trajstore schema is malformed ({fault_text(e)}); "
                                "the store cannot be opened"))
        scan_orphans(loc, keys, None, rep)
        return rep, sc
    sc.tables = {name: {"capacity": t.capacity, "fields": [f.path for f in t.fields]} for name, t in sc.schema.items()}
    # Arrays: each one's own zarr.json, and its consolidated entry (what zarr readers use).
    try:
        entries = consolidated(root, str(loc.url))
    except DamagedStoreError as e:
        entries = None
        rep.faults.append(Fault("array-unreadable", "zarr.json", f"zarr.json: consolidated metadata is malformed ({fault_text(e)})"))
    for name, t in sc.schema.items():
        for f in t.fields:
            key = f"{f.path}/zarr.json"
            meta, why = read_json_key(loc, key)
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
                rep.faults.append(Fault("array-unreadable", key, f"{key}: malformed array metadata ({fault_text(e)})", name))
                continue
            raw = f.layout == "raw" and len(meta["codecs"]) == 1
            sc.arrays[f.path] = StoredArray(f.path, name, (rows, *f.shape), f.chunk_rows, f.dtype, raw)
            rep.checked["arrays"] += 1
    # Commit record.
    obj, why = read_json_key(loc, HEAD_KEY)
    if obj is None:
        sc.head_fault = True
        msg = "is missing" if why is None else f"is unreadable ({why})"
        rep.faults.append(Fault("head-missing" if why is None else "head-unreadable", HEAD_KEY,
                                f"{HEAD_KEY}: the commit record {msg}"))
    else:
        head, why = parse_head(obj, list(sc.tables))
        if head is not None:
            try:
                check_pending(head.pending, sc.schema, {n: st.allocated for n, st in head.tables.items()}, "")
            except DamagedStoreError as e:
                head, why = None, fault_text(e)
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
            rep.faults.append(Fault("bad-chunk", f"{path}/c", f"{path}/c: the chunk folder cannot be read ({fault_text(e)}); "
                                    f"table {a.table!r} rows are unreadable", a.table))
            sc.unlistable.add(path)
        for key in listed:
            k = chunk_index(key, path, len(a.shape))
            if k is not None:
                found[k] = key
        sc.chunks[path] = found
    if sc.head is not None:
        _check_rows(loc, sc, rep, deep, progress)
        if not any(f.kind.startswith("head") for f in rep.faults):
            _check_episodes(loc, sc, rep, storage_options)
    scan_orphans(loc, keys, sc.head, rep)
    if sc.head_fault or any(f.kind in ("head-past-data", "head-impossible") for f in rep.faults):
        _note_prev(loc, sc, rep)
    return rep, sc


def probe_head(loc: Location, sc: Scan, head: Head) -> VerifyReport:
    """verify's row checks as if ``head`` were the commit record (what the scan learned is kept)."""
    probe = VerifyReport(str(loc.url), False)
    saved = sc.head, sc.bad_rows, sc.stale
    sc.head, sc.bad_rows, sc.stale = head, {}, dict(sc.stale)
    try:
        _check_rows(loc, sc, probe, False, None)
    finally:
        sc.head, sc.bad_rows, sc.stale = saved
    return probe


def usable_prev(loc: Location, sc: Scan) -> tuple[Head | None, str]:
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
        return None, fault_text(e)
    bad = [f.message for f in probe_head(loc, sc, head).faults if f.kind != "stale-shape"]
    if bad:
        return None, f"it does not fit the data either ({bad[0]})"
    return head, ""


def _note_prev(loc: Location, sc: Scan, rep: VerifyReport) -> None:
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


def _head_plausible(sc: Scan, rep: VerifyReport, name: str, st: TableState, cap: int | None) -> bool:
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
            problem = fault_text(e)
    if problem is None:
        return True
    rep.faults.append(Fault("head-impossible", HEAD_KEY, f"{HEAD_KEY}: table {name!r} {problem}", name))
    return False


def _check_rows(loc: Location, sc: Scan, rep: VerifyReport, deep: bool, progress: Callable[[int, str], Any] | None) -> None:
    """Committed rows against the chunks on disk.  Work grows with the chunk files that exist and
    the runs of missing ones, never with the rows a (possibly hostile) record claims."""
    head = sc.head
    assert head is not None
    pending = head.pending or {}
    staged = {p: set(ks) for p, ks in (pending.get("chunks") or {}).items()}
    prefix = pending.get("prefix")
    todo: list[tuple[StoredArray, int, list[tuple[int, int]]]] = []
    videos = {f.path for t in (sc.schema or {}).values() for f in t.fields if f.layout == "video"}
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
            if path in videos:
                _check_video(loc, rep, a, st.end, deep, bad)
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
            runs = committed_runs(st, cap, limit)
            ks_sorted = sorted(found)
            # Staged chunks (a pending rewrite) count as present while their staged file exists.
            staged_here = {k for k in staged.get(path, ()) if prefix is not None and loc.exists(f"{prefix}/{a.chunk_key(k)}")}
            present = sorted(set(ks_sorted) | staged_here)
            for k in sorted(staged_here):  # a writer moves these into place: they must be plain files
                key = f"{prefix}/{a.chunk_key(k)}"
                try:
                    key_size(loc, key)
                except (DamagedStoreError, FileNotFoundError) as e:
                    rep.faults.append(Fault("bad-chunk", key, f"{key}: staged chunk of the pending rewrite: "
                                            f"{fault_text(e) if isinstance(e, DamagedStoreError) else 'not a file'}", name))
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
                                                f"{fmt_rows([(lo, hi)])} are lost", name, (lo, hi)))
                        bad.append((lo, hi))
                for k in here:
                    ranges = [rows_of(k)]
                    key = a.chunk_key(k) if k in found else f"{prefix}/{a.chunk_key(k)}"
                    try:
                        size = key_size(loc, key)
                    except (DamagedStoreError, FileNotFoundError) as e:
                        rep.faults.append(Fault("bad-chunk", key, f"{key}: {fault_text(e) if isinstance(e, DamagedStoreError) else 'not a file'}"
                                                f"; table {name!r} rows {fmt_rows(ranges)} are unreadable", name, ranges[0]))
                        bad.extend(ranges)
                        continue
                    if size > MAX_FILE_BYTES:
                        rep.faults.append(Fault("bad-chunk", key, f"{key}: holds {size} bytes, more than a chunk may "
                                                f"({MAX_FILE_BYTES}); table {name!r} rows {fmt_rows(ranges)} are "
                                                "unreadable", name, ranges[0]))
                        bad.extend(ranges)
                        continue
                    if (a.raw and size != a.chunk_bytes) or size == 0:
                        what = f"{size} of {a.chunk_bytes} bytes" if a.raw else "0 bytes"
                        rep.faults.append(Fault("truncated-chunk", key, f"{key}: truncated chunk file ({what}); table "
                                                f"{name!r} rows {fmt_rows(ranges)} are damaged", name, ranges[0]))
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


def _check_video(loc: Location, rep: VerifyReport, a: StoredArray, end: int, deep: bool,
                 bad: list[tuple[int, int]]) -> None:
    """A video field's committed rows (an unbounded table: physical rows are absolute) against
    its segment index and segments (:func:`trajstore.storage.fields.video.check_video`)."""
    from trajstore.storage.fields.video import check_video
    from trajstore.storage.fields.video_codec import VIDEO_ATTR

    meta, _why = read_json_key(loc, f"{a.path}/zarr.json")  # (checked by the scan before)
    attrs = meta.get("attributes") if isinstance(meta, dict) else None
    settings = attrs.get(VIDEO_ATTR) if isinstance(attrs, dict) else None
    faults, decoded, extra = check_video(loc, a.path, a.shape[1:], settings, end, deep)
    for kind, key, msg, lo, hi in faults:
        rep.faults.append(Fault(kind, key, f"{msg} (table {a.table!r})", a.table, (lo, hi)))
        bad.append((lo, hi))
    rep.checked["chunks"] += 1
    rep.checked["decoded"] += decoded
    rep.removable.extend((k, "uncommitted chunk (a video segment no commit record counts)") for k in extra)


def _decode(loc: Location, sc: Scan, rep: VerifyReport, todo: list[tuple[StoredArray, int, list[tuple[int, int]]]],
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
                                        f"{a.table!r} rows {fmt_rows(ranges)} are damaged", a.table,
                                        (ranges[0][0], ranges[-1][1])))
                sc.bad_rows[a.table].extend(ranges)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _check_opens(loc: Location, sc: Scan, rep: VerifyReport, storage_options: dict[str, Any] | None) -> Any:
    """Open the store read-only, as a reader would; a store that does not open is a fault.
    Returns the open store (the caller closes it) or None."""
    from trajstore.maintenance.summary import open_store

    if loc.url is None:
        return None
    try:
        return open_store(loc.url, storage_options)
    except TrajstoreError as e:
        rep.faults.append(Fault("open", str(loc.url), f"the store does not open: {fault_text(e)}"))
    return None


def _check_episodes(loc: Location, sc: Scan, rep: VerifyReport, storage_options: dict[str, Any] | None) -> None:
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
        _check_runs(loc, sc, rep, store.committed, ids)
        _check_robot_files(loc, rep)
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
        rep.faults.append(Fault("open", str(loc.url), f"the store's rows cannot be read: {fault_text(e)}"))
    finally:
        store.close()


def _check_robot_files(loc: Location, rep: VerifyReport) -> None:
    """``trajstore.robot.json`` and ``trajstore.stats`` parse (docs/format.md "Robot metadata").  A
    damaged stats file is derived data: repair removes it (readers then compute statistics from
    the rows); a damaged robot file holds the tasks, so it stays for a person to look at."""
    for key, load in ((ROBOT_KEY, load_robot), (STATS_KEY, load_stats)):
        try:
            load(loc)
        except DamagedStoreError as e:
            rep.faults.append(Fault("robot", key, fault_text(e)))
            if key == STATS_KEY:
                rep.removable.append((key, "damaged per-episode statistics (computed again from the rows)"))


def _check_runs(loc: Location, sc: Scan, rep: VerifyReport, head: Head, ids: np.ndarray) -> None:
    """The saved run index (:mod:`trajstore.storage.runs_file`), when there is one: well formed,
    and for the committed rows it describes, the runs of ``ids``.  Readers ignore a malformed or
    stale one, so those are notes; one that lies would make them accept windows across episodes."""
    st = head.tables[RUNS_TABLE]
    try:
        raw = loc.get(RUNS_KEY, limit=runs_limit(st, sc.tables[RUNS_TABLE]["capacity"]))
        saved = None if raw is None else decode_runs(raw, str(loc.url))
    except DamagedStoreError as e:
        rep.notes.append(f"{RUNS_KEY}: unusable saved run index ({fault_text(e)}); readers ignore it and scan the "
                         "step ids (removed by repair or by the next writer)")
        rep.removable.append((RUNS_KEY, "unusable saved run index"))
        return
    if saved is None:
        return
    if not saved.usable(head.epoch, st):
        rep.notes.append(f"{RUNS_KEY}: saved run index of other rows (epoch {saved.epoch}, rows [{saved.begin}, "
                         f"{saved.end})); readers ignore it (removed by repair or by the next writer)")
        rep.removable.append((RUNS_KEY, "stale saved run index"))
        return
    row = disagreement(saved, ids, st.start)
    if row is not None:
        rep.faults.append(Fault("runs", RUNS_KEY, f"{RUNS_KEY}: the saved run index disagrees with step_episode_ids "
                                f"at row {row - st.start} (logical): readers would take windows across episodes for "
                                "windows inside one; repair removes it"))
        rep.removable.append((RUNS_KEY, "saved run index that disagrees with the step ids"))


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
    loc = locate(path, storage_options, read_only=True)
    try:
        rep, sc = scan_store(loc, deep, progress, storage_options)
        faults, notes = check_sidecar(loc, sc.head, storage_options, deep, verify_store)  # prioritized replay's
        rep.faults += [Fault(*f) for f in faults]
        rep.notes += notes
    except DamagedStoreError as e:  # whatever the scan could not turn into a finer fault
        rep = VerifyReport(str(loc.url), deep, [Fault("damaged", "", fault_text(e))])
    finally:
        loc.close()
    return rep
