"""A new process for test_torch_resume.py: rebuilds the loader of argv[1]'s store, loads the sampler
state saved at argv[2], and prints every remaining batch's ``obs[:, 0]`` (one JSON list per line),
read through two DataLoader workers."""

import json
import sys

from torch.utils.data import DataLoader

from trajstore.torch import MixtureDataset, MixtureSampler, collate_batch

mix = MixtureDataset({"a": sys.argv[1] + "/a", "b": sys.argv[1] + "/b"}, fields=["obs"])
sampler = MixtureSampler(mix, 8, {"a": 1, "b": 3}, num_batches=10, seed=5)
with open(sys.argv[2]) as f:
    sampler.load_state_dict(json.load(f))
for batch in DataLoader(mix, batch_sampler=sampler, num_workers=2, collate_fn=collate_batch):
    print(json.dumps(batch["obs"][:, 0].tolist()), flush=True)
