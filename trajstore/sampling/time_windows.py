"""Windows in seconds (LeRobot's ``delta_timestamps``) and reads at query times (issue 32).

A step's time is its ``timestamp`` field (float64 seconds, non-decreasing within an episode) or,
without one, its position in its episode divided by the store's ``fps``.  A query ``(episode,
t)`` is answered by the episode's step nearest to ``t`` (``mode="nearest"``, ties to the earlier)
or the latest at or before it (``mode="previous"``; 1 ns of clock rounding allowed); it is *padded*
when the episode has no such step or the step lies more than ``tolerance_s`` from ``t``.  A padded
frame reads the nearest step of the episode and is flagged, never silently replaced.

Cost: per call O(runs log runs) to find the episodes (from the run index), then a vectorized
bisection over each episode's time column (log2 of its length reads of B x T times; none with a
frame rate), then one gather per field: flat in the number of episodes.  Episodes split over
several runs of rows (written interleaved) are read one at a time instead, their whole time
column each.  Timestamp order is checked when written (``extend``); whatever a store holds, a
frame is only ever returned unpadded when its time lies within the tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from trajstore.errors import BadArgumentError, BadOptionError, TimeOrderError
from trajstore.sampling.source import EpisodeSource

__all__ = ["MODES", "Clock", "anchor_times", "check_deltas", "check_increasing", "check_tolerance", "episode_spans",
           "episode_times", "lookup", "read_at", "rows_at_times"]

MODES = ("nearest", "previous")
#: Clock rounding that "previous" forgives (seconds).
_ROUNDING = 1e-9


class Clock(NamedTuple):
    """Where a source's step times come from: a leaf of float seconds, else a frame rate."""

    leaf: int | None
    fps: float | None


def check_tolerance(tolerance_s: Any, mode: str) -> float:
    """``tolerance_s`` as a float >= 0 (BadOptionError otherwise), and ``mode`` one of :data:`MODES`."""
    if mode not in MODES:
        raise BadOptionError(f"mode must be one of {MODES}; got {mode!r}")
    if isinstance(tolerance_s, bool) or not isinstance(tolerance_s, (int, float)) or not math.isfinite(tolerance_s) \
            or tolerance_s < 0:
        raise BadOptionError(f"tolerance_s must be a finite number of seconds >= 0; got {tolerance_s!r}")
    return float(tolerance_s)


def check_deltas(deltas: Any) -> dict[str, np.ndarray]:
    """``{key: (T,) float64 seconds}`` from a mapping of keys to finite numbers (BadArgumentError /
    BadOptionError otherwise)."""
    if not hasattr(deltas, "items") or not deltas:
        raise BadArgumentError(f"delta_timestamps must be a non-empty mapping of field -> seconds; got {deltas!r:.80}")
    out = {}
    for k, v in deltas.items():
        if not isinstance(k, str):
            raise BadArgumentError(f"delta_timestamps keys must be field names; got {k!r}")
        try:
            d = np.asarray(v, np.float64)
        except (TypeError, ValueError):
            raise BadOptionError(f"delta_timestamps[{k!r}] must be a list of seconds; got {v!r:.80}") from None
        if d.ndim != 1 or d.size == 0 or not np.isfinite(d).all():
            raise BadOptionError(f"delta_timestamps[{k!r}] must be a non-empty list of finite seconds; got {v!r:.80}")
        out[k] = d
    return out


def check_increasing(ts: np.ndarray, what: str) -> None:
    """Refuse times that go back (TimeOrderError naming ``what`` and the first step out of order)."""
    bad = np.flatnonzero(~(np.diff(ts) >= 0))
    if bad.size or (ts.size and not np.isfinite(ts).all()):
        k = int(bad[0]) + 1 if bad.size else int(np.flatnonzero(~np.isfinite(ts))[0])
        raise TimeOrderError(f"{what}: timestamp at step {k} is {ts[k]!r} after {ts[k - 1] if k else None!r}; "
                             "timestamps must be finite and non-decreasing within an episode")


def lookup(ts: np.ndarray, t: np.ndarray, mode: str, tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """Positions in ``ts`` (sorted, non-empty) answering query times ``t``, and which are padded."""
    n = len(ts)
    if mode == "nearest":
        i = np.searchsorted(ts, t, side="left")
        before, after = np.clip(i - 1, 0, n - 1), np.clip(i, 0, n - 1)
        pos = np.where(np.abs(ts[before] - t) <= np.abs(ts[after] - t), before, after)
        pad = np.abs(ts[pos] - t) > tolerance
    else:
        j = np.searchsorted(ts, t + _ROUNDING, side="right") - 1
        pos = np.clip(j, 0, n - 1)
        pad = (j < 0) | (t - ts[pos] > tolerance)
    return pos, pad


def _episode_rows(first: np.ndarray, lengths: np.ndarray, ids: np.ndarray, eid: int) -> np.ndarray:
    mine = np.flatnonzero(ids == eid)
    return np.concatenate([np.arange(first[k], first[k] + lengths[k]) for k in mine.tolist()] +
                          [np.zeros(0, np.int64)])


def episode_times(src: EpisodeSource, rows: np.ndarray, clock: Clock, what: str) -> np.ndarray:
    """(n,) float64 seconds of an episode's logical ``rows`` (TimeOrderError when they go back)."""
    if clock.leaf is None:
        return np.arange(len(rows), dtype=np.float64) / float(clock.fps or 1.0)
    ts = np.asarray(src.read_rows(rows, [clock.leaf])[0], np.float64).reshape(len(rows))
    check_increasing(ts, what)
    return ts


def episode_spans(src: EpisodeSource, eids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(begin, end)`` logical rows of each episode of ``eids`` (any shape; ``begin == end`` where it
    has no steps), or None when one of them is split over several runs of rows (then the caller
    goes episode by episode).  O(runs log runs), without reading ids."""
    first, lengths, ids = src.runs()
    order = np.argsort(ids, kind="stable")
    sids = ids[order]
    pos = np.clip(np.searchsorted(sids, eids), 0, max(len(sids) - 1, 0))
    if not len(sids):
        return np.zeros(eids.shape, np.int64), np.zeros(eids.shape, np.int64)
    found = sids[pos] == eids
    nxt = np.minimum(pos + 1, len(sids) - 1)
    if (found & (nxt != pos) & (sids[nxt] == eids)).any():
        return None
    begin = np.where(found, first[order[pos]], 0)
    return begin, np.where(found, begin + lengths[order[pos]], 0)


def _times(src: EpisodeSource, clock: Clock, rows: np.ndarray, begin: np.ndarray) -> np.ndarray:
    """Times of logical ``rows`` (of episodes starting at ``begin``), any shape."""
    if clock.leaf is None:
        return (rows - begin) / float(clock.fps or 1.0)
    flat = src.read_rows(rows.ravel(), [clock.leaf])[0]
    return np.asarray(flat, np.float64).reshape(rows.shape)


def _search(src: EpisodeSource, clock: Clock, begin: np.ndarray, end: np.ndarray, t: np.ndarray,
            right: bool) -> np.ndarray:
    """First row in ``[begin, end)`` whose time is ``>= t`` (``right``: ``> t``), per element: a
    vectorized bisection, one read of B x T times per step (log2 of the episode length steps)."""
    if clock.leaf is None:
        x = t * float(clock.fps or 1.0)
        k = np.floor(x) + 1 if right else np.ceil(x)
        return np.clip(begin + np.maximum(k, 0).astype(np.int64), begin, end)
    lo, hi = begin.copy(), end.copy()
    while True:
        open_ = lo < hi
        if not open_.any():
            return lo
        mid = (lo + hi) // 2
        ts = _times(src, clock, mid[open_], begin[open_])
        below = ts <= t[open_] if right else ts < t[open_]
        lo[open_] = np.where(below, mid[open_] + 1, lo[open_])
        hi[open_] = np.where(below, hi[open_], mid[open_])


def rows_at_times(src: EpisodeSource, clock: Clock, episode_ids: np.ndarray, times: np.ndarray, mode: str,
                  tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """Logical rows answering queries ``(episode_ids[b], times[b, k])`` and whether each is padded.

    Parameters
    ----------
    episode_ids : (B,) int64
    times : (B, T) float64 seconds

    Returns
    -------
    rows : (B, T) int64
        Logical rows (a padded query: the episode's nearest step, or row 0 when the episode has none).
    pad : (B, T) bool
    """
    src.sync()
    spans = episode_spans(src, episode_ids)
    if spans is None:
        return _rows_by_episode(src, clock, episode_ids, times, mode, tolerance)
    begin = np.broadcast_to(spans[0][:, None], times.shape).ravel().copy()
    end = np.broadcast_to(spans[1][:, None], times.shape).ravel().copy()
    t = times.ravel()
    empty = begin == end
    last = np.maximum(end - 1, begin)
    if mode == "nearest":
        i = _search(src, clock, begin, end, t, right=False)
        before, after = np.clip(i - 1, begin, last), np.clip(i, begin, last)
        tb, ta = _times(src, clock, before, begin), _times(src, clock, after, begin)
        pick_before = np.abs(tb - t) <= np.abs(ta - t)
        rows, at = np.where(pick_before, before, after), np.where(pick_before, tb, ta)
        pad = empty | ~(np.abs(at - t) <= tolerance)
    else:
        j = _search(src, clock, begin, end, t + _ROUNDING, right=True) - 1
        rows = np.clip(j, begin, last)
        pad = empty | (j < begin) | ~(t - _times(src, clock, rows, begin) <= tolerance)
    return rows.reshape(times.shape), pad.reshape(times.shape)


def _rows_by_episode(src: EpisodeSource, clock: Clock, episode_ids: np.ndarray, times: np.ndarray, mode: str,
                     tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`rows_at_times` for episodes split over several runs (rows interleaved by several
    writers): each episode's whole time column is read (and checked for order)."""
    first, lengths, ids = src.runs()
    rows = np.zeros(times.shape, np.int64)
    pad = np.ones(times.shape, bool)
    for eid in np.unique(episode_ids).tolist():
        mine = np.flatnonzero(episode_ids == eid)
        ep = _episode_rows(first, lengths, ids, eid)
        if ep.size == 0:
            continue
        ts = episode_times(src, ep, clock, f"{src.name}: episode {eid}")
        pos, p = lookup(ts, times[mine], mode, tolerance)
        rows[mine], pad[mine] = ep[pos], p
    return rows, pad


def anchor_times(src: EpisodeSource, clock: Clock, anchors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(episode ids, times)`` of logical ``anchors`` (B,)."""
    src.sync()
    eids = src.step_ids(anchors)
    spans = episode_spans(src, eids)
    if spans is not None:
        return eids, _times(src, clock, anchors, spans[0])
    first, lengths, ids = src.runs()
    times = np.zeros(len(anchors))
    for eid in np.unique(eids).tolist():
        mine = np.flatnonzero(eids == eid)
        ep = _episode_rows(first, lengths, ids, eid)
        ts = episode_times(src, ep, clock, f"{src.name}: episode {eid}")
        times[mine] = ts[np.searchsorted(ep, anchors[mine])]
    return eids, times


def read_at(src: EpisodeSource, rows: np.ndarray, leaves: Sequence[int]) -> list[np.ndarray]:
    """Leaves at (B, T) logical ``rows``: one (B, T, ...) array each."""
    got = src.read_rows(rows.ravel(), list(leaves))
    return [a.reshape(rows.shape + a.shape[1:]) for a in got]
