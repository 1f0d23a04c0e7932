"""A read-only reader of a live store whose episode-data ring is smaller than its step ring.

The writer evicts the oldest episode-data rows and reuses their slots while the steps of those
episodes stay in the step ring.  A read that overlaps such an eviction must not return the new
occupant's data as the old episode's: the episode has no data under the new record, so its
steps come back with zeros.  The eviction is injected between the point where a sample has drawn
its rows and the point where it reads their episode data (one process, no timing).  Before the
fix every sampler returned episode 8's data for episode 4's steps.
"""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict

from trajstore import TrajectoryReplayBuffer
from trajstore.buffers.trajectory_layout import TrajectoryLayout

STEP = Dict({"obs": Box(-1e9, 1e9, (), np.float64)})
EP = Box(-1e9, 1e9, (), np.float64)
LENGTH = 8  # steps per episode; every step's obs and every episode's data is its episode id


def record_episode(w: TrajectoryReplayBuffer) -> None:
    e = w.current_episode_id
    w.extend({"obs": np.full(LENGTH, e, np.float64)})
    w.set_current_episode_data(np.float64(e))
    w.mark_episode_end()


SAMPLERS = {
    "sample": lambda b: (b.sample(256, rng=np.random.default_rng(0))["step_data"]["obs"], None),
    "sample_sequences": lambda b: b.sample_sequences(256, 2, rng=np.random.default_rng(0), within_episode=True),
    "per-field windows": lambda b: b.sample_sequences(256, offsets={"obs": [-1, 0]}, rng=np.random.default_rng(0),
                                                      within_episode=True),
}


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("how", list(SAMPLERS))
def test_episode_data_evicted_while_read(tmp_path, monkeypatch, how, view):
    store = tmp_path / "s"
    w = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP, step_data_capacity=8 * LENGTH,
                                      episode_data_capacity=4, cache_path=store, chunk_rows=16)
    for _ in range(8):  # steps of episodes 0..7, data of episodes 4..7 only
        record_episode(w)
    w.flush()
    ro = TrajectoryReplayBuffer.load_from(store, read_only=True)
    reader = ro.select_episodes(np.arange(1, 8)) if view else ro
    sample = SAMPLERS[how]
    sample(reader)  # the reader's episode index is now built and cached
    real, injected = TrajectoryLayout.episode_rows, []

    def evict_while_reading(self, index, ids, fields):
        if self is ro.layout and not injected:  # episode 8 evicts episode 4's data row and takes its slot
            injected.append(True)
            record_episode(w)
            w.flush()
        return real(self, index, ids, fields)

    monkeypatch.setattr(TrajectoryLayout, "episode_rows", evict_while_reading)
    data, _ = sample(reader) if how != "sample" else (reader.sample(256, rng=np.random.default_rng(0)), None)
    assert injected
    obs = np.asarray(data["step_data"]["obs"])
    eid = obs if obs.ndim == 1 else obs[:, -1]
    ep = np.asarray(data["episode_data"])
    assert (eid == 4).any()  # steps of episode 4 were sampled ...
    np.testing.assert_array_equal(ep[eid == 4], 0)  # ... and have no episode data now
    have = np.isin(eid, [5, 6, 7])
    np.testing.assert_array_equal(ep[have], eid[have])
    assert not np.isin(eid, [0, 8]).any() if view else True  # (episode 8 is not selected; 0 was evicted)
    ro.close()
    w.close()
