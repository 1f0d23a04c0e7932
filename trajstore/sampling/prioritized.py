"""Prioritized experience replay (Schaul et al. 2016) over any stored buffer, with priorities
that persist in the store.

:class:`PrioritizedSampler` draws rows of a ``ReplayBuffer`` or ``TrajectoryReplayBuffer`` with
probability ``P(i) = p_i ** alpha / sum_k p_k ** alpha`` (``p_i = priority_i + eps``) from a sum
tree in RAM (:class:`~trajstore.sampling.sumtree.SumTree`), and returns importance weights
``(N * P(i)) ** -beta``, divided by their largest value in the batch.

Priorities persist in a *sidecar store* inside the buffer's folder (``trajstore.priorities/``):
the storage decision and the rules that follow from it are in
:mod:`trajstore.sampling.priority_store`; the priorities of the live rows and their sum tree, kept
in step with the buffer, in :mod:`trajstore.sampling.priority_rows`.

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

from trajstore.core.store import in_zarr_loop, register_before_pools_stop
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
from trajstore.sampling.priority_rows import REBUILD_FRACTION, LiveRows
from trajstore.sampling.priority_store import PriorityStore
from trajstore.sampling.source import SAMPLE_ATTEMPTS, EpisodeSource, RowSource, check_batch_size
from trajstore.storage.keys import PRIORITIES_DIR

__all__ = ["PrioritizedSampler", "PRIORITIES_DIR", "ACCEPT_ROUNDS", "REBUILD_FRACTION"]

_OPEN: "weakref.WeakSet[PrioritizedSampler]" = weakref.WeakSet()


def _flush_all() -> None:
    for s in list(_OPEN):
        try:
            s.flush()
        except Exception:  # exiting anyway: one broken sampler must not stop the others
            pass


@atexit.register
def _close_all() -> None:
    # After _flush_all: Python's thread pools, which zarr's reads go through, are shut down now, so
    # a sampler with nothing changed since is released without touching the sidecar.
    for s in list(_OPEN):
        try:
            s.close()  # writes only if a thread that ran on after the main thread updated priorities
        except Exception:
            pass


# Samplers left open write their priorities at exit before anything is shut down: a threading exit
# hook runs before Python's thread pools stop taking work (concurrent.futures' own threading hook,
# registered earlier, runs after ours) and before every atexit hook, so the buffers are still open
# and zarr's IO still works.  From a plain atexit hook the pool is already shut down: the write
# failed ("cannot schedule new futures after shutdown") and left a sidecar the next open had to
# write anew.  The samplers stay open (threads that still run may use them) until _close_all.
register_before_pools_stop(_flush_all)


class PrioritizedSampler:
    """Prioritized replay over a ``ReplayBuffer`` or ``TrajectoryReplayBuffer``.

    Row ``i`` is drawn (with replacement) with probability ``P(i) = p_i ** alpha / sum_k p_k **
    alpha``, where ``p_i`` is the row's priority plus ``eps``; a new row enters with the largest
    priority seen so far (1.0 at first) and a row evicted from a ring leaves the distribution.
    Priorities are kept in the store (:mod:`trajstore.sampling.priority_store`), so a reopened
    buffer, or a read-only reader in another process, samples with the same ones.

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
        self._torch = getattr(buffer, "backend", "numpy") == "torch"
        self._rng = np.random.default_rng()
        self._pid = os.getpid()
        self._closed = True  # until built
        self.last_start: int | None = None
        self._last_count = 0
        self._last_epoch: int | None = None
        self._side = PriorityStore(buffer, self._writable, self._src.capacity, self._side_state)
        self._live = LiveRows(self._src, self._side, self._alpha, self._eps)
        self._last_flush = time.monotonic()
        self._flushing = False
        try:
            self._side.open(create=False)
            self._live.follow()
        except BaseException:
            self._release()
            raise
        self._closed = False
        _OPEN.add(self)
        attach = getattr(buffer, "attach", None)
        if attach is not None and self._writable:
            attach(self)  # the buffer's flush and close commit the priorities too

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
        return self._live.end - self._live.start

    @property
    def max_priority(self) -> float:
        """The largest priority seen so far (what new rows get)."""
        return self._live.max_priority

    @max_priority.setter
    def max_priority(self, value: float) -> None:
        self._live.max_priority = float(value)

    # -- the sidecar store -------------------------------------------------------------------
    def _side_state(self) -> dict[str, Any]:
        """The sidecar's commit-record state: which numbering of rows its priorities follow."""
        return {"main_epoch": self._live.epoch, "max_priority": float(self._live.max_priority)}

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
        k = check_batch_size(batch_size, what, minimum=1)
        if self._closed:
            raise ClosedError(f"{what}: the PrioritizedSampler was closed")
        gen = rng if isinstance(rng, np.random.Generator) else (self._rng if rng is None else np.random.default_rng(rng))
        src, live = self._src, self._live
        for _ in range(SAMPLE_ATTEMPTS):
            live.follow()
            total = live.tree.total
            n = live.end - live.start
            if n <= 0:
                raise EmptyBufferError(f"cannot sample from an empty buffer ({src.name})")
            if total <= 0:
                raise BadValueError(f"{what}: every one of the {n} rows has priority 0 and eps is 0, so no row can "
                                    "be drawn; give some rows a priority > 0 or use eps > 0")
            start, epoch = live.start, live.epoch
            slots, leaf = self._draw(k, gen, total, accept, what)
            idx = live.logical(slots)
            if not src.live:
                out = read(idx)
                break
            try:
                # Pinned to the record follow() just read: the buffer's read need not stat it again
                # before reading (it checks it after, and so does the test below).
                with src.pinned():
                    out = read(idx)
            except IndexOutOfRangeError:  # a writer shrank the ring's view meanwhile: draw again
                continue
            if src.start == start and src.record.epoch == epoch:  # the rows read are the rows drawn
                break
        else:
            raise ConcurrentWriteError(f"{src.name}: the writer evicts rows faster than this reader can sample them")
        # (N P(i)) ** -beta / max_j (N P(j)) ** -beta == (min_j P(j) / P(i)) ** beta: P's common
        # factors (N, the total) cancel, so the tree's weights give it directly.
        w = (leaf.min() / leaf).astype(np.float32)  # in [0, 1] (float64 first: leaf weights may pass float32's range)
        np.power(w, np.float32(self.beta), out=w)
        self.last_start, self._last_count, self._last_epoch = start, n, epoch
        weights: Any = w
        if self._torch:
            import torch

            weights = torch.as_tensor(w, device=self.buffer.device)
        return out, idx, weights

    def _draw(self, k: int, gen: np.random.Generator, total: float,
              accept: Callable[[np.ndarray], np.ndarray] | None, what: str) -> tuple[np.ndarray, np.ndarray]:
        """``k`` slots drawn by priority and their tree weights; with ``accept``, only slots whose
        logical rows it approves (drawn again in rounds, up to :data:`ACCEPT_ROUNDS`)."""
        tree = self._live.tree
        if accept is None:
            mass = gen.random(k)
            mass *= total
            return tree.find_weighted(mass)
        slots = draw_accepted(lambda n: tree.find(gen.random(n) * total), self._live.logical, k, accept, what)
        return slots, tree.get(slots)

    def probabilities(self, indices: Any) -> np.ndarray:
        """``P(i)`` of logical rows ``indices`` now: (B,) float64.

        Raises
        ------
        IndexOutOfRangeError
            An index outside ``[0, len)``.
        """
        live = self._live
        live.follow()
        idx = check.indices(indices, live.end - live.start, "probabilities")
        total = live.tree.total
        return live.tree.get(live.slots(idx + live.start)) / total if total > 0 else np.zeros(len(idx))

    def priorities(self, indices: Any) -> np.ndarray:
        """Priorities (as given to :meth:`update_priorities`, before ``eps``) of logical rows
        ``indices`` now: (B,) float32.

        Raises
        ------
        IndexOutOfRangeError
            An index outside ``[0, len)``.
        """
        live = self._live
        live.follow()
        idx = check.indices(indices, live.end - live.start, "priorities")
        return live.p[live.slots(idx + live.start)].copy()

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
        live = self._live
        if start is None and self.last_start is None:
            live.follow()
            base, count, epoch = live.start, live.end - live.start, live.epoch
        elif start is None:
            base, count, epoch = int(self.last_start or 0), self._last_count, self._last_epoch
        else:
            base, count, epoch = int(start), live.end - int(start), live.epoch
        idx = check.indices(indices, count, "update_priorities")
        p = check.priorities(priorities, idx.size)
        live.follow()
        if epoch != live.epoch:
            return  # rows were renumbered since the sample: the indices name other rows now
        live.set(idx + base, p)
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
        self._flushing = True  # the buffer's flush calls buffer_flushed: written once, below
        try:
            self.buffer.flush(fsync)
        except ClosedError:
            pass  # the buffer was closed first: its last commit stands; write priorities up to it
        finally:
            self._flushing = False
        self._write(fsync)

    def buffer_flushed(self, fsync: bool | None = None) -> None:
        """Called by the buffer (see ``attach``) after each of its flushes: write the priorities
        up to the rows it committed."""
        if self._flushing or self._closed or not self._writable or self._side.url is None:
            return
        self._last_flush = time.monotonic()
        self._write(fsync)

    def changed(self) -> bool:
        """Whether priorities were updated since they were last written."""
        return bool(self._writable and not self._closed and self._live.dirty.any())

    def buffer_closing(self) -> None:
        """Called by the buffer (see ``attach``) as it closes: write the priorities and release
        the sidecar, so the buffer can be reopened with a new sampler."""
        self.close()

    def _write(self, fsync: bool | None) -> None:
        """Bring the sidecar up to the buffer's committed rows and commit the changed priorities."""
        live = self._live
        try:
            live.follow()
        except ClosedError:
            pass
        main_start, main_end = self._src.committed
        slots = np.flatnonzero(live.dirty)
        self._side.write(live.epoch, (main_start, min(main_end, live.end)), max(main_start, live.start),
                         live.rows_of(slots), live.p[slots].astype(np.float32), live.tail, fsync)
        live.dirty[slots] = False

    def close(self) -> None:
        """Flush (writers, when priorities changed since they were last written) and release the
        sidecar store and its writer lock.  The buffer stays open.  (In a process forked from the
        writer nothing is written: the parent writes.)  Rows added since the last write need no
        write: they count as the ``max_priority`` stored with it, which only updates change."""
        if self._closed:
            return
        try:
            if os.getpid() == self._pid and self.changed():
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
