"""Errors a new user provokes in the first hour name the path, the field and the fix, and are
``trajstore.errors`` types (issue 13, "Errors that guide")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import gymnasium as gym
import numpy as np
import pytest

from trajstore import ReplayBuffer, TrajectoryReplayBuffer, errors
from trajstore.demo import record_demo

SPACE = gym.spaces.Dict({"obs": gym.spaces.Box(-1, 1, (3,), np.float32), "action": gym.spaces.Discrete(2)})


@pytest.fixture
def text_file(tmp_path) -> str:
    p = tmp_path / "file.txt"
    p.write_text("not a store\n")
    return str(p)


# -- a regular file where a store is expected ------------------------------------------------
@pytest.mark.parametrize("open_it", [
    lambda p: ReplayBuffer.load_from(p),
    lambda p: ReplayBuffer.load_from(p, read_only=True),
    lambda p: TrajectoryReplayBuffer.load_from(p),
    lambda p: TrajectoryReplayBuffer.load_from(p, read_only=True),
    lambda p: ReplayBuffer.create(SPACE, cache_path=p),
    lambda p: ReplayBuffer.create(SPACE, cache_path=p, overwrite=True),
    lambda p: TrajectoryReplayBuffer.create(SPACE, cache_path=p),
], ids=["rb-load", "rb-load-ro", "trb-load", "trb-load-ro", "rb-create", "rb-create-overwrite", "trb-create"])
def test_a_file_is_not_a_store(text_file, open_it):
    with pytest.raises(errors.NotATrajstoreError) as ei:
        open_it(text_file)
    msg = str(ei.value)
    assert text_file in msg and "is a file, not a trajstore store" in msg
    assert "folder" in msg and ".zip" in msg and "URL" in msg  # what a store is: the fix
    with open(text_file) as f:
        assert f.read() == "not a store\n"  # untouched


@pytest.mark.parametrize("open_it", [
    lambda p: ReplayBuffer.load_from(p),
    lambda p: ReplayBuffer.create(SPACE, cache_path=p),
    lambda p: TrajectoryReplayBuffer.create(SPACE, cache_path=p),
], ids=["rb-load", "rb-create", "trb-create"])
def test_a_path_under_a_file(text_file, open_it):
    """``file.txt/sub``: the OS would say ``[Errno 20] Not a directory``; the error names the file."""
    with pytest.raises(errors.NotATrajstoreError) as ei:
        open_it(os.path.join(text_file, "sub"))
    msg = str(ei.value)
    assert os.path.join(text_file, "sub") in msg and f"parent {text_file!r} is a file" in msg


def test_cli_info_on_a_file(text_file):
    r = subprocess.run([sys.executable, "-m", "trajstore", "info", text_file], capture_output=True, text=True)
    assert r.returncode != 0
    assert "Errno" not in r.stderr and "Traceback" not in r.stderr
    assert text_file in r.stderr and "is a file, not a trajstore store" in r.stderr


# -- the path passed positionally into storage_cls --------------------------------------------
@pytest.mark.parametrize("cls", [ReplayBuffer, TrajectoryReplayBuffer])
@pytest.mark.parametrize("path", ["runs/x", "pathlib"])
def test_path_given_as_storage_cls(tmp_path, cls, path):
    import pathlib

    where = pathlib.Path(tmp_path / "x") if path == "pathlib" else "runs/x"
    with pytest.raises(errors.BadArgumentError) as ei:
        cls.create(SPACE, where)
    assert isinstance(ei.value, TypeError)  # what the check raised before: callers catching it still do
    msg = str(ei.value)
    assert "storage_cls" in msg and f"cache_path={os.fspath(where)!r}" in msg
    assert not os.path.exists("runs/x") and not (tmp_path / "x").exists()  # nothing created


def test_other_storage_cls_still_refused():
    with pytest.raises(errors.BadArgumentError, match="storage_cls must be None or trajstore.ZarrStorage"):
        ReplayBuffer.create(SPACE, dict)


# -- dataset fields ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_store(tmp_path_factory) -> str:
    return record_demo(str(tmp_path_factory.mktemp("demo") / "cartpole"), episodes=2)


@pytest.mark.parametrize("which", ["TransitionDataset", "SequenceDataset"])
@pytest.mark.parametrize("field", ["observation", "obs/x", "episode_data/return"])
def test_unknown_dataset_field_lists_the_fields(demo_store, which, field):
    pytest.importorskip("torch")
    import trajstore.torch as tt

    make = (lambda: tt.TransitionDataset(demo_store, fields=["reward", field])) if which == "TransitionDataset" \
        else (lambda: tt.SequenceDataset(demo_store, 4, fields=[field]))
    with pytest.raises(errors.UnknownFieldError) as ei:
        make()
    assert isinstance(ei.value, KeyError)  # as before, for callers that catch KeyError
    msg = str(ei.value)
    assert not msg.startswith("'")  # shown as a sentence, not a quoted KeyError repr
    assert demo_store in msg and repr(field) in msg
    for name in ("obs", "action", "reward", "next_obs", "terminated", "truncated"):
        assert repr(name) in msg


def test_unknown_field_of_a_trajectory_store(tmp_path):
    pytest.importorskip("torch")
    from trajstore.torch import TransitionDataset

    step = gym.spaces.Dict({"obs": gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,), np.float32),
                                                    "tag": gym.spaces.Tuple([gym.spaces.Discrete(3)])})})
    path = str(tmp_path / "traj")
    with TrajectoryReplayBuffer.create(step, cache_path=path,
                                       episode_data_instance_space=gym.spaces.Dict({"ret": gym.spaces.Box(0, 1, ())})) as b:
        b.append(step.sample())
    assert TransitionDataset(path, ["obs/tag/0", "episode_data/ret"]).fields == ["obs/tag/0", "episode_data/ret"]
    for bad in ("obs/tag/1", "obs/vel", "episode_data/return", "step_data/obs"):
        with pytest.raises(errors.UnknownFieldError) as ei:
            TransitionDataset(path, [bad])
        msg = str(ei.value)
        assert repr(bad) in msg and "'obs/pos', 'obs/tag/0'" in msg and "'episode_data/ret'" in msg

    no_ep = str(tmp_path / "no_ep")
    with TrajectoryReplayBuffer.create(step, cache_path=no_ep) as b:
        b.append(step.sample())
    with pytest.raises(errors.UnknownFieldError, match="no episode data"):
        TransitionDataset(no_ep, ["episode_data/ret"])


def test_unnamed_rows_say_use_fields_none(tmp_path):
    pytest.importorskip("torch")
    from trajstore.torch import TransitionDataset

    path = str(tmp_path / "box")
    with ReplayBuffer.create(gym.spaces.Box(0, 1, (2,), np.float32), cache_path=path) as b:
        b.append(np.zeros(2, np.float32))
    with pytest.raises(errors.UnknownFieldError, match="fields=None"):
        TransitionDataset(path, ["obs"])


# -- trajstore.torch without torch -----------------------------------------------------------
def test_import_trajstore_torch_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # import torch now raises ImportError, as when not installed
        import trajstore
        from trajstore import errors
        try:
            import trajstore.torch
        except errors.MissingDependencyError as e:
            assert isinstance(e, ImportError)
            print("MSG:", e)
        else:
            raise SystemExit("imported without torch")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "trajstore.torch needs torch" in r.stdout and "pip install 'trajstore[torch]'" in r.stdout


def test_optional_dependencies_are_probed_in_one_place() -> None:
    """``trajstore._optional``: tensors recognized without importing torch, and a missing optional
    module named with the pip extra that installs it."""
    import torch

    from trajstore._optional import EXTRAS, is_tensor, missing, to_numpy
    from trajstore.errors import MissingDependencyError

    t = torch.arange(3)
    assert is_tensor(t) and not is_tensor(np.arange(3)) and not is_tensor([0, 1, 2])
    assert to_numpy(t).tolist() == [0, 1, 2] and to_numpy((1, 2)).tolist() == [1, 2]
    EXTRAS["trajstore_no_such_module"] = "nothing"
    try:
        with pytest.raises(MissingDependencyError, match=r"the frobnicator needs trajstore-no-such-module: "
                                                         r"pip install 'trajstore\[nothing\]'"):
            try:
                import trajstore_no_such_module.sub  # noqa: F401
            except ImportError:
                raise missing("trajstore_no_such_module.sub", "the frobnicator") from None
    finally:
        del EXTRAS["trajstore_no_such_module"]


def _closed_buffer() -> ReplayBuffer:
    rb = ReplayBuffer.create(gym.spaces.Discrete(3))
    rb.close()
    return rb


def _closed_trajectory() -> TrajectoryReplayBuffer:
    tb = TrajectoryReplayBuffer.create(gym.spaces.Discrete(3))
    tb.close()
    return tb


def test_writes_to_a_closed_store_raise_and_touch_nothing(tmp_path) -> None:
    """Writes after close() were accepted and lost (append, extend) or wrote a commit record after
    the writer lock was released (clear): each must raise ClosedError and leave the files alone."""
    for cls in (ReplayBuffer, TrajectoryReplayBuffer):
        path = tmp_path / cls.__name__
        rb = cls.create(gym.spaces.Discrete(3), cache_path=path)
        rb.extend(np.array([0, 1, 2]))
        rb.close()
        before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
        for write in (lambda: rb.append(1), lambda: rb.extend(np.array([1])), lambda: rb.set_at(0, 2),
                      lambda: rb.remove_at(0), lambda: rb.clear(), lambda: rb.append_flattened(np.eye(3)[1])):
            with pytest.raises(errors.ClosedError):
                write()
        assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
        with cls.load_from(path, read_only=True) as ro:
            assert len(ro) == 3


# (call, trajstore type, the builtin it also is, words the message must hold)
_ARGUMENT_ERRORS = {
    "capacity-zero": (lambda: ReplayBuffer.create(gym.spaces.Discrete(3), capacity=0),
                      errors.BadOptionError, ValueError, "capacity must be a positive int"),
    "chunk-rows-zero": (lambda: ReplayBuffer.create(gym.spaces.Discrete(3), chunk_rows=0),
                        errors.BadOptionError, ValueError, "chunk_rows"),
    "unknown-option": (lambda: ReplayBuffer.create(gym.spaces.Discrete(3), chunkrows=8),
                       errors.BadArgumentError, TypeError, "unexpected storage option(s) ['chunkrows']"),
    "backend": (lambda: ReplayBuffer.create(gym.spaces.Discrete(3), backend="jax"),
                errors.BadOptionError, ValueError, "backend must be 'numpy' or 'torch'; got 'jax'"),
    "compressor": (lambda: ReplayBuffer.create(gym.spaces.Discrete(3), compressor="brotli"),
                   errors.BadOptionError, ValueError, "compressor must be None, 'lz4', 'zstd'"),
    "closed-append": (lambda: _closed_buffer().append(1), errors.ClosedError, ValueError, "closed buffer"),
    "closed-extend": (lambda: _closed_buffer().extend(np.array([1, 2])), errors.ClosedError, ValueError, "closed"),
    "closed-clear": (lambda: _closed_buffer().clear(), errors.ClosedError, ValueError, "closed"),
    "closed-trajectory-append": (lambda: _closed_trajectory().append(1), errors.ClosedError, ValueError, "closed"),
    "trajectory-capacity": (lambda: TrajectoryReplayBuffer.create(gym.spaces.Discrete(3), step_data_capacity=-1),
                            errors.BadOptionError, ValueError, "must be a positive int or None"),
    "unknown-episode": (lambda: TrajectoryReplayBuffer.create(
        gym.spaces.Discrete(3), episode_data_instance_space=gym.spaces.Discrete(2)).episode_id_to_episode_data_index(7),
        errors.UnknownEpisodeError, KeyError, "no episode data for episode id(s) [7]"),
    # what the CLI's summaries (trajstore episodes/head/stats) raise
    "summary-no-episodes": (lambda: _summary("episode_table"), errors.NoEpisodesError, ValueError,
                            "no terminated/truncated (or done) fields"),
    "summary-unknown-field": (lambda: _summary("select_fields", "nope"), errors.UnknownFieldError, KeyError,
                              "no array matches field 'nope'"),
    "summary-unknown-episode": (lambda: _summary("episode_rows", 7, kind="trajectory"), errors.UnknownEpisodeError,
                                KeyError, "episode 7 has no steps in the store"),
    "summary-reward-field": (lambda: _summary("episode_table", "obs", kind="trajectory"), errors.UnknownFieldError,
                             KeyError, "--reward-field 'obs' must name one scalar step field"),
}


def _summary(fn: str, *args: object, kind: str = "replay") -> object:
    """``trajstore.maintenance.summary.<fn>(store, *args)`` on a small store of ``kind``."""
    import tempfile

    from trajstore.maintenance import summary

    path = tempfile.mkdtemp() + "/s"
    space = gym.spaces.Dict({"obs": gym.spaces.Box(-1, 1, (3,), np.float32)})
    cls = ReplayBuffer if kind == "replay" else TrajectoryReplayBuffer
    with cls.create(space, cache_path=path) as b:
        b.extend({"obs": np.zeros((4, 3), np.float32)})
    store = summary.open_store(path)
    try:
        return getattr(summary, fn)(store, *args)
    finally:
        store.close()


@pytest.mark.parametrize("case", list(_ARGUMENT_ERRORS))
def test_argument_errors_are_trajstore_types_and_keep_their_builtin(case: str) -> None:
    call, kind, builtin, words = _ARGUMENT_ERRORS[case]
    with pytest.raises(kind) as info:
        call()
    assert isinstance(info.value, builtin) and isinstance(info.value, errors.TrajstoreError)
    assert words in str(info.value), str(info.value)
