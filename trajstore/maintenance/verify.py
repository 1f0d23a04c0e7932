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

from typing import Any, Callable

import numpy as np

from trajstore.core.store import ATTRS_KEY, check_attrs
from trajstore.errors import (
    DamagedStoreError,
    NotATrajstoreError,
    StoreNotFoundError,
    TrajstoreError,
)
from trajstore.maintenance.chunk_rows import check_rows
from trajstore.maintenance.pieces import (
    Scan,
    StoredArray,
    chunk_index,
    fault_text,
    locate,
    parse_head,
    read_json_key,
    scan_orphans,
)
from trajstore.maintenance.report import Fault, VerifyReport
from trajstore.sampling.priority_store import check_sidecar
from trajstore.spaces import space_from_json
from trajstore.storage.array_meta import check_array_meta, consolidated
from trajstore.storage.head import HEAD_KEY, PREV_KEY, Head, read_prev
from trajstore.storage.keys import ROBOT_KEY, RUNS_KEY, STATS_KEY
from trajstore.storage.location import Location
from trajstore.storage.robot_files import load_robot, load_stats
from trajstore.storage.runs_file import RUNS_TABLE, decode_runs, disagreement, runs_limit
from trajstore.storage.schema import (
    check_pending,
    check_schema,
)

__all__ = ["Fault", "VerifyReport", "verify_store", "scan_store", "probe_head", "usable_prev"]


def scan_store(loc: Location, deep: bool, progress: Callable[[int, str], Any] | None,
               storage_options: dict[str, Any] | None = None, packs: bool = True) -> tuple[VerifyReport, Scan]:
    """Verify the store at ``loc``: the report, and the :class:`Scan` of what was learned (which
    repair reuses).  ``progress`` and ``packs`` as :func:`verify_store` takes them.

    The steps, in order: list the keys, read the root metadata and its schema (a store without
    them stops there), each array's metadata, the commit record, each array's chunk listing, then
    the committed rows, the episodes and the files no record names."""
    rep = VerifyReport(str(loc.url), deep)
    sc = Scan()
    sc.pack_bytes = packs
    keys = _list_keys(loc, rep)
    root = _read_root(loc, keys, rep, sc)
    if root is None or not _check_root(loc, root, rep, sc):
        scan_orphans(loc, keys, None, rep)
        return rep, sc
    _scan_arrays(loc, root, rep, sc)
    _read_head(loc, rep, sc)
    _list_chunks(loc, rep, sc)
    if sc.head is not None:
        check_rows(loc, sc, rep, deep, progress)
        if not any(f.kind.startswith("head") for f in rep.faults):
            _check_episodes(loc, sc, rep, storage_options)
    scan_orphans(loc, keys, sc.head, rep)
    if sc.head_fault or any(f.kind in ("head-past-data", "head-impossible") for f in rep.faults):
        _note_prev(loc, sc, rep)
    return rep, sc


def _list_keys(loc: Location, rep: VerifyReport) -> list[str]:
    """Every key of the store (none and an ``unlistable`` fault when it cannot be listed)."""
    try:
        keys = loc.list_prefix("")
    except DamagedStoreError as e:
        keys = []
        rep.faults.append(Fault("unlistable", "", f"the store cannot be listed ({fault_text(e)})"))
    if not keys and not rep.faults:
        raise StoreNotFoundError(f"no store at {loc.url!r}: nothing is stored there")
    return keys


def _read_root(loc: Location, keys: list[str], rep: VerifyReport, sc: Scan) -> Any:
    """The root ``zarr.json`` as parsed JSON, or None (a fault says why; a location holding no
    store at all raises :class:`NotATrajstoreError`)."""
    root, why = read_json_key(loc, "zarr.json")
    if root is not None:
        return root
    if why is not None:
        rep.faults.append(Fault("root-unreadable", "zarr.json", f"zarr.json: the root metadata is unreadable ({why}); "
                                "the store cannot be opened"))
    elif HEAD_KEY in keys or any(k.endswith("/zarr.json") for k in keys):
        sc.root_missing = True
        rep.faults.append(Fault("root-missing", "zarr.json", "zarr.json: the root metadata (schema and spaces) is "
                                "missing; the store cannot be opened"))
    elif not rep.faults:
        raise NotATrajstoreError(f"{loc.url}: not a trajstore store (no zarr.json at its root)")
    return None


def _check_root(loc: Location, root: Any, rep: VerifyReport, sc: Scan) -> bool:
    """The root is zarr v3 group metadata holding a trajstore schema whose spaces decode: fills
    ``sc.attrs``, ``sc.schema`` and ``sc.tables``.  False (a ``schema`` fault) otherwise; not a
    store, or a newer format, raises (those are not faults of a store)."""
    attrs = (root.get("attributes") or {}).get(ATTRS_KEY) if isinstance(root, dict) and isinstance(
        root.get("attributes"), (dict, type(None))) else None
    try:
        attrs = check_attrs(loc, attrs)
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
        return False
    sc.tables = {name: {"capacity": t.capacity, "fields": [f.path for f in t.fields]} for name, t in sc.schema.items()}
    return True


def _scan_arrays(loc: Location, root: Any, rep: VerifyReport, sc: Scan) -> None:
    """Each array's own ``zarr.json`` and its consolidated entry (what zarr readers use) against
    the schema: fills ``sc.arrays``; a missing or malformed one is a fault."""
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


def _read_head(loc: Location, rep: VerifyReport, sc: Scan) -> None:
    """The commit record: ``sc.head`` when readable, with an entry per table and a pending rewrite
    that fits the schema; otherwise ``sc.head_fault`` and a fault."""
    obj, why = read_json_key(loc, HEAD_KEY)
    if obj is None:
        sc.head_fault = True
        msg = "is missing" if why is None else f"is unreadable ({why})"
        rep.faults.append(Fault("head-missing" if why is None else "head-unreadable", HEAD_KEY,
                                f"{HEAD_KEY}: the commit record {msg}"))
        return
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


def _list_chunks(loc: Location, rep: VerifyReport, sc: Scan) -> None:
    """One listing per array into ``sc.chunks`` (only keys named exactly as zarr names chunks
    count); an array whose chunk folder cannot be listed goes to ``sc.unlistable``."""
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


def probe_head(loc: Location, sc: Scan, head: Head) -> VerifyReport:
    """verify's row checks as if ``head`` were the commit record (what the scan learned is kept)."""
    probe = VerifyReport(str(loc.url), False)
    saved = sc.head, sc.bad_rows, sc.stale
    sc.head, sc.bad_rows, sc.stale = head, {}, dict(sc.stale)
    try:
        check_rows(loc, sc, probe, False, None)
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
                 progress: Callable[[int, str], Any] | None = None, packs: bool = True) -> VerifyReport:
    """Check the store at ``path`` (read-only; nothing is written).

    ``progress(total, description)``, if given, returns a bar with ``update(n)`` and ``close()``
    (used for the deep decode).  ``packs=False`` reads no linked video segment's packets to
    compare their crc32c (each pack is still checked to be a regular file holding them): for an
    import that has just computed those checksums from the same bytes.

    Raises
    ------
    StoreNotFoundError, NotATrajstoreError, FormatVersionError
        Nothing to verify at ``path`` (these are not faults of a store).
    """
    loc = locate(path, storage_options, read_only=True)
    try:
        rep, sc = scan_store(loc, deep, progress, storage_options, packs)
        faults, notes = check_sidecar(loc, sc.head, storage_options, deep, verify_store)  # prioritized replay's
        rep.faults += [Fault(*f) for f in faults]
        rep.notes += notes
    except DamagedStoreError as e:  # whatever the scan could not turn into a finer fault
        rep = VerifyReport(str(loc.url), deep, [Fault("damaged", "", fault_text(e))])
    finally:
        loc.close()
    return rep
