"""JPEG frames decode with simplejpeg where it is installed, else with imagecodecs (issue 31): the
same stored bytes (imagecodecs encodes every frame) must decode to the same arrays either way, for
every frame layout a JPEG field holds; a frame of another size is refused by both; a store whose
process lacks simplejpeg reads on with imagecodecs.

Real stores on disk, the real libraries (both libjpeg-turbo), a fresh process without simplejpeg.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box

import trajstore.images as ti
from trajstore import ReplayBuffer
from trajstore.errors import BadOptionError, DamagedStoreError
from trajstore.storage.fields.image_codecs import jpeg_decoder

imagecodecs = pytest.importorskip("imagecodecs")
pytest.importorskip("simplejpeg")

ROOT = str(Path(__file__).resolve().parents[1])


def _frames(n: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """``n`` frames with edges and gradients (shifted sines plus a little noise), uint8."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0 : shape[0], 0 : shape[1]].astype(np.float64)
    out = np.empty((n, *shape), np.uint8)
    for i in range(n):
        base = 127 + 90 * np.sin((x + 3 * i) / 5) * np.cos((y - 2 * i) / 7)
        img = base[..., None] + 25 * np.arange(shape[2]) if len(shape) == 3 else base
        out[i] = (img + rng.normal(0, 6, img.shape)).clip(0, 255)
    return out


def _read(path: Path, idx: np.ndarray, library: str) -> np.ndarray:
    ti.set_jpeg_decoder(library)
    try:
        with ReplayBuffer.load_from(str(path), read_only=True) as ro:
            return np.asarray(ro[idx])
    finally:
        ti.set_jpeg_decoder(None)


@pytest.mark.parametrize("shape", [(84, 84, 3), (84, 84), (84, 84, 1), (84, 84, 4), (4, 84, 84), (37, 53, 3)])
def test_both_libraries_decode_a_store_to_the_same_arrays(tmp_path, shape):
    """RGB (4:2:0, fancy upsampling), grey, (H, W, 1), frame stacks as 4 grey planes (either axis)
    and odd sizes (partial MCUs): simplejpeg's arrays equal imagecodecs', bit for bit, on 1 and 2
    decode threads; the default is simplejpeg."""
    imgs = _frames(48, shape)
    with ReplayBuffer.create(Box(0, 255, shape, np.uint8), cache_path=str(tmp_path / "s"), capacity=64,
                             compressor="jpeg:90", chunk_rows=16) as rb:
        rb.extend(imgs)
    idx = np.array([47, 3, 3, 20, 0, 31, 16, 15, 46, 8, 8, 1])
    want = _read(tmp_path / "s", idx, "imagecodecs")
    assert 10 * np.log10(255**2 / ((want.astype(float) - imgs[idx]) ** 2).mean()) > 30  # decoded, not zeros
    for threads in (1, 2):
        ti.set_decode_threads(threads)
        try:
            assert np.array_equal(_read(tmp_path / "s", idx, "simplejpeg"), want)
        finally:
            ti.set_decode_threads(None)
    assert jpeg_decoder().__module__ == jpeg_decoder("simplejpeg").__module__
    assert jpeg_decoder().__qualname__ == jpeg_decoder("simplejpeg").__qualname__ != \
        jpeg_decoder("imagecodecs").__qualname__


@pytest.mark.parametrize("quality", [10, 75, 95, 100])
def test_both_libraries_decode_the_same_bytes_to_the_same_pixels(quality):
    """imagecodecs' JPEG bytes at qualities from coarse to the finest tables, RGB, grey and a size
    of partial MCUs, decoded into preallocated frames."""
    for shape in ((64, 80, 3), (64, 80), (17, 9, 3)):
        for img in _frames(6, shape, seed=quality):
            data = imagecodecs.jpeg8_encode(img, level=quality)
            a, b = np.zeros(shape, np.uint8), np.full(shape, 7, np.uint8)
            jpeg_decoder("imagecodecs")(data, a)
            jpeg_decoder("simplejpeg")(data, b)
            assert np.array_equal(a, b), (shape, quality)


@pytest.mark.parametrize("library", ["imagecodecs", "simplejpeg"])
def test_an_image_of_another_size_is_refused_by_both(library):
    """A larger image does not fit ``out`` (refused before decoding), a smaller one does not fill
    it: both raise (the field turns it into DamagedStoreError naming the row)."""
    dec = jpeg_decoder(library)
    for size in ((200, 300), (8, 8), (84, 42)):
        data = imagecodecs.jpeg8_encode(np.zeros((*size, 3), np.uint8), level=50)
        with pytest.raises(Exception) as e:  # noqa: B017, PT011 - each library's own error type
            dec(data, np.zeros((84, 84, 3), np.uint8))
        assert not isinstance(e.value, (MemoryError, SystemError)), e.value
    with pytest.raises(Exception):  # noqa: B017, PT011
        dec(b"\xff\xd8\x00 not a jpeg", np.zeros((84, 84, 3), np.uint8))


def test_a_damaged_frame_raises_with_either_library(tmp_path):
    imgs = _frames(16, (32, 32, 3))
    with ReplayBuffer.create(Box(0, 255, (32, 32, 3), np.uint8), cache_path=str(tmp_path / "s"), capacity=16,
                             compressor="jpeg:90", chunk_rows=16) as rb:
        rb.extend(imgs)
    shard = next(p for p in sorted((tmp_path / "s" / "step_data" / "c").rglob("*")) if p.is_file())
    data = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(data[-4 - 16 * 16 : -4]), "<u8").reshape(16, 2)
    off, size = (int(v) for v in index[5])
    data[off : off + size] = b"\x00" * size
    shard.write_bytes(bytes(data))
    for library in ("imagecodecs", "simplejpeg"):
        with pytest.raises(DamagedStoreError, match=r"row 5 \(chunk 0\) does not decode"):
            _read(tmp_path / "s", np.arange(16), library)


def test_set_jpeg_decoder_refuses_unknown_names():
    for bad in ("pillow", "", 3):
        with pytest.raises(BadOptionError, match="simplejpeg"):
            ti.set_jpeg_decoder(bad)  # type: ignore[arg-type]
    assert ti.JPEG_DECODERS == ("simplejpeg", "imagecodecs")


def test_without_simplejpeg_frames_decode_with_imagecodecs(tmp_path):
    """A process where simplejpeg is missing reads the store with imagecodecs (the same arrays),
    and asking for simplejpeg names the extra."""
    imgs = _frames(8, (24, 24, 3))
    with ReplayBuffer.create(Box(0, 255, (24, 24, 3), np.uint8), cache_path=str(tmp_path / "s"), capacity=8,
                             compressor="jpeg:90") as rb:
        rb.extend(imgs)
    np.save(tmp_path / "want.npy", _read(tmp_path / "s", np.arange(8), "simplejpeg"))
    code = (
        "import sys; sys.modules['simplejpeg'] = None  # as if it were not installed\n"
        "import numpy as np\n"
        "import trajstore.images as ti\n"
        "from trajstore import ReplayBuffer\n"
        "from trajstore.errors import MissingDependencyError\n"
        f"with ReplayBuffer.load_from({str(tmp_path / 's')!r}, read_only=True) as ro:\n"
        f"    print('SAME', np.array_equal(np.asarray(ro[np.arange(8)]), np.load({str(tmp_path / 'want.npy')!r})))\n"
        "try:\n"
        "    ti.set_jpeg_decoder('simplejpeg')\n"
        "except MissingDependencyError as e:\n"
        "    print('MISSING', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    assert "SAME True" in out.stdout, out.stdout + out.stderr
    assert "MISSING" in out.stdout and "pip install 'trajstore[images]'" in out.stdout, out.stdout
