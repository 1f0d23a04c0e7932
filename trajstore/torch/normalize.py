"""Normalization of dataset fields by a store's statistics (docs/robot.md "Statistics").

``dataset.normalize({"state": "mean_std", "action": "min_max"})`` takes the statistics once, in
the process that calls it (``buffer.stats()``: stored per-episode statistics where current), and
keeps them as small numpy arrays that travel to DataLoader workers with the dataset.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from trajstore.errors import BadOptionError, UnknownFieldError

__all__ = ["MODES", "Normalizer"]

#: ``mean_std``: (x - mean) / std; ``min_max``: min..max to -1..1; ``quantile``: q01..q99 to -1..1
#: (LeRobot's ``MEAN_STD``, ``MIN_MAX`` and ``QUANTILES``).
MODES = ("mean_std", "min_max", "quantile")
_EPS = 1e-8


class Normalizer:
    """Per field: ``(x - shift) / scale`` (float32), with the statistics of ``buffer.stats``.

    Parameters
    ----------
    buffer : TrajectoryReplayBuffer
    modes : mapping of field name (a step leaf, ``"obs/state"``) to a mode of :data:`MODES`
    episodes : iterable of int, optional
        The episodes whose statistics are used (default: all).
    """

    def __init__(self, buffer: Any, modes: Mapping[str, str], episodes: Any = None) -> None:
        if not isinstance(modes, Mapping) or not modes:
            raise BadOptionError(f"normalize takes a mapping of field -> mode {MODES}; got {modes!r:.80}")
        bad = {k: m for k, m in modes.items() if m not in MODES}
        if bad:
            raise BadOptionError(f"normalize: modes {bad} are not among {MODES}")
        if not hasattr(buffer, "stats"):
            raise BadOptionError("normalize needs a TrajectoryReplayBuffer store (its episode statistics)")
        stats = buffer.stats(episodes, fields=list(modes))
        self.params: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for key, mode in modes.items():
            s = stats[key]
            if mode == "mean_std":
                shift, scale = s["mean"], s["std"]
            else:
                lo, hi = (s["min"], s["max"]) if mode == "min_max" else (s["q01"], s["q99"])
                shift, scale = (hi + lo) / 2, (hi - lo) / 2
            self.params[key] = (np.asarray(shift, np.float32), np.maximum(np.asarray(scale, np.float32), _EPS))

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` with every normalized field replaced (numpy or torch, nested or ``/`` keys)."""
        for key, (shift, scale) in self.params.items():
            holder, last = _locate(batch, key)
            x = holder[last]
            if isinstance(x, torch.Tensor):
                holder[last] = (x.float() - torch.as_tensor(shift, device=x.device)) / torch.as_tensor(
                    scale, device=x.device)
            else:
                holder[last] = ((np.asarray(x, np.float32) - shift) / scale).astype(np.float32)
        return batch


def _locate(batch: dict[str, Any], key: str) -> tuple[dict[str, Any], str]:
    """The dict holding field ``key`` of a batch and its name there."""
    if key in batch:
        return batch, key
    node: Any = batch
    parts = key.split("/")
    for p in parts[:-1]:
        node = node.get(p) if isinstance(node, dict) else None
    if not isinstance(node, dict) or parts[-1] not in node:
        raise UnknownFieldError(f"normalize: field {key!r} is not in the dataset's items; they hold {list(batch)}")
    return node, parts[-1]
