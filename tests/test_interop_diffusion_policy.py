"""Diffusion Policy zarr import and export (issue 14): stores written with zarr-python as Diffusion
Policy lays them out (data/<key>, meta/episode_ends; zarr format 2 and 3; folders and .zarr.zip),
values and episodes compared, round trips, a plain format-2 reader of the exported files, bad input
refused before writing, a damaged chunk leaves nothing behind."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import zarr

from trajstore import TrajectoryReplayBuffer
from trajstore.cli import main
from trajstore.errors import (
    BadOptionError,
    BadValueError,
    DamagedStoreError,
    NotATrajstoreError,
    StoreExistsError,
    StoreNotFoundError,
    UnsupportedSpaceError,
)
from trajstore.interop import export_diffusion_policy, import_diffusion_policy
from trajstore.maintenance.verify import verify_store


def pusht_like(n_eps: int = 7, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Arrays as Diffusion Policy's PushT dataset holds them, and the episode ends."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 90, n_eps)
    ends = np.cumsum(lengths).astype(np.int64)
    n = int(ends[-1])
    return {"img": rng.integers(0, 255, (n, 12, 12, 3)).astype(np.float32),
            "state": rng.standard_normal((n, 5)).astype(np.float32),
            "keypoint": rng.standard_normal((n, 9, 2)).astype(np.float32),
            "n_contacts": rng.integers(0, 4, (n, 1)).astype(np.float32),
            "action": rng.standard_normal((n, 2)).astype(np.float32)}, ends


def write_dp(path: Path, data: dict[str, np.ndarray], ends: np.ndarray, zarr_format: int = 2,
             chunk: int = 64) -> None:
    """The layout of diffusion_policy.common.replay_buffer.ReplayBuffer (its default compressor:
    Blosc lz4, no shuffle; episode_ends uncompressed), written with zarr-python."""
    zs = zarr.storage.ZipStore(path, mode="w") if str(path).endswith(".zip") else None
    root = zarr.open_group(zs if zs is not None else str(path), mode="w", zarr_format=zarr_format)  # type: ignore[arg-type]
    comp: Any = (numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.NOSHUFFLE) if zarr_format == 2
                 else zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="noshuffle"))
    g = root.require_group("data")
    for k, v in data.items():
        a = g.create_array(k, shape=v.shape, chunks=(chunk, *v.shape[1:]), dtype=v.dtype, compressors=comp)
        a[:] = v
    e = root.require_group("meta").create_array("episode_ends", shape=ends.shape, dtype=np.int64, compressors=None)
    e[:] = ends
    if zs is not None:
        zs.close()


def read_dp(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:
    zs = zarr.storage.ZipStore(path, mode="r") if str(path).endswith(".zip") else None
    root = zarr.open_group(zs if zs is not None else str(path), mode="r")
    try:
        return ({k: a[:] for k, a in root["data"].arrays()},  # type: ignore[union-attr]
                np.asarray(root["meta/episode_ends"][:]))  # type: ignore[index]
    finally:
        if zs is not None:
            zs.close()


def _no_leftovers(parent: Path) -> None:
    assert not [p for p in os.listdir(parent) if "trajstore-partial" in p]


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("name", ["pusht.zarr", "pusht.zarr.zip"])
def test_import_values_and_episodes(tmp_path: Path, zarr_format: int, name: str) -> None:
    data, ends = pusht_like()
    write_dp(tmp_path / name, data, ends, zarr_format)
    with import_diffusion_policy(tmp_path / name, tmp_path / "store") as buf:
        n = int(ends[-1])
        assert len(buf) == n
        col = lambda *k: np.asarray(buf.get_column(["step_data", *k])[:])  # noqa: E731
        for k, v in data.items():
            np.testing.assert_array_equal(col(*(["action"] if k == "action" else ["obs", k])), v, err_msg=k)
        table = buf.episodes()
        starts = np.concatenate([[0], ends[:-1]])
        np.testing.assert_array_equal(table["start"], starts)
        np.testing.assert_array_equal(table["length"], np.diff(np.concatenate([[0], ends])))
        assert not col("reward").any() and not col("terminated").any()
        np.testing.assert_array_equal(np.flatnonzero(col("truncated")), ends - 1)
        np.testing.assert_array_equal(np.asarray(buf.get_column(["episode_data", "length"])[:])[starts],
                                      table["length"])
        assert buf.step_space["obs"]["img"].shape == (12, 12, 3)
    assert verify_store(tmp_path / "store").ok


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("name", ["out.zarr", "out.zarr.zip"])
def test_round_trip_dp_store_dp(tmp_path: Path, zarr_format: int, name: str) -> None:
    data, ends = pusht_like(seed=1)
    write_dp(tmp_path / "src.zarr", data, ends)
    import_diffusion_policy(tmp_path / "src.zarr", tmp_path / "store").close()
    out = export_diffusion_policy(tmp_path / "store", tmp_path / name, zarr_format=zarr_format)
    assert out["verified"] and out["episodes"] == len(ends) and out["zarr_format"] == zarr_format
    got, got_ends = read_dp(tmp_path / name)
    assert sorted(got) == sorted(data)
    for k in data:
        assert got[k].dtype == data[k].dtype
        np.testing.assert_array_equal(got[k], data[k], err_msg=k)
    np.testing.assert_array_equal(got_ends, ends)
    assert got_ends.dtype == np.int64


def test_exported_format_2_reads_with_a_plain_v2_reader(tmp_path: Path) -> None:
    """What zarr 2.x (Diffusion Policy's reader) needs: .zgroup files, .zarray metadata of format 2
    and chunk files 'i.j...' decoded by numcodecs; read here without zarr-python."""
    data, ends = pusht_like(n_eps=3, seed=2)
    write_dp(tmp_path / "src.zarr", data, ends, zarr_format=3)
    import_diffusion_policy(tmp_path / "src.zarr", tmp_path / "store").close()
    export_diffusion_policy(tmp_path / "store", tmp_path / "v2.zarr")
    root = tmp_path / "v2.zarr"
    for group in (root, root / "data", root / "meta"):
        assert json.loads((group / ".zgroup").read_text()) == {"zarr_format": 2}

    def v2_read(path: Path) -> np.ndarray:
        meta = json.loads((path / ".zarray").read_text())
        assert meta["zarr_format"] == 2 and meta["order"] == "C"
        shape, chunks = meta["shape"], meta["chunks"]
        codec = numcodecs.get_codec(meta["compressor"]) if meta["compressor"] else None
        out = np.empty(shape, np.dtype(meta["dtype"]))
        for c in range(-(-shape[0] // chunks[0])):
            raw = (path / ".".join([str(c)] + ["0"] * (len(shape) - 1))).read_bytes()
            buf = codec.decode(raw) if codec else raw
            block = np.frombuffer(buf, np.dtype(meta["dtype"])).reshape(chunks)
            lo = c * chunks[0]
            out[lo:lo + chunks[0]] = block[: shape[0] - lo]
        return out

    for k, v in data.items():
        np.testing.assert_array_equal(v2_read(root / "data" / k), v, err_msg=k)
    np.testing.assert_array_equal(v2_read(root / "meta" / "episode_ends"), ends)


def test_export_of_a_recorded_store(tmp_path: Path) -> None:
    """A Box obs becomes data/obs; reward, terminated, truncated are not kept; a store whose last
    episode is still live ends it at the last row."""
    from gymnasium.spaces import Box

    from trajstore.recording import EPISODE_SPACE, step_space

    space = step_space(Box(-1, 1, (3,), np.float32), Box(-1, 1, (2,), np.float32), next_obs=True)
    with TrajectoryReplayBuffer.create(space, episode_data_instance_space=EPISODE_SPACE,
                                       cache_path=tmp_path / "s") as buf:
        for k, n in enumerate([4, 6, 3]):
            buf.extend({"obs": np.full((n, 3), k, np.float32), "action": np.full((n, 2), -k, np.float32),
                        "reward": np.ones(n), "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool),
                        "next_obs": np.zeros((n, 3), np.float32)})
            if k < 2:
                buf.mark_episode_end()
        out = export_diffusion_policy(buf, tmp_path / "dp.zarr")
    assert out["episodes"] == 3
    got, ends = read_dp(tmp_path / "dp.zarr")
    assert sorted(got) == ["action", "obs"] and ends.tolist() == [4, 10, 13]
    assert got["obs"][:, 0].tolist() == [0] * 4 + [1] * 6 + [2] * 3


@pytest.mark.parametrize("case, error, words", [
    ("noaction", NotATrajstoreError, ["expected the array data/action", "['img', 'state']"]),
    ("ends", BadValueError, ["episode_ends must increase strictly", "entry 1 is 5 after 10"]),
    ("length", BadValueError, ["data/state has shape (29, 5) and data/action (30, 2)", "one row per step"]),
    ("nometa", NotATrajstoreError, ["expected the groups data/ and meta/", "['data']"]),
    ("notzarr", NotATrajstoreError, ["is not a zarr group"]),
    ("nothing", StoreNotFoundError, ["no such file"]),
])
def test_bad_input_is_refused_before_writing(tmp_path: Path, case: str, error: type, words: list[str]) -> None:
    src = tmp_path / "bad.zarr"
    rng = np.random.default_rng(0)
    data = {"img": rng.standard_normal((30, 4)).astype(np.float32), "state": np.zeros((30, 5), np.float32),
            "action": np.zeros((30, 2), np.float32)}
    ends = np.array([10, 20, 30])
    if case == "noaction":
        del data["action"]
    elif case == "ends":
        ends = np.array([10, 5, 30])
    elif case == "length":
        data["state"] = np.zeros((29, 5), np.float32)
    if case == "notzarr":
        src.mkdir()
        (src / "readme.txt").write_text("not zarr")
    elif case != "nothing":
        write_dp(src, data, ends)
        if case == "nometa":
            import shutil

            shutil.rmtree(src / "meta")
    with pytest.raises(error) as e:
        import_diffusion_policy(src, tmp_path / "dst")
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert not (tmp_path / "dst").exists()
    _no_leftovers(tmp_path)


def test_damaged_chunk_leaves_no_partial_store(tmp_path: Path) -> None:
    """A chunk file of a format-2 store replaced by garbage after the first blocks: the import
    fails and leaves neither the store nor a temporary folder."""
    n = 40_000
    rng = np.random.default_rng(0)
    data = {"state": rng.standard_normal((n, 64)).astype(np.float32), "action": np.zeros((n, 2), np.float32)}
    write_dp(tmp_path / "src.zarr", data, np.arange(1000, n + 1, 1000), chunk=1000)
    (tmp_path / "src.zarr" / "data" / "state" / "38.0").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(DamagedStoreError, match=r"data/state: rows \d+:40000 cannot be read"):
        import_diffusion_policy(tmp_path / "src.zarr", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    _no_leftovers(tmp_path)


def test_export_refusals(tmp_path: Path) -> None:
    from gymnasium.spaces import Box, Dict

    from trajstore.recording import step_space

    data, ends = pusht_like(n_eps=2)
    write_dp(tmp_path / "src.zarr", data, ends)
    import_diffusion_policy(tmp_path / "src.zarr", tmp_path / "store").close()
    with pytest.raises(BadOptionError, match="zarr_format must be 2 or 3; got 4"):
        export_diffusion_policy(tmp_path / "store", tmp_path / "x.zarr", zarr_format=4)
    export_diffusion_policy(tmp_path / "store", tmp_path / "x.zarr")
    with pytest.raises(StoreExistsError):
        export_diffusion_policy(tmp_path / "store", tmp_path / "x.zarr")
    nested = step_space(Dict({"cam": Dict({"rgb": Box(0, 1, (2,))})}), Box(-1, 1, (1,)))
    with TrajectoryReplayBuffer.create(nested, cache_path=tmp_path / "nested") as buf:
        buf.extend({"obs": {"cam": {"rgb": np.zeros((2, 2), np.float32)}}, "action": np.zeros((2, 1), np.float32),
                    "reward": np.zeros(2), "terminated": np.zeros(2, bool), "truncated": np.zeros(2, bool)})
    with pytest.raises(UnsupportedSpaceError, match="obs leaf 'obs/cam/rgb' is nested"):
        export_diffusion_policy(tmp_path / "nested", tmp_path / "n.zarr")
    assert not (tmp_path / "n.zarr").exists()
    _no_leftovers(tmp_path)


def test_cli_import_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, ends = pusht_like(n_eps=3)
    write_dp(tmp_path / "src.zarr.zip", data, ends)
    assert main(["import", "diffusion-policy", str(tmp_path / "src.zarr.zip"), str(tmp_path / "s"), "--json",
                 "--stats"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "diffusion-policy" and out["episodes"] == 3 and out["steps"] == int(ends[-1])
    assert out["stats"] is True and out["task"] is None
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as buf:
        assert buf.robot_info().tasks == [] and verify_store(tmp_path / "s").ok
        np.testing.assert_allclose(buf.stats(fields=["action"])["action"]["mean"], data["action"].mean(0), rtol=1e-5)
    assert main(["export", "diffusion-policy", str(tmp_path / "s"), str(tmp_path / "o.zarr"), "--zarr-format", "3",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["zarr_format"] == 3 and out["verified"] is True
    assert zarr.open_group(str(tmp_path / "o.zarr"), mode="r").metadata.zarr_format == 3
    assert main(["export", "d4rl", str(tmp_path / "s"), str(tmp_path / "o.hdf5"), "--zarr-format", "3"]) == 2
    assert "--zarr-format applies to diffusion-policy" in capsys.readouterr().err


_CHILD = """
import resource, sys
import numpy as np, zarr
from trajstore.interop import import_diffusion_policy, export_diffusion_policy
def data_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmData"):
            return int(line.split()[1]) * 1024
# Warm-up on a 10-step store: imports modules and starts the threads zarr keeps (their stacks count
# in VmData), so the cap below measures the data the big run holds.
small = sys.argv[2] + ".small.zarr"
root = zarr.open_group(small, mode="w", zarr_format=2)
root.create_array("data/state", shape=(10, 256), dtype=np.float32)[:] = 0
root.create_array("data/action", shape=(10, 2), dtype=np.float32)[:] = 0
root.create_array("meta/episode_ends", shape=(1,), dtype=np.int64)[:] = [10]
import_diffusion_policy(small, small + ".store", overwrite=True).close()
export_diffusion_policy(small + ".store", small + ".out.zip", overwrite=True)
cap = data_bytes() + (64 << 20)
resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
if sys.argv[1] == "whole":  # control: reading the source's state array at once does not fit
    zarr.open_group(sys.argv[2], mode="r")["data/state"][:]
else:
    buf = import_diffusion_policy(sys.argv[2], sys.argv[3])
    n = len(buf)
    buf.close()
    out = export_diffusion_policy(sys.argv[3], sys.argv[3] + ".zarr.zip")
    print(n, out["steps"])
"""


def test_import_and_export_in_bounded_memory(tmp_path: Path) -> None:
    """A 164 MB store imported and exported (to a zip) by a process whose heap may grow by 64 MiB
    only (RLIMIT_DATA, as tests/test_interop_d4rl.py); reading the source's array at once fails."""
    import subprocess
    import sys

    n, w = 160_000, 256
    root = zarr.open_group(str(tmp_path / "big.zarr"), mode="w", zarr_format=2)
    state = root.create_array("data/state", shape=(n, w), chunks=(4096, w), dtype=np.float32, compressors=None)
    for lo in range(0, n, 40_000):
        state[lo:lo + 40_000] = np.repeat(np.arange(lo, lo + 40_000, dtype=np.float32)[:, None], w, axis=1)
    root.create_array("data/action", shape=(n, 2), dtype=np.float32)[:] = 0
    root.create_array("meta/episode_ends", shape=(160,), dtype=np.int64)[:] = np.arange(1000, n + 1, 1000)
    # One malloc arena: glibc's per-thread arenas (zarr reads on a pool of threads) would count
    # their retained heaps in VmData, which is not data the conversion holds.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "MALLOC_ARENA_MAX": "1"}
    control = subprocess.run([sys.executable, "-c", _CHILD, "whole", str(tmp_path / "big.zarr")],
                             capture_output=True, text=True, env=env, timeout=120)
    assert control.returncode != 0 and "MemoryError" in control.stderr, control.stderr[-2000:]
    run = subprocess.run([sys.executable, "-c", _CHILD, "stream", str(tmp_path / "big.zarr"), str(tmp_path / "s")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [str(n), str(n)]
    import zipfile

    names = zipfile.ZipFile(tmp_path / "s.zarr.zip").namelist()
    assert len(names) == len(set(names))  # every chunk written once, whole (blocks regrouped into chunks)
    assert sum(1 for x in names if x.startswith("data/state/") and not x.endswith((".zarray", ".zattrs"))) > 100
    got, ends = read_dp(tmp_path / "s.zarr.zip")
    assert got["state"].shape == (n, w) and len(ends) == 160
    np.testing.assert_array_equal(got["state"][n - 3 :, 0], np.arange(n - 3, n, dtype=np.float32))
