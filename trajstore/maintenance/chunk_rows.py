"""verify's row checks (:func:`check_rows`): a store's committed rows against the chunk files on
disk, one named step per check (the table's record, each field's allocation, staged chunks, the
chunks each run of rows needs, each chunk file's size, and with ``deep`` each chunk's decode).

Work grows with the chunk files that exist and the runs of missing ones, never with the rows a
(possibly hostile) commit record claims.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable

import zarr

from trajstore.errors import DamagedStoreError
from trajstore.maintenance.pieces import (
    Scan,
    StoredArray,
    committed_runs,
    fault_text,
    fmt_rows,
    key_size,
    read_json_key,
)
from trajstore.maintenance.report import Fault, VerifyReport
from trajstore.storage.confined import MAX_FILE_BYTES
from trajstore.storage.head import HEAD_KEY, TableState
from trajstore.storage.location import Location
from trajstore.storage.schema import check_allocation

__all__ = ["check_rows"]

#: A chunk to decode (``deep``): its array, its index, and the logical rows of the table it holds.
Todo = tuple[StoredArray, int, list[tuple[int, int]]]


def check_rows(loc: Location, sc: Scan, rep: VerifyReport, deep: bool,
               progress: Callable[[int, str], Any] | None) -> None:
    """Check every committed row of ``sc.head`` against the chunks on disk: faults go to ``rep``,
    the damaged logical rows of each table to ``sc.bad_rows``, shapes that lag the record to
    ``sc.stale`` and chunks holding no committed row to ``rep.removable``.  ``deep`` also decodes
    every chunk holding a committed row (``progress`` as :func:`~trajstore.maintenance.verify.verify_store`
    takes it)."""
    head = sc.head
    assert head is not None
    pending = head.pending or {}
    staged = {p: set(ks) for p, ks in (pending.get("chunks") or {}).items()}
    todo: list[Todo] = []
    videos = {f.path for t in (sc.schema or {}).values() for f in t.fields if f.layout == "video"}
    for name, t in sc.tables.items():
        st, cap = head.tables[name], t["capacity"]
        bad: list[tuple[int, int]] = []
        sc.bad_rows[name] = bad
        if not _record_fits(sc, rep, name, st, cap, bad):
            continue
        rep.checked["rows"] += st.count
        rep.checked["table_rows"][name] = st.count
        for path in t["fields"]:
            a = sc.arrays.get(path)
            if a is None or path in sc.unlistable:
                bad.append((0, st.count))
                continue
            if path in videos:
                _check_video(loc, rep, a, st.end, deep, bad, sc.pack_bytes)
                continue
            check = _FieldRows(loc, rep, name, st, cap, a, sc.chunks.get(path, {}), pending.get("prefix"), bad, deep)
            check.run(sc, staged.get(path, set()))
            todo += check.todo
    if deep and todo:
        _decode(loc, sc, rep, todo, progress)


def _check_video(loc: Location, rep: VerifyReport, a: StoredArray, end: int, deep: bool,
                 bad: list[tuple[int, int]], packs: bool) -> None:
    """A video field's committed rows (an unbounded table: physical rows are absolute) against
    its segment index and segments (:func:`trajstore.storage.fields.video_check.check_video`;
    ``packs``: linked segments' bytes read and checksummed)."""
    from trajstore.storage.fields.video_check import check_video
    from trajstore.storage.fields.video_codec import VIDEO_ATTR

    meta, _why = read_json_key(loc, f"{a.path}/zarr.json")  # (checked by the scan before)
    attrs = meta.get("attributes") if isinstance(meta, dict) else None
    settings = attrs.get(VIDEO_ATTR) if isinstance(attrs, dict) else None
    faults, decoded, extra = check_video(loc, a.path, a.shape[1:], settings, end, deep, packs)
    for kind, key, msg, lo, hi in faults:
        rep.faults.append(Fault(kind, key, f"{msg} (table {a.table!r})", a.table, (lo, hi)))
        bad.append((lo, hi))
    rep.checked["chunks"] += 1
    rep.checked["decoded"] += decoded
    rep.removable.extend((k, "uncommitted chunk (a video segment no commit record counts)") for k in extra)


def _record_fits(sc: Scan, rep: VerifyReport, name: str, st: TableState, cap: int | None,
                 bad: list[tuple[int, int]]) -> bool:
    """The record's rows of table ``name`` are possible (``0 <= start <= end``, an allocation the
    schema allows); otherwise a ``head-impossible`` fault, every row bad, and False.  A ring
    committing more rows than its capacity is a ``head-past-data`` fault for the rows past it."""
    if not 0 <= st.start <= st.end:
        rep.faults.append(Fault("head-impossible", HEAD_KEY, f"{HEAD_KEY}: table {name!r} names impossible rows "
                                f"start={st.start} end={st.end}", name))
        bad.append((0, max(st.end - st.start, 0)))
        return False
    if not _head_plausible(sc, rep, name, st, cap):
        bad.append((0, st.count))
        return False
    if cap is not None and st.count > cap:
        rep.faults.append(Fault("head-past-data", HEAD_KEY, f"{HEAD_KEY}: table {name!r} commits {st.count} rows "
                                f"but its capacity is {cap}", name, (cap, st.count)))
        bad.append((cap, st.count))
    return True


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


@dataclass
class _FieldRows:
    """The row checks of one field (array ``a``) of table ``table``: what its steps share.  Bad
    logical rows are appended to ``bad`` (the table's list in ``Scan.bad_rows``), and with
    ``deep`` the chunks to decode to ``todo``."""

    loc: Location
    rep: VerifyReport
    table: str
    st: TableState
    cap: int | None
    a: StoredArray
    found: dict[int, str]
    prefix: str | None
    bad: list[tuple[int, int]]
    deep: bool
    todo: list[Todo] = field(default_factory=list)

    def run(self, sc: Scan, staged: set[int]) -> None:
        """Every step, in order: the rows the array holds, the staged chunks, each run's chunks,
        then the chunks holding no committed row."""
        limit = self._row_limit(sc)
        ks_sorted = sorted(self.found)
        present = sorted(set(ks_sorted) | self._staged(staged))
        wanted = [self._check_run(p, off, m, present, ks_sorted)
                  for p, off, m in committed_runs(self.st, self.cap, limit)]
        # Chunks holding no committed row: left by a writer that died, or beyond the rows in use.
        for k in ks_sorted:
            if not any(k0 <= k <= k1 for k0, k1 in wanted):
                self.rep.removable.append((self.found[k], "uncommitted chunk (holds no committed row)"))

    def _fault(self, kind: str, key: str, message: str, rows: tuple[int, int] | None) -> None:
        self.rep.faults.append(Fault(kind, key, message, self.table, rows))

    def _row_limit(self, sc: Scan) -> int:
        """Physical rows the chunks are checked against: the array's rows (a ring: its capacity),
        or the record's end where the array's recorded shape lags it (a note; ``sc.stale``)."""
        a, st, cap, path = self.a, self.st, self.cap, self.a.path
        alloc = a.shape[0]
        if cap is None and st.end > alloc:
            # The shape lags the commit record (a writer publishes it right after each record:
            # storage/published.py): plain zarr readers see fewer rows.  Chunks are checked
            # against the record; repair (or the next commit) publishes the shape.
            sc.stale[path] = st.end
            self.rep.notes.append(f"{path}/zarr.json: shape records {alloc} rows but table {self.table!r} commits "
                                  f"{st.end}: plain zarr readers see only the first {alloc} (repair or the next "
                                  "commit updates it)")
            return st.end
        if cap is not None and alloc < cap:
            self._fault("schema", f"{path}/zarr.json", f"{path}: holds {alloc} rows; the ring's capacity is {cap}",
                        (0, st.count))
            self.bad.append((0, st.count))
        return alloc if cap is None else cap

    def _staged(self, staged: set[int]) -> set[int]:
        """Staged chunks (a pending rewrite) that count as present: their staged file exists.  A
        writer moves these into place, so each must be a plain file (else the table's rows are bad)."""
        prefix = self.prefix
        here = {k for k in staged if prefix is not None and self.loc.exists(f"{prefix}/{self.a.chunk_key(k)}")}
        for k in sorted(here):
            key = f"{prefix}/{self.a.chunk_key(k)}"
            try:
                key_size(self.loc, key)
            except (DamagedStoreError, FileNotFoundError) as e:
                self._fault("bad-chunk", key, f"{key}: staged chunk of the pending rewrite: "
                            f"{fault_text(e) if isinstance(e, DamagedStoreError) else 'not a file'}", None)
                self.bad.append((0, self.st.count))
        return here

    def _check_run(self, p: int, off: int, m: int, present: list[int], ks_sorted: list[int]) -> tuple[int, int]:
        """One run of committed rows (physical rows ``[p, p + m)``, logical from ``off``): its
        missing chunks, then each present chunk's file.  Returns the run's chunks ``(k0, k1)``."""
        C = self.a.chunk_rows
        k0, k1 = p // C, (p + m - 1) // C
        self.rep.checked["chunks"] += k1 - k0 + 1

        def rows_of(k: int) -> tuple[int, int]:
            lo, hi = max(p, k * C), min(p + m, (k + 1) * C)
            return off + lo - p, off + hi - p

        here = present[bisect.bisect_left(present, k0):bisect.bisect_right(present, k1)]
        self._report_gaps(_gaps(here, k0, k1), k1, ks_sorted, rows_of)
        for k in here:
            self._check_chunk(k, rows_of(k))
        return k0, k1

    def _report_gaps(self, gaps: list[tuple[int, int]], k1: int, ks_sorted: list[int],
                     rows_of: Callable[[int], tuple[int, int]]) -> None:
        """Missing chunks of a run: one ``head-past-data`` fault when every chunk from the first
        missing one on is gone (an unbounded table), else one ``missing-chunk`` fault per gap."""
        a, name, count = self.a, self.table, self.st.count
        if self.cap is None and len(gaps) == 1 and gaps[0][1] == k1 and gaps[0][0] > 0 \
                and (not ks_sorted or ks_sorted[-1] < gaps[0][0]):
            # Every chunk from the first missing one to the last committed row is gone, and no
            # chunk at all exists there: the commit record names rows that were never written.
            tail = gaps[0][0]
            lo = rows_of(tail)[0]
            self._fault("head-past-data", HEAD_KEY, f"{HEAD_KEY}: table {name!r} commits rows up to {count} but "
                        f"{a.path} has data only for rows [0, {lo}) (no chunk from {a.chunk_key(tail)} on)",
                        (lo, count))
            self.bad.append((lo, count))
            return
        for g0, g1 in gaps:
            lo, hi = rows_of(g0)[0], rows_of(g1)[1]
            what = f"{a.chunk_key(g0)}: chunk missing" if g0 == g1 else \
                f"{a.chunk_key(g0)}: {g1 - g0 + 1} chunks missing (to {a.chunk_key(g1)})"
            self._fault("missing-chunk", a.chunk_key(g0), f"{what}; table {name!r} rows {fmt_rows([(lo, hi)])} are lost",
                        (lo, hi))
            self.bad.append((lo, hi))

    def _check_chunk(self, k: int, rows: tuple[int, int]) -> None:
        """Chunk ``k``'s file (its own key, or the staged one): a plain file, no larger than a chunk
        may be, at full size when raw and never empty; queued for decoding when it passes."""
        a, name = self.a, self.table
        ranges = [rows]
        key = a.chunk_key(k) if k in self.found else f"{self.prefix}/{a.chunk_key(k)}"
        try:
            size = key_size(self.loc, key)
        except (DamagedStoreError, FileNotFoundError) as e:
            self._fault("bad-chunk", key, f"{key}: {fault_text(e) if isinstance(e, DamagedStoreError) else 'not a file'}"
                        f"; table {name!r} rows {fmt_rows(ranges)} are unreadable", rows)
        else:
            if size > MAX_FILE_BYTES:
                self._fault("bad-chunk", key, f"{key}: holds {size} bytes, more than a chunk may ({MAX_FILE_BYTES}); "
                            f"table {name!r} rows {fmt_rows(ranges)} are unreadable", rows)
            elif (a.raw and size != a.chunk_bytes) or size == 0:
                what = f"{size} of {a.chunk_bytes} bytes" if a.raw else "0 bytes"
                self._fault("truncated-chunk", key, f"{key}: truncated chunk file ({what}); table {name!r} rows "
                            f"{fmt_rows(ranges)} are damaged", rows)
            else:
                if self.deep:
                    self.todo.append((a, k, ranges))
                return
        self.bad.extend(ranges)


def _gaps(here: list[int], k0: int, k1: int) -> list[tuple[int, int]]:
    """Runs ``(first, last)`` of chunk indices in ``[k0, k1]`` missing from the sorted ``here``."""
    gaps, nxt = [], k0
    for k in here:
        if k > nxt:
            gaps.append((nxt, k - 1))
        nxt = k + 1
    if nxt <= k1:
        gaps.append((nxt, k1))
    return gaps


def _decode(loc: Location, sc: Scan, rep: VerifyReport, todo: list[Todo],
            progress: Callable[[int, str], Any] | None) -> None:
    """Decode every chunk of ``todo`` through zarr; one that does not decode is an
    ``undecodable-chunk`` fault and its rows are bad."""
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
