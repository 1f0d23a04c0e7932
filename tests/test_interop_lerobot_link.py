"""Linked LeRobot imports (``import_lerobot(..., link=True)``, issue 32): each AV1 MP4 hard-linked
into the store as a pack, each episode a linked segment naming its packets there
(trajstore.storage.fields.video_pack).  Real datasets (tests/lerobot_fixture.py) and stores on
disk: the same arrays as a copying import, verify, a kill mid-import, a source edited or truncated
in place, another filesystem, copies holding no pack, and hostile packs and linked segments."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")
pytest.importorskip("pyarrow")

from lerobot_fixture import write_v3  # noqa: E402
from test_cli import cli_json  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.errors import DamagedStoreError  # noqa: E402
from trajstore.interop import import_lerobot  # noqa: E402
from trajstore.maintenance.combine import combine  # noqa: E402
from trajstore.maintenance.verify import verify_store  # noqa: E402
from trajstore.storage.fields.video_pack import LINK_MAGIC, MAX_PACKS, linked_segment  # noqa: E402

LENGTHS = [6, 8, 4]
CAMS = ("observation.images.top", "observation.images.wrist")
TOP = "step_data/observation.images.top/video"


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_v3(str(tmp_path_factory.mktemp("lrlink") / "v3"), LENGTHS, CAMS))


def _source(v3: Path, tmp_path: Path) -> Path:
    """A private copy of the dataset (its own inodes: a test may edit it)."""
    return Path(shutil.copytree(v3, tmp_path / "src"))


def _mp4(src: Path, cam: str = CAMS[0]) -> Path:
    return src / f"videos/{cam}/chunk-000/file-000.mp4"


def _all_rows(path: Path) -> dict[str, np.ndarray]:
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as b:
        return dict(b[0 : sum(LENGTHS)]["step_data"])


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _head(store: Path, lo: int) -> tuple[int, int, int, int]:
    """(pack, a, b, crc) of the linked segment of rows ``lo`` of the top camera."""
    data = (store / TOP / str(lo)).read_bytes()
    assert data[:8] == LINK_MAGIC
    return struct.unpack("<QQQQ", data[8:40])


def test_linked_import_equals_the_copying_import_and_verifies(v3: Path, tmp_path: Path) -> None:
    src = _source(v3, tmp_path)
    copied = import_lerobot(src, tmp_path / "copy")
    out = import_lerobot(src, tmp_path / "link", link=True)
    assert out["linked"] == {c: 3 for c in CAMS} and out["link_fallbacks"] == 0
    assert out["adopted"] == copied["adopted"]
    want, got = _all_rows(tmp_path / "copy"), _all_rows(tmp_path / "link")
    assert set(want) == set(got)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    for cam in CAMS:  # the pack is the source MP4 itself (a hard link), and no segment holds packets
        pack = tmp_path / f"link/step_data/{cam}/video/pack/0"
        assert os.stat(pack).st_ino == os.stat(_mp4(src, cam)).st_ino and os.stat(pack).st_nlink == 2
        for lo in (0, 6, 14):
            assert (tmp_path / f"link/step_data/{cam}/video/{lo}").read_bytes()[:8] == LINK_MAGIC
    rep = verify_store(tmp_path / "link", deep=True)
    assert rep.ok and not rep.removable, rep.faults
    assert rep.checked["decoded"] >= 6  # the six segments (and the other fields' chunks)


_KILL_PROGRAM = """
import sys, time
from trajstore.interop import lerobot as lr
episode = lr._Importer.episode
def slow(self, *a, **k):
    episode(self, *a, **k)
    open(sys.argv[3], "w").close()
    time.sleep(60)
lr._Importer.episode = slow
lr.import_lerobot(sys.argv[1], sys.argv[2], link=True)
"""


def test_linked_import_killed_midway(v3: Path, tmp_path: Path) -> None:
    """SIGKILL after the first episode (its packs linked into the staged folder): nothing at the
    destination, the source unchanged; the next import removes the staged folder and links anew."""
    src = _source(v3, tmp_path)
    before = _digests(src)
    ready = tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _KILL_PROGRAM, str(src), str(tmp_path / "s"), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the import child never wrote its first episode"
        staged = [p for p in tmp_path.iterdir() if "partial" in p.name]
        assert len(staged) == 1 and list(staged[0].rglob("video/pack/0"))  # killed mid-way, packs linked
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert not (tmp_path / "s").exists()
    assert _digests(src) == before
    assert import_lerobot(src, tmp_path / "s", link=True)["linked"] == {c: 3 for c in CAMS}
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]
    assert os.stat(_mp4(src)).st_nlink == 2  # the source and the new store's pack: the dead one's link is gone
    assert verify_store(tmp_path / "s").ok and _digests(src) == before


def test_source_edited_in_place_is_found_by_verify_and_reads(v3: Path, tmp_path: Path) -> None:
    src = _source(v3, tmp_path)
    import_lerobot(src, tmp_path / "s", link=True)
    _pack, a, b, _crc = _head(tmp_path / "s", 6)
    with open(_mp4(src), "r+b") as f:  # the same inode: the store's pack changes with it
        f.seek((a + b) // 2)
        byte = f.read(1)
        f.seek((a + b) // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    rep = verify_store(tmp_path / "s")
    assert [(f.kind, f.key, f.rows) for f in rep.faults] == [("bad-chunk", f"{TOP}/6", (6, 14))]
    assert "do not match their checksum" in rep.faults[0].message
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as buf:
        np.testing.assert_array_equal(buf[0:6]["step_data"][CAMS[1]], buf[0:6]["step_data"][CAMS[1]])
        buf[0:6]["step_data"][CAMS[0]]  # the other episodes read
        with pytest.raises(DamagedStoreError, match=r"observation\.images\.top: rows 6\.\.13.*checksum"):
            buf[6:14]["step_data"]


def test_source_truncated_in_place_is_an_error_not_a_crash(v3: Path, tmp_path: Path) -> None:
    src = _source(v3, tmp_path)
    import_lerobot(src, tmp_path / "s", link=True)
    _pack, a, _b, _crc = _head(tmp_path / "s", 6)
    os.truncate(_mp4(src), a + 10)  # rows 6.. lose their packets; a map of them would SIGBUS
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as buf:
        assert buf[0:6]["step_data"][CAMS[0]].shape == (6, 48, 64, 3)
        with pytest.raises(DamagedStoreError, match=r"rows 6\.\.13.*holds \d+ bytes"):
            buf[6:14]["step_data"]
    rep = verify_store(tmp_path / "s", packs=False)  # the size is checked without reading the bytes
    assert sorted(f.rows for f in rep.faults) == [(6, 14), (14, 18)]


def test_another_filesystem_falls_back_to_the_copy(v3: Path, tmp_path: Path) -> None:
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no /dev/shm on another filesystem than tmp_path")
    src = Path(shutil.copytree(v3, f"/dev/shm/trajstore-link-{os.getpid()}-{tmp_path.name}"))
    try:
        out = import_lerobot(src, tmp_path / "s", link=True)
        assert out["link_fallbacks"] == 2 and out["linked"] == {c: 0 for c in CAMS}
        assert "EXDEV" in out["link_fallback_why"]
        assert not list((tmp_path / "s").rglob("pack"))
        import_lerobot(src, tmp_path / "c")
        want, got = _all_rows(tmp_path / "c"), _all_rows(tmp_path / "s")
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    finally:
        shutil.rmtree(src)
    assert verify_store(tmp_path / "s").ok


def _plain(store: Path) -> None:
    """``store`` holds no pack and no linked segment."""
    assert not list(store.rglob("pack"))
    for cam in CAMS:
        for lo in (0, 6, 14):
            assert (store / f"step_data/{cam}/video/{lo}").read_bytes()[:8] == b"TSVSEG01"


def test_copies_of_a_linked_store_hold_their_own_packets(v3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _source(v3, tmp_path)
    import_lerobot(src, tmp_path / "s", link=True)
    want = _all_rows(tmp_path / "s")
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as buf:
        buf.dumps(tmp_path / "dumped")
    cli_json(capsys, "copy", str(tmp_path / "s"), str(tmp_path / "copied"))
    combine([tmp_path / "s"], tmp_path / "combined")
    shutil.rmtree(src)  # the copies need nothing of the source
    for name in ("dumped", "copied", "combined"):
        _plain(tmp_path / name)
        assert verify_store(tmp_path / name, deep=True).ok, name
        got = _all_rows(tmp_path / name)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{name}: {k}")
    assert verify_store(tmp_path / "s").ok  # the store's own link keeps the packets


def test_a_writer_reopened_on_a_linked_store_appends_plain_segments(v3: Path, tmp_path: Path) -> None:
    src = _source(v3, tmp_path)
    import_lerobot(src, tmp_path / "s", link=True)
    with TrajectoryReplayBuffer.load_from(tmp_path / "s") as buf:
        step = buf[0:6]["step_data"]
        buf.extend({"step_data": step, "episode_ids": np.full(6, 7, np.int64)})
        buf.mark_episode_end()
    assert (tmp_path / f"s/{TOP}/18").read_bytes()[:8] == b"TSVSEG01"
    assert verify_store(tmp_path / "s").ok
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as buf:  # encoded again: lossy
        a, b = buf[18:24]["step_data"][CAMS[0]].astype(np.float64), buf[0:6]["step_data"][CAMS[0]]
        assert 10 * np.log10(255**2 / max(float(((a - b) ** 2).mean()), 1e-9)) > 25


def _rewrite(store: Path, lo: int, **change: int) -> None:
    """Replace the linked segment of rows ``lo`` by one whose head fields ``change`` says (a
    well-formed segment: its own checksum matches)."""
    data = (store / TOP / str(lo)).read_bytes()
    pack, a, b, crc = struct.unpack("<QQQQ", data[8:40])
    n = (len(data) - 52) // 24
    table = np.frombuffer(data[40 : 40 + 24 * n], "<u8").reshape(n, 3)
    head = {"pack": pack, "a": a, "b": b, "crc": crc} | change
    blob = linked_segment(head["pack"], head["a"], head["b"], head["crc"], table[:, 0], table[:, 1], table[:, 2])
    os.unlink(store / TOP / str(lo))
    (store / TOP / str(lo)).write_bytes(blob)


@pytest.mark.parametrize("case", ["pack-symlink", "past-the-end", "range-too-large", "pack-out-of-range",
                                  "pack-missing"])
def test_hostile_packs_and_linked_segments(v3: Path, tmp_path: Path, case: str) -> None:
    src = _source(v3, tmp_path)
    s = tmp_path / "s"
    import_lerobot(src, s, link=True)
    pack = s / TOP / "pack/0"
    if case == "pack-symlink":  # a link inside a store is never followed, even to the right file
        os.unlink(pack)
        os.symlink(_mp4(src), pack)
        rows, match = (0, 18), "symbolic link"
    elif case == "past-the-end":
        _rewrite(s, 6, b=os.path.getsize(pack) + 100)
        rows, match = (6, 14), r"holds \d+ bytes; the segment needs"
    elif case == "range-too-large":  # more bytes than the rows' frames may take: refused before any read
        _rewrite(s, 6, b=1 << 40)
        rows, match = (6, 14), "out of range"
    elif case == "pack-out-of-range":
        _rewrite(s, 6, pack=MAX_PACKS)
        rows, match = (6, 14), "out of range"
    else:
        _rewrite(s, 6, pack=3)
        rows, match = (6, 14), "pack/3 is missing"
    rep = verify_store(s)
    assert not rep.ok and {f.kind for f in rep.faults} == {"bad-chunk"}
    assert (min(f.rows[0] for f in rep.faults), max(f.rows[1] for f in rep.faults)) == rows
    assert all(("pack/0" not in k) for k, _w in rep.removable)
    with TrajectoryReplayBuffer.load_from(s, read_only=True) as buf:
        with pytest.raises(DamagedStoreError, match=match):
            buf[rows[0] : rows[1]]["step_data"]


def test_cli_import_link(v3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _source(v3, tmp_path)
    out = cli_json(capsys, "import", "lerobot", str(src), str(tmp_path / "s"), "--link")
    assert out["linked"] == {c: 3 for c in CAMS} and out["link_fallbacks"] == 0
    assert (tmp_path / f"s/{TOP}/pack/0").stat().st_ino == _mp4(src).stat().st_ino
    assert cli_json(capsys, "verify", str(tmp_path / "s"))["ok"]


def test_a_linked_store_uploaded_as_files_reads_through_byte_ranges(v3: Path, tmp_path: Path) -> None:
    """The folder's files put as they are behind fsspec (its in-memory filesystem): the packs are
    read by byte range, the same arrays; verify checks them there too."""
    import uuid

    import fsspec

    src = _source(v3, tmp_path)
    import_lerobot(src, tmp_path / "s", link=True)
    fs = fsspec.filesystem("memory")
    name = f"/linked-{uuid.uuid4().hex}"
    fs.put(str(tmp_path / "s"), name, recursive=True)
    try:
        assert fs.exists(f"{name}/{TOP}/pack/0")
        with TrajectoryReplayBuffer.load_from(f"memory://{name}", read_only=True) as b:
            got = dict(b[0 : sum(LENGTHS)]["step_data"])
        want = _all_rows(tmp_path / "s")
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
        assert verify_store(f"memory://{name}").ok
        fs.pipe(f"{name}/{TOP}/pack/0", b"short")  # a pack shorter than its segments need
        assert {f.rows for f in verify_store(f"memory://{name}").faults} == {(0, 6), (6, 14), (14, 18)}
    finally:
        fs.rm(name, recursive=True)


def test_link_pack_links_the_file_opened_never_another(tmp_path: Path) -> None:
    """link_pack is given the open file and the name it was opened by, and that name now holds
    another file (replaced after the open): the pack is the file opened (linked through
    /proc/self/fd) or there is none (linked by name, the inodes differ, the link removed)."""
    from trajstore.storage.fields.video_pack import link_pack
    from trajstore.storage.location import resolve_location

    (tmp_path / "opened").write_bytes(b"the file the gate checked")
    (tmp_path / "other").write_bytes(b"a file swapped in later")
    loc = resolve_location(str(tmp_path / "store"), read_only=False, must_exist=False)
    try:
        with open(tmp_path / "opened", "rb", buffering=0) as f:
            why = link_pack(loc, "f/video/pack/0", f, str(tmp_path / "other"))
            pack = tmp_path / "store/f/video/pack/0"
            if why:
                assert "not the one opened" in why or "EXDEV" in why or "EPERM" in why, why
                assert not pack.exists() and not pack.parent.exists()
            else:
                assert pack.stat().st_ino == os.fstat(f.fileno()).st_ino
        assert (tmp_path / "other").stat().st_nlink == 1
    finally:
        loc.close()
