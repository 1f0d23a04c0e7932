"""trajstore: a disk-backed trajectory and replay store for reinforcement learning.

Every field is a chunked Zarr v3 array under a ``cache_path`` (local folder, ``.zip`` or
any fsspec URL); ``create`` / ``load_from`` / ``dumps`` are metadata operations and reads
are lazy.  See README.md and docs/.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from trajstore import errors
from trajstore.buffers.replay import ReplayBuffer, ZarrStorage
from trajstore.buffers.trajectory import TrajectoryData, TrajectoryReplayBuffer
from trajstore.buffers.views import BatchBase, ColumnView, SliceView

try:
    __version__ = version("trajstore")  # the installed distribution's (pyproject.toml's) version
except PackageNotFoundError:  # pragma: no cover - imported from a source tree that was never installed
    __version__ = "unknown"

# Maintenance (verify, repair, combine, split), the prioritized sampler and sharded datasets are imported on first
# use: most programs never call them, and ``import trajstore`` should cost little beyond zarr, numpy and gymnasium.
_LAZY = ("verify_store", "repair_store", "PrioritizedSampler", "combine", "split", "to_trajectory", "create_shard",
         "open_sharded", "merge_shards", "break_lease", "tag", "load_from", "push", "pull")


def __getattr__(name: str) -> Any:
    # Explicit imports of this package's own modules: no module is ever imported by a computed name.
    value: Any
    if name == "verify_store":
        from trajstore.maintenance.verify import verify_store as value
    elif name == "repair_store":
        from trajstore.maintenance.repair import repair_store as value
    elif name == "tag":
        from trajstore.maintenance.versions import tag as value
    elif name == "load_from":
        from trajstore.maintenance.versions import load_version as value
    elif name in ("push", "pull"):
        from trajstore.maintenance import push_pull as _push_pull
        value = getattr(_push_pull, name)
    elif name == "break_lease":
        from trajstore.storage.lease import break_lease as value
    elif name == "PrioritizedSampler":
        from trajstore.sampling.prioritized import PrioritizedSampler as value
    elif name in ("combine", "split"):
        from trajstore.maintenance import combine as _combine

        value = getattr(_combine, name)
    elif name == "to_trajectory":
        from trajstore.maintenance.convert import to_trajectory as value
    elif name in ("create_shard", "open_sharded", "merge_shards"):
        from trajstore import shards as _shards

        value = getattr(_shards, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = ["ReplayBuffer", "TrajectoryReplayBuffer", "TrajectoryData", "ZarrStorage", "BatchBase", "SliceView", "ColumnView", "verify_store", "repair_store", "PrioritizedSampler", "combine", "split",
           "to_trajectory", "create_shard", "open_sharded", "merge_shards", "break_lease", "tag", "load_from", "push", "pull", "errors",
           "__version__"]
