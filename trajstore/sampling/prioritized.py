"""Prioritized experience replay (Schaul et al. 2016) over any stored buffer, with priorities
that persist in the store.

:class:`PrioritizedSampler` draws rows of a ``ReplayBuffer`` or ``TrajectoryReplayBuffer`` with
probability ``P(i) = p_i ** alpha / sum_k p_k ** alpha`` (``p_i = priority_i + eps``) from a sum
tree in RAM (:class:`~trajstore.sampling.sumtree.SumTree`), and returns importance weights
``(N * P(i)) ** -beta``, divided by their largest value in the batch.

Where the priorities live (the storage decision)
------------------------------------------------
In a *sidecar store*: an ordinary trajstore ReplayBuffer store (one float32 row per row of the
buffer, space ``Box(0, inf, (), float32)``) in the folder ``trajstore.priorities/`` inside the
buffer's own folder (or under its URL).  Its rows are numbered with the buffer's absolute row
numbers (for a ring buffer, a ring 1/8 larger than the buffer's, so that its early evictions
never drop a row the buffer still holds), and its commit record's state holds
``{"main_epoch", "max_priority"}``.  Why a store of its own
rather than a field of the buffer's table:

- the buffer's format, its commit record, ``trajstore verify``/``repair`` and every reader of old
  stores stay exactly as they are (a buffer without the folder has no priorities stored, and
  readers that do not know about priorities never look at it);
- it inherits the commit protocol and its crash safety unchanged: the sidecar is written with
  the same data-first/record-last commits, priority changes of committed rows with the staged,
  crash-atomic rewrite of ``set_at``, so a SIGKILL at any instant leaves both stores opening,
  each with its last commit (``trajstore verify <store>/trajstore.priorities`` checks it);
- ``dumps`` to another folder and ``trajstore copy`` copy it with the buffer (byte copies of the
  folder); a ``.zip`` export does not carry priorities.

Rules that follow from it:

- Only a sampler over a *writable* buffer writes the sidecar (it takes the sidecar's writer lock,
  so one such sampler per store at a time; another raises ``LockedError``).  Priority changes
  live in RAM and are written every ``flush_interval`` seconds during :meth:`update_priorities`,
  and by :meth:`PrioritizedSampler.flush` / :meth:`PrioritizedSampler.close`; the buffer is
  flushed first, so the sidecar never names rows the buffer has not committed.
- A row without a stored priority (appended after the last sidecar commit, or any row of a store
  that never had a sampler) counts as the largest priority seen so far (``max_priority`` of the
  sidecar's record; 1.0 before any).
- Readers (``load_from(..., read_only=True)``, other processes) open the sidecar read-only and
  re-read it whenever its commit record changes, so they sample with the writer's last flushed
  priorities.  A reader may call :meth:`update_priorities` too: those changes stay in its RAM.
- Operations that rewrite rows in place (``set_at``, ``remove_at``, ``clear``, rewriting episode
  data of a trajectory buffer) change the buffer's epoch; rows may have been renumbered, so every
  priority returns to ``max_priority`` (the sidecar is reset at the next flush).

Indices
-------
``sample`` returns the buffer's *logical* row indices (``buffer[indices]`` is the batch).  A ring
renumbers its rows when it evicts, so :meth:`PrioritizedSampler.update_priorities` reads indices
as they were numbered at the most recent :meth:`~PrioritizedSampler.sample` (it keeps that
sample's first absolute row, :attr:`PrioritizedSampler.last_start`): rows appended in between
do not misdirect updates, and updates of rows evicted in between are dropped.  Pass ``start=``
to update from an older sample.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from trajstore.core.store import in_zarr_loop
from trajstore.errors import (
    BadOptionError,
    BadValueError,
    ClosedError,
    ConcurrentWriteError,
    EmptyBufferError,
    IndexOutOfRangeError,
)
from trajstore.sampling import prioritized_checks as check
from trajstore.sampling.prioritized_windows import ACCEPT_ROUNDS, draw_accepted, inside_one_run, window_offsets
from trajstore.sampling.priority_store import PriorityStore
from trajstore.sampling.source import SAMPLE_ATTEMPTS, EpisodeSource, RowSource
from trajstore.sampling.sumtree import SumTree
from trajstore.storage.keys import PRIORITIES_DIR

__all__ = ["PrioritizedSampler", "PRIORITIES_DIR", "ACCEPT_ROUNDS"]

#: Rows added or evicted at once beyond this fraction of the tree rebuild it (O(n)) instead of
#: updating row by row (O(k log n)).
REBUILD_FRACTION = 0.125

_OPEN: "weakref.WeakSet[PrioritizedSampler]" = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    # Registered after the buffers' own exit hook (buffers are imported first), so it runs before
    # it: the buffer is still open when the sampler flushes it and then its priorities.
    for s in list(_OPEN):
        try:
            s.close()
        except Exception:  # exiting anyway: one broken sampler must not stop the others
            pass


class PrioritizedSampler:
    """Prioritized replay over a ``ReplayBuffer`` or ``TrajectoryReplayBuffer``.

    Row ``i`` is drawn (with replacement) with probability ``P(i) = p_i ** alpha / sum_k p_k **
    alpha``, where ``p_i`` is the row's priority plus ``eps``; a new row enters with the largest
    priority seen so far (1.0 at first) and a row evicted from a ring leaves the distribution.
    Priorities are kept in the store (see the module docstring), so a reopened buffer, or a
    read-only reader in another process, samples with the same ones.

    Importance weights are ``w_i = (N * P(i)) ** -beta / max_j w_j`` (N: rows in the buffer) with
    the max over the *batch*, as Dopamine's Rainbow agent does (stable-baselines3 and its contrib
    package ship no prioritized replay).  OpenAI baselines and TorchRL divide by the largest weight
    over the whole buffer instead (``(p_i / min_k p_k) ** -beta``, the smallest priority kept in a
    second, min tree); the batch max needs no second tree to maintain and
    persist, and a single stale row of tiny priority anywhere in the buffer cannot shrink every
    batch's weights (and so the effective learning rate).  Either way the weights only ever scale
    updates down; the largest weight in every batch is exactly 1.

    Parameters
    ----------
    buffer : ReplayBuffer or TrajectoryReplayBuffer
        Anything with ``row_source()``, ``get_at(indices)``, ``read_only``, ``cache_path``,
        ``storage_options`` and ``flush()``.
    alpha : float
        Priority exponent (0: uniform).
    beta : float
        Importance-sampling exponent; an attribute, anneal it (e.g. towards 1) as training goes.
    eps : float
        Added to every priority, so a row of priority 0 is still drawn now and then.
    flush_interval : float or None
        Seconds between automatic writes of changed priorities during :meth:`update_priorities`
        (writable buffers only); None: only :meth:`flush` and :meth:`close` write them.

    Attributes
    ----------
    alpha, beta, eps : float
        As given; ``beta`` may be changed at any time.  (Changing ``alpha`` or ``eps`` later is
        refused: every weight in the tree would have to be recomputed; make a new sampler.)
    max_priority : float
        The largest priority seen so far (what new rows get).
    last_start : int or None
        Absolute row number of logical row 0 at the last :meth:`sample` (see ``update_priorities``).
    """

    def __init__(self, buffer: Any, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6, *,
                 flush_interval: float | None = 1.0) -> None:
        self._alpha = check.positive_float("alpha", alpha)
        self.beta = check.positive_float("beta", beta)
        self._eps = check.positive_float("eps", eps)
        if flush_interval is not None:
            flush_interval = check.positive_float("flush_interval", flush_interval)
        self.flush_interval = flush_interval
        if not callable(getattr(buffer, "row_source", None)):
            raise BadOptionError(f"PrioritizedSampler needs a ReplayBuffer or TrajectoryReplayBuffer; got "
                                 f"{type(buffer).__name__}")
        self.buffer = buffer
        self._src: RowSource = buffer.row_source()
        self._writable = not buffer.read_only
        self._rng = np.random.default_rng()
        self._pid = os.getpid()
        self._closed = True  # until built
        self.max_priority = 1.0
        self.last_start: int | None = None
        self._last_count = 0
        self._last_epoch: int | None = None
        cap = self._src.capacity
        self._cap = cap
        n = cap if cap is not None else max(1024, self._src.start + self._src.count)
        self._tree = SumTree(n)
        self._p = np.zeros(self._tree.size, np.float32)  # raw priority per slot (live slots only)
        self._dirty = np.zeros(self._tree.size, bool)  # changed since the sidecar last stored it
        # The rows the tree holds: absolute [start, end) under buffer epoch `epoch`.
        self._start = self._end = 0
        self._epoch: int | None = None
        self._side = PriorityStore(buffer, self._writable, cap, self._side_state)
        self._last_flush = time.monotonic()
        try:
            self._side.open(create=False)
            self._follow()
        except BaseException:
            self._release()
            raise
        self._closed = False
        _OPEN.add(self)

    # -- parameters --------------------------------------------------------------------------
    @property
    def alpha(self) -> float:
        """Priority exponent: ``P(i)`` is proportional to ``(priority_i + eps) ** alpha``."""
        return self._alpha

    @property
    def eps(self) -> float:
        """Added to every priority before the exponent."""
        return self._eps

    def __len__(self) -> int:
        """Rows the sampler draws from (the buffer's rows as of the last sample or update)."""
        return self._end - self._start

    # -- the sidecar store -------------------------------------------------------------------
    def _side_state(self) -> dict[str, Any]:
        """The sidecar's commit-record state: which numbering of rows its priorities follow."""
        return {"main_epoch": self._epoch, "max_priority": float(self.max_priority)}

    def _adopt_side_max(self) -> None:
        m = self._side.max_priority()
        if m is not None:
            self.max_priority = max(self.max_priority, m)

    def _stored(self, lo: int, hi: int) -> np.ndarray:
        """Priorities of absolute rows ``[lo, hi)`` (``max_priority`` where none is stored)."""
        return self._side.read(lo, hi, self._epoch, self.max_priority)

    # -- following the buffer ----------------------------------------------------------------
    def _slots(self, rows: np.ndarray) -> np.ndarray:
        return rows % self._cap if self._cap is not None else rows

    def _weights(self, p: np.ndarray) -> np.ndarray:
        return np.power(p.astype(np.float64) + self._eps, self._alpha)

    def _ensure_room(self, end: int) -> None:
        if self._cap is None and end > self._tree.size:
            self._tree.grow(end)
            size = self._tree.size
            self._p = np.concatenate([self._p, np.zeros(size - len(self._p), np.float32)])
            self._dirty = np.concatenate([self._dirty, np.zeros(size - len(self._dirty), bool)])

    def _rebuild(self) -> None:
        """Tree weights from ``_p`` for the live rows [start, end), O(n)."""
        w = np.zeros(self._tree.size, np.float64)
        if self._end > self._start:
            slots = self._slots(np.arange(self._start, self._end, dtype=np.int64))
            w[slots] = self._weights(self._p[slots])
        self._tree.build(w)

    def _reload(self) -> None:
        """Every live row's priority from the sidecar again (its record changed), keeping this
        process's own unwritten changes."""
        self._adopt_side_max()
        if self._end > self._start:
            slots = self._slots(np.arange(self._start, self._end, dtype=np.int64))
            stored = self._stored(self._start, self._end)
            mine = self._dirty[slots]
            self._p[slots] = np.where(mine, self._p[slots], stored)
        self._rebuild()

    def _follow(self) -> None:
        """Catch the tree up with the buffer (rows added and evicted, a new epoch) and with the
        sidecar (a newer record written by the writer's sampler)."""
        src = self._src
        src.sync()
        side_changed = self._side.changed()
        epoch = src.record.epoch
        start, end = src.start, src.start + src.count
        if epoch != self._epoch or start < self._start or end < self._end:
            # Rows were rewritten, removed or cleared (or this is the first look): renumbered.
            self._epoch = epoch
            self._start, self._end = start, end
            self._ensure_room(end)
            self._dirty[:] = False
            self._adopt_side_max()
            if end > start:
                self._p[self._slots(np.arange(start, end, dtype=np.int64))] = self._stored(start, end)
            self._rebuild()
            return
        moved = start != self._start or end != self._end
        if not moved and not side_changed:
            return
        self._ensure_room(end)
        gone = np.arange(self._start, min(start, self._end), dtype=np.int64)
        new = np.arange(max(self._end, start), end, dtype=np.int64)
        self._start, self._end = start, end
        gs, ns = self._slots(gone), self._slots(new)
        self._dirty[gs] = False
        self._dirty[ns] = False
        if side_changed:
            self._reload()
            return
        if new.size:
            self._p[ns] = self._stored(int(new[0]), end)
        if gone.size + new.size > REBUILD_FRACTION * self._tree.size:
            self._rebuild()
            return
        # A ring's new row in a freed slot: its weight comes last and wins.
        self._tree.update(np.concatenate([gs, ns]),
                          np.concatenate([np.zeros(gone.size), self._weights(self._p[ns])]))

    def _logical(self, slots: np.ndarray) -> np.ndarray:
        if self._cap is None:
            return slots - self._start
        return (slots - self._start) % self._cap

    # -- sampling ------------------------------------------------------------------------------
    def sample(self, batch_size: int, rng: np.random.Generator | int | None = None) -> tuple[Any, np.ndarray, Any]:
        """Draw ``batch_size`` rows with replacement, each with probability ``P(i)``.

        Parameters
        ----------
        batch_size : int
            Rows to draw, > 0.
        rng : numpy.random.Generator, int or None
            Random source (an int seeds a new Generator); default: the sampler's own.

        Returns
        -------
        batch : Any
            ``buffer[indices]``: the rows, as the buffer returns them (nested dict or tuple of
            (B, ...) arrays, a ``TrajectoryData`` for a trajectory buffer; torch tensors on a
            torch backend).
        indices : np.ndarray
            (B,) int64 logical row indices (valid for ``buffer[...]`` until the next write).
        weights : np.ndarray or torch.Tensor
            (B,) float32 importance weights ``(N * P(i)) ** -beta / max over the batch``, in
            ``(0, 1]`` (a torch tensor on the buffer's device for a torch backend).

        Raises
        ------
        BadOptionError
            ``batch_size`` is not an int > 0.
        EmptyBufferError
            The buffer holds no rows.
        BadValueError
            Every row has priority 0 and ``eps`` is 0.
        ConcurrentWriteError
            (Readers) a writer evicted rows faster than they could be sampled, 100 times running.
        """
        batch, idx, weights = self._sample("sample", batch_size, rng, self.buffer.get_at)
        return batch, idx, weights

    def sample_sequences(self, batch_size: int, seq_len: int | None = None, *, offsets: Any = None,
                         rng: np.random.Generator | int | None = None, pad: Any = "edge",
                         within_episode: bool = False) -> tuple[Any, Any, np.ndarray, Any]:
        """Prioritized sequences (trajectory buffers): windows around anchor rows drawn with
        probability ``P(i)`` of the anchor, as ``buffer.get_sequences`` reads them.

        Parameters
        ----------
        batch_size : int
            Windows to draw, > 0.
        seq_len : int, optional
            Windows of rows ``anchor .. anchor + seq_len - 1`` (as ``buffer.sample_sequences``).
        offsets : sequence of int or mapping, optional
            Instead of ``seq_len``: the frames of each window, one list for every field or one per
            field of a Dict step space (``{"obs": [-1, 0], "action": range(16)}``).
        rng : numpy.random.Generator, int or None
            Random source; default: the sampler's own.
        pad : str or mapping
            Padding of frames outside the anchor's episode (``"edge"`` or ``"zero"``).
        within_episode : bool
            Only anchors whose whole window (every field's frames and the anchor) lies in one run
            of the anchor's episode; others are drawn again.  Their probabilities are then
            ``P(i)`` renormalized over such anchors; the weights use ``P(i)`` as drawn (their
            ratios within a batch are the same).

        Returns
        -------
        data : TrajectoryData
            ``step_data`` leaves (B, T, ...) (per field: (B, len(offsets[key]), ...)), ``episode_data``.
        mask : (B, T) bool, or per field a dict key -> (B, len(offsets[key])) bool
        indices : np.ndarray
            (B,) int64 logical anchor rows (update their priorities with :meth:`update_priorities`).
        weights : np.ndarray or torch.Tensor
            (B,) float32 importance weights of the anchors, as :meth:`sample` gives them.

        Raises
        ------
        BadOptionError
            Not a trajectory buffer; a bad ``seq_len``; with ``within_episode``, hardly any drawn
            anchor has its window inside one episode.
        BadArgumentError
            Both or neither of ``seq_len`` and ``offsets``; offsets that are not integers.
        """
        get_sequences = getattr(self.buffer, "get_sequences", None)
        if get_sequences is None:
            raise BadOptionError(f"sample_sequences needs a TrajectoryReplayBuffer (episodes); got "
                                 f"{type(self.buffer).__name__}")
        offsets, lo, hi = window_offsets(seq_len, offsets)
        accept = inside_one_run(cast(EpisodeSource, self._src), lo, hi) if within_episode else None
        data, idx, weights = self._sample("sample_sequences", batch_size, rng,
                                          lambda i: get_sequences(i, offsets, pad=pad), accept)
        return data[0], data[1], idx, weights

    def _sample(self, what: str, batch_size: Any, rng: np.random.Generator | int | None,
                read: Callable[[np.ndarray], Any], accept: Callable[[np.ndarray], np.ndarray] | None = None
                ) -> tuple[Any, np.ndarray, Any]:
        """Draw ``batch_size`` logical rows by priority (only rows ``accept`` approves, if given),
        ``read`` them as of one commit record, and weigh them: ``(read(indices), indices, weights)``."""
        k = check.batch_size(what, batch_size)
        if self._closed:
            raise ClosedError(f"{what}: the PrioritizedSampler was closed")
        gen = rng if isinstance(rng, np.random.Generator) else (self._rng if rng is None else np.random.default_rng(rng))
        src = self._src
        for _ in range(SAMPLE_ATTEMPTS):
            self._follow()
            total = self._tree.total
            if self._end <= self._start:
                raise EmptyBufferError(f"cannot sample from an empty buffer ({src.name})")
            if total <= 0:
                raise BadValueError(f"{what}: every one of the {self._end - self._start} rows has priority 0 and eps "
                                    "is 0, so no row can be drawn; give some rows a priority > 0 or use eps > 0")
            start, epoch = self._start, self._epoch
            slots = self._draw(k, gen, total, accept, what)
            idx = self._logical(slots)
            if not src.live:
                out = read(idx)
                break
            try:
                out = read(idx)
            except IndexOutOfRangeError:  # a writer shrank the ring's view meanwhile: draw again
                continue
            if src.start == start and src.record.epoch == epoch:  # the rows read are the rows drawn
                break
        else:
            raise ConcurrentWriteError(f"{src.name}: the writer evicts rows faster than this reader can sample them")
        n = self._end - self._start
        # (N P(i)) ** -beta / max_j (N P(j)) ** -beta == (min_j P(j) / P(i)) ** beta: P's common
        # factors (N, the total) cancel, so the tree's weights give it directly.
        leaf = self._tree.get(slots)
        w = np.power(leaf.min() / leaf, self.beta).astype(np.float32)
        self.last_start, self._last_count, self._last_epoch = start, n, epoch
        weights: Any = w
        if getattr(self.buffer, "backend", "numpy") == "torch":
            import torch

            weights = torch.as_tensor(w, device=self.buffer.device)
        return out, idx.astype(np.int64, copy=False), weights

    def _draw(self, k: int, gen: np.random.Generator, total: float,
              accept: Callable[[np.ndarray], np.ndarray] | None, what: str) -> np.ndarray:
        """``k`` slots drawn by priority; with ``accept``, only slots whose logical rows it approves
        (drawn again in rounds, up to :data:`ACCEPT_ROUNDS`)."""
        if accept is None:
            return self._tree.find(gen.random(k) * total)
        return draw_accepted(lambda n: self._tree.find(gen.random(n) * total), self._logical, k, accept, what)

    def probabilities(self, indices: Any) -> np.ndarray:
        """``P(i)`` of logical rows ``indices`` now: (B,) float64.

        Raises
        ------
        IndexOutOfRangeError
            An index outside ``[0, len)``.
        """
        self._follow()
        idx = check.indices(indices, self._end - self._start, "probabilities")
        total = self._tree.total
        return self._tree.get(self._slots(idx + self._start)) / total if total > 0 else np.zeros(len(idx))

    def priorities(self, indices: Any) -> np.ndarray:
        """Priorities (as given to :meth:`update_priorities`, before ``eps``) of logical rows
        ``indices`` now: (B,) float32.

        Raises
        ------
        IndexOutOfRangeError
            An index outside ``[0, len)``.
        """
        self._follow()
        idx = check.indices(indices, self._end - self._start, "priorities")
        return self._p[self._slots(idx + self._start)].copy()

    # -- priorities ----------------------------------------------------------------------------
    def update_priorities(self, indices: Any, priorities: Any, *, start: int | None = None) -> None:
        """Set the priorities of rows ``indices`` (e.g. ``|TD error|``).

        Parameters
        ----------
        indices : array-like of int
            (B,) logical rows as numbered at the last :meth:`sample` (numpy, list or torch).
        priorities : array-like of float
            (B,) finite values >= 0 (or one value for all); ``eps`` is added when sampling.
        start : int, optional
            Absolute row of logical row 0 when ``indices`` were drawn: the ``last_start`` of the
            sample they came from.  Default: that of the last sample.

        Rows evicted since that sample are skipped (they left the buffer).  After a ``set_at``,
        ``remove_at`` or ``clear`` since that sample (rows renumbered) nothing is updated.
        Changes are written to the store every ``flush_interval`` seconds (writable buffers).

        Raises
        ------
        BadIndexError
            ``indices`` are not a 1-D array of integers.
        IndexOutOfRangeError
            An index outside the rows that sample saw.
        BadValueError
            A priority is negative, NaN, infinite or beyond float32's range, or their number differs
            from the indices'.
        ClosedError
            The sampler was closed.
        """
        if self._closed:
            raise ClosedError("update_priorities: the PrioritizedSampler was closed")
        if start is None and self.last_start is None:
            self._follow()
            base, count, epoch = self._start, self._end - self._start, self._epoch
        elif start is None:
            base, count, epoch = int(self.last_start or 0), self._last_count, self._last_epoch
        else:
            base, count, epoch = int(start), self._end - int(start), self._epoch
        idx = check.indices(indices, count, "update_priorities")
        p = check.priorities(priorities, idx.size)
        self._follow()
        if epoch != self._epoch:
            return  # rows were renumbered since the sample: the indices name other rows now
        rows = idx + base
        live = (rows >= self._start) & (rows < self._end)
        rows, p = rows[live], p[live]
        if rows.size:
            slots = self._slots(rows)
            self._p[slots] = p
            self._dirty[slots] = True
            self._tree.update(slots, self._weights(self._p[slots]))
            self.max_priority = max(self.max_priority, float(p.max()))
        if (self._writable and self.flush_interval is not None
                and time.monotonic() - self._last_flush >= self.flush_interval):
            self.flush()

    # -- persistence ---------------------------------------------------------------------------
    def flush(self, fsync: bool | None = None) -> None:
        """Write changed priorities to the store: the buffer is flushed first, then the sidecar
        is brought up to the buffer's committed rows and committed.  Nothing to do for
        read-only buffers, in-memory buffers and ``.zip`` stores.

        Parameters
        ----------
        fsync : bool, optional
            As ``buffer.flush(fsync)``: also survive power loss.
        """
        self._last_flush = time.monotonic()
        if not self._writable or self._side.url is None or self._closed:
            return
        try:
            self.buffer.flush(fsync)
            self._follow()
        except ClosedError:
            pass  # the buffer was closed first: its last commit stands; write priorities up to it
        main_start, main_end = self._src.committed
        slots = np.flatnonzero(self._dirty)
        self._side.write(self._epoch, (main_start, min(main_end, self._end)), max(main_start, self._start),
                         self._rows_of(slots), self._p[slots].astype(np.float32), self._tail, fsync)
        self._dirty[slots] = False

    def _tail(self, new: np.ndarray) -> np.ndarray:
        """Priorities of absolute rows ``new`` the sidecar does not hold yet, (K,) float32."""
        vals = np.full(new.size, self.max_priority, np.float32)
        alive = new >= self._start
        vals[alive] = self._p[self._slots(new[alive])]
        return vals

    def _rows_of(self, slots: np.ndarray) -> np.ndarray:
        """Absolute rows of live ``slots``."""
        if self._cap is None:
            return slots.astype(np.int64)
        first = self._start % self._cap
        return self._start + (slots - first) % self._cap

    def close(self) -> None:
        """Flush (writers) and release the sidecar store and its writer lock.  The buffer stays
        open.  (In a process forked from the writer nothing is written: the parent writes.)"""
        if self._closed:
            return
        try:
            if os.getpid() == self._pid:
                self.flush()
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        _OPEN.discard(self)
        side = self.__dict__.get("_side")
        if side is not None:
            side.close()

    def __enter__(self) -> "PrioritizedSampler":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if sys.is_finalizing() or self.__dict__.get("_closed", True):
            return  # exiting (the exit hook flushed), or never fully built
        try:
            if in_zarr_loop():
                # Collected in zarr's IO thread (which a write waits on): release without writing.
                self._release()
            else:
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"PrioritizedSampler({self._src.name!r}, rows={len(self)}, alpha={self._alpha}, beta={self.beta}, "
                f"eps={self._eps}, max_priority={self.max_priority:g})")
