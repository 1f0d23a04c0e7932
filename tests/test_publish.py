"""Publishing a new store over an old one (issue 37 sections 4 and 6): every overwriting command,
killed right in its replace window or at a random instant, leaves each destination opening and
verifying as either its old store or its new one, and the next operation on it completes what the
kill left; a full disk in every copy path is a StoreFullError naming the destination, with
nothing left behind.

Kills are real SIGKILLs of a child (``_publish_workers``, forked from a server that has imported
trajstore) that stops at the chosen instant by wrapping the publish module's own steps in that
child; nothing in the package has a test hook.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr.storage._local as zarr_local
from gymnasium.spaces import Box, Dict

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _publish_workers as P  # noqa: E402
import _workers as W  # noqa: E402

from trajstore import TrajectoryReplayBuffer, verify_store  # noqa: E402
from trajstore.cli import main  # noqa: E402
from trajstore.errors import StoreExistsError, StoreFullError  # noqa: E402
from trajstore.maintenance.combine import combine, filter_store, split  # noqa: E402
from trajstore.storage import _replace, publish  # noqa: E402

STEP = Box(-1, 1, (3,), np.float32)
EPISODE = Dict({"ret": Box(-np.inf, np.inf, (), np.float64)})
OLD = 11  # episodes of every old store a destination starts with
A, B, D4RL = 4, 3, 6  # episodes of the sources and of the D4RL file


def _store(path: Path, episodes: int, length: int = 5) -> None:
    with TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EPISODE, cache_path=path) as buf:
        for e in range(episodes):
            buf.extend(np.full((length, 3), e / 100, np.float32))
            buf.set_current_episode_data({"ret": np.float64(e)})
            buf.mark_episode_end()


def _d4rl(path: Path, episodes: int) -> None:
    import h5py

    n = episodes * 4
    term = np.zeros(n, bool)
    term[3::4] = True
    with h5py.File(path, "w") as f:
        f.create_dataset("observations", data=np.zeros((n, 3), np.float32))
        f.create_dataset("actions", data=np.zeros((n, 2), np.float32))
        f.create_dataset("rewards", data=np.ones(n, np.float32))
        f.create_dataset("terminals", data=term)
        f.create_dataset("timeouts", data=np.zeros(n, bool))


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sources")
    _store(root / "a", A)
    _store(root / "b", B)
    _store(root / "old", OLD)
    _d4rl(root / "d.hdf5", D4RL)
    return root


#: op -> (sources (names under the fixture folder), destinations (names under the test folder),
#: episodes of each new store)
OPS: dict[str, tuple[list[str], list[str], list[int]]] = {
    "combine": (["a", "b"], ["out"], [A + B]),
    "filter": (["a"], ["out"], [A]),
    "split": (["a"], ["s_train", "s_val"], [A // 2, A - A // 2]),
    "import": (["d.hdf5"], ["out"], [D4RL]),
    "dumps": (["a"], ["out"], [A]),
}


def _base(op: str) -> str:
    return op.removeprefix("cli-").replace("copy", "dumps")


def _start(op: str, sources: Path, folder: Path, stop: str, procs: list) -> tuple[Any, list[Path], list[int], str]:
    """Old stores at the destinations, then the child running ``op`` (stopping at ``stop``)."""
    srcs, dsts, new = OPS[_base(op)]
    out = [folder / d for d in dsts]
    for d in out:
        shutil.copytree(sources / "old", d)
    args = [str(sources / s) for s in srcs] + ([str(folder / "s_")] if _base(op) == "split" else [str(out[0])])
    ready = str(folder / f"ready-{op}-{stop}")
    p = W.start(P.run, op, args, stop, ready)
    procs.append(p)
    return p, out, new, ready


def _state(d: Path, new: int) -> str:
    """"old", "new" or "missing"; a store there must open and verify."""
    if not os.path.lexists(d):
        return "missing"
    rep = verify_store(d)
    assert rep.ok, f"{d}: {[f.message for f in rep.faults]}"
    with TrajectoryReplayBuffer.load_from(d, read_only=True) as ro:
        n = len(ro.episodes()["episode_id"])
    assert n in (OLD, new), f"{d} holds {n} episodes: neither the old store ({OLD}) nor the new one ({new})"
    return "old" if n == OLD else "new"


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".trajstore-" in p.name)


def _next_operation(sources: Path, dst: Path) -> list[str]:
    """An operation on ``dst`` (a combine without overwrite, refused since a store is there) after
    a kill; returns the PublishRecoveredWarning messages it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(StoreExistsError):
            combine([sources / "a"], dst)
    return [str(w.message) for w in caught if issubclass(w.category, publish.PublishRecoveredWarning)]


#: (op, stop) -> the state of each destination the kill must leave
CASES = {
    ("combine", "journal"): ["old"], ("combine", "exchanged"): ["new"], ("combine", "aside"): ["missing"],
    ("cli-combine", "journal"): ["old"], ("cli-combine", "exchanged"): ["new"],
    ("filter", "journal"): ["old"], ("cli-filter", "exchanged"): ["new"], ("cli-filter", "aside"): ["missing"],
    ("split", "journal"): ["old", "old"], ("split", "exchanged"): ["new", "old"], ("split", "second"): ["new", "old"],
    ("split", "aside"): ["missing", "old"], ("cli-split", "second"): ["new", "old"],
    ("import", "journal"): ["old"], ("import", "exchanged"): ["new"], ("cli-import", "aside"): ["missing"],
    ("dumps", "journal"): ["old"], ("dumps", "exchanged"): ["new"], ("dumps", "aside"): ["missing"],
    ("cli-copy", "journal"): ["old"], ("cli-copy", "exchanged"): ["new"],
}


@pytest.mark.parametrize("op,stop", list(CASES), ids=[f"{o}-{s}" for o, s in CASES])
def test_a_kill_in_the_replace_window_leaves_old_or_new_and_the_next_operation_completes_it(
        sources: Path, tmp_path: Path, procs: list, op: str, stop: str) -> None:
    """SIGKILL at the chosen instant of the publish: each destination opens and verifies as its old
    or its new store (``aside``, the portable path where the filesystem cannot exchange: the
    destination is missing for the instant between its two renames), the new store waits under its
    temporary name with the journal, and the next operation on the destination puts every new
    store of the journal into place (reported with a PublishRecoveredWarning) and removes the old
    ones: nothing verified is ever deleted."""
    if stop in ("journal", "exchanged", "second") and _replace._renameat2 is None:
        pytest.skip("no renameat2 here: publishing takes the portable path")
    p, dsts, new, ready = _start(op, sources, tmp_path, stop, procs)
    W.wait_for_file(ready, p)
    W.kill(p)
    procs.remove(p)
    got = [_state(d, n) for d, n in zip(dsts, new)]
    assert got == CASES[(op, stop)], got
    left = _leftovers(tmp_path)
    assert any(".trajstore-publish-" in n for n in left), left  # the journal: the kill is recoverable
    reported = _next_operation(sources, dsts[-1])
    assert [_state(d, n) for d, n in zip(dsts, new)] == ["new"] * len(dsts)
    assert _leftovers(tmp_path) == [], _leftovers(tmp_path)  # old stores and journal removed
    assert bool(reported) == (got != ["new"] * len(dsts)), reported  # reported when it put a store in place


def test_a_rerun_of_a_killed_split_completes_it(sources: Path, tmp_path: Path, procs: list) -> None:
    """split killed between its outputs (train new, val old), then run again: both new."""
    p, dsts, new, ready = _start("split", sources, tmp_path, "second", procs)
    W.wait_for_file(ready, p)
    W.kill(p)
    procs.remove(p)
    assert [_state(d, n) for d, n in zip(dsts, new)] == ["new", "old"]
    with pytest.warns(publish.PublishRecoveredWarning, match="s_val: completed the publish"):
        split(sources / "a", {"train": 0.5, "val": 0.5}, tmp_path / "s_", overwrite=True, tqdm=False)
    assert [_state(d, n) for d, n in zip(dsts, new)] == ["new", "new"] and _leftovers(tmp_path) == []


@pytest.mark.slow
def test_random_kills_of_overwriting_commands(sources: Path, tmp_path: Path, procs: list) -> None:
    """Every overwriting command killed at random instants (30 rounds, from half way through to a
    little past its usual end, where the publish is): each destination always
    opens and verifies as its old or its new store, and after the next operation on it as well."""
    rng = np.random.default_rng(37)
    ops = ["combine", "cli-combine", "filter", "cli-filter", "split", "cli-split", "import", "dumps", "cli-copy"]
    seen: dict[str, int] = {"old": 0, "new": 0}
    took: dict[str, float] = {}  # each command's time, run once to its end first
    killed = 0
    for r in range(len(ops) + 30):
        op = ops[r % len(ops)]
        folder = tmp_path / f"r{r}"
        folder.mkdir()
        p, dsts, new, ready = _start(op, sources, folder, "none", procs)
        W.wait_for_file(ready, p)
        if op not in took:
            t0 = time.monotonic()
            p.join(60)
            took[op] = time.monotonic() - t0
        time.sleep(rng.uniform(0.5, 1.1) * took[op])  # around the end, where the publish is
        with contextlib.suppress(ProcessLookupError):  # (it may just have finished)
            os.kill(p.pid, signal.SIGKILL)
        p.join(20)
        assert p.exitcode in (0, -signal.SIGKILL), f"{op} exited {p.exitcode}"
        killed += p.exitcode == -signal.SIGKILL
        if p.exitcode == 0:  # it ran faster than its first run (a load that eased): aim earlier next time
            took[op] *= 0.7
        procs.remove(p)
        for d, n in zip(dsts, new):
            seen[_state(d, n)] += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", publish.PublishRecoveredWarning)
            with pytest.raises(StoreExistsError):
                combine([sources / "a"], dsts[-1])
        for d, n in zip(dsts, new):
            assert _state(d, n) in ("old", "new")
        assert not [n for n in _leftovers(folder) if ".trajstore-publish-" in n]
    print(f"random kills: {killed} killed, destinations found {seen}")
    assert seen["old"] and seen["new"] and killed >= 10, (seen, killed)  # kills before and after the publish


# -- the primitive -----------------------------------------------------------------------------------
@pytest.mark.parametrize("portable", [False, True])
def test_publish_swaps_a_folder_or_a_file_and_removes_the_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               portable: bool) -> None:
    if portable:
        monkeypatch.setattr(_replace, "_renameat2", None)
    for kind in ("folder", "file"):
        dst = str(tmp_path / kind)
        new = publish.partial_path(dst)
        if kind == "folder":
            os.mkdir(dst)
            Path(dst, "old").write_text("old")
            os.mkdir(new)
            Path(new, "new").write_text("new")
        else:
            Path(dst).write_text("old")
            Path(new).write_text("new")
        ino = os.lstat(new).st_ino
        publish.publish([(new, dst)], overwrite=True)
        assert os.lstat(dst).st_ino == ino and not os.path.lexists(new)
    assert sorted(os.listdir(tmp_path)) == ["file", "folder"]
    assert os.listdir(tmp_path / "folder") == ["new"] and (tmp_path / "file").read_text() == "new"
    # Without overwrite, something non-empty that appeared meanwhile is kept, the new store waits.
    new = publish.partial_path(str(tmp_path / "folder"))
    os.mkdir(new)
    with pytest.raises(StoreExistsError, match="appeared there"):
        publish.publish([(new, str(tmp_path / "folder"))], overwrite=False)
    assert os.listdir(tmp_path / "folder") == ["new"] and os.path.isdir(new)


def test_overwrite_through_the_portable_path(sources: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the filesystem cannot exchange: combine --overwrite, split and dumps still end with the
    new stores in place and nothing beside them."""
    monkeypatch.setattr(_replace, "_renameat2", None)
    for d in ("out", "s_train", "s_val", "copy"):
        shutil.copytree(sources / "old", tmp_path / d)
    combine([sources / "a", sources / "b"], tmp_path / "out", overwrite=True, tqdm=False)
    split(sources / "a", {"train": 0.5, "val": 0.5}, tmp_path / "s_", overwrite=True, tqdm=False)
    with TrajectoryReplayBuffer.load_from(sources / "a", read_only=True) as buf:
        buf.dumps(tmp_path / "copy", progress=False)
    assert [_state(tmp_path / d, n) for d, n in (("out", A + B), ("s_train", 2), ("s_val", 2), ("copy", A))] == \
        ["new"] * 4
    assert _leftovers(tmp_path) == []


def test_a_torn_or_foreign_journal_is_never_followed(tmp_path: Path) -> None:
    """A dead process's journal that is torn (killed while writing it: nothing was published) is
    removed; one naming entries outside its rules (another folder, names that are not temporary
    names of the destination) is reported and left, and nothing it names is touched."""
    dead = _dead_pid()
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("keep")
    outside = tmp_path / "outside"
    outside.mkdir()
    torn = tmp_path / f".out.trajstore-publish-{publish.HOST}-{dead}-0123abcd.json"
    torn.write_text('{"overwrite": true, "pairs": [{"partial"')
    foreign = tmp_path / f".out.trajstore-publish-{publish.HOST}-{dead}-4567abcd.json"
    ino = os.lstat(outside)
    foreign.write_text(json.dumps({"overwrite": True, "pairs": [
        {"partial": "../outside", "destination": "out", "dev": ino.st_dev, "ino": ino.st_ino, "aside": "x"}]}))
    with pytest.warns(publish.PublishRecoveredWarning, match="not a publish journal"):
        publish.recover(str(dst))
    assert not torn.exists() and foreign.exists()
    assert (dst / "keep").read_text() == "keep" and outside.is_dir()


def test_a_journal_nested_past_the_parsers_depth_is_not_followed(tmp_path: Path) -> None:
    """A journal file of nested brackets (under the size bound) is not one of ours: no
    RecursionError escapes recover, and the destination is untouched."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("keep")
    bomb = tmp_path / f".out.trajstore-publish-{publish.HOST}-{_dead_pid()}-89abcdef.json"
    bomb.write_text("[" * 200_000)
    publish.recover(str(dst))
    assert (dst / "keep").read_text() == "keep"


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# -- a full disk in every copy path ------------------------------------------------------------------
def _fail_partial_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes into a store being built (a temporary name) fail with ENOSPC, as on a full disk:
    zarr's local writes (the first is the new store's metadata) and the creation of files there
    (a byte copy's files, a writer's lock file)."""
    real_put, real_open = zarr_local._put, os.open

    def put(path: Any, *args: Any, **kwargs: Any) -> Any:
        if ".trajstore-partial-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(path, *args, **kwargs)

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT and ".trajstore-partial-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(zarr_local, "_put", put)
    monkeypatch.setattr(os, "open", open_)


def _dumps(src: Path, dst: Any, **kw: Any) -> None:
    with TrajectoryReplayBuffer.load_from(src, read_only=True) as buf:
        buf.dumps(dst, progress=False, **kw)


def _copy_paths(sources: Path, folder: Path) -> dict[str, Any]:
    """Every copy path, each a callable writing the destination ``folder / name``."""
    from trajstore.interop.d4rl import d4rl_to_store

    a, b = str(sources / "a"), str(sources / "b")
    return {
        "combine": lambda name: combine([a, b], folder / name, tqdm=False),
        "split": lambda name: split(a, {"train": 0.5, "val": 0.5}, folder / f"{name}_", tqdm=False),
        "filter": lambda name: filter_store(a, folder / name, "length >= 0", tqdm=False),
        "import": lambda name: d4rl_to_store(sources / "d.hdf5", folder / name, tqdm=False),
        "dumps": lambda name: _dumps(sources / "a", folder / name),
        "cli-copy": lambda name: main(["copy", a, str(folder / name), "--json"]),
        "cli-copy-relayout": lambda name: main(["copy", a, str(folder / name), "--compressor", "none", "--json"]),
        "cli-combine": lambda name: main(["combine", a, b, str(folder / name), "--json"]),
    }


def test_full_disk_in_every_copy_path_is_store_full_error_naming_the_destination(
        sources: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """combine, split, filter, an import, dumps to a folder and ``trajstore copy`` (byte copy and
    relayout) on a disk that is full when the new store's metadata is written: StoreFullError (an
    OSError, errno ENOSPC) naming the destination, or the CLI's one line naming it with exit status
    1; nothing is left in the destination's folder, and an old store there is kept."""
    _fail_partial_writes(monkeypatch)
    for name, run in _copy_paths(sources, tmp_path).items():
        shutil.copytree(sources / "old", tmp_path / f"{name}-old")
        before = sorted(os.listdir(tmp_path))
        if name.startswith("cli-"):
            assert run(name) == 1, name
            err = capsys.readouterr().err
            assert str(tmp_path / name) in err and "No space left on device" in err, err
        else:
            with pytest.raises(StoreFullError) as info:
                run(name)
            assert info.value.errno == errno.ENOSPC and str(tmp_path / name) in str(info.value), (name, info.value)
        assert sorted(os.listdir(tmp_path)) == before, (name, _leftovers(tmp_path))
    with pytest.raises(StoreFullError, match="combine-old"):  # an overwrite keeps the old store
        combine([sources / "a"], tmp_path / "combine-old", tqdm=False, overwrite=True)
    assert _state(tmp_path / "combine-old", A) == "old" and _leftovers(tmp_path) == []


def test_a_real_full_disk_in_every_copy_path(tmp_path: Path, small_tmpfs: Any,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The same copy paths from a 6 MiB store into a 3 MiB filesystem (and a .zip): a
    StoreFullError naming the destination wherever the disk fills, and the filesystem empty
    afterwards."""
    tiny_fs = small_tmpfs(3)
    big = tmp_path / "big"
    with TrajectoryReplayBuffer.create(Box(0, 255, (64, 64, 3), np.uint8), episode_data_instance_space=EPISODE,
                                       cache_path=big) as buf:
        rng = np.random.default_rng(0)
        for e in range(4):
            buf.extend(rng.integers(0, 255, (128, 64, 64, 3), dtype=np.uint8))
            buf.set_current_episode_data({"ret": np.float64(e)})
            buf.mark_episode_end()
    runs = {
        "combine": lambda d: combine([big], d, tqdm=False),
        "split": lambda d: split(big, {"train": 0.5, "val": 0.5}, f"{d}_", tqdm=False),
        "filter": lambda d: filter_store(big, d, "length >= 0", tqdm=False),
        "dumps": lambda d: _dumps(big, d),
        "dumps-zip": lambda d: _dumps(big, f"{d}.zip", compressor="none"),
    }
    for name, run in runs.items():
        with pytest.raises(StoreFullError) as info:
            run(tiny_fs / name)
        assert str(tiny_fs / name) in str(info.value), (name, info.value)
        assert os.listdir(tiny_fs) == [], (name, os.listdir(tiny_fs))
    for argv in (["copy", str(big), str(tiny_fs / "c")], ["copy", str(big), str(tiny_fs / "c.zip")],
                 ["combine", str(big), str(tiny_fs / "c")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert argv[-1] in err and "No space left on device" in err, err
        assert os.listdir(tiny_fs) == [], (argv, os.listdir(tiny_fs))
