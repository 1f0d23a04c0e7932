"""TorchRL integration: a TorchRL ``Storage`` whose rows live in a trajstore store (docs/torchrl.md).

```python
from torchrl.data import ReplayBuffer, SliceSampler
from trajstore.torchrl import TrajstoreStorage

rb = ReplayBuffer(storage=TrajstoreStorage("runs/replay", max_size=1_000_000),
                  sampler=SliceSampler(slice_len=8, traj_key=("collector", "traj_ids")), batch_size=256)
```
"""

from trajstore._optional import missing

try:
    import tensordict  # noqa: F401
    import torchrl  # noqa: F401
except ImportError as e:
    raise missing(e.name or "torchrl", "trajstore.torchrl") from None

from trajstore.torchrl.layout import space_from_spec  # noqa: E402
from trajstore.torchrl.storage import TrajstoreStorage  # noqa: E402

__all__ = ["TrajstoreStorage", "space_from_spec"]
