"""D4RL HDF5 import and export (issue 14): files laid out as D4RL's datasets are, written with
h5py; values and episode boundaries compared with a numpy model; round trips; bad input refused
before anything is written; a damaged file leaves nothing behind; bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.cli import main  # noqa: E402
from trajstore.errors import (  # noqa: E402
    BadValueError,
    DamagedStoreError,
    NotATrajstoreError,
    StoreExistsError,
    StoreNotFoundError,
    UnknownFieldError,
    UnsupportedSpaceError,
)
from trajstore.interop import export_d4rl, import_d4rl  # noqa: E402
from trajstore.maintenance.verify import verify_store  # noqa: E402
from trajstore.metadata import get_dataset_info  # noqa: E402


def _ends(n: int, rng: np.random.Generator, trailing: int = 37) -> tuple[np.ndarray, np.ndarray]:
    """terminals and timeouts of n steps: episodes of random lengths, the last ``trailing`` steps
    unfinished; timeouts every 1000th step of an episode, some terminal."""
    term, tout = np.zeros(n, bool), np.zeros(n, bool)
    i = 0
    while True:
        i += int(rng.integers(1, 1500))
        if i > n - trailing:
            break
        (tout if i % 3 else term)[i - 1] = True
    term[n - trailing - 1] = True
    return term, tout


def write_d4rl(path: Path, n: int = 120_000, *, seed: int = 0, next_obs: bool = True, trailing: int = 37,
               **extra: Any) -> dict[str, np.ndarray]:
    """A D4RL-layout file (hopper-like: 11 float32 obs, 3 float32 actions, infos/qpos, qvel,
    action_log_probs, a metadata group) and its arrays."""
    rng = np.random.default_rng(seed)
    term, tout = _ends(n, rng, trailing)
    data = {"observations": rng.standard_normal((n, 11)).astype(np.float32),
            "actions": rng.uniform(-1, 1, (n, 3)).astype(np.float32),
            "rewards": rng.standard_normal(n).astype(np.float32),
            "terminals": term, "timeouts": tout,
            "infos/qpos": rng.standard_normal((n, 6)), "infos/qvel": rng.standard_normal((n, 6)),
            "infos/action_log_probs": rng.standard_normal(n).astype(np.float32)}
    if next_obs:
        data["next_observations"] = rng.standard_normal((n, 11)).astype(np.float32)
    data.update(extra)
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f.create_dataset(k, data=v)
        f.create_dataset("metadata/algorithm", data="SAC")
        f.attrs["env_name"] = "hopper-medium-v2"
    return data


def episodes_of(term: np.ndarray, tout: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each episode: ends after terminals | timeouts, a trailing one kept."""
    ends = np.flatnonzero(term | tout) + 1
    bounds = [0, *ends.tolist()]
    if bounds[-1] != len(term):
        bounds.append(len(term))
    return [(a, b - a) for a, b in zip(bounds[:-1], bounds[1:])]


def _no_leftovers(parent: Path) -> None:
    assert not [p for p in os.listdir(parent) if "trajstore-partial" in p]


def test_import_d4rl_values_episodes_and_episode_data(tmp_path: Path) -> None:
    data = write_d4rl(tmp_path / "hopper.hdf5")
    buf = import_d4rl(tmp_path / "hopper.hdf5", tmp_path / "store")
    try:
        n = len(data["rewards"])
        assert len(buf) == n
        col = lambda *k: np.asarray(buf.get_column(["step_data", *k])[:])  # noqa: E731
        np.testing.assert_array_equal(col("obs"), data["observations"])
        np.testing.assert_array_equal(col("next_obs"), data["next_observations"])
        np.testing.assert_array_equal(col("action"), data["actions"])
        np.testing.assert_array_equal(col("reward"), data["rewards"].astype(np.float64))
        np.testing.assert_array_equal(col("terminated"), data["terminals"])
        np.testing.assert_array_equal(col("truncated"), data["timeouts"])
        np.testing.assert_array_equal(col("info", "qpos"), data["infos/qpos"])
        np.testing.assert_array_equal(col("info", "action_log_probs"), data["infos/action_log_probs"])
        want = episodes_of(data["terminals"], data["timeouts"])
        table = buf.episodes()
        assert list(zip(table["start"].tolist(), table["length"].tolist())) == want
        assert table["episode_id"].tolist() == list(range(len(want)))
        assert want[-1][1] == 37  # the trailing unfinished episode is kept
        starts = table["start"]  # episode data per step: the value of each episode at its first step
        returns = np.asarray(buf.get_column(["episode_data", "return"])[:])[starts]
        lengths = np.asarray(buf.get_column(["episode_data", "length"])[:])[starts]
        np.testing.assert_allclose(returns, [data["rewards"][a:a + k].astype(np.float64).sum() for a, k in want])
        assert lengths.tolist() == [k for _, k in want]
        assert set(np.asarray(buf.get_column(["episode_data", "seed"])[:]).tolist()) == {-1}
        info = get_dataset_info(buf)["imported_from"]
        assert info["format"] == "d4rl" and info["attrs"] == {"env_name": "hopper-medium-v2"}
    finally:
        buf.close()
    assert verify_store(tmp_path / "store").ok


def test_round_trip_file_store_file_is_identical(tmp_path: Path) -> None:
    write_d4rl(tmp_path / "a.hdf5", 130_000, seed=1)
    import_d4rl(tmp_path / "a.hdf5", tmp_path / "store").close()
    out = export_d4rl(tmp_path / "store", tmp_path / "b.hdf5")
    assert out["verified"] and out["steps"] == 130_000
    with h5py.File(tmp_path / "a.hdf5") as a, h5py.File(tmp_path / "b.hdf5") as b:
        names: list[str] = []
        a.visititems(lambda name, node: names.append(name) if isinstance(node, h5py.Dataset) else None)
        names.remove("metadata/algorithm")  # not step data: not kept
        for name in names:
            assert b[name].dtype == a[name].dtype, name
            np.testing.assert_array_equal(b[name][()], a[name][()], err_msg=name)
    # and back: the same episodes
    again = import_d4rl(tmp_path / "b.hdf5", tmp_path / "store2")
    with again, TrajectoryReplayBuffer.load_from(tmp_path / "store", read_only=True) as first:
        for k in ("start", "length", "episode_id"):
            np.testing.assert_array_equal(again.episodes()[k], first.episodes()[k])


def test_export_marks_episode_ends_that_have_no_flag(tmp_path: Path) -> None:
    """A store whose episodes end without terminated/truncated (e.g. cut by the user) keeps its
    boundaries: the export sets timeouts there; the store's last step is left as it is."""
    import gymnasium
    from gymnasium.spaces import Box, Discrete

    from trajstore.recording import EPISODE_SPACE, step_space

    space = step_space(Box(-1, 1, (2,), np.float32), Discrete(4))
    lengths = [5, 3, 7, 4]
    with TrajectoryReplayBuffer.create(space, episode_data_instance_space=EPISODE_SPACE,
                                       cache_path=tmp_path / "s") as buf:
        for k, n in enumerate(lengths):
            term = np.zeros(n, bool)
            if k == 1:
                term[-1] = True
            buf.extend({"obs": np.full((n, 2), k, np.float32), "action": np.arange(n) % 4,
                        "reward": np.ones(n), "terminated": term, "truncated": np.zeros(n, bool)})
            buf.mark_episode_end()
        assert isinstance(buf.step_space, gymnasium.spaces.Dict)
        out = export_d4rl(buf, tmp_path / "x.hdf5")  # an open buffer as src
    assert out["episodes"] == 4
    with h5py.File(tmp_path / "x.hdf5") as f:
        ends = np.cumsum(lengths) - 1
        assert np.flatnonzero(f["terminals"][()]).tolist() == [ends[1]]
        assert np.flatnonzero(f["timeouts"][()]).tolist() == [ends[0], ends[2]]
        assert f["actions"].dtype == np.int64 and f["actions"].shape == (19,)
        assert f["rewards"].dtype == np.float32 and "next_observations" not in f
    with import_d4rl(tmp_path / "x.hdf5", tmp_path / "back") as back:
        assert back.episodes()["length"].tolist() == lengths


def test_old_file_without_timeouts_or_next_observations(tmp_path: Path) -> None:
    n = 500
    rng = np.random.default_rng(3)
    term = np.zeros(n, np.float32)
    term[[99, 299]] = 1.0  # some old files keep terminals as float 0/1
    with h5py.File(tmp_path / "old.hdf5", "w") as f:
        f["observations"] = rng.integers(0, 255, (n, 4, 4), dtype=np.uint8)
        f["actions"] = rng.integers(0, 6, n)
        f["rewards"] = rng.standard_normal(n)
        f["terminals"] = term
    with import_d4rl(tmp_path / "old.hdf5", tmp_path / "s") as buf:
        assert buf.episodes()["length"].tolist() == [100, 200, 200]
        assert "next_obs" not in buf.step_space.spaces
        assert buf.step_space["obs"].dtype == np.uint8 and buf.step_space["obs"].shape == (4, 4)
        assert not np.asarray(buf.get_column(["step_data", "truncated"])[:]).any()


@pytest.mark.parametrize("case, error, words", [
    ("missing", NotATrajstoreError, ["'rewards' is missing", "observations"]),
    ("length", BadValueError, ["actions has shape (99, 3)", "expected (100, ...)"]),
    ("rewards2d", BadValueError, ["rewards has shape (100, 2)", "expected (100,)"]),
    ("strings", UnsupportedSpaceError, ["infos/name", "dtype", "expected numbers or bools"]),
    ("nextobs", BadValueError, ["next_observations is float64 (100, 11)", "float32 (100, 11)"]),
    ("infolen", BadValueError, ["infos/qpos has shape (50, 6)", "(100, ...)"]),
    ("notfile", NotATrajstoreError, ["not an HDF5 file"]),
    ("nothing", StoreNotFoundError, ["no such file"]),
])
def test_bad_input_is_refused_before_writing(tmp_path: Path, case: str, error: type, words: list[str]) -> None:
    src = tmp_path / "bad.hdf5"
    if case == "notfile":
        src.write_text("observations,actions\n1,2\n")
    elif case != "nothing":
        n = 100
        base: dict[str, Any] = {"observations": np.zeros((n, 11), np.float32), "actions": np.zeros((n, 3), np.float32),
                                "rewards": np.zeros(n, np.float32), "terminals": np.zeros(n, bool),
                                "timeouts": np.zeros(n, bool)}
        if case == "missing":
            del base["rewards"]
        elif case == "length":
            base["actions"] = np.zeros((99, 3), np.float32)
        elif case == "rewards2d":
            base["rewards"] = np.zeros((n, 2), np.float32)
        elif case == "strings":
            base["infos/name"] = np.array([b"walker"] * n)
        elif case == "nextobs":
            base["next_observations"] = np.zeros((n, 11))
        elif case == "infolen":
            base["infos/qpos"] = np.zeros((50, 6))
        with h5py.File(src, "w") as f:
            for k, v in base.items():
                f[k] = v
    with pytest.raises(error) as e:
        import_d4rl(src, tmp_path / "dst")
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert not (tmp_path / "dst").exists()
    _no_leftovers(tmp_path)


def test_damaged_file_leaves_no_partial_store(tmp_path: Path) -> None:
    """A file whose metadata is fine but one compressed chunk late in it is garbage: the import
    fails after writing earlier blocks, and neither the store nor a temporary folder remains."""
    n, w = 120_000, 16
    src = tmp_path / "damaged.hdf5"
    with h5py.File(src, "w") as f:
        f.create_dataset("observations", data=np.random.default_rng(0).standard_normal((n, w)).astype(np.float32),
                         chunks=(1000, w), compression="gzip")
        f["actions"] = np.zeros((n, 2), np.float32)
        f["rewards"] = np.ones(n, np.float32)
        term = np.zeros(n, bool)
        term[999::1000] = True
        f["terminals"] = term
        f["timeouts"] = np.zeros(n, bool)
        chunk = f["observations"].id.get_chunk_info(n // 1000 - 2)  # in the second block of rows
    with open(src, "r+b") as fh:
        fh.seek(chunk.byte_offset)
        fh.write(b"\xff" * chunk.size)
    with pytest.raises(DamagedStoreError, match=r"observations: rows \d+:120000 cannot be read"):
        import_d4rl(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    _no_leftovers(tmp_path)


def test_existing_destination_and_overwrite(tmp_path: Path) -> None:
    write_d4rl(tmp_path / "a.hdf5", 2000)
    import_d4rl(tmp_path / "a.hdf5", tmp_path / "s").close()
    with pytest.raises(StoreExistsError, match="already exists"):
        import_d4rl(tmp_path / "a.hdf5", tmp_path / "s")
    write_d4rl(tmp_path / "b.hdf5", 3000, seed=5)
    with import_d4rl(tmp_path / "b.hdf5", tmp_path / "s", overwrite=True) as buf:
        assert len(buf) == 3000
    export_d4rl(tmp_path / "s", tmp_path / "out.hdf5")
    with pytest.raises(StoreExistsError):
        export_d4rl(tmp_path / "s", tmp_path / "out.hdf5")
    _no_leftovers(tmp_path)


def test_export_refuses_stores_it_cannot_hold(tmp_path: Path) -> None:
    from gymnasium.spaces import Box, Dict

    from trajstore.recording import step_space

    dict_obs = step_space(Dict({"a": Box(0, 1, (2,)), "b": Box(0, 1, (3,))}), Box(-1, 1, (1,)))
    with TrajectoryReplayBuffer.create(dict_obs, cache_path=tmp_path / "d") as buf:
        buf.extend({"obs": {"a": np.zeros((2, 2), np.float32), "b": np.zeros((2, 3), np.float32)},
                    "action": np.zeros((2, 1), np.float32), "reward": np.zeros(2), "terminated": np.zeros(2, bool),
                    "truncated": np.zeros(2, bool)})
    with pytest.raises(UnsupportedSpaceError, match="'obs' is a Dict space"):
        export_d4rl(tmp_path / "d", tmp_path / "d.hdf5")
    with TrajectoryReplayBuffer.create(Box(0, 1, (3,)), cache_path=tmp_path / "plain") as buf:
        buf.extend(np.zeros((4, 3), np.float32))
    with pytest.raises(UnsupportedSpaceError, match=r"step space is Box.*expected the recorders' Dict"):
        export_d4rl(tmp_path / "plain", tmp_path / "p.hdf5")
    with TrajectoryReplayBuffer.create(Dict({"obs": Box(0, 1, (3,)), "action": Box(0, 1, (1,))}),
                                       cache_path=tmp_path / "few") as buf:
        buf.extend({"obs": np.zeros((4, 3), np.float32), "action": np.zeros((4, 1), np.float32)})
    with pytest.raises(UnknownFieldError, match=r"no reward, terminated, truncated \(it has \['action', 'obs'\]\)"):
        export_d4rl(tmp_path / "few", tmp_path / "p.hdf5")
    assert not (tmp_path / "d.hdf5").exists() and not (tmp_path / "p.hdf5").exists()
    _no_leftovers(tmp_path)


_CHILD = textwrap.dedent("""
    import resource, sys
    import numpy as np, h5py
    from trajstore.interop import import_d4rl, export_d4rl
    def data_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmData"):
                return int(line.split()[1]) * 1024
    # Warm-up on a 10-step file: imports modules and starts the threads zarr and h5py keep (their
    # stacks count in VmData), so the cap below measures the data the big run holds.
    small = sys.argv[2] + ".small"
    with h5py.File(small, "w") as f:
        for k, v in {"observations": np.zeros((10, 256), np.float32), "actions": np.zeros((10, 2), np.float32),
                     "rewards": np.zeros(10, np.float32), "terminals": np.zeros(10, bool),
                     "timeouts": np.zeros(10, bool)}.items():
            f[k] = v
    import_d4rl(small, small + ".store", overwrite=True).close()
    export_d4rl(small + ".store", small + ".hdf5", overwrite=True)
    cap = data_bytes() + (64 << 20)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    if sys.argv[1] == "whole":  # control: reading the source at once does not fit
        with h5py.File(sys.argv[2]) as f:
            f["observations"][()]
    else:
        buf = import_d4rl(sys.argv[2], sys.argv[3])
        n = len(buf)
        buf.close()
        out = export_d4rl(sys.argv[3], sys.argv[3] + ".hdf5")
        print(n, out["steps"])
""")


def test_import_and_export_in_bounded_memory(tmp_path: Path) -> None:
    """A 164 MB source imported and exported by a process whose heap may grow by 64 MiB only
    (RLIMIT_DATA: private writable memory, what numpy arrays take; the store's raw chunks are
    file-backed maps, which it does not count); reading the source's observations at once in the
    same process fails."""
    n, w = 160_000, 256
    src = tmp_path / "big.hdf5"
    with h5py.File(src, "w") as f:
        obs = f.create_dataset("observations", (n, w), np.float32, chunks=(4096, w))
        for lo in range(0, n, 40_000):
            obs[lo:lo + 40_000] = np.repeat(np.arange(lo, lo + 40_000, dtype=np.float32)[:, None], w, axis=1)
        f["actions"] = np.zeros((n, 2), np.float32)
        f["rewards"] = np.ones(n, np.float32)
        term = np.zeros(n, bool)
        term[999::1000] = True
        f["terminals"] = term
        f["timeouts"] = np.zeros(n, bool)
    # One malloc arena: glibc's per-thread arenas (zarr reads on a pool of threads) would count
    # their retained heaps in VmData, which is not data the conversion holds.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "MALLOC_ARENA_MAX": "1"}
    control = subprocess.run([sys.executable, "-c", _CHILD, "whole", str(src)], capture_output=True, text=True,
                             env=env, timeout=120)
    assert control.returncode != 0 and "MemoryError" in control.stderr, control.stderr[-2000:]
    run = subprocess.run([sys.executable, "-c", _CHILD, "stream", str(src), str(tmp_path / "store")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [str(n), str(n)]
    with h5py.File(tmp_path / "store.hdf5") as f:
        assert f["observations"].shape == (n, w)
        np.testing.assert_array_equal(f["observations"][n - 5 :, 0], np.arange(n - 5, n, dtype=np.float32))
        assert int(f["terminals"][()].sum()) == 160


def test_cli_import_export_json_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_d4rl(tmp_path / "a.hdf5", 3000, next_obs=False)
    assert main(["import", "d4rl", str(tmp_path / "a.hdf5"), str(tmp_path / "s"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "d4rl" and out["steps"] == 3000 and out["verified"] is True
    assert out["destination"] == str(tmp_path / "s")
    assert main(["export", "d4rl", str(tmp_path / "s"), str(tmp_path / "b.hdf5")]) == 0
    text = capsys.readouterr().out
    assert "3000 steps" in text and "read back and verified" in text
    with h5py.File(tmp_path / "b.hdf5") as f:
        assert f["observations"].shape == (3000, 11)
    assert main(["import", "d4rl", str(tmp_path / "missing.hdf5"), str(tmp_path / "t")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("trajstore import: error:") and "no such file" in err
    assert main(["episodes", str(tmp_path / "s"), "--json"]) == 0  # the store works with the other commands
    assert json.loads(capsys.readouterr().out)


def _import_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n_keys: int) -> dict[str, int]:
    """Store operations of one import of a 40-row D4RL file with ``n_keys`` more ``infos/*`` keys:
    calls and bytes of every read of the store's files (``Confinement.read``: zarr's reads and
    trajstore's), of trajstore's writes (``Location.put``) and zarr's (``ConfinedLocalStore._set``),
    and ``os.pwrite`` calls; counted by wrappers that call the real methods."""
    from trajstore.storage.confined import ConfinedLocalStore, Confinement
    from trajstore.storage.location import Location

    counts: dict[str, int] = {}

    def count(tag: str, nbytes: int) -> None:
        counts[f"{tag} calls"] = counts.get(f"{tag} calls", 0) + 1
        counts[f"{tag} bytes"] = counts.get(f"{tag} bytes", 0) + nbytes

    read, put, zset, pwrite = Confinement.read, Location.put, ConfinedLocalStore._set, os.pwrite

    def counted_read(self: Any, *a: Any, **k: Any) -> Any:
        out = read(self, *a, **k)
        count("read", len(out or b""))
        return out

    def counted_put(self: Any, key: str, data: bytes, **k: Any) -> None:
        count("put", len(data))
        put(self, key, data, **k)

    async def counted_set(self: Any, key: str, value: Any, exclusive: bool = False) -> None:
        count("zarr set", len(value))
        await zset(self, key, value, exclusive)

    def counted_pwrite(fd: int, data: Any, offset: int) -> int:
        counts["pwrite calls"] = counts.get("pwrite calls", 0) + 1
        return pwrite(fd, data, offset)

    src = tmp_path / f"keys{n_keys}.hdf5"
    write_d4rl(src, 40)
    with h5py.File(src, "a") as f:
        for i in range(n_keys):
            f.create_dataset(f"infos/k{i:04d}", data=np.full(40, i, np.float32))
    with monkeypatch.context() as m:
        m.setattr(Confinement, "read", counted_read)
        m.setattr(Location, "put", counted_put)
        m.setattr(ConfinedLocalStore, "_set", counted_set)
        m.setattr(os, "pwrite", counted_pwrite)
        buf = import_d4rl(src, tmp_path / f"store{n_keys}")
    try:
        last = np.asarray(buf.get_column(["step_data", "info", f"k{n_keys - 1:04d}"])[:])
    finally:
        buf.close()
    np.testing.assert_array_equal(last, np.full(40, n_keys - 1, np.float32))
    return counts


def test_import_cost_per_info_key_is_constant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: a D4RL file with 3,000 ``infos/*`` keys took minutes to import.  The store
    operations an import does (reads and writes of the store's files, their bytes) grow by the same
    amount for keys 40..120 as for keys 120..200: linear in the number of fields, where anything
    that reads or rewrites a file listing every field once per field (the root ``zarr.json``, the
    consolidated metadata) grows twice as fast over the second 80 keys.  Each key costs at most 10
    store calls (7 today: zarr used to read and write every parent group's ``zarr.json`` for each
    array it created), and its first rows go into its new chunk file by ``pwrite`` (a first store
    through a new file's mapping faults into the filesystem's journal, milliseconds on a busy disk)."""
    a, b, c = (_import_counts(tmp_path, monkeypatch, n) for n in (40, 120, 200))
    for key in sorted(set(a) | set(b) | set(c)):
        first, second = b.get(key, 0) - a.get(key, 0), c.get(key, 0) - b.get(key, 0)
        assert second <= first * 1.05 + 64, (key, a.get(key), b.get(key), c.get(key))
    calls = sum(c[k] - b[k] for k in c if k.endswith("calls") and k != "pwrite calls")
    assert calls <= 10 * 80, (b, c)
    assert c["pwrite calls"] - b["pwrite calls"] >= 80, (b, c)


def test_stats_computed_at_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_d4rl(tmp_path / "d.hdf5", n=600)
    with import_d4rl(tmp_path / "d.hdf5", tmp_path / "s", stats=True) as buf:
        s = buf.stats(fields=["reward"])["reward"]
        assert buf.tasks == []  # a D4RL env_name names the dataset, not a task
    assert s["count"] == 600 and s["max"] == data["rewards"].max()
    np.testing.assert_allclose(s["mean"], data["rewards"].astype(np.float64).mean(), rtol=1e-6)
    assert main(["info", str(tmp_path / "s")]) == 0
    assert "statistics of " in capsys.readouterr().out
