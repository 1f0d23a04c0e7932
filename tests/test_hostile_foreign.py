"""Hostile foreign files (issue 37 sections 1-3): every importer reads its source through
``trajstore.interop.foreign_gate``.

A corpus of hostile D4RL, robomimic and Minari HDF5 files and Diffusion Policy zarr stores, built
with real h5py / zarr / minari in tmp_path: links and storage out of the file, special files,
cycles, nesting, declared sizes beyond the store's limits, decompression bombs, JSON bombs.  Each
case asserts the specific trajstore error naming the file and the object, that nothing is left at
the destination, that no byte of a "secret" file outside the source reaches anything written, and
that nothing outside is touched.  Cases where a hang is the risk (FIFOs) run in a subprocess
with a timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

from test_interop_d4rl import write_d4rl  # noqa: E402
from test_interop_diffusion_policy import pusht_like, write_dp  # noqa: E402
from test_interop_robomimic import write_robomimic  # noqa: E402
from test_open_diffusion_policy import zip_claiming_2gib  # noqa: E402

from trajstore.errors import DamagedStoreError, ForeignFileError  # noqa: E402
from trajstore.interop import (  # noqa: E402
    foreign_gate,
    import_d4rl,
    import_diffusion_policy,
    import_minari,
    import_robomimic,
    open_diffusion_policy,
)

#: What a secret file outside the source holds: float32 values no source here has.
MARK = 12345.678

# -- the importers' sources -----------------------------------------------------------------------
#: importer -> (dataset a case replaces, group a case nests or links under)
TARGETS = {"d4rl": ("observations", "infos"), "robomimic": ("data/demo_0/obs/robot0_eef_pos", "data/demo_0/obs"),
           "minari": ("episode_0/actions", "episode_0/infos")}


def _minari_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pytest.importorskip("minari")
    from test_interop_minari import make_dataset

    root = tmp_path / "src" / "datasets"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    make_dataset("toy/reach-v0")
    return root / "toy" / "reach-v0"


def _source(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """``(what the importer is given, the HDF5 file inside it)`` of a valid source of ``kind``."""
    (tmp_path / "src").mkdir(exist_ok=True)
    if kind == "d4rl":
        p = tmp_path / "src" / "d.hdf5"
        write_d4rl(p, 500)
        return p, p
    if kind == "robomimic":
        p = tmp_path / "src" / "r.hdf5"
        write_robomimic(p)
        return p, p
    folder = _minari_source(tmp_path, monkeypatch)
    return folder, folder / "data" / "main_data.hdf5"


IMPORT: dict[str, Callable[..., Any]] = {"d4rl": import_d4rl, "robomimic": import_robomimic, "minari": import_minari}


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside every source: a secret raw file of marked float32s and an HDF5 file
    holding them (``/secret``, 500 x 11)."""
    out = tmp_path / "outside"
    out.mkdir()
    secret = np.full((500, 11), MARK, np.float32)
    (out / "secret.bin").write_bytes(secret.tobytes() * 4)
    with h5py.File(out / "secret.h5", "w") as f:
        f["secret"] = secret
    return out


def _tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` with its SHA-256 (links not followed)."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()}


def _expect_refused(tmp_path: Path, outside: Path, run: Callable[[Path], Any], error: type, words: list[str]) -> str:
    """``run(dst)`` raises ``error`` with ``words`` in its message; nothing is at or next to the
    destination, nothing outside changed, and no secret byte reached a file written."""
    before = _tree(outside)
    dst = tmp_path / "out" / "store"
    dst.parent.mkdir(exist_ok=True)
    with pytest.raises(error) as e:
        run(dst)
    msg = str(e.value)
    for w in words:
        assert w in msg, (w, msg)
    assert os.listdir(dst.parent) == []
    assert _tree(outside) == before
    return msg


# -- HDF5: one corpus for D4RL, robomimic and Minari -----------------------------------------------
def _replace(f: Any, target: str, make: Callable[[tuple[int, ...], np.dtype], None]) -> None:
    d = f[target]
    shape, dtype = d.shape, d.dtype
    del f[target]
    make(shape, dtype)


def _deep(f: Any, group: str) -> None:
    g = f[group]
    for _ in range(foreign_gate.MAX_DEPTH + 10):
        g = g.create_group("g")


def _bomb(f: Any, target: str) -> None:
    """A gzip dataset whose first chunk is a deflate stream of 8 MiB (its chunk: 1 row)."""
    def make(shape: tuple[int, ...], dtype: np.dtype) -> None:
        d = f.create_dataset(target, shape=shape, dtype=dtype, chunks=(1, *shape[1:]), compression="gzip")
        d[:] = 1
        d.id.write_direct_chunk((0,) * len(shape), zlib.compress(b"\0" * (8 << 20), 1))
    _replace(f, target, make)


def _hdf5_case(case: str, f: Any, target: str, group: str, outside: Path) -> None:
    if case == "external_link":
        del f[target]
        f[target] = h5py.ExternalLink(str(outside / "secret.h5"), "/secret")
    elif case in ("external_storage", "external_dev_zero"):
        src = str(outside / "secret.bin") if case == "external_storage" else "/dev/zero"
        _replace(f, target, lambda s, dt: f.create_dataset(
            target, shape=s, dtype=dt, external=[(src, 0, int(np.prod(s)) * dt.itemsize)]))
    elif case == "virtual":
        def make(shape: tuple[int, ...], dtype: np.dtype) -> None:
            layout = h5py.VirtualLayout(shape=shape, dtype=np.float32)
            layout[:] = h5py.VirtualSource(str(outside / "secret.h5"), "secret", shape=(500, 11))[
                tuple(slice(0, n) for n in shape)]
            f.create_virtual_dataset(target, layout)
        _replace(f, target, make)
    elif case == "soft_link_cycle":
        f[f"{group}/loop"] = h5py.SoftLink("/" + group)
    elif case == "hard_link_cycle":
        f[f"{group}/loop"] = f[group]
    elif case == "deep":
        _deep(f, group)
    elif case == "huge_row":  # a Box's bounds of 10**10 float32s: 37 GiB
        _replace(f, target, lambda s, dt: f.create_dataset(target, shape=(s[0], 100_000, 100_000), dtype=dt,
                                                           chunks=(1, 1, 1000)))
    elif case == "huge_rows":  # 10**12 rows in 1 MiB-row chunks, none written
        _replace(f, target, lambda s, dt: f.create_dataset(target, shape=(10**12, *s[1:]), dtype=dt,
                                                           chunks=(1 << 20, *s[1:])))
    elif case == "deflate_bomb":
        _bomb(f, target)
    else:
        raise AssertionError(case)


HDF5_CASES = {
    "external_link": ["external link", "secret.h5"],
    "external_storage": ["external files", "secret.bin"],
    "external_dev_zero": ["external files", "/dev/zero"],
    "virtual": ["virtual dataset"],
    "soft_link_cycle": ["SoftLink", "loop"],
    "hard_link_cycle": ["already reached", "loop"],
    "deep": ["deeper than 64 levels"],
    "huge_row": ["[100000, 100000]", "8388608 elements"],
    "huge_rows": ["declares", "stores 0"],
    "deflate_bomb": ["decompression bomb", "(0, 0)"],
}


@pytest.mark.parametrize("kind", sorted(IMPORT))
@pytest.mark.parametrize("case", sorted(HDF5_CASES))
def test_hostile_hdf5_refused(tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch, kind: str,
                              case: str) -> None:
    given, h5 = _source(kind, tmp_path, monkeypatch)
    target, group = TARGETS[kind]
    with h5py.File(h5, "a") as f:
        _hdf5_case(case, f, target, group, outside)
    words = list(HDF5_CASES[case])
    if case in ("external_link", "external_storage", "external_dev_zero", "virtual", "deflate_bomb", "huge_row"):
        words.append(target.rsplit("/", 1)[-1])
    msg = _expect_refused(tmp_path, outside, lambda dst: IMPORT[kind](given, dst), ForeignFileError, words)
    assert str(h5) in msg


@pytest.mark.parametrize("kind", sorted(IMPORT))
def test_too_many_links_refused(tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """More links than MAX_LINKS (lowered here: each base file has a few dozen) are refused before
    a group's names are listed."""
    given, h5 = _source(kind, tmp_path, monkeypatch)
    monkeypatch.setattr(foreign_gate, "MAX_LINKS", 8)
    _expect_refused(tmp_path, outside, lambda dst: IMPORT[kind](given, dst), ForeignFileError,
                    [str(h5), "more than 8 links"])


def test_d4rl_with_3000_info_keys_finds_the_link_after_them(tmp_path: Path, outside: Path) -> None:
    """3,000 infos/* datasets, then an external link: the walk reaches it (each link once, in one
    pass; the 3,000 cost about 1 ms each on a loaded machine) and refuses it."""
    src = tmp_path / "src.hdf5"
    write_d4rl(src, 50)
    with h5py.File(src, "a") as f:
        for i in range(3000):
            f.create_dataset(f"infos/k{i:04d}", data=np.zeros(50, np.float32))
        f["infos/zzz"] = h5py.ExternalLink(str(outside / "secret.h5"), "/secret")
    _expect_refused(tmp_path, outside, lambda dst: import_d4rl(src, dst), ForeignFileError, ["/infos/zzz"])


def test_robomimic_demo_index_and_env_args_bombs(tmp_path: Path, outside: Path) -> None:
    src = tmp_path / "r.hdf5"
    write_robomimic(src)
    with h5py.File(src, "a") as f:
        f.move("data/demo_0", f"data/demo_{10**30}")
    _expect_refused(tmp_path, outside, lambda dst: import_robomimic(src, dst), ForeignFileError,
                    [str(src), "demo_1000000000000000000000000000000", "demo index"])
    write_robomimic(src)
    with h5py.File(src, "a") as f:
        f["data"].attrs["env_args"] = "[" * 100_000 + "]" * 100_000
    _expect_refused(tmp_path, outside, lambda dst: import_robomimic(src, dst), ForeignFileError,
                    [str(src), "env_args", "deeper than 64"])


def test_minari_main_file_linked_out_of_the_folder(tmp_path: Path, outside: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    folder, h5 = _source("minari", tmp_path, monkeypatch)
    os.replace(h5, outside / "main_data.hdf5")
    os.symlink(outside / "main_data.hdf5", h5)
    _expect_refused(tmp_path, outside, lambda dst: import_minari(folder, dst), ForeignFileError,
                    [str(h5), "symbolic link"])
    os.unlink(h5)
    os.symlink(outside, folder / "data" / "more")  # any link below the folder: never followed
    _expect_refused(tmp_path, outside, lambda dst: import_minari(folder, dst), ForeignFileError,
                    ["data/more", "symbolic link"])


@pytest.mark.parametrize("case", ["no_spaces", "huge_space", "json_bomb"])
def test_minari_metadata_refused(tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """metadata.json without serialized spaces (minari would make the environment its env_spec
    names: here ``builtins:open`` creating a canary file), with a Box of 10**10 elements, or
    nested 100,000 deep."""
    folder, _ = _source("minari", tmp_path, monkeypatch)
    meta_path = folder / "data" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    canary = tmp_path / "canary"
    if case == "no_spaces":
        del meta["observation_space"], meta["action_space"]
        from gymnasium.envs.registration import EnvSpec

        # Before the gate, minari's reader made this "environment": open(canary, "w") ran.
        meta["env_spec"] = EnvSpec(id="Canary-v0", entry_point="builtins:open",
                                   kwargs={"file": str(canary), "mode": "w"}).to_json()
        raw, words = json.dumps(meta), ["no serialized observation_space", "env_spec"]
    elif case == "huge_space":
        meta["observation_space"] = json.dumps({"type": "Box", "dtype": "float32", "shape": [100000, 100000],
                                                "low": 0.0, "high": 1.0})
        raw, words = json.dumps(meta), ["observation_space", "8388608 elements"]
    else:
        raw, words = "[" * 100_000 + "]" * 100_000, ["metadata.json", "deeper than 64"]
    meta_path.write_text(raw)
    _expect_refused(tmp_path, outside, lambda dst: import_minari(folder, dst), ForeignFileError, words)
    assert not canary.exists()


# -- FIFOs: bounded time, in one subprocess ------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import sys
    import trajstore.interop as interop
    for line in sys.stdin:
        func, src, dst = line.rstrip("\\n").split("\\t")
        try:
            getattr(interop, func)(src, dst)
        except Exception as e:
            print(type(e).__name__, str(e).replace("\\n", " "), flush=True)
        else:
            print("imported", flush=True)
""")


def test_fifos_refused_in_bounded_time(tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A FIFO as an HDF5 dataset's external storage (D4RL, robomimic), as the file given (or the
    target of a link given), as a Diffusion Policy ``.zarray`` or chunk: each import returns
    with the trajstore error naming it (one child process runs them all, with a timeout)."""
    jobs: list[tuple[str, Path, list[str], str]] = []
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for kind in ("d4rl", "robomimic"):
        sub = tmp_path / kind
        sub.mkdir()
        given, h5 = _source(kind, sub, monkeypatch)
        target, _ = TARGETS[kind]
        with h5py.File(h5, "a") as f:
            _replace(f, target, lambda s, dt: f.create_dataset(
                target, shape=s, dtype=dt, external=[(str(fifo), 0, int(np.prod(s)) * dt.itemsize)]))
        jobs.append((f"import_{kind}", given, ["external files", str(fifo)], "ForeignFileError"))
        link = sub / "link.hdf5"
        os.symlink(fifo, link)
        jobs.append((f"import_{kind}", fifo, ["FIFO", str(fifo)], "ForeignFileError"))
        jobs.append((f"import_{kind}", link, ["FIFO", str(link)], "ForeignFileError"))
    for case in ("fifo_zarray", "fifo_chunk"):
        src = _dp(tmp_path / case, outside, case)
        jobs.append(("import_diffusion_policy", src, ["FIFO", "data/state"], "ForeignFileError"))
    stdin = "".join(f"{func}\t{src}\t{tmp_path / 'dst'}\n" for func, src, _, _ in jobs)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-c", _CHILD], input=stdin, capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == len(jobs), run.stdout
    for (func, src, words, error), line in zip(jobs, lines):
        assert line.startswith(error + " ") and all(w in line for w in words), (func, src, line)
    assert not (tmp_path / "dst").exists()


# -- Diffusion Policy zarr --------------------------------------------------------------------------
def _dp(tmp_path: Path, outside: Path, case: str) -> Path:
    """A Diffusion Policy store (format 2, chunks of 32 rows) under ``tmp_path/src`` made hostile
    by ``case``."""
    data, ends = pusht_like(n_eps=3)
    src = tmp_path / "src" / "d.zarr"
    if case == "unwritten_rows":  # 10**12 rows declared in chunks of 10**7, none written
        data, ends = {"state": data["state"], "action": data["action"]}, np.array([10**12])
    write_dp(src, data, ends, chunk=32)
    state = src / "data" / "state"
    if case == "unwritten_rows":
        for key, a in data.items():
            meta = json.loads((src / "data" / key / ".zarray").read_text())
            meta.update(shape=[10**12, *a.shape[1:]], chunks=[10**7, *a.shape[1:]])
            (src / "data" / key / ".zarray").write_text(json.dumps(meta))
    if case == "chunk_link":  # an outside file of the chunk's size, marked values
        (outside / "chunk").write_bytes((state / "0.0").read_bytes())
        (state / "0.0").unlink()
        os.symlink(outside / "secret.bin", state / "0.0")
    elif case == "chunk_dev_zero":
        (state / "0.0").unlink()
        os.symlink("/dev/zero", state / "0.0")
    elif case == "folder_link":
        os.rename(state, outside / "state")
        os.symlink(outside / "state", state)
    elif case == "big_zarray":  # 300 MB (sparse)
        with open(state / ".zarray", "r+b") as f:
            f.truncate(300 << 20)
    elif case == "huge_shape":
        meta = json.loads((state / ".zarray").read_text())
        meta.update(shape=[int(ends[-1]), 200_000, 200_000], chunks=[1, 200_000, 200_000])
        (state / ".zarray").write_text(json.dumps(meta))
    elif case in ("fifo_zarray", "fifo_chunk"):
        p = state / (".zarray" if case == "fifo_zarray" else "0.0")
        p.unlink()
        os.mkfifo(p)
    return src


DP_CASES = {
    "chunk_link": ["data/state", "symbolic link"],
    "chunk_dev_zero": ["data/state", "symbolic link"],
    "folder_link": ["data/state", "symbolic link"],
    "big_zarray": ["data/state/.zarray", "at most 16777216"],
    "huge_shape": ["data/state", "8388608 elements"],
    "unwritten_rows": ["data/action", "declares 8000000000000 bytes but stores"],
}


@pytest.mark.parametrize("case", sorted(DP_CASES))
def test_hostile_diffusion_policy_import_refused(tmp_path: Path, outside: Path, case: str) -> None:
    """Links and special files are refused by the walk of the folder before the destination
    exists (ForeignFileError); sizes by the confined reads and the arrays' checks."""
    src = _dp(tmp_path, outside, case)
    error = DamagedStoreError if case == "big_zarray" else ForeignFileError
    msg = _expect_refused(tmp_path, outside, lambda dst: import_diffusion_policy(src, dst), error, DP_CASES[case])
    assert str(src) in msg


@pytest.mark.parametrize("case", ["big_zarray", "huge_shape", "folder_link"])
def test_hostile_diffusion_policy_open_refused(tmp_path: Path, outside: Path, case: str) -> None:
    src = _dp(tmp_path, outside, case)
    with pytest.raises(DamagedStoreError) as e:
        with open_diffusion_policy(src) as buf:
            buf[:]
    for w in DP_CASES[case]:
        assert w in str(e.value), (w, str(e.value))


def test_diffusion_policy_zip_entry_bomb_refused_on_import(tmp_path: Path, outside: Path) -> None:
    """A .zarr.zip whose chunk entry claims 2 GiB (a deflate bomb's size) is refused before zarr
    reads it whole."""
    src = tmp_path / "d.zarr.zip"
    zip_claiming_2gib(src)
    _expect_refused(tmp_path, outside, lambda dst: import_diffusion_policy(src, dst), ForeignFileError,
                    [str(src), "data/state/0.0", "2147483647"])



# The peak is VmHWM (this process's own memory: ru_maxrss keeps the forking parent's peak on Linux).
_ZIP_CHILD = textwrap.dedent("""
    import sys
    from trajstore.interop import import_diffusion_policy
    try:
        import_diffusion_policy(sys.argv[1], sys.argv[2])
    except Exception as e:
        print(type(e).__name__, str(e).replace("\\n", " "))
    with open("/proc/self/status") as f:
        print(next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM:")))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the peak is read from Linux's /proc")
def test_zip_entry_longer_than_it_claims_is_read_in_bounded_memory(tmp_path: Path) -> None:
    """A chunk entry claiming its real size (1,296 bytes) whose deflate stream inflates to 256 MiB:
    zipfile inflated the whole stream for zarr's ``read()`` (1 GiB peak for 512 MiB); the ZipReader
    every zip is read through asks for the claimed bytes only, and the CRC refuses the entry."""
    data, ends = pusht_like(n_eps=2)
    good = tmp_path / "good.zarr.zip"
    write_dp(good, data, ends)
    src = tmp_path / "d.zarr.zip"
    name = "data/state/0.0"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(src, "w", compresslevel=1) as zout:
        for info in zin.infolist():
            if info.filename != name:
                zout.writestr(info, zin.read(info))
                continue
            claim = info.file_size
            bomb = zipfile.ZipInfo(name)
            bomb.compress_type, bomb.file_size = zipfile.ZIP_DEFLATED, 1 << 28
            with zout.open(bomb, "w", force_zip64=True) as f:
                for _ in range(256):
                    f.write(bytes(1 << 20))
    raw = bytearray(src.read_bytes())  # the entry's sizes, local header and central directory: its claim
    encoded = name.encode()
    for sig, size_at, name_at in ((b"PK\x03\x04", 22, 30), (b"PK\x01\x02", 24, 46)):
        at = raw.index(sig)
        while bytes(raw[at + name_at : at + name_at + len(encoded)]) != encoded:
            at = raw.index(sig, at + 4)
        raw[at + size_at : at + size_at + 4] = claim.to_bytes(4, "little")
    src.write_bytes(bytes(raw))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-c", _ZIP_CHILD, str(src), str(tmp_path / "dst")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    error, peak = run.stdout.splitlines()
    assert error.startswith("DamagedStoreError") and "data/state" in error and "CRC" in error, error
    assert int(peak) < 192, f"peak {peak} MiB reading a 256 MiB stream claiming {claim} bytes"
    assert not (tmp_path / "dst").exists()
