"""Where a :class:`~trajstore.sampling.prioritized.PrioritizedSampler` keeps its priorities: a
*sidecar store* inside the buffer's folder (``trajstore.priorities/``).  This module opens, reads
and writes that store, checks it for ``trajstore verify`` (:func:`check_sidecar`), and treats it
as input like any store: a link or a non-folder in its place is refused, damaged contents are
replaced by a writer and ignored by a reader, and stored values that are not finite and >= 0 are
never used.

Where the priorities live (the storage decision)
------------------------------------------------
In a *sidecar store*: an ordinary trajstore ReplayBuffer store (one float32 row per row of the
buffer, space ``Box(0, inf, (), float32)``) in the folder ``trajstore.priorities/`` inside the
buffer's own folder (or under its URL).  Its rows are numbered with the buffer's absolute row
numbers (for a ring buffer, a ring 1/8 larger than the buffer's, so that its early evictions
never drop a row the buffer still holds), and its commit record's state holds
``{"main_epoch", "max_priority"}``.  Why a store of its own rather than a field of the buffer's
table:

- the buffer's format, its commit record, ``trajstore verify``/``repair`` and every reader of old
  stores stay exactly as they are (a buffer without the folder has no priorities stored, and
  readers that do not know about priorities never look at it);
- it inherits the commit protocol and its crash safety unchanged: the sidecar is written with
  the same data-first/record-last commits, priority changes of committed rows with the staged,
  crash-atomic rewrite of ``set_at``, so a SIGKILL at any instant leaves both stores opening,
  each with its last commit (``trajstore verify <store>`` checks the sidecar too:
  :func:`check_sidecar`);
- ``dumps`` to another folder and ``trajstore copy`` copy it with the buffer (byte copies of the
  folder); a ``.zip`` export does not carry priorities.

Rules that follow from it:

- Only a sampler over a *writable* buffer writes the sidecar (it takes the sidecar's writer lock,
  so one such sampler per store at a time; another raises ``LockedError``).  Priority changes
  live in RAM and are written every ``flush_interval`` seconds during the sampler's
  ``update_priorities``, and by its ``flush`` and ``close``; the buffer is flushed first, so the
  sidecar never names rows the buffer has not committed.
- A row without a stored priority (appended after the last sidecar commit, or any row of a store
  that never had a sampler) counts as the largest priority seen so far (``max_priority`` of the
  sidecar's record; 1.0 before any).
- Readers (``load_from(..., read_only=True)``, other processes) open the sidecar read-only and
  re-read it whenever its commit record changes, so they sample with the writer's last flushed
  priorities.  A reader may call ``update_priorities`` too: those changes stay in its RAM.
- Operations that rewrite rows in place (``set_at``, ``remove_at``, ``clear``, rewriting episode
  data of a trajectory buffer) change the buffer's epoch; rows may have been renumbered, so every
  priority returns to ``max_priority`` (the sidecar is reset at the next flush).
"""

from __future__ import annotations

import math
import os
import stat
import time
import warnings
from typing import Any, Callable

import numpy as np

from trajstore.core.store import Store, TableSpec
from trajstore.errors import (
    ConcurrentWriteError,
    DamagedStoreError,
    NotATrajstoreError,
    StoreNotFoundError,
    TrajstoreError,
)
from trajstore.sampling.source import SAMPLE_ATTEMPTS
from trajstore.spaces import space_to_json
from trajstore.storage.fields.layout import make_field_spec
from trajstore.storage.head import HEAD_KEY, Head
from trajstore.storage.keys import PRIORITIES_DIR
from trajstore.storage.location import Location

__all__ = ["PriorityStore", "sidecar_url", "check_sidecar"]

#: The sidecar's table and field (a ReplayBuffer store of one float32 per row).
_TABLE = "step_data"
#: Rows per sidecar chunk (64 KiB of float32): a flush rewrites only the chunks holding changes.
SIDE_CHUNK_ROWS = 16384
#: A reader that found no sidecar looks for one again at most this often (seconds).
SIDE_RECHECK_S = 1.0
#: Stored priorities :func:`check_sidecar` reads at a time (4 MiB of float32).
CHECK_BLOCK_ROWS = 1 << 20


def sidecar_url(buffer: Any) -> str | None:
    """Where the buffer's sidecar lives: None for in-memory buffers and ``.zip`` files."""
    path = buffer.cache_path
    if path is None:
        return None
    p = os.fspath(path)
    if "://" in p or "::" in p:
        return p.rstrip("/") + "/" + PRIORITIES_DIR
    if os.path.isdir(p):
        return os.path.join(p, PRIORITIES_DIR)
    return None  # a .zip (read-only, written whole by dumps): no sidecar


def _not_a_folder(url: str) -> str | None:
    """Why the local sidecar ``url`` must not be opened: it is a link (a tampered store could
    point it anywhere, and a writer would write, or erase and recreate, what it points to) or
    something other than a folder.  None: a folder, or nothing there yet, or not a local path."""
    if url.startswith("file://"):
        url = url[len("file://"):]
    elif "://" in url or "::" in url:
        return None  # object stores have no links
    try:
        st = os.lstat(url)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "is a link, which trajstore never follows out of a store"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    return None


class PriorityStore:
    """The sidecar store of one buffer's priorities, opened lazily.

    Parameters
    ----------
    buffer : ReplayBuffer or TrajectoryReplayBuffer
        Gives ``cache_path`` and ``storage_options``.
    writable : bool
        A writer's sampler (creates, rewrites and commits the sidecar); else read-only.
    capacity : int or None
        The buffer's ring capacity (None: unbounded).
    state : callable
        The commit-record state a writer's commits carry (``main_epoch``, ``max_priority``).
    """

    def __init__(self, buffer: Any, writable: bool, capacity: int | None,
                 state: Callable[[], dict[str, Any]]) -> None:
        self.url = sidecar_url(buffer)
        self.writable = writable
        self._options = buffer.storage_options
        self._capacity = capacity
        self._state = state
        self.store: Store | None = None
        self.seen = 0  # generation of the record the sampler's values came from
        self._looked = -math.inf

    def open(self, create: bool) -> Store | None:
        """The sidecar store, opened (writers: created when ``create``) if it is not yet; None
        where there is none (yet) or it must not be read.

        Raises
        ------
        DamagedStoreError
            (writers) Its place holds a link or something other than a folder.
        """
        if self.store is not None or self.url is None:
            return self.store
        if not create and time.monotonic() - self._looked < SIDE_RECHECK_S:
            return None
        self._looked = time.monotonic()
        refused = _not_a_folder(self.url)
        if refused is not None:
            msg = f"{self.url} {refused}; remove it so that priorities can be stored there"
            if self.writable:
                raise DamagedStoreError(msg)
            warnings.warn(f"{msg}. Every row counts as max_priority", stacklevel=4)
            self.url = None  # never looked at again
            return None
        overwrite = False
        try:
            self.store = Store.open(self.url, "ReplayBuffer", read_only=not self.writable,
                                    multiprocessing=False, storage_options=self._options, options={})
        except StoreNotFoundError:
            if not (create and self.writable):
                return None
        except (DamagedStoreError, NotATrajstoreError) as e:
            # A writer killed while it created the sidecar (or a damaged one): priorities are
            # hints, so a writer starts a new sidecar and a reader samples without them.
            if not self.writable:
                warnings.warn(f"{self.url}: the stored priorities cannot be read ({e}); every row counts "
                              "as max_priority", stacklevel=4)
                return None
            if not create:
                return None
            warnings.warn(f"{self.url}: the stored priorities cannot be read ({e}); they are written anew",
                          stacklevel=4)
            overwrite = True
        if self.store is None:
            self.store = self._create(overwrite)
        if self.writable:
            self.store.state_provider = self._state
        self.seen = -1  # values not read yet
        return self.store

    def _create(self, overwrite: bool) -> Store:
        assert self.url is not None
        remote = "://" in self.url and not self.url.startswith(("file://", "memory://"))
        # A ring evicts up to two `guard`s of rows (1/16 of its capacity) before it must: a
        # sidecar ring 1/8 larger than the buffer's always keeps every row the buffer keeps.
        cap = None if self._capacity is None else self._capacity + self._capacity // 8 + 64
        spec = make_field_spec(_TABLE, (), np.dtype(np.float32), capacity=cap,
                               compressor="lz4" if remote else None, chunk_rows=SIDE_CHUNK_ROWS)
        from gymnasium.spaces import Box

        space = Box(0.0, np.inf, (), np.float32)
        return Store.create(self.url, "ReplayBuffer", [TableSpec(_TABLE, cap, [spec])],
                            {"spaces": {_TABLE: space_to_json(space)}}, storage_options=self._options,
                            overwrite=overwrite, multiprocessing=False, options={})

    def valid(self, epoch: int | None) -> bool:
        """Whether the stored rows are numbered as the buffer's are under ``epoch``."""
        return self.store is not None and self.store.committed.state.get("main_epoch") == epoch

    def max_priority(self) -> float | None:
        """The largest priority the last record names (None: none, or not a finite number > 0)."""
        m = self.store.committed.state.get("max_priority") if self.store is not None else None
        if isinstance(m, (int, float)) and not isinstance(m, bool) and math.isfinite(m) and m > 0:
            return float(m)
        return None

    def changed(self) -> bool:
        """A reader re-reads the record; True when a record other than the one last used is current."""
        if self.store is None and self.url is not None and not self.writable:
            if self.open(create=False) is None:
                return False
        elif self.store is not None and not self.writable:
            self.store.refresh()
        if self.store is None or self.seen == self.store.committed.generation:
            return False
        self.seen = self.store.committed.generation
        return True

    def read(self, lo: int, hi: int, epoch: int | None, default: float) -> np.ndarray:
        """Priorities of absolute rows ``[lo, hi)``: the stored ones where there are (finite and
        >= 0; the store is input like any), ``default`` elsewhere.  (hi - lo,) float32."""
        out = np.full(hi - lo, default, np.float32)
        side = self.store
        if side is None or hi <= lo or not self.valid(epoch):
            return out
        t = side.tables[_TABLE]
        for _ in range(SAMPLE_ATTEMPTS):
            gen = side.committed.generation
            a, b = max(lo, t.state.start), min(hi, t.state.end)
            vals = t.read_contiguous(a - t.state.start, b - t.state.start, [0])[0] if a < b else None
            if side.writable or not side.refresh() or side.committed.generation == gen:
                break
        else:
            raise ConcurrentWriteError(f"{self.url}: the priorities kept changing while they were read")
        if vals is not None:
            good = np.isfinite(vals) & (vals >= 0)
            out[a - lo : b - lo] = np.where(good, vals, np.float32(default))
        return out

    def write(self, epoch: int | None, main: tuple[int, int], restart: int, rows: np.ndarray, values: np.ndarray,
              tail: Callable[[np.ndarray], np.ndarray], fsync: bool | None) -> None:
        """Commit priorities (writers): ``values`` (K,) float32 of absolute ``rows`` (K,) where the
        store holds them, then rows up to the buffer's committed end, whose values ``tail(rows)``
        gives.

        Parameters
        ----------
        epoch : int or None
            The buffer's epoch (numbering of rows) the values follow.
        main : (int, int)
            The buffer's committed absolute rows ``[start, end)`` (end: at most the sampler's).
        restart : int
            Where the stored rows start over when they follow another epoch or none of ``main``.
        """
        side = self.open(create=True)
        assert side is not None
        t = side.tables[_TABLE]
        main_start, main_end = main
        if not self.valid(epoch) or t.state.end > main_end or t.state.end < main_start:
            # Renumbered rows (a new epoch), or every stored row gone: start over at the buffer's start.
            t.state.start = t.state.end = restart
            head = side.current_head()
            head.epoch += 1
            head.state = self._state()
            side.write_record(head)
        lo, hi = t.state.start, t.state.end
        keep = (rows >= lo) & (rows < hi)
        if keep.any():
            side.rewrite(t.rewrite_plan_set(rows[keep] - lo, [values[keep]], [0]), lambda: None)
        if main_end > t.state.end:
            new = np.arange(t.state.end, main_end, dtype=np.int64)
            t.extend([tail(new)], new.size)
        side.commit(fsync=fsync, state=self._state())
        self.seen = side.committed.generation

    def close(self) -> None:
        """Release the store (and a writer's lock)."""
        if self.store is not None:
            self.store.close()
            self.store = None


#: One finding of :func:`check_sidecar` as ``trajstore verify`` reports it: ``(kind, key, message,
#: table, rows)``, the fields of :class:`trajstore.maintenance.verify.Fault` in order.
SidecarFault = tuple[str, str, str, str | None, tuple[int, int] | None]


def check_sidecar(loc: Location, head: Head | None, storage_options: dict[str, Any] | None, deep: bool,
                  verify: Callable[..., Any]) -> tuple[list[SidecarFault], list[str]]:
    """What ``trajstore verify`` says about a buffer's priorities (``trajstore.priorities``, if
    there is one): ``(faults, notes)``.

    Faults: the entry is a link (never followed) or not a folder; the sidecar is not a sound store
    (``verify``'s own faults, keys under ``trajstore.priorities/``); it is not a store of one
    float32 per row; its record's ``max_priority`` is not a finite number > 0; it holds priorities
    of rows the buffer has not committed, or lacks some of the buffer's oldest rows; a stored value
    is not a finite number >= 0.  Notes (states the protocol produces, which samplers handle): no
    sidecar commit yet (a writer stopped while creating it), priorities numbered under an earlier
    epoch of the buffer, or the newest rows not stored yet (committed after the sampler's last
    flush): those rows count as ``max_priority``.

    Parameters
    ----------
    loc : Location
        The buffer's store (read-only).
    head : Head or None
        The buffer's commit record (None: unreadable; rows are then not compared).
    storage_options : dict or None
        As given to verify (remote stores).
    deep : bool
        Also decode every committed chunk of the sidecar.
    verify : callable
        ``verify(url, storage_options=..., deep=...)`` returning a report with ``faults`` (each with
        ``kind``, ``key``, ``message``) and ``notes``: the checker of whole stores (injected, as it
        lives in a layer above this one).
    """
    faults: list[SidecarFault] = []
    notes: list[str] = []

    def fault(msg: str, key: str = PRIORITIES_DIR, rows: tuple[int, int] | None = None) -> None:
        faults.append(("priorities", key, f"{PRIORITIES_DIR}: {msg}", _TABLE if rows else None, rows))

    if loc.url is None:
        return faults, notes
    if loc.local_root is not None:
        url = str(loc.local_root / PRIORITIES_DIR)
        if not os.path.lexists(url):
            return faults, notes
        refused = _not_a_folder(url)
        if refused is not None:
            fault(f"{refused}; samplers ignore it (readers) or refuse to store priorities (writers) until it is "
                  "removed")
            return faults, notes
    else:
        url = str(loc.url).rstrip("/") + "/" + PRIORITIES_DIR
        if not loc.list_prefix(PRIORITIES_DIR):
            return faults, notes
    never = (f"{PRIORITIES_DIR}: holds no committed priorities (a writer was stopped while it created them); every "
             "row counts as max_priority, and the next writer's sampler writes them anew")
    try:
        sub = verify(url, storage_options=storage_options, deep=deep)
    except (StoreNotFoundError, NotATrajstoreError):
        notes.append(never)
        return faults, notes
    except TrajstoreError as e:
        fault(f"not a store of priorities ({e})")
        return faults, notes
    if any(f.kind == "head-missing" for f in sub.faults):
        notes.append(never)
        return faults, notes
    faults += [("priorities", f"{PRIORITIES_DIR}/{f.key}", f"{PRIORITIES_DIR}: {f.message}", None, None)
               for f in sub.faults]
    notes += [f"{PRIORITIES_DIR}: {n}" for n in sub.notes]
    if faults:
        return faults, notes
    try:
        side = Store.open(url, "ReplayBuffer", read_only=True, multiprocessing=False,
                          storage_options=storage_options, options={})
    except TrajstoreError as e:
        fault(f"does not open ({e})")
        return faults, notes
    try:
        _check_rows(side, head, fault, notes)
    except (TrajstoreError, OSError) as e:  # (a file changed since the sidecar's own check)
        fault(f"the stored priorities cannot be read ({e})")
    finally:
        side.close()
    return faults, notes


def _check_rows(side: Store, head: Head | None, fault: Callable[..., None], notes: list[str]) -> None:
    """The sidecar's rows against the buffer's commit record ``head``, and every stored value."""
    t = side.tables.get(_TABLE)
    if t is None or len(t.fields) != 1 or t.fields[0].spec.dtype != np.float32 or t.fields[0].spec.row_shape != ():
        fault(f"expected one float32 per row in table {_TABLE!r}; holds tables {sorted(side.tables)}")
        return
    state = side.committed.state
    m = state.get("max_priority")
    if m is not None and not (isinstance(m, (int, float)) and not isinstance(m, bool) and math.isfinite(m) and m > 0):
        fault(f"{HEAD_KEY}: max_priority must be a finite number > 0; got {m!r:.40}", f"{PRIORITIES_DIR}/{HEAD_KEY}")
    a, b = t.state.start, t.state.end
    main = head.tables.get(_TABLE) if head is not None else None
    same = head is not None and state.get("main_epoch") == head.epoch
    if head is not None and not same:
        notes.append(f"{PRIORITIES_DIR}: the priorities follow an earlier numbering of the buffer's rows (epoch "
                     f"{state.get('main_epoch')!r:.20}, the buffer's is {head.epoch}); every row counts as "
                     "max_priority until a writer's sampler stores them anew")
    s, e = (main.start, main.end) if main is not None and same else (a, b)
    if b > e:
        fault(f"holds priorities of rows up to {b}, but the buffer commits rows only up to {e} (the buffer must be "
              "committed before its priorities)")
    elif a > s:
        fault(f"the buffer's rows {s}..{min(a, e) - 1} have no stored priority, although later ones have (the "
              "sidecar must start at or before the buffer's first row)", rows=(0, min(a, e) - s))
    elif b < e:
        notes.append(f"{PRIORITIES_DIR}: the buffer's last {e - max(b, s)} row(s) have no stored priority yet "
                     "(committed after the sampler's last flush); they count as max_priority")
    bad, first, last = 0, None, 0
    for lo in range(a, b, CHECK_BLOCK_ROWS):
        hi = min(b, lo + CHECK_BLOCK_ROWS)
        vals = t.read_contiguous(lo - a, hi - a, [0])[0]
        wrong = np.flatnonzero(~(np.isfinite(vals) & (vals >= 0)))
        if wrong.size:
            bad += int(wrong.size)
            first = first if first is not None else (lo + int(wrong[0]), float(vals[wrong[0]]))
            last = lo + int(wrong[-1])
    if first is not None:
        row, val = first
        lo_, hi_ = max(row, s), min(last + 1, e)
        fault(f"{bad} stored priorit{'y is' if bad == 1 else 'ies are'} not a finite number >= 0 (first: row {row}, "
              f"{val!r}); samplers ignore them (those rows count as max_priority)",
              rows=(lo_ - s, hi_ - s) if lo_ < hi_ else None)
