"""Sharded datasets: many writers (one shard each, on any number of machines), read as one.

:func:`create_shard` adds a shard (an ordinary writable buffer with all its guarantees) under a
dataset root; :func:`open_sharded` reads every shard as one read-only buffer.  See docs/scale.md.
"""

from trajstore.shards.create import create_shard
from trajstore.shards.dataset import ShardedDataset, ShardedTrajectories, open_sharded
from trajstore.shards.merge import merge_shards

__all__ = ["create_shard", "open_sharded", "merge_shards", "ShardedDataset", "ShardedTrajectories"]
