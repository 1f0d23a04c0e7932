"""PyTorch datasets over trajstore stores (offline RL, bigger than RAM, local or remote).

```python
from torch.utils.data import DataLoader
from trajstore.torch import TransitionDataset, SequenceDataset, RandomBatchSampler

ds = TransitionDataset("runs/dataset", fields=["obs", "action", "reward"])
loader = DataLoader(ds, batch_size=256, shuffle=True)      # small local rows: no workers
seqs = SequenceDataset("s3://bucket/dataset", 32, within_episode=True, storage_options={...})
loader = DataLoader(seqs, batch_sampler=RandomBatchSampler(seqs, 64, num_batches=None),
                    num_workers=4, pin_memory=True, persistent_workers=True)
```

Each batch is read whole (``__getitems__``) and, in a worker, crosses to the main process as one
buffer (``_transfer``); torch's default collate and :func:`collate_batch` both pass it through.
"""

from trajstore._optional import missing

try:
    import torch  # noqa: F401
except ImportError:
    raise missing("torch", "trajstore.torch") from None

from trajstore.torch.chunk_sampler import ChunkShuffleSampler  # noqa: E402
from trajstore.torch.datasets import (  # noqa: E402
    SampleBatch,
    SequenceDataset,
    TransitionDataset,
    collate_batch,
)
from trajstore.torch.mixture import MixtureDataset, MixtureSampler, episode_item_weights  # noqa: E402
from trajstore.torch.samplers import RandomBatchSampler  # noqa: E402
from trajstore.torch.time_dataset import TimeWindowDataset  # noqa: E402

__all__ = ["MixtureDataset", "MixtureSampler", "RandomBatchSampler", "SampleBatch", "SequenceDataset",
           "ChunkShuffleSampler", "TimeWindowDataset", "TransitionDataset", "collate_batch", "episode_item_weights"]
