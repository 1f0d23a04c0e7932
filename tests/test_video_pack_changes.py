"""A linked store's pack changed while a reader holds its segment open (issue: linked segments
are checked when first opened; trajstore.storage.fields.video_pack re-checks a pack whose fstat
changed since).  Real LeRobot datasets (tests/lerobot_fixture.py) imported with ``link=True``,
real stores on disk, one open read-only buffer: the source MP4 (the pack's other name) edited in
place after the segment was read is a DamagedStoreError naming the field and rows, never frames
decoded from the changed bytes; an unchanged pack is read with no checksum pass per read."""

from __future__ import annotations

import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")
pytest.importorskip("pyarrow")

from lerobot_fixture import write_v3  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.errors import DamagedStoreError  # noqa: E402
from trajstore.interop import import_lerobot  # noqa: E402
from trajstore.maintenance.verify import verify_store  # noqa: E402
from trajstore.storage.fields import video_pack  # noqa: E402

LENGTHS = [6, 8, 4]
CAM = "observation.images.top"
TOP = f"step_data/{CAM}/video"


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_v3(str(tmp_path_factory.mktemp("lrpack") / "v3"), LENGTHS, (CAM,)))


def _linked(v3: Path, tmp_path: Path) -> tuple[Path, Path]:
    """``(store, source MP4)``: a private copy of the dataset imported with ``link=True``."""
    src = Path(shutil.copytree(v3, tmp_path / "src"))
    import_lerobot(src, tmp_path / "s", link=True)
    mp4 = src / f"videos/{CAM}/chunk-000/file-000.mp4"
    assert os.stat(mp4).st_ino == os.stat(tmp_path / "s" / TOP / "pack/0").st_ino
    return tmp_path / "s", mp4


def _range(store: Path, lo: int) -> tuple[int, int]:
    """``[a, b)``: the packets' byte range in the pack of the linked segment of rows ``lo``."""
    data = (store / TOP / str(lo)).read_bytes()
    return struct.unpack("<QQQQ", data[8:40])[1:3]


def _flip_keeping_mtime(path: Path, at: int) -> None:
    """Invert the byte at ``at`` in place (same inode, same size) and put the mtime back: only the
    ctime says the file changed."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


def _settle(path: Path) -> None:
    """Wait until the file's last change is :data:`~video_pack.SETTLE_NS` old (at most that long):
    a reader trusts an fstat only then (a change within one timestamp tick can leave it as it was)."""
    wait = video_pack.SETTLE_NS - (time.time_ns() - os.stat(path).st_ctime_ns)
    if wait > 0:
        time.sleep(wait / 1e9 + 0.01)


def test_a_pack_rewritten_in_place_after_its_check_is_damage_not_other_frames(v3: Path, tmp_path: Path) -> None:
    store, mp4 = _linked(v3, tmp_path)
    a, b = _range(store, 6)
    with TrajectoryReplayBuffer.load_from(store, read_only=True) as buf:
        first = buf[0:6]["step_data"][CAM]
        buf[6:14]["step_data"][CAM]  # rows 6..13's segment opened and checked
        for at in (a + 1, (a + b) // 2, b - 1):  # each a byte of a packet of that segment only
            _flip_keeping_mtime(mp4, at)
            with pytest.raises(DamagedStoreError, match=rf"{TOP[:-6]}: rows 6\.\.13 .*do not match their checksum"):
                buf[6:14]["step_data"]
            with pytest.raises(DamagedStoreError, match=r"rows 6\.\.13"):  # a single frame
                buf[9:10]["step_data"]
            _flip_keeping_mtime(mp4, at)  # put back: the same bytes, the store reads again
            np.testing.assert_array_equal(buf[0:6]["step_data"][CAM], first)
            assert buf[6:14]["step_data"][CAM].shape == (8, 48, 64, 3)
    assert verify_store(store).ok


def test_a_pack_truncated_after_its_check_is_damage(v3: Path, tmp_path: Path) -> None:
    store, mp4 = _linked(v3, tmp_path)
    a, _b = _range(store, 6)
    with TrajectoryReplayBuffer.load_from(store, read_only=True) as buf:
        buf[0:18]["step_data"][CAM]
        os.truncate(mp4, a + 10)
        buf[0:6]["step_data"][CAM]  # its packets lie before the cut
        with pytest.raises(DamagedStoreError, match=r"rows 6\.\.13 .*holds \d+ bytes"):
            buf[6:14]["step_data"]
        with pytest.raises(DamagedStoreError, match=r"rows 14\.\.17 .*holds \d+ bytes"):
            buf[15:16]["step_data"]


def test_a_pack_replaced_by_another_file_is_checked_again(v3: Path, tmp_path: Path) -> None:
    """The pack's name given to another inode (the same bytes, then others): read again, the
    same frames; different bytes are damage."""
    store, mp4 = _linked(v3, tmp_path)
    pack = store / TOP / "pack/0"
    a, b = _range(store, 6)
    with TrajectoryReplayBuffer.load_from(store, read_only=True) as buf:
        want = buf[0:18]["step_data"][CAM]
        shutil.copyfile(mp4, tmp_path / "twin")
        os.replace(tmp_path / "twin", pack)
        np.testing.assert_array_equal(buf[0:18]["step_data"][CAM], want)
        data = bytearray(pack.read_bytes())
        data[(a + b) // 2] ^= 0xFF
        (tmp_path / "other").write_bytes(bytes(data))
        os.replace(tmp_path / "other", pack)
        with pytest.raises(DamagedStoreError, match=r"rows 6\.\.13 .*do not match their checksum"):
            buf[6:14]["step_data"]


def test_an_unchanged_pack_is_read_with_no_checksum_pass(v3: Path, tmp_path: Path) -> None:
    store, _mp4 = _linked(v3, tmp_path)
    _settle(store / TOP / "pack/0")
    with TrajectoryReplayBuffer.load_from(store, read_only=True) as buf:
        want = buf[0:18]["step_data"][CAM]  # each segment opened: one checksum pass each
        before = video_pack.checks_done()
        for _ in range(3):
            for lo, hi in ((0, 6), (6, 14), (14, 18), (9, 10), (2, 16)):
                np.testing.assert_array_equal(buf[lo:hi]["step_data"][CAM], want[lo:hi])
        assert video_pack.checks_done() == before


def _child_read(buf: TrajectoryReplayBuffer, go: object, out: object) -> None:
    go.wait(30)  # type: ignore[attr-defined]
    try:
        buf[6:14]["step_data"]
        out.put("read")  # type: ignore[attr-defined]
    except DamagedStoreError as e:
        out.put(f"DamagedStoreError: {e}")  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 (reported to the parent)
        out.put(f"{type(e).__name__}: {e}")  # type: ignore[attr-defined]


def test_a_forked_worker_sees_a_change_made_after_its_parent_checked(v3: Path, tmp_path: Path) -> None:
    """A DataLoader worker forked from a reader that checked the segment: the pack edited after
    the fork, the worker's read (the parent's stamp, its own fstat) is damage too."""
    import multiprocessing as mp

    store, mp4 = _linked(v3, tmp_path)
    a, b = _range(store, 6)
    _settle(store / TOP / "pack/0")
    ctx = mp.get_context("fork")
    with TrajectoryReplayBuffer.load_from(store, read_only=True) as buf:
        buf[0:18]["step_data"]  # checked, trusted stamps
        go, out = ctx.Event(), ctx.Queue()
        child = ctx.Process(target=_child_read, args=(buf, go, out))
        child.start()
        try:
            _flip_keeping_mtime(mp4, (a + b) // 2)
            go.set()
            got = out.get(timeout=60)
        finally:
            child.join(30)
    assert got.startswith("DamagedStoreError") and "rows 6..13" in got and "checksum" in got, got


def test_a_batch_over_several_segments_on_the_decode_threads(v3: Path, tmp_path: Path) -> None:
    """One gather over every segment (their GOPs on the decode threads) after one pack byte
    changed: the damaged segment's rows are named; the others read alone."""
    store, mp4 = _linked(v3, tmp_path)
    a, b = _range(store, 14)
    with TrajectoryReplayBuffer.load_from(store, read_only=True) as buf:
        want = buf[0:18]["step_data"][CAM]
        _flip_keeping_mtime(mp4, (a + b) // 2)
        with pytest.raises(DamagedStoreError, match=r"rows 14\.\.17 .*checksum"):
            buf[0:18]["step_data"]
        np.testing.assert_array_equal(buf[0:14]["step_data"][CAM], want[:14])
