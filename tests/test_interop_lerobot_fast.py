"""import_lerobot's shortcuts (issue 32): the MP4 sample table read from the ``moov`` box instead of
demuxing every packet, adopted packets copied file to file (``FileSpan`` pieces), and verify
mapping video segments instead of reading them.  Each shortcut must give what the long way gives,
and refuse (or step aside for) what the long way refuses."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")
pytest.importorskip("pyarrow")

from lerobot_fixture import write_v3  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.errors import ForeignFileError  # noqa: E402
from trajstore.interop import import_lerobot  # noqa: E402
from trajstore.interop.lerobot_video import Mp4Writer, index_packets  # noqa: E402
from trajstore.interop.mp4_table import plain_table  # noqa: E402
from trajstore.maintenance.verify import verify_store  # noqa: E402
from trajstore.storage.spans import FileSpan, join_pieces, write_pieces  # noqa: E402

CAM = "observation.images.top"
MP4 = f"videos/{CAM}/chunk-000/file-000.mp4"


def _frames(n: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    base = g.integers(0, 255, (48, 64, 3), dtype=np.uint8)
    return np.stack([np.roll(base, 3 * i, axis=1) for i in range(n)])


def _demuxed(path: Path) -> tuple[np.ndarray, ...]:
    """(pts, pos, size, keys) as FFmpeg's demuxer gives them."""
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        rows = [(p.pts, p.pos, p.size, p.is_keyframe) for p in c.demux(s) if p.size and p.pts is not None]
    pts, pos, size, keys = zip(*rows)
    return np.array(pts), np.array(pos), np.array(size), np.array(keys, bool)


def _table_of(path: Path) -> tuple[np.ndarray, ...] | None:
    with open(path, "rb", buffering=0) as f:
        t = plain_table(f)
    return None if t is None else (t.pts, t.pos, t.size, t.keys)


@pytest.mark.parametrize("codec", ["av1", "h264"])
def test_the_sample_table_is_the_demuxers(tmp_path: Path, codec: str) -> None:
    path = tmp_path / "v.mp4"
    w = Mp4Writer(str(path), 10, (48, 64), codec=codec, gop=3)
    for e in range(3):
        w.add(_frames(7 + e, e), new_episode=True)
    w.close()
    got, want = _table_of(path), _demuxed(path)
    assert got is not None
    for a, b in zip(got, want):
        assert np.array_equal(a, b)


def test_b_frames_are_not_plain_and_are_demuxed(tmp_path: Path) -> None:
    path = tmp_path / "b.mp4"
    with av.open(str(path), "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=10)
        s.height, s.width, s.pix_fmt = 48, 64, "yuv420p"
        s.options = {"bf": "2", "g": "8", "preset": "ultrafast"}
        for i, f in enumerate(_frames(16)):
            vf = av.VideoFrame.from_ndarray(f, format="rgb24")
            vf.pts = i
            for p in s.encode(vf):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    assert _table_of(path) is None  # composition offsets: display order is not file order
    with open(path, "rb", buffering=0) as f:
        idx = index_packets(f, str(path))
        try:
            assert idx.codec is None and len(idx.pos) == 16  # demuxed, and not adoptable
        finally:
            idx.close()


def test_a_uniform_size_table_claiming_billions_of_samples_allocates_nothing_for_them(tmp_path: Path) -> None:
    """stsz with one size for all samples states the count in 4 bytes: 2**32 - 1 samples would size
    34 GB of arrays; the table is not plain (bounded by MAX_SAMPLES) and nothing large is allocated."""
    import tracemalloc

    d = Path(write_v3(str(tmp_path / "d"), [5, 4], (CAM,)))
    mp4 = d / MP4
    data = bytearray(mp4.read_bytes())
    at = data.index(b"stsz", data.rindex(b"moov") - 4) + 4  # payload: version+flags, size, count
    data[at + 4 : at + 8] = (1).to_bytes(4, "big")
    data[at + 8 : at + 12] = (2**32 - 1).to_bytes(4, "big")
    mp4.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        assert _table_of(mp4) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


@pytest.mark.parametrize("damage", ["truncated", "stsz-count", "moov-size"])
def test_a_damaged_table_is_left_to_the_demuxer(tmp_path: Path, damage: str) -> None:
    d = Path(write_v3(str(tmp_path / "d"), [5, 4], (CAM,)))
    mp4 = d / MP4
    data = bytearray(mp4.read_bytes())
    moov = data.rindex(b"moov") - 4
    if damage == "truncated":  # the moov kept, the packets cut: samples outside the file
        data = data[:200] + data[moov:]
        data[36:40] = (len(data) - 32).to_bytes(4, "big")  # (any size: the table is not plain either way)
    elif damage == "stsz-count":
        at = data.index(b"stsz", moov) + 4
        data[at + 8 : at + 12] = (1 << 30).to_bytes(4, "big")
    else:
        data[moov : moov + 4] = (1 << 31).to_bytes(4, "big")
    mp4.write_bytes(bytes(data))
    assert _table_of(mp4) is None
    if damage == "moov-size":  # FFmpeg reads a last box running past the file's end: so does the import
        assert import_lerobot(d, tmp_path / "s")["adopted"] == {CAM: 2}
        return
    with pytest.raises(ForeignFileError, match="file-000.mp4"):
        import_lerobot(d, tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_import_adopts_packets_byte_for_byte_and_verifies(tmp_path: Path) -> None:
    d = Path(write_v3(str(tmp_path / "d"), [6, 9, 5], (CAM,), files=2))
    out = import_lerobot(d, tmp_path / "s")
    assert out["adopted"] == {CAM: 3} and verify_store(tmp_path / "s", deep=True).ok
    segs = tmp_path / "s" / "step_data" / CAM / "video"
    packets = b"".join((d / f"videos/{CAM}/chunk-000/file-00{k}.mp4").read_bytes() for k in range(2))
    for name in ("0", "6", "15"):
        seg = (segs / name).read_bytes()
        n = int.from_bytes(seg[-12:-4], "little")
        body = seg[8 : len(seg) - 24 * n - 12]
        assert body and body in packets  # the MP4's packets, one run, unchanged
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as b:
        assert len(b) == 20


def test_pieces_copy_spans_and_refuse_a_file_that_ends_early(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(bytes(range(256)) * 64)
    with open(src, "rb", buffering=0) as f:
        pieces = [b"head", FileSpan(f, 100, 5000, "src.mp4"), bytearray(b"tail")]
        fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            write_pieces(fd, pieces)
        finally:
            os.close(fd)
        want = b"head" + src.read_bytes()[100:5100] + b"tail"
        assert (tmp_path / "out").read_bytes() == want == join_pieces(pieces)
        with pytest.raises(ForeignFileError, match="src.mp4: the file ends"):
            join_pieces([FileSpan(f, 16000, 1000, "src.mp4")])
        fd = os.open(tmp_path / "out2", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            with pytest.raises(ForeignFileError, match="src.mp4: the file ends"):
                write_pieces(fd, [FileSpan(f, 16000, 1000, "src.mp4")])
        finally:
            os.close(fd)
    with pytest.raises(ValueError):  # a closed file is never read through a reused descriptor
        join_pieces([FileSpan(f, 0, 10, "src.mp4")])


@pytest.mark.parametrize("damage", ["short", "grown", "missing", "link"])
def test_verify_without_deep_still_finds_damaged_segments(tmp_path: Path, damage: str) -> None:
    d = Path(write_v3(str(tmp_path / "d"), [6, 5], (CAM,)))
    import_lerobot(d, tmp_path / "s")
    seg = tmp_path / "s" / "step_data" / CAM / "video" / "6"
    data = seg.read_bytes()
    if damage == "short":
        seg.write_bytes(data[:-30])
    elif damage == "grown":  # past what 5 rows of 48x64 frames may hold
        seg.write_bytes(data + bytes(5 * 2 * 48 * 64 * 3 + 8192))
    elif damage == "missing":
        seg.unlink()
    else:
        shutil.move(seg, tmp_path / "outside")
        seg.symlink_to(tmp_path / "outside")
    rep = verify_store(tmp_path / "s")
    assert not rep.ok and f"step_data/{CAM}/video/6" in str(rep)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a second filesystem (tmpfs at /dev/shm)")
def test_a_span_from_another_filesystem_is_copied_through_memory(tmp_path: Path) -> None:
    """``copy_file_range`` refuses a copy across filesystems (EXDEV): the span is read and written
    in blocks instead, with the same bytes."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        src = Path(shm) / "src"
        src.write_bytes(os.urandom(100_000))
        with open(src, "rb", buffering=0) as f:
            fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                write_pieces(fd, [b"h", FileSpan(f, 10, 99_990, "src"), b"t"])
            finally:
                os.close(fd)
        assert (tmp_path / "out").read_bytes() == b"h" + src.read_bytes()[10:] + b"t"
