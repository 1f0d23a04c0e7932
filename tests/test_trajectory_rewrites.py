"""TrajectoryReplayBuffer.remove_at is one crash-atomic rewrite of steps and episode data
(issue 3 item 4): a writer deleting steps and whole episodes is SIGKILLed at random, and
every reopened store is consistent — no episode keeps data without steps, no step's
episode has data of another episode, every remaining step is intact."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _traj_workers as TW  # noqa: E402
import _workers as W  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402


def _check(tb: TrajectoryReplayBuffer, where: str) -> int:
    data, meta = tb.get_at_with_metadata(slice(None))
    ids = np.asarray(meta["episode_ids"])
    a, b, ok = TW.decode_steps(data["step_data"])
    assert ok.all(), f"{where}: torn or zeroed steps at rows {np.flatnonzero(~ok)[:5].tolist()}"
    assert np.array_equal(a, ids), f"{where}: a step's stored episode id differs from the episode it encodes"
    with_data = tb.episode_index.column()
    assert set(with_data.tolist()) <= set(ids.tolist()), (
        f"{where}: episodes {sorted(set(with_data.tolist()) - set(ids.tolist()))} keep data without steps")
    ep = np.asarray(data["episode_data"])
    has = ep[:, 2] == 1.0
    assert np.array_equal(ep[has, 0].astype(np.int64), ids[has]), f"{where}: a step shows another episode's data"
    assert tb.current_episode_id > (ids.max() if len(ids) else -1), f"{where}: current id would be reused"
    return len(ids)


@pytest.mark.slow
def test_sigkill_during_remove_at_keeps_steps_and_episode_data_consistent(tmp_path):
    store = str(tmp_path / "store")
    with TrajectoryReplayBuffer.create(TW.STEP_SPACE, episode_data_instance_space=TW.EP_SPACE, cache_path=store,
                                       chunk_rows=64) as tb:
        for _ in range(30):
            eid = tb.current_episode_id
            tb.extend(TW.encode_steps(np.full(5, eid), np.arange(5)))
            tb.set_current_episode_data(TW.encode_episode(eid, 1))
            tb.mark_episode_end()
    rng = np.random.default_rng(5)
    sizes = []
    for r in range(20):
        ready = str(tmp_path / f"ready{r}")
        p = W.start(TW.remove_loop, store, ready, 100 + r)
        try:
            W.wait_for_file(ready, p)
            time.sleep(rng.uniform(0.05, 0.4))
        finally:
            W.kill(p)
        with TrajectoryReplayBuffer.load_from(store, read_only=True) as ro:
            _check(ro, f"round {r}, read-only open")
        with TrajectoryReplayBuffer.load_from(store) as w:
            sizes.append(_check(w, f"round {r}, writer open"))
            assert W.orphans(store) == []
    assert min(sizes) > 0
