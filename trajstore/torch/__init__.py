"""PyTorch datasets over trajstore stores (offline RL, bigger than RAM, local or remote).

```python
from torch.utils.data import DataLoader
from trajstore.torch import TransitionDataset, SequenceDataset, RandomBatchSampler, collate_batch

ds = TransitionDataset("runs/dataset", fields=["obs", "action", "reward"])
loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=4, collate_fn=collate_batch,
                    persistent_workers=True)
seqs = SequenceDataset("s3://bucket/dataset", 32, within_episode=True, storage_options={...})
loader = DataLoader(seqs, batch_sampler=RandomBatchSampler(seqs, 64, num_batches=None),
                    num_workers=4, collate_fn=collate_batch)
```
"""

from .datasets import SampleBatch, SequenceDataset, TransitionDataset, collate_batch
from .samplers import RandomBatchSampler

__all__ = ["RandomBatchSampler", "SampleBatch", "SequenceDataset", "TransitionDataset", "collate_batch"]
