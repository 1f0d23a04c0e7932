"""``repair`` of a trajectory store whose step rows it rolls back also drops the episode data of
the episodes left without steps (issue 37 section 6), so the repaired store holds no episode-data
row that no step refers to, opens, and verifies."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict

from trajstore import TrajectoryReplayBuffer, repair_store, verify_store
from trajstore.storage.keys import HEAD_KEY

STEP_SPACE = Dict({"obs": Box(-np.inf, np.inf, (4,), np.float32)})
EPISODE_SPACE = Dict({"ret": Box(-np.inf, np.inf, (), np.float64)})


def _store(path):
    """100 episodes of 5 steps (rows 0-499, chunks of 256 rows); step ``obs`` and episode ``ret``
    both hold the episode id."""
    with TrajectoryReplayBuffer.create(STEP_SPACE, cache_path=path, episode_data_instance_space=EPISODE_SPACE,
                                       chunk_rows=256) as rb:
        for _ in range(100):
            e = rb.current_episode_id
            rb.extend({"obs": np.full((5, 4), e, np.float32)})
            rb.set_current_episode_data({"ret": np.float64(e)})
            rb.mark_episode_end()


@pytest.mark.parametrize(("chunk", "steps_kept"), [(0, 0), (1, 256)], ids=["first-chunk", "second-chunk"])
def test_repair_drops_episode_data_of_episodes_without_steps(tmp_path, chunk, steps_kept):
    path = tmp_path / "s"
    _store(path)
    with open(path / "step_data" / "obs" / "c" / str(chunk) / "0", "r+b") as f:
        f.truncate(10)  # a damaged chunk: repair keeps the steps before it
    rep = repair_store(path)
    assert rep.recovered, rep.problems
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as rb:
        assert len(rb) == steps_kept
        with_steps = rb.episodes()["episode_id"].tolist()
        if steps_kept:
            item, meta = rb.get_at_with_metadata(slice(None))
            # every kept step still reads its own episode's data
            np.testing.assert_array_equal(np.asarray(item["episode_data"]["ret"]), np.asarray(meta["episode_ids"]))
    head = json.loads((path / HEAD_KEY).read_text())["tables"]["episode_data"]
    assert head["end"] - head["start"] == len(with_steps), (
        f"{head['end'] - head['start']} episode-data rows kept for {len(with_steps)} episodes with steps")
    assert any(c["action"] == "rollback" and c["table"] == "episode_data" for c in rep.changes)
    assert verify_store(path).ok


def test_undecodable_episode_ids_are_reported_not_raised(tmp_path):
    """The kept rows' episode ids are read to find the orphaned episode data; a compressed id chunk
    that does not decode (a plain repair checks sizes only) is a problem in the report, never a
    builtin error from the decoder."""
    path = tmp_path / "s"
    with TrajectoryReplayBuffer.create(STEP_SPACE, cache_path=path, episode_data_instance_space=EPISODE_SPACE,
                                       chunk_rows=256, step_episode_id_storage_kwargs={"compressor": "lz4"}) as rb:
        for _ in range(100):
            rb.extend({"obs": np.full((5, 4), rb.current_episode_id, np.float32)})
            rb.mark_episode_end()
    with open(path / "step_data" / "obs" / "c" / "1" / "0", "r+b") as f:
        f.truncate(10)
    ids = path / "step_episode_ids" / "c" / "0"
    ids.write_bytes(bytes(range(256)) * (ids.stat().st_size // 256 + 1))
    rep = repair_store(path)
    assert not rep.recovered
    assert any("episode ids of the rows kept could not be read" in p for p in rep.problems), rep.problems
