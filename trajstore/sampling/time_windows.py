"""Windows in seconds (LeRobot's ``delta_timestamps``) and reads at query times (issue 32).

A step's time is its ``timestamp`` field (float64 seconds, non-decreasing within an episode) or,
without one, its position in its episode divided by the store's ``fps``.  A query ``(episode,
t)`` is answered by the episode's step nearest to ``t`` (``mode="nearest"``, ties to the earlier)
or the latest at or before it (``mode="previous"``; 1 ns of clock rounding allowed); it is *padded*
when the episode has no such step or the step lies more than ``tolerance_s`` from ``t``.  A padded
frame reads the nearest step of the episode and is flagged, never silently replaced.

Cost: O(steps of each distinct episode queried) to find the times (one read of its time column),
then one gather per field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from trajstore.errors import BadArgumentError, BadOptionError, TimeOrderError
from trajstore.sampling.source import EpisodeSource

__all__ = ["MODES", "Clock", "check_deltas", "check_tolerance", "check_increasing", "lookup", "rows_at_times"]

MODES = ("nearest", "previous")
#: Clock rounding that "previous" forgives (seconds).
_ROUNDING = 1e-9


class Clock(NamedTuple):
    """Where a source's step times come from: a leaf of float seconds, else a frame rate."""

    leaf: int | None
    fps: float | None

    def describe(self) -> str:
        return "its timestamp field" if self.leaf is not None else f"fps={self.fps}"


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


def rows_at_times(src: EpisodeSource, clock: Clock, episode_ids: np.ndarray, times: np.ndarray, mode: str,
                  tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """Logical rows answering queries ``(episode_ids[q], times[...q])`` and whether each is padded.

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
    first, lengths, ids = src.runs()
    eids = src.step_ids(anchors)
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
