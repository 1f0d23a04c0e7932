"""stable-baselines3 replay-buffer pickles (issue 14): files written by SB3's own
``model.save_replay_buffer`` after real collection; rows per env oldest first (wrapped rings),
episode ends, terminated / truncated from dones and timeouts, optimize_memory_usage; refused
without trust=True (a pickle that would run code is never opened)."""

from __future__ import annotations

import json
import os
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

from stable_baselines3 import DQN, SAC  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402

from trajstore.cli import main  # noqa: E402
from trajstore.errors import (  # noqa: E402
    BadOptionError,
    ForeignFileError,
    NotATrajstoreError,
    UnsupportedSpaceError,
)
from trajstore.interop import import_sb3_replay_buffer  # noqa: E402
from trajstore.maintenance.verify import verify_store  # noqa: E402
from trajstore.metadata import get_dataset_info  # noqa: E402


def _episode_lengths(ends: np.ndarray) -> list[int]:
    """Lengths of episodes of one env's stream whose ends are ``ends`` (last row always ends)."""
    ends = ends.copy()
    ends[-1] = True
    cut = np.flatnonzero(ends) + 1
    return np.diff(np.concatenate([[0], cut])).tolist()


@pytest.fixture(scope="module")
def cartpole(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DQN]:
    """DQN on 2 CartPole envs, 75 slots per env, 210 steps per env: the ring wrapped twice."""
    d = tmp_path_factory.mktemp("sb3")
    env = make_vec_env("CartPole-v1", n_envs=2, seed=0)
    model = DQN("MlpPolicy", env, buffer_size=150, learning_starts=10**6, seed=0)
    model.learn(420)
    model.save_replay_buffer(d / "cartpole")  # SB3 adds .pkl
    return d / "cartpole.pkl", model


def test_import_wrapped_multi_env_ring(cartpole: tuple[Path, DQN], tmp_path: Path) -> None:
    path, model = cartpole
    rb = model.replay_buffer
    assert rb.full and rb.pos > 0
    order = np.concatenate([np.arange(rb.pos, rb.buffer_size), np.arange(rb.pos)])
    with import_sb3_replay_buffer(path, tmp_path / "s", trust=True) as buf:
        assert len(buf) == rb.buffer_size * rb.n_envs
        col = lambda k: np.asarray(buf.get_column(["step_data", k])[:])  # noqa: E731
        want_lengths: list[int] = []
        for env in range(rb.n_envs):
            rows = slice(env * rb.buffer_size, (env + 1) * rb.buffer_size)
            np.testing.assert_array_equal(col("obs")[rows], rb.observations[order, env])
            np.testing.assert_array_equal(col("next_obs")[rows], rb.next_observations[order, env])
            np.testing.assert_array_equal(col("action")[rows], rb.actions[order, env])
            np.testing.assert_array_equal(col("reward")[rows], rb.rewards[order, env].astype(np.float64))
            done, tout = rb.dones[order, env] != 0, rb.timeouts[order, env] != 0
            np.testing.assert_array_equal(col("terminated")[rows], done & ~tout)
            np.testing.assert_array_equal(col("truncated")[rows], done & tout)
            want_lengths += _episode_lengths(done)
        assert buf.episodes()["length"].tolist() == want_lengths
        info = get_dataset_info(buf)["imported_from"]
        assert info["class"] == "ReplayBuffer" and info["n_envs"] == 2 and info["full"] is True
    assert verify_store(tmp_path / "s").ok


def test_timeouts_become_truncated(tmp_path: Path) -> None:
    """Pendulum ends every episode by its 200-step time limit: SB3 stores dones and timeouts."""
    model = SAC("MlpPolicy", "Pendulum-v1", buffer_size=1000, learning_starts=10**6, seed=0)
    model.learn(450)
    model.save_replay_buffer(tmp_path / "pendulum.pkl")
    with import_sb3_replay_buffer(tmp_path / "pendulum.pkl", tmp_path / "s", trust=True) as buf:
        assert len(buf) == 450
        assert np.flatnonzero(np.asarray(buf.get_column(["step_data", "truncated"])[:])).tolist() == [199, 399]
        assert not np.asarray(buf.get_column(["step_data", "terminated"])[:]).any()
        assert buf.episodes()["length"].tolist() == [200, 200, 50]
        ret = np.asarray(buf.get_column(["episode_data", "return"])[:])[[0, 200, 400]]
        np.testing.assert_allclose(ret, [model.replay_buffer.rewards[a:b, 0].astype(np.float64).sum()
                                         for a, b in ((0, 200), (200, 400), (400, 450))])


def test_optimize_memory_usage_has_no_next_obs(tmp_path: Path) -> None:
    model = DQN("MlpPolicy", "CartPole-v1", buffer_size=300, learning_starts=10**6, seed=1,
                optimize_memory_usage=True, replay_buffer_kwargs={"handle_timeout_termination": False})
    model.learn(120)
    model.save_replay_buffer(tmp_path / "opt.pkl")
    with import_sb3_replay_buffer(tmp_path / "opt.pkl", tmp_path / "s", trust=True) as buf:
        assert "next_obs" not in buf.step_space.spaces and len(buf) == 120
        np.testing.assert_array_equal(np.asarray(buf.get_column(["step_data", "obs"])[:]),
                                      model.replay_buffer.observations[:120, 0])


class _Marker:
    """Unpickling this creates a file: stands for code a hostile pickle would run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def test_refused_without_trust_and_nothing_runs(tmp_path: Path, cartpole: tuple[Path, DQN]) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(_Marker(str(marker)), protocol=4))
    with pytest.raises(BadOptionError, match="unpickling runs code.*trust=True"):
        import_sb3_replay_buffer(tmp_path / "evil.pkl", tmp_path / "s")
    assert not marker.exists() and not (tmp_path / "s").exists()
    with pytest.raises(BadOptionError, match="trust=True"):
        import_sb3_replay_buffer(cartpole[0], tmp_path / "s")
    (tmp_path / "text.pkl").write_text("observations: 1")
    with pytest.raises(NotATrajstoreError, match="not a pickle"):
        import_sb3_replay_buffer(tmp_path / "text.pkl", tmp_path / "s", trust=True)
    (tmp_path / "dict.pkl").write_bytes(pickle.dumps({"observations": np.zeros(3)}, protocol=4))
    with pytest.raises(UnsupportedSpaceError, match="holds a builtins.dict; expected SB3's ReplayBuffer"):
        import_sb3_replay_buffer(tmp_path / "dict.pkl", tmp_path / "s", trust=True)
    (tmp_path / "cut.pkl").write_bytes(cartpole[0].read_bytes()[:2000])
    with pytest.raises(NotATrajstoreError, match="cannot be unpickled"):
        import_sb3_replay_buffer(tmp_path / "cut.pkl", tmp_path / "s", trust=True)
    assert not (tmp_path / "s").exists()
    assert not [p for p in tmp_path.iterdir() if "trajstore-partial" in p.name]


def test_special_files_are_refused_before_any_read(tmp_path: Path) -> None:
    """A FIFO or a device named as the pickle is refused by the foreign gate (ForeignFileError)
    before a read: a plain ``open`` of a FIFO blocks until a writer appears (a hung import)."""
    fifo = tmp_path / "buffer.pkl"
    os.mkfifo(fifo)
    got: list[BaseException] = []

    def run() -> None:
        try:
            import_sb3_replay_buffer(fifo, tmp_path / "s", trust=True)
        except BaseException as e:  # noqa: BLE001  # handed to the test thread
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():  # blocked in open(): a writer releases it, and the test fails
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("import_sb3_replay_buffer blocked on a FIFO")
    assert len(got) == 1 and isinstance(got[0], ForeignFileError) and "FIFO" in str(got[0])
    with pytest.raises(ForeignFileError, match="device"):
        import_sb3_replay_buffer("/dev/zero", tmp_path / "s", trust=True)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("trust", ["no", "false", "False", "0", 1, np.True_, [True], "yes"])
def test_trust_that_is_not_true_never_unpickles(tmp_path: Path, trust: object) -> None:
    """Only ``trust is True`` unpickles: a truthy string ("no", "false"), 1 or numpy's True is
    refused with BadOptionError before the file is opened (the pickle's ``__reduce__`` would create
    the canary file), and False / None give the "pass trust=True" refusal."""
    canary = tmp_path / "canary"
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps(_Marker(str(canary)), protocol=4))
    with pytest.raises(BadOptionError, match=r"trust must be True or False; got .*Nothing was read"):
        import_sb3_replay_buffer(evil, tmp_path / "s", trust=trust)
    with pytest.raises(BadOptionError, match="trust must be True or False"):
        import_sb3_replay_buffer(tmp_path / "missing.pkl", tmp_path / "s", trust=trust)  # before any look at the file
    for no in (False, None):
        with pytest.raises(BadOptionError, match="unpickling runs code.*trust=True"):
            import_sb3_replay_buffer(evil, tmp_path / "s", trust=no)
    assert not canary.exists() and not (tmp_path / "s").exists()
    with pytest.raises(UnsupportedSpaceError, match="holds a _io.TextIOWrapper"):
        import_sb3_replay_buffer(evil, tmp_path / "s", trust=True)  # unpickled: the canary proves the test can fail
    assert canary.exists()


def test_cli_import_sb3(cartpole: tuple[Path, DQN], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import", "sb3", str(cartpole[0]), str(tmp_path / "s")]) == 1
    assert "--trust" in capsys.readouterr().err
    assert main(["import", "sb3", str(cartpole[0]), str(tmp_path / "s"), "--trust", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "sb3" and out["steps"] == 150 and out["verified"] is True
    assert main(["import", "d4rl", str(cartpole[0]), str(tmp_path / "t"), "--trust"]) == 2
    assert "--trust applies to sb3 imports only" in capsys.readouterr().err
