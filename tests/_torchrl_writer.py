"""Writer process for test_torchrl_training.py's kill test: extends a TrajstoreStorage ring of 48
through a TorchRL ReplayBuffer with rows 0, 1, 2, ... and prints the row count after each flush."""

import sys

import torch
from tensordict import TensorDict
from torchrl.data import ReplayBuffer

from trajstore.torchrl import TrajstoreStorage

storage = TrajstoreStorage(sys.argv[1], max_size=48, chunk_rows=16)
rb = ReplayBuffer(storage=storage)
n = 0
while True:
    for _ in range(3):                                   # unflushed extends between flushes too
        rb.extend(TensorDict({"x": torch.arange(n, n + 7)}, [7]))
        n += 7
    storage.flush()
    print(n, flush=True)
