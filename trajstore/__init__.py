"""trajstore: a disk-backed trajectory and replay store for reinforcement learning.

Every field is a chunked Zarr v3 array under a ``cache_path`` (local folder, ``.zip`` or
any fsspec URL); ``create`` / ``load_from`` / ``dumps`` are metadata operations and reads
are lazy.  See README.md and docs/.
"""

from . import errors
from .repair import repair_store
from .replay_buffer import ReplayBuffer, ZarrStorage
from .trajectory import TrajectoryData, TrajectoryReplayBuffer
from .verify import verify_store
from .views import BatchBase, ColumnView, SliceView

__all__ = ["ReplayBuffer", "TrajectoryReplayBuffer", "TrajectoryData", "ZarrStorage", "BatchBase", "SliceView", "ColumnView", "verify_store", "repair_store", "errors"]
