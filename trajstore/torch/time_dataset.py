"""A map-style dataset of windows in seconds (LeRobot's ``delta_timestamps``; docs/robot.md "Time").

One item per stored step (the anchor): ``{leaf: (T, ...), key + "_is_pad": (T,) bool}`` as
:meth:`TrajectoryReplayBuffer.get_time_windows` returns them.  Streams at other rates are store
paths (or buffers) opened read-only once per process, as the dataset's own store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trajstore.errors import BadArgumentError, BadOptionError
from trajstore.sampling import time_windows as _tw
from trajstore.torch._source import make_source
from trajstore.torch.datasets import BaseDataset

__all__ = ["TimeWindowDataset"]


class TimeWindowDataset(BaseDataset):
    """Windows of frames at times relative to each step, as LeRobot's datasets give them.

    Parameters
    ----------
    source : str, os.PathLike or TrajectoryReplayBuffer
        A trajectory store with a time (a ``timestamp`` step field or a declared ``fps``).
    delta_timestamps : mapping of str to list of float
        Field (or ``"<stream>/<field>"``) -> seconds relative to the anchor step.
    tolerance_s, mode, on_missing
        As :meth:`~trajstore.TrajectoryReplayBuffer.get_time_windows`.
    streams : mapping of str to path or TrajectoryReplayBuffer, optional
        Stores at other rates with the same episode ids and clock.
    output : "torch" or "numpy"
    storage_options : dict, optional
        fsspec options for URLs (the store's and the streams').

    Raises
    ------
    BadArgumentError
        The source is not a trajectory store.
    BadOptionError
        A bad tolerance, mode, ``on_missing`` or ``delta_timestamps`` (checked here, before any read).
    """

    def __init__(self, source: Any, delta_timestamps: Mapping[str, Sequence[float]], *, tolerance_s: float = 1e-4,
                 mode: str = "nearest", on_missing: str = "pad", streams: Mapping[str, Any] | None = None,
                 output: str = "torch", storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(source, None, output, storage_options)
        if not self._src.is_trajectory or not hasattr(self._src.buffer, "get_time_windows"):
            raise BadArgumentError(f"TimeWindowDataset needs a TrajectoryReplayBuffer store; got {self._src.kind}")
        _tw.check_tolerance(tolerance_s, mode)
        if on_missing not in ("pad", "raise"):
            raise BadOptionError(f"on_missing must be 'pad' or 'raise'; got {on_missing!r}")
        self.delta_timestamps = {k: v.tolist() for k, v in _tw.check_deltas(delta_timestamps).items()}
        self.tolerance_s, self.mode, self.on_missing = float(tolerance_s), mode, on_missing
        self._streams = {k: make_source(v, storage_options) for k, v in (streams or {}).items()}
        self._n = len(self._src.buffer)

    def __len__(self) -> int:
        return self._n

    def _read(self, indices: Any, out: Any) -> dict[str, Any]:
        w = self._src.buffer.get_time_windows(
            np.asarray(indices, np.int64), self.delta_timestamps, tolerance_s=self.tolerance_s, mode=self.mode,
            on_missing=self.on_missing, streams={k: s.buffer for k, s in self._streams.items()})
        return {k: out(np.asarray(v)) for k, v in w.items()}

    def close(self) -> None:
        """Close the handles this dataset opened in this process (its store's and the streams')."""
        super().close()
        for s in self._streams.values():
            s.close()
