"""Sampling: uniform rows and sequence windows over a :class:`~trajstore.sampling.source.RowSource`,
and prioritized replay (:class:`~trajstore.sampling.prioritized.PrioritizedSampler`).

Imports only :mod:`trajstore.core` and below; buffers hand themselves in as row sources.
"""

from typing import Any

__all__ = ["PrioritizedSampler"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the buffers import trajstore.sampling.source on every ``import trajstore``.
    if name == "PrioritizedSampler":
        from trajstore.sampling.prioritized import PrioritizedSampler

        globals()[name] = PrioritizedSampler
        return PrioritizedSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
