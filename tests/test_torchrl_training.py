"""A TorchRL DQN loop on CartPole gives the same losses with TrajstoreStorage as with LazyMemmapStorage
(issue 35, point 1), and a writer SIGKILLed through a TorchRL buffer leaves a store that reopens
with every committed row (docs/design.md 3.3).

The losses are compared bit for bit: both runs draw the same indices from torch's global generator
(RandomSampler draws ``randint(len(storage))``), both storages return the stored float32 values
exactly, so every batch, gradient and action is the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn
from torchrl.data import LazyMemmapStorage, OneHot, RandomSampler, ReplayBuffer
from torchrl.modules import QValueActor
from torchrl.objectives import DQNLoss

from trajstore.maintenance.verify import verify_store
from trajstore.torchrl import TrajstoreStorage

HERE = Path(__file__).resolve().parent


def dqn_losses(storage, steps: int = 300, warmup: int = 64, seed: int = 0) -> list[float]:
    """A hand DQN loop with TorchRL's QValueActor and DQNLoss; returns every loss."""
    torch.manual_seed(seed)
    env = gym.make("CartPole-v1")
    net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    actor = QValueActor(net, in_keys=["observation"], spec=OneHot(2))
    loss_fn = DQNLoss(actor, action_space="one-hot", delay_value=False)
    opt = torch.optim.Adam(loss_fn.parameters(), lr=1e-3)
    rb = ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=32)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    losses: list[float] = []
    for step in range(steps):
        o = torch.as_tensor(obs, dtype=torch.float32)
        with torch.no_grad():
            greedy = actor(TensorDict({"observation": o}, []))["action"]
        action = greedy if rng.random() > 0.2 else torch.eye(2, dtype=greedy.dtype)[int(rng.integers(2))]
        nxt, reward, term, trunc, _ = env.step(int(action.argmax()))
        rb.add(TensorDict({"observation": o, "action": action,
                           "next": {"observation": torch.as_tensor(nxt, dtype=torch.float32),
                                    "reward": torch.tensor([reward], dtype=torch.float32),
                                    "done": torch.tensor([term or trunc]), "terminated": torch.tensor([term])}}, []))
        obs = env.reset()[0] if term or trunc else nxt
        if step >= warmup:
            loss = loss_fn(rb.sample())["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    env.close()
    return losses


def test_dqn_on_cartpole_gives_the_same_losses_as_lazy_memmap(tmp_path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # tiny matmuls: threads only contend on a loaded machine
    try:
        ref = dqn_losses(LazyMemmapStorage(200, scratch_dir=tmp_path / "memmap"))
        ours = dqn_losses(TrajstoreStorage(tmp_path / "store", max_size=200))   # 300 steps wrap the ring
    finally:
        torch.set_num_threads(threads)
    assert len(ours) == 236 and ours == ref
    assert verify_store(tmp_path / "store").ok


def test_sigkilled_torchrl_writer_leaves_every_committed_row(tmp_path) -> None:
    """The writer (tests/_torchrl_writer.py) extends a ring of 48 through a TorchRL ReplayBuffer
    and prints each count it has flushed; it is killed mid-write after a few prints.
    round.  The store reopens, verifies deep, holds a run of consecutive rows ending at or after the
    last flushed one, and a resumed TorchRL buffer appends after it (one round: each writer process
    pays for importing torchrl)."""
    for kill_after in (5,):                 # 105 rows flushed: the ring of 48 wrapped twice
        path = tmp_path / f"store{kill_after}"
        proc = subprocess.Popen([sys.executable, str(HERE / "_torchrl_writer.py"), str(path)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
        assert proc.stdout is not None
        flushed = [int(proc.stdout.readline()) for _ in range(kill_after)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert verify_store(path, deep=True).ok
        st = TrajstoreStorage(path)
        values = st[:]["x"].tolist()
        first = min(range(len(values)), key=lambda i: values[i])       # the ring's oldest slot
        ordered = values[first:] + values[:first]
        assert ordered == list(range(ordered[0], ordered[0] + len(ordered)))
        # A kill inside a ring write leaves the ring short of the rows that write evicted first
        # (docs/design.md 3: evicted before written), at most one extend of 7.
        assert ordered[-1] + 1 >= flushed[-1] and (flushed[-1] <= 48 or len(ordered) >= 48 - 7)
        rb = ReplayBuffer(storage=st)
        st.resume(rb)
        n = ordered[-1] + 1
        rb.extend(TensorDict({"x": torch.arange(n, n + 5)}, [5]))
        values = st[:]["x"].tolist()
        assert sorted(values)[-5:] == list(range(n, n + 5))
        st.close()
