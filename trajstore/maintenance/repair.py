"""Repairing stores on disk (``trajstore repair``), from what :mod:`trajstore.verify` finds.

:func:`repair_store` never changes the commit protocol: it only ever writes a commit record
that names a subset of the rows the previous one named (rows whose chunks are all intact), or
one found complete on disk (the previous commit record ``trajstore.head.prev.json`` that local
writers keep, or a record left in ``.trajstore-tmp`` by a commit that was interrupted before its
rename), or, for a store with no data at all, an empty record.  When none of these is provably
right it changes nothing and says why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import zarr

from trajstore.errors import DamagedStoreError, LockedError, ReadOnlyError
from trajstore.maintenance.pieces import Scan, committed_runs, fmt_rows, locate, parse_head, scan_orphans
from trajstore.maintenance.report import VerifyReport
from trajstore.maintenance.verify import probe_head, scan_store, usable_prev
from trajstore.storage.confined import MAX_HEAD_BYTES
from trajstore.storage.fields.spec import sized_array
from trajstore.storage.head import (
    HEAD_KEY,
    LOCK_KEY,
    MPLOCK_KEY,
    PREV_KEY,
    Head,
    TableState,
    write_head,
)
from trajstore.storage.keys import RUNS_KEY
from trajstore.storage.location import STAGING_DIR, TMP_DIR, Location
from trajstore.storage.locks import WriterLock
from trajstore.storage.schema import check_pending, load_json

__all__ = ["RepairReport", "repair_store"]


@dataclass
class RepairReport:
    """What :func:`repair_store` did (or, with ``dry_run``, would do).

    Attributes
    ----------
    url : str
        The store repaired, as given.
    dry_run : bool
        True: nothing was written; ``changes`` lists what a real run would change.
    recovered : bool
        Whether the store is (or would be) consistent afterwards; False when repair cannot fix
        it safely (``problems`` says why) or faults remain after the repair.
    changes : list of dict
        One per change, in order: ``action`` (``"write"`` a commit record, ``"rollback"`` a
        table's committed rows, ``"resize"`` an array's recorded shape, ``"delete"`` a key,
        ``"keep"`` intact chunks of dropped rows), ``key``, ``why``; a rollback adds ``table``,
        ``rows_before`` and ``rows_after`` (absolute ``[start, end]``), a write of a found commit
        record ``rows_after`` per table.
    problems : list of str
        Why the store could not be (fully) repaired, one line each.
    before : VerifyReport or None
        The scan repair acted on.
    after : VerifyReport or None
        A scan after the changes were written (None for a dry run, or when repair stopped early).
    """

    url: str
    dry_run: bool
    recovered: bool
    changes: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    before: VerifyReport | None = None
    after: VerifyReport | None = None

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON object (what ``trajstore repair --json`` prints): ``path``,
        ``dry_run``, ``recovered``, ``changes``, ``problems``, and ``before``/``after`` as
        :meth:`VerifyReport.to_json` (or null)."""
        return {"path": self.url, "dry_run": self.dry_run, "recovered": self.recovered, "changes": self.changes,
                "problems": self.problems, "before": self.before.to_json() if self.before else None,
                "after": self.after.to_json() if self.after else None}


def _intact_window(count: int, bad: list[tuple[int, int]], ring: bool) -> tuple[int, int]:
    """Logical rows ``[a, b)`` to keep: an unbounded table keeps the prefix before its first damaged
    row (its rows must start at 0); a ring keeps its longest undamaged run (the later one on ties)."""
    marks = np.zeros(count, bool)
    for lo, hi in bad:
        marks[max(lo, 0):min(hi, count)] = True
    if not marks.any():
        return 0, count
    if not ring:
        return 0, int(np.argmax(marks))
    best, a = (0, 0), None
    for i in range(count + 1):
        good = i < count and not marks[i]
        if good and a is None:
            a = i
        elif not good and a is not None:
            if i - a >= best[1] - best[0]:
                best = (a, i)
            a = None
    return best


def _tmp_head_candidates(loc: Location, sc: Scan) -> list[Head]:
    """Complete commit records left in the temp folder by a commit interrupted before its rename."""
    out = []
    for key in loc.list_prefix(TMP_DIR):
        try:  # regular files of a commit record's size only (a link, FIFO or device is skipped)
            raw = loc.get(key, limit=MAX_HEAD_BYTES)
            if raw is None or not raw.lstrip().startswith(b"{"):
                continue
            obj = load_json(raw, str(loc.url), key, strict_numbers=True)
        except DamagedStoreError:
            continue
        head, fault_text = parse_head(obj, list(sc.tables))
        if head is not None:
            try:
                check_pending(head.pending, sc.schema, {n: st.allocated for n, st in head.tables.items()}, "")
            except DamagedStoreError:
                continue
        if head is not None and set(head.tables) == set(sc.tables) and not head.pending:
            out.append(head)
    return sorted(out, key=lambda h: h.generation, reverse=True)


def _probe(loc: Location, sc: Scan, head: Head) -> VerifyReport:
    """verify's row checks as if ``head`` were the commit record."""
    return probe_head(loc, sc, head)


def _head_consistent(loc: Location, sc: Scan, head: Head) -> bool:
    """Every committed row of ``head`` has its chunks present, at full size, inside the arrays."""
    return not [f for f in _probe(loc, sc, head).faults if f.kind != "stale-shape"]


def _read_ids(loc: Location, sc: Scan, path: str, st: TableState) -> np.ndarray:
    """The committed rows ``st`` of the 1-D id array ``path`` (int64, logical order), read through
    zarr (rows a repair keeps are intact)."""
    cap = sc.tables[sc.arrays[path].table]["capacity"]
    z = sized_array(zarr.open_array(loc.zstore, path=path, mode="r"), st.allocated)
    parts = [np.asarray(z[p:p + m], np.int64) for p, _off, m in committed_runs(st, cap, st.allocated)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _drop_orphan_episode_data(loc: Location, sc: Scan, old: Head, new: Head, rep: RepairReport) -> None:
    """After the step table of a trajectory store was rolled back, drop from ``new`` the episode-data
    rows of the episodes whose steps all went with it (ids above every kept step's; every id when
    no step is kept), as ``remove_at`` drops the data of episodes it leaves without steps.  The
    episode being recorded (``current_episode_id``) keeps its row: its data may be set before its
    first step.  Like every rollback, the record keeps a window of the rows it named (a ring: the
    longest run without such rows; an unbounded table: the rows before the first one)."""
    steps, episodes = "step_data", "episode_data"
    if (sc.attrs is None or sc.attrs.get("kind") != "TrajectoryReplayBuffer" or episodes not in new.tables
            or new.tables[steps] == old.tables[steps]):
        return
    st, et = new.tables[steps], new.tables[episodes]
    try:
        kept = _read_ids(loc, sc, "step_episode_ids", st)
        eids = _read_ids(loc, sc, f"{episodes}/_episode_id", et)
    except Exception as e:  # any decoder's error: a chunk present at full size that does not decode
        rep.recovered = False
        rep.problems.append(f"the episode ids of the rows kept could not be read ({type(e).__name__}: {e}), so "
                            "episode data of episodes left without steps was not dropped; run repair --deep")
        return
    orphan = ~np.isin(eids, kept) & (eids != new.state.get("current_episode_id"))
    if kept.size:
        orphan &= eids > kept.max()
    if not orphan.any():
        return
    a, b = _intact_window(len(eids), [(int(i), int(i) + 1) for i in np.flatnonzero(orphan)],
                          sc.tables[episodes]["capacity"] is not None)
    new.tables[episodes] = TableState(et.start + a, et.start + b, et.allocated)
    dropped = ([(0, a)] if a else []) + ([(b, len(eids))] if b < len(eids) else [])
    rep.changes.append({"action": "rollback", "key": HEAD_KEY, "table": episodes,
                        "rows_before": [et.start, et.end], "rows_after": [et.start + a, et.start + b],
                        "why": f"table {episodes!r}: dropped rows {fmt_rows(dropped)} (logical rows before repair), "
                               f"episode data of episodes whose steps were all dropped; kept {b - a} rows"})


def _refuse_zip(p: str, dry_run: bool) -> None:
    """A ``.zip`` store is written once: repairing it in place is refused (a dry run only reads)."""
    if not dry_run and "://" not in p and p.endswith(".zip"):
        raise ReadOnlyError(f"{p}: a .zip store is written once and cannot be repaired in place; copy it to a folder "
                            "(trajstore copy), repair that, and copy it back")


def _lock_for_repair(loc: Location, dry_run: bool) -> WriterLock | None:
    """The writer lock of a local store repair will write to, or None (a dry run, a remote store).

    ``shared=True``: taken exclusively when free, without marking the lock file, so what the next
    writer learns about an unclean end (fresh episode ids) is kept."""
    if dry_run or not loc.is_local:
        return None
    try:
        lock = WriterLock(loc, shared=True)
    except LockedError:
        raise LockedError(f"{loc.url}: a writer has the store open; close it before repairing") from None
    if not lock.sole:
        lock.release()
        raise LockedError(f"{loc.url}: a writer has the store open; close it before repairing")
    return lock


def _metadata_lost(sc: Scan, before: VerifyReport, rep: RepairReport) -> bool:
    """True (and the problem reported) when the root or array metadata cannot be read: no other copy
    of it is stored, so nothing can be repaired."""
    if not (sc.root_missing or sc.attrs is None or any(f.kind in ("root-unreadable", "schema", "array-missing",
                                                                  "array-unreadable") for f in before.faults)):
        return False
    rep.recovered = False
    rep.problems.append("the root or array metadata (schema, spaces, array layout) is missing or unreadable "
                        "and no other copy of it is stored: restore the store from a backup or copy; nothing "
                        "was changed")
    return True


def _found_head(loc: Location, sc: Scan, rep: RepairReport, cands: list[tuple[int, int, Head]]) -> Head:
    """The newest candidate record (the previous one first on a tie: it was committed), moved past
    any generation a reader may have seen and into a new epoch; the change is reported."""
    _gen, is_prev, cand = max(cands, key=lambda c: (c[0], c[1]))
    new_head = cand.copy()
    # Past any record a reader may have seen (the damaged one may have been the next generation),
    # and a new epoch: rows it named past these may be written anew.
    new_head.generation += 2 if is_prev else 1
    new_head.epoch += 1
    rows = {n: [st.start, st.end] for n, st in cand.tables.items()}
    if is_prev:
        why = (f"replaced the damaged commit record by the previous one, {PREV_KEY} (generation "
               f"{cand.generation}; rows {', '.join(f'{n} {st.count}' for n, st in cand.tables.items())}): "
               "it is a copy of the last commit record, or of the one before it when a writer was killed "
               "while committing, so at most the rows of the last commit are lost")
    else:
        why = (f"replaced the damaged commit record by a complete one (generation {cand.generation}) left "
               f"in {TMP_DIR} by an interrupted commit")
    rep.changes.append({"action": "write", "key": HEAD_KEY, "rows_after": rows, "why": why})
    return new_head


def _empty_head(sc: Scan, rep: RepairReport) -> Head:
    """An empty commit record for a store whose arrays hold no data (it loses nothing)."""
    assert sc.attrs is not None
    new_head = Head(1, 0, {name: TableState(0, 0, sc.arrays[t["fields"][0]].shape[0])
                           for name, t in sc.tables.items()}, {}, None)
    if sc.attrs.get("kind") == "TrajectoryReplayBuffer":
        new_head.state = {"current_episode_id": 0, "next_episode_id": 1}
    rep.changes.append({"action": "write", "key": HEAD_KEY, "why": "wrote an empty commit record: no "
                        "array holds any data, so no committed row can be lost"})
    return new_head


def _replace_untrusted_head(loc: Location, sc: Scan, rep: RepairReport) -> Head | None:
    """A record to replace a missing, unreadable or untrustworthy one: the previous commit record
    (kept by local writers) or a complete record left in the temp folder, the newest whose rows are
    all present and whole; an empty record when no array holds data.  None (the problem reported)
    when no record is provably right."""
    prev, prev_why = usable_prev(loc, sc)
    cands = [(c.generation, 0, c) for c in _tmp_head_candidates(loc, sc) if _head_consistent(loc, sc, c)]
    if prev is not None:
        cands.append((prev.generation, 1, prev))
    no_data = not any(sc.chunks.get(a) for a in sc.arrays)
    if cands and not no_data:
        return _found_head(loc, sc, rep, cands)
    if no_data:  # an empty record loses nothing (whatever an earlier record says)
        return _empty_head(sc, rep)
    what = "is missing or unreadable" if sc.head_fault else "names rows past the stored data"
    rep.recovered = False
    rep.problems.append(f"{HEAD_KEY} {what} and no earlier consistent commit record is on disk "
                        f"({PREV_KEY}: {prev_why}): which rows were committed cannot be known "
                        "safely, so nothing was changed; restore the store from a backup or copy")
    return None


def _roll_back(loc: Location, sc: Scan, rep: RepairReport) -> Head:
    """The commit record with each table's damaged rows dropped: the longest intact run of the rows
    it named (an unbounded table: the prefix before the first damaged row), in a new epoch; then
    the episode data of episodes left without steps."""
    assert sc.head is not None
    new_head = sc.head.copy()
    new_head.generation += 1
    new_head.epoch += 1
    for name, t in sc.tables.items():
        st = sc.head.tables[name]
        bad = sc.bad_rows.get(name) or []
        if not bad:
            continue
        a, b = _intact_window(max(st.count, 0), bad, t["capacity"] is not None)
        allocated = st.allocated
        if t["capacity"] is None and not any(p in sc.stale for p in t["fields"]):
            shape = min(sc.arrays[p].shape[0] for p in t["fields"])
            allocated = max(min(st.allocated, shape), b)
        new = TableState(st.start + a, st.start + b, allocated)
        new_head.tables[name] = new
        dropped = [(0, a)] if a else []
        dropped += [(b, st.count)] if b < st.count else []
        rep.changes.append({"action": "rollback", "key": HEAD_KEY, "table": name,
                            "rows_before": [st.start, st.end], "rows_after": [new.start, new.end],
                            "why": f"table {name!r}: dropped damaged or missing rows {fmt_rows(dropped)} "
                                   f"(logical rows before repair); kept {b - a} intact committed rows"})
    _drop_orphan_episode_data(loc, sc, sc.head, new_head, rep)
    return new_head


def _keep_dropped_chunks(before: VerifyReport, removable: list[tuple[str, str]],
                         rep: RepairReport) -> list[tuple[str, str]]:
    """After a rollback: intact chunks of the dropped rows stay (readable with zarr, for salvage; a
    later repair removes them); damaged chunk files go now (a writer could not map a truncated one).
    Returns what is still removed."""
    damaged = {f.key: f.kind for f in before.faults if f.kind in ("truncated-chunk", "undecodable-chunk", "bad-chunk")}
    was = {k for k, _w in before.removable}
    kept = [k for k, _w in removable if k not in was and k not in damaged]
    out = [(k, w) if k not in damaged else (k, f"damaged chunk ({damaged[k]}) of dropped rows")
           for k, w in removable if k in was or k in damaged]
    if kept:
        rep.changes.append({"action": "keep", "key": ", ".join(kept[:3]) + (" ..." if len(kept) > 3 else ""),
                            "why": f"{len(kept)} intact chunk(s) of the dropped rows stay on disk, readable "
                                   "with zarr; run repair again to remove them"})
    return out


def _removable(loc: Location, sc: Scan, before: VerifyReport, new_head: Head | None, rolled_back: bool,
               rep: RepairReport) -> list[tuple[str, str]]:
    """(key, why) of what to delete, judged against the record that will be in place (the lock
    files never)."""
    if new_head is None:
        removable = list(before.removable)
    else:
        removable = list(_probe(loc, sc, new_head).removable)
        if rolled_back:
            removable = _keep_dropped_chunks(before, removable, rep)
        keys = loc.list_prefix("")
        orphan = VerifyReport(str(loc.url), False)
        scan_orphans(loc, keys, new_head, orphan)
        removable += orphan.removable
        if RUNS_KEY in keys and RUNS_KEY not in {k for k, _w in removable}:
            removable.append((RUNS_KEY, "saved run index of the replaced commit record"))
    return [(k, w) for k, w in removable if k not in (LOCK_KEY, MPLOCK_KEY)]


def _write_changes(loc: Location, sc: Scan, new_head: Head | None, removable: list[tuple[str, str]]) -> None:
    """Write what the report lists: stale shapes grown, the new record, then the deletions (the
    record first: no committed row ever points at a deleted chunk)."""
    if sc.stale:
        _resize(loc, sc)
    if new_head is not None:
        write_head(loc, new_head)
    for key, _why in removable:
        loc.delete(key)
    if loc.local_root is not None:
        for folder in (TMP_DIR, STAGING_DIR):
            _prune_empty(loc.local_root / folder)


def _repair_scanned(loc: Location, sc: Scan, before: VerifyReport, rep: RepairReport, dry_run: bool) -> bool:
    """Decide and (unless ``dry_run``) write the changes for the scan ``before``.  False when repair
    stopped without changing anything (``rep.problems`` says why)."""
    if _metadata_lost(sc, before, rep):
        return False
    new_head: Head | None = None
    rolled_back = False
    # A record naming rows past the data (or impossible rows) cannot be trusted at all: where its
    # committed rows really ended is unknown (raw chunks are full size, padded chunks hold zeros),
    # so it is treated like an unreadable one.
    if sc.head_fault or any(f.kind in ("head-past-data", "head-impossible") for f in before.faults):
        new_head = _replace_untrusted_head(loc, sc, rep)
        if new_head is None:
            return False
    elif any(sc.bad_rows.get(t) for t in sc.tables):
        new_head, rolled_back = _roll_back(loc, sc, rep), True
    episode_faults = [f for f in before.faults if f.kind == "episodes"]
    if episode_faults and new_head is None:
        rep.recovered = False
        rep.problems.append("the episode table is inconsistent with the commit record; repair cannot fix that "
                            "safely: " + "; ".join(f.message for f in episode_faults))
    removable = _removable(loc, sc, before, new_head, rolled_back, rep)
    for path, n_rows in sorted(sc.stale.items()):
        rep.changes.append({"action": "resize", "key": f"{path}/zarr.json", "why": f"recorded shape "
                            f"{sc.arrays[path].shape[0]} -> {n_rows} rows (the chunks are there; zarr readers now "
                            "see every committed row)"})
    if not dry_run:
        _write_changes(loc, sc, new_head, removable)
    for key, why in removable:
        rep.changes.append({"action": "delete", "key": key, "why": why})
    return True


def repair_store(path: Any, *, storage_options: dict[str, Any] | None = None, dry_run: bool = False,
                 deep: bool = False, progress: Callable[[int, str], Any] | None = None) -> RepairReport:
    """Bring the store at ``path`` back to a consistent state, or say why that is impossible.

    What it does (and lists in ``changes``):

    - a commit record naming rows whose chunks are missing, truncated (or, with ``deep``, do
      not decode), or that lie past the arrays: rolled back to the longest intact run of the rows
      it named (an unbounded table keeps the prefix before the first damaged row); every row kept
      was committed and is intact;
    - a missing or unreadable commit record: replaced by a complete record left in
      ``.trajstore-tmp`` by an interrupted commit (the newest one whose rows are all intact), or,
      when no array holds any chunk, by an empty record; otherwise recovery is impossible
      (which rows were committed cannot be known) and nothing is changed;
    - removes temp files, unreferenced staging folders, zarr ``*.partial`` files and chunks that
      hold no committed row.

    A missing root ``zarr.json`` (the schema and spaces) cannot be rebuilt: reported, nothing
    changed.  ``dry_run=True`` reports the same changes without writing a byte.  Local stores are
    locked while repaired (a store a writer has open is refused); remote stores have no lock, so
    make sure no writer is running.

    Raises
    ------
    ReadOnlyError
        A ``.zip`` store without ``dry_run`` (zips are written once; repair a folder copy).
    LockedError
        A writer has the local store open.
    StoreNotFoundError
        No local folder or zip at ``path``.
    """
    p = os.fspath(path)
    _refuse_zip(p, dry_run)
    loc = locate(path, storage_options, read_only=dry_run)
    lock = None
    try:
        lock = _lock_for_repair(loc, dry_run)
        before, sc = scan_store(loc, deep, progress, storage_options)
        rep = RepairReport(str(loc.url), dry_run, True, before=before)
        if _repair_scanned(loc, sc, before, rep, dry_run) and not dry_run:
            rep.after, _ = scan_store(loc, deep, progress, storage_options)
            if rep.after.faults:
                rep.recovered = False
                rep.problems.append("faults remain after repair: " + "; ".join(f.message for f in rep.after.faults))
        return rep
    finally:
        if lock is not None:
            lock.release()
        loc.close()


def _resize(loc: Location, sc: Scan) -> None:
    """Grow stale array shapes (metadata only: growing never touches chunks), then consolidate."""
    import warnings

    for path, rows in sc.stale.items():
        z = zarr.open_array(loc.zstore, path=path, mode="r+")
        if z.shape[0] < rows:
            z.resize((rows, *z.shape[1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(loc.zstore)


def _prune_empty(folder: Any) -> None:
    """Remove empty folders left under ``folder`` (and it, if empty)."""
    if os.path.islink(folder) or not os.path.isdir(folder):
        return  # os.walk would follow a link at the top: never prune outside the store
    for dirpath, _dirs, _files in sorted(os.walk(folder), key=lambda x: -len(x[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass

