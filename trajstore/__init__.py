"""trajstore: a disk-backed trajectory and replay store for reinforcement learning.

Every field is a chunked Zarr v3 array under a ``cache_path`` (local folder, ``.zip`` or
any fsspec URL); ``create`` / ``load_from`` / ``dumps`` are metadata operations and reads
are lazy.  See README.md and docs/.
"""

import importlib
from typing import Any

from trajstore import errors
from trajstore.buffers.replay import ReplayBuffer, ZarrStorage
from trajstore.buffers.trajectory import TrajectoryData, TrajectoryReplayBuffer
from trajstore.buffers.views import BatchBase, ColumnView, SliceView

# Maintenance (verify, repair, combine, split), the prioritized sampler and sharded datasets are imported on first
# use: most programs never call them, and ``import trajstore`` should cost little beyond zarr, numpy and gymnasium.
_LAZY = {
    "verify_store": "trajstore.maintenance.verify",
    "repair_store": "trajstore.maintenance.repair",
    "PrioritizedSampler": "trajstore.sampling.prioritized",
    "combine": "trajstore.maintenance.combine",
    "split": "trajstore.maintenance.combine",
    "create_shard": "trajstore.shards",
    "open_sharded": "trajstore.shards",
    "merge_shards": "trajstore.shards",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = ["ReplayBuffer", "TrajectoryReplayBuffer", "TrajectoryData", "ZarrStorage", "BatchBase", "SliceView", "ColumnView", "verify_store", "repair_store", "PrioritizedSampler", "combine", "split",
           "create_shard", "open_sharded", "merge_shards", "errors"]
