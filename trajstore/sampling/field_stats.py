"""Statistics of step fields per episode, and their aggregation over any set of episodes (issue 32).

Per episode and channel we keep the count, mean, m2 (sum of squared deviations from the mean), min,
max and all 101 percentiles (numpy's ``linear`` method, exact for that episode).  Aggregates:

- count, mean, std (population, ddof 0), min and max are exact (Chan's parallel merge of the moments);
- quantiles of one episode are exact; over several they are the quantiles of the *mixture* of the
  episodes' piecewise-linear CDFs through their percentiles, weighted by counts.  Each episode's
  CDF is known within one percentile step at every value, so the mixture's rank error is at most
  0.01 (plus ``1/n`` of the smallest episode from interpolation): q50 of the aggregate lies between
  the true q49 and q51.  ``exact=True`` recomputes them from the rows instead.

Channels: an image field (3-D, 1, 3 or 4 channels last or first, both other sides longer than 4) has
one channel per colour plane; any other field of at most :data:`MAX_ELEMENT_CHANNELS` elements one per element
(a 14-dim state: 14); larger fields are one channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from trajstore.sampling.source import EpisodeSource, read_consistent
from trajstore.storage.robot_files import QUANTILE_GRID, STAT_WIDTH, StatsTable

__all__ = ["MAX_ELEMENT_CHANNELS", "QUANTILES", "StatField", "aggregate", "columns_of", "episode_stats", "group_stats",
           "summarize"]

#: Fields with more elements than this (and not images) get one channel.
MAX_ELEMENT_CHANNELS = 4096
#: The quantiles reported, as LeRobot names them.
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
#: Rows read at a time while an episode's integer image planes are counted.
_BLOCK_BYTES = 64 << 20


class StatField(NamedTuple):
    """One step leaf: its name, source leaf number, per-row shape and dtype."""

    name: str
    leaf: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def channel_axis(self) -> int | None:
        """Axis of the row holding colour planes, else None: an image is 3-D with 1, 3 or 4 channels
        last (H, W, C) or first (C, H, W), both other sides longer than 4."""
        sh = self.shape
        if len(sh) == 3:
            if sh[2] in (1, 3, 4) and min(sh[0], sh[1]) > 4:
                return 2
            if sh[0] in (1, 3, 4) and min(sh[1], sh[2]) > 4:
                return 0
        return None

    @property
    def channels(self) -> int:
        """Colour planes of an image, else elements (at most MAX_ELEMENT_CHANNELS, else 1)."""
        ax = self.channel_axis
        if ax is not None:
            return self.shape[ax]
        n = int(np.prod(self.shape, dtype=np.int64))
        return n if n <= MAX_ELEMENT_CHANNELS else 1

    @property
    def stat_shape(self) -> tuple[int, ...]:
        """Shape of each statistic: broadcasts against one row (images: ``(1, 1, C)`` or ``(C, 1, 1)``)."""
        ax = self.channel_axis
        if ax is not None:
            return tuple(self.shape[ax] if k == ax else 1 for k in range(3))
        return self.shape if self.channels > 1 or not self.shape else ()

    def samples(self, rows: np.ndarray) -> np.ndarray:
        """(rows, ...) values as (samples, channels)."""
        ax = self.channel_axis
        if ax is not None:
            rows = np.moveaxis(rows, ax + 1, -1)
        return rows.reshape(-1, self.channels)


def _from_counts(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(C, STAT_WIDTH) statistics of channels given as histograms ``counts`` (C, V) over ``values`` (V,)."""
    n = counts.sum(1).astype(np.float64)
    mean = counts @ values / n
    m2 = counts @ (values ** 2) - n * mean ** 2
    cum = np.cumsum(counts, 1)
    pos = np.linspace(0, 1, QUANTILE_GRID)[None, :] * (n[:, None] - 1)  # numpy's "linear" positions
    lo, frac = np.floor(pos), pos - np.floor(pos)
    at = np.stack([np.searchsorted(c, lo_c, side="right") for c, lo_c in zip(cum, lo)])
    at1 = np.stack([np.searchsorted(c, lo_c + 1, side="right") for c, lo_c in zip(cum, lo)])
    a, b = values[np.minimum(at, len(values) - 1)], values[np.minimum(at1, len(values) - 1)]
    grid = a + (b - a) * frac  # exactly a where a == b: a * (1 - f) + b * f may round below it
    return np.concatenate([n[:, None], mean[:, None], np.maximum(m2, 0)[:, None], grid[:, :1], grid[:, -1:], grid], 1)


def _from_samples(x: np.ndarray) -> np.ndarray:
    """(C, STAT_WIDTH) statistics of (samples, C) values."""
    x = x.astype(np.float64)
    mean = x.mean(0)
    grid = np.quantile(x, np.linspace(0, 1, QUANTILE_GRID), axis=0).T
    return np.concatenate([np.full((x.shape[1], 1), len(x), np.float64), mean[:, None],
                           ((x - mean) ** 2).sum(0)[:, None], x.min(0)[:, None], x.max(0)[:, None], grid], 1)


def _field_stats(src: EpisodeSource, rows: np.ndarray, f: StatField) -> np.ndarray:
    """One episode's (channels, STAT_WIDTH) statistics of field ``f`` (its logical ``rows``)."""
    if f.dtype == np.uint8:  # counted in blocks: bounded memory for camera frames
        per_row = max(int(np.prod(f.shape, dtype=np.int64)), 1)
        step = max(1, _BLOCK_BYTES // per_row)
        counts = np.zeros((f.channels, 256), np.int64)
        for k in range(0, len(rows), step):
            x = f.samples(src.read_rows(rows[k:k + step], [f.leaf])[0])
            # A contiguous uint8 copy of each plane first: bincount casts its input to intp, and
            # from a strided view that cast runs at half the speed (52 against 93 MB/s here).
            counts += np.stack([np.bincount(np.ascontiguousarray(x[:, c]), minlength=256) for c in range(f.channels)])
        return _from_counts(counts, np.arange(256, dtype=np.float64))
    return _from_samples(f.samples(src.read_rows(rows, [f.leaf])[0]))


def _stats_of_groups(src: EpisodeSource, fields: Sequence[StatField], groups: list[np.ndarray]
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(G,) steps and (G, channels, STAT_WIDTH) statistics of each group of episode ids, read
    under one commit record."""
    def read() -> tuple[np.ndarray, np.ndarray]:
        src.sync()
        first, lengths, ids = src.runs()
        out = np.zeros((len(groups), sum(f.channels for f in fields), STAT_WIDTH))
        n = np.zeros(len(groups), np.int64)
        for k, group in enumerate(groups):
            mine = np.flatnonzero(np.isin(ids, group))
            rows = np.concatenate([np.arange(first[j], first[j] + lengths[j]) for j in mine.tolist()] +
                                  [np.zeros(0, np.int64)])
            n[k] = len(rows)
            c = 0
            for f in fields:
                out[k, c:c + f.channels] = _field_stats(src, rows, f)
                c += f.channels
        return n, out

    return read_consistent(src, read)


def episode_stats(src: EpisodeSource, fields: Sequence[StatField], episode_ids: np.ndarray,
                  epoch: int) -> StatsTable:
    """Statistics of every field for each episode of ``episode_ids`` (all read under one commit
    record): ``values`` of shape (E, sum of channels, STAT_WIDTH)."""
    ids = np.asarray(episode_ids, np.int64)
    n, values = _stats_of_groups(src, fields, [ids[k:k + 1] for k in range(len(ids))])
    return StatsTable(epoch, [(f.name, f.channels) for f in fields], ids, n, values)


def group_stats(src: EpisodeSource, fields: Sequence[StatField], episode_ids: np.ndarray, epoch: int) -> StatsTable:
    """Exact statistics of all the steps of ``episode_ids`` together (one row; reads them all)."""
    ids = np.asarray(episode_ids, np.int64)
    n, values = _stats_of_groups(src, fields, [ids])
    return StatsTable(epoch, [(f.name, f.channels) for f in fields], ids[:1], n, values)


def columns_of(table: StatsTable, fields: Sequence[StatField]) -> np.ndarray | None:
    """Positions of ``fields``' channels in ``table`` (None when one is missing or changed shape)."""
    at, c = {}, 0
    for name, channels in table.fields:
        at[name] = (c, channels)
        c += channels
    cols = []
    for f in fields:
        if at.get(f.name, (0, -1))[1] != f.channels:
            return None
        cols.append(np.arange(at[f.name][0], at[f.name][0] + f.channels))
    return np.concatenate(cols) if cols else np.zeros(0, np.int64)


def _mixture_quantile(grids: np.ndarray, weights: np.ndarray, q: float) -> np.ndarray:
    """(C,) value ``x`` where the count-weighted mixture of the episodes' piecewise-linear CDFs
    (knots ``grids`` (E, C, G) at probabilities 0..1) reaches ``q``: a bisection.

    Every episode's CDF is at least ``q`` at or past its own ``q`` knot, and below it before, so
    the answer lies between the smallest and the largest of the episodes' ``q`` knots; the search
    stops when that bracket is 1e-9 of the data's range (far below the method's rank error)."""
    g = grids.shape[-1]
    w = weights / weights.sum(0)
    k = q * (g - 1)
    at = grids[:, :, int(np.floor(k))] + (grids[:, :, int(np.ceil(k))] - grids[:, :, int(np.floor(k))]) * (k % 1)
    lo, hi = at.min(0), at.max(0)
    eps = 1e-9 * np.maximum(grids[:, :, -1].max(0) - grids[:, :, 0].min(0), 1e-300)
    for _ in range(64):
        if np.all(hi - lo <= eps):
            break
        x = (lo + hi) / 2
        j = (grids <= x[None, :, None]).sum(-1)
        a = np.take_along_axis(grids, np.clip(j - 1, 0, g - 1)[..., None], -1)[..., 0]
        b = np.take_along_axis(grids, np.clip(j, 0, g - 1)[..., None], -1)[..., 0]
        frac = np.where(b > a, (x[None] - a) / np.where(b > a, b - a, 1), 1.0)
        cdf = np.where(j == 0, 0.0, np.where(j >= g, 1.0, (j - 1 + frac) / (g - 1)))
        below = (w * cdf).sum(0) < q
        lo, hi = np.where(below, x, lo), np.where(below, hi, x)
    return np.asarray(hi)


def aggregate(values: np.ndarray) -> dict[str, np.ndarray]:
    """Merge per-episode statistics (E, C, STAT_WIDTH) into per-channel ``count`` (steps are not
    known here: samples per channel), ``mean``, ``std``, ``min``, ``max`` and :data:`QUANTILES`, each (C,)."""
    n, mean, m2 = values[:, :, 0], values[:, :, 1], values[:, :, 2]
    total = n.sum(0)
    mu = (n * mean).sum(0) / total
    var = ((m2 + n * (mean - mu) ** 2).sum(0)) / total  # Chan et al.: exact, whatever the split
    out = {"count": total, "mean": mu, "std": np.sqrt(np.maximum(var, 0)), "min": values[:, :, 3].min(0),
           "max": values[:, :, 4].max(0)}
    grids = values[:, :, 5:]
    for name, q in QUANTILES.items():
        if len(values) == 1:  # one episode: its own percentile, exact
            out[name] = grids[0, :, round(q * (QUANTILE_GRID - 1))]
        else:
            out[name] = _mixture_quantile(grids, n, q)
    return out


def summarize(table: StatsTable, rows: np.ndarray, fields: Sequence[StatField], steps: int
              ) -> dict[str, dict[str, np.ndarray]]:
    """``{field: {statistic: array of the field's stat_shape}}`` aggregated over the episodes at
    positions ``rows`` of ``table``; ``count`` is ``steps`` (frames, as LeRobot counts)."""
    agg = aggregate(table.values[rows])
    out, c = {}, 0
    for f in fields:
        part = {k: v[c:c + f.channels].reshape(f.stat_shape) for k, v in agg.items() if k != "count"}
        part["count"] = np.asarray(steps, np.int64)
        out[f.name] = part
        c += f.channels
    return out
