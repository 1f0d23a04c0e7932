"""Image fields (issue 31): per-frame image codecs inside zarr shards of one-frame inner chunks.

Real stores on disk, real imagecodecs encoders, a plain zarr-python reader in a fresh process, a
real writer process killed with SIGKILL, and damaged shard bytes written into a real store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict

import trajstore.images as ti
from trajstore import ReplayBuffer
from trajstore.errors import BadOptionError, DamagedStoreError, MissingDependencyError

pytest.importorskip("imagecodecs")

ROOT = str(Path(__file__).resolve().parents[1])


def frames(n: int, shape: tuple[int, ...], dtype: str = "uint8", seed: int = 0) -> np.ndarray:
    """``n`` smooth synthetic frames (sums of sines, shifted per frame and per channel): what a
    rendered scene looks like to a codec, unlike noise."""
    rng = np.random.default_rng(seed)
    hi = np.iinfo(dtype).max
    h, w = (shape[1], shape[2]) if len(shape) == 3 and shape[0] < shape[2] and shape[2] > 4 else shape[:2]
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    planes = shape[2] if len(shape) == 3 and not (shape[0] < shape[2] and shape[2] > 4) else (
        shape[0] if len(shape) == 3 else 1)
    out = np.empty((n, *shape), dtype)
    for i in range(n):
        fx, fy, ph = rng.uniform(3, 12), rng.uniform(3, 12), rng.uniform(0, 6)
        ps = [0.5 + 0.25 * np.sin(x / fx + ph + c) + 0.2 * np.cos(y / fy - c) for c in range(planes)]
        img = np.stack([(p * hi).round().clip(0, hi) for p in ps], -1 if len(shape) != 3 or shape[2] <= 4 else 0)
        out[i] = img.reshape(shape).astype(dtype)
    return out


def psnr(a: np.ndarray, b: np.ndarray, peak: float = 255.0) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(peak**2 / mse)


def make(path: Path | str, shape: tuple[int, ...], compressor, dtype: str = "uint8", capacity: int | None = None,
         **kw) -> ReplayBuffer:
    space = Dict({"img": Box(0, np.iinfo(dtype).max, shape, np.dtype(dtype)), "seq": Box(0, 2**62, (), np.int64)})
    return ReplayBuffer.create(space, cache_path=str(path), capacity=capacity, compressor={"img": compressor}, **kw)


def fill(rb: ReplayBuffer, imgs: np.ndarray, step: int = 7, flush_every: int = 3) -> None:
    """Append ``imgs`` in small batches with flushes between (partial shards rewritten many times)."""
    for j, lo in enumerate(range(0, len(imgs), step)):
        part = imgs[lo : lo + step]
        rb.extend({"img": part, "seq": np.arange(lo, lo + len(part))})
        if j % flush_every == 0:
            rb.flush()
    rb.flush()


LOSSLESS = [("png", "uint8"), ("png", "uint16"), ("webp-lossless", "uint8"), ("jpegxl-lossless", "uint8"),
            ("jpegxl-lossless", "uint16"), ("jpeg2k", "uint8")]
SHAPES = [(40, 48), (40, 48, 1), (40, 48, 3), (40, 48, 4), (4, 40, 48)]


@pytest.mark.parametrize("codec,dtype", LOSSLESS)
@pytest.mark.parametrize("shape", SHAPES)
def test_lossless_round_trip_is_exact(tmp_path, codec, dtype, shape):
    imgs = frames(50, shape, dtype)
    with make(tmp_path / "s", shape, codec, dtype) as rb:
        fill(rb, imgs)
        assert np.array_equal(rb[np.arange(50)]["img"], imgs)  # the writer's own rows
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert np.array_equal(ro[:]["img"], imgs)
        idx = np.random.default_rng(1).integers(0, 50, 64)
        assert np.array_equal(ro[idx]["img"], imgs[idx])
        assert np.array_equal(ro[7]["img"], imgs[7])


@pytest.mark.parametrize("codec,min_db", [("jpeg:90", 36), ("jpeg:50", 30), ("webp:90", 33), ("avif:80", 33),
                                          ("jpegxl:90", 35), ("jpeg2k:60", 35)])
@pytest.mark.parametrize("shape", [(84, 84, 3), (84, 84), (84, 84, 4)])
def test_lossy_codec_psnr_and_size(tmp_path, codec, min_db, shape):
    imgs = frames(40, shape)
    with make(tmp_path / "s", shape, codec) as rb:
        fill(rb, imgs)
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        got = ro[:]["img"]
    assert got.shape == imgs.shape and got.dtype == imgs.dtype
    assert psnr(got, imgs) >= min_db, f"{codec} {shape}: {psnr(got, imgs):.1f} dB"
    on_disk = sum(p.stat().st_size for p in (tmp_path / "s" / "step_data" / "img").rglob("c/**/*") if p.is_file())
    assert on_disk < imgs.nbytes / 2, f"{codec}: {on_disk} bytes on disk for {imgs.nbytes} raw"


def test_codec_settings_are_in_the_metadata(tmp_path):
    with make(tmp_path / "s", (84, 84, 4), "jpeg:75", capacity=100):
        pass
    meta = json.loads((tmp_path / "s" / "step_data" / "img" / "zarr.json").read_text())
    (shard,) = meta["codecs"]
    assert shard["name"] == "sharding_indexed"
    assert shard["configuration"]["chunk_shape"] == [1, 84, 84, 4]  # every frame decodes alone
    assert shard["configuration"]["codecs"] == [{"name": "trajstore.image", "configuration": {
        "format": "jpeg", "level": 75, "lossless": False, "planes": -1}}]
    root = json.loads((tmp_path / "s" / "zarr.json").read_text())
    fields = root["attributes"]["trajstore"]["tables"]
    assert any(f["layout"] == "image" for t in (fields.values() if isinstance(fields, dict) else fields)
               for f in (t["fields"] if isinstance(t, dict) else []))


def test_plain_zarr_reader_opens_an_image_field(tmp_path):
    imgs = frames(30, (32, 40, 3))
    with make(tmp_path / "s", (32, 40, 3), "webp-lossless", capacity=64) as rb:
        fill(rb, imgs)
    code = ("import sys, numpy as np, zarr\n"
            "import trajstore.images  # registers the codec (docs/format.md)\n"
            f"z = zarr.open_array({str(tmp_path / 's' / 'step_data' / 'img')!r}, mode='r')\n"
            "np.save(sys.argv[1], z[:30])\n")
    out = tmp_path / "plain.npy"
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, env={**os.environ, "PYTHONPATH": ROOT},
                   timeout=120)
    assert np.array_equal(np.load(out), imgs)


def test_thread_pool_decode_equals_serial(tmp_path):
    imgs = frames(300, (48, 48, 3))
    with make(tmp_path / "s", (48, 48, 3), "jpeg:90", chunk_rows=32) as rb:
        fill(rb, imgs, step=50)
    idx = np.random.default_rng(3).integers(0, 300, 256)
    try:
        with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
            ti.set_decode_threads(1)
            serial = ro[idx]["img"]
            ti.set_decode_threads(4)
            threaded = ro[idx]["img"]
            windows = ro.sample(64, rng=5)["img"]
    finally:
        ti.set_decode_threads(None)
    assert np.array_equal(serial, threaded)
    assert windows.shape == (64, 48, 48, 3)
    assert psnr(serial, imgs[idx]) > 35
    with pytest.raises(BadOptionError, match="1..256"):
        ti.set_decode_threads(0)


def test_committed_frames_are_never_encoded_again(tmp_path):
    """A flush encodes only rows written since: lossy frames of a shard being filled keep their
    first encoding (re-encoding decoded JPEG would lose quality at every commit)."""
    imgs = frames(40, (64, 64, 3))
    with make(tmp_path / "s", (64, 64, 3), "jpeg:60", chunk_rows=64) as rb:
        rb.extend({"img": imgs[:10], "seq": np.arange(10)})
        rb.flush()
        with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
            first = ro[:10]["img"]
        for lo in range(10, 40, 3):  # nine more commits of the same shard
            rb.extend({"img": imgs[lo : lo + 3], "seq": np.arange(lo, min(lo + 3, 40))})
            rb.flush()
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert np.array_equal(ro[:10]["img"], first)


def test_ring_overwrite_of_image_rows(tmp_path):
    imgs = frames(100, (32, 32))
    with make(tmp_path / "s", (32, 32), "png", capacity=48, chunk_rows=16) as rb:
        fill(rb, imgs, step=5)
        assert len(rb) == 48
        assert np.array_equal(rb[:]["img"], imgs[52:])
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert np.array_equal(ro[:]["img"], imgs[52:])
        assert np.array_equal(ro[:]["seq"], np.arange(52, 100))


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["jpeg:90", "webp:80", "avif"])
def test_float_frames_refused_at_create_with_the_allowed_list(tmp_path, codec):
    with pytest.raises(BadOptionError, match="uint8") as e:
        ReplayBuffer.create(Dict({"img": Box(0, 1, (16, 16, 3), np.float32)}), cache_path=str(tmp_path / "s"),
                            capacity=8, compressor={"img": codec})
    assert "float32" in str(e.value)
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())  # nothing written


@pytest.mark.parametrize("compressor,match", [
    ({"img": "jpeg:101"}, "1..100"), ({"img": "png:90"}, "0..9"), ({"img": "jpeg-lossless"}, "lossy only"),
    ({"imgs": "jpeg"}, "name no field"), ({"img": "bmp"}, "compressor must be")])
def test_bad_image_compressor_options(tmp_path, compressor, match):
    with pytest.raises(BadOptionError, match=match):
        ReplayBuffer.create(Dict({"img": Box(0, 255, (16, 16, 3), np.uint8)}), cache_path=str(tmp_path / "s"),
                            capacity=8, compressor=compressor)


def test_frame_shapes_a_codec_cannot_hold(tmp_path):
    with pytest.raises(BadOptionError, match=r"\(H, W\), \(H, W, C\)"):
        ReplayBuffer.create(Dict({"img": Box(0, 255, (2, 3, 16, 16), np.uint8)}), cache_path=str(tmp_path / "s"),
                            capacity=8, compressor={"img": "jpeg"})
    with pytest.raises(BadOptionError, match="jpeg"):  # RGBA asked for explicitly: JPEG holds no alpha
        ReplayBuffer.create(Dict({"img": Box(0, 255, (16, 16, 4), np.uint8)}), cache_path=str(tmp_path / "t"),
                            capacity=8, compressor={"img": ti.ImageCodec("jpeg", 90, planes=None)})


def _shard_file(store: Path) -> Path:
    return next(p for p in sorted((store / "step_data" / "img" / "c").rglob("*")) if p.is_file())


def test_damaged_frame_raises_naming_field_and_row(tmp_path):
    imgs = frames(16, (32, 32, 3))
    with make(tmp_path / "s", (32, 32, 3), "jpeg:90", capacity=16, chunk_rows=16) as rb:
        fill(rb, imgs)
    shard = _shard_file(tmp_path / "s")
    data = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(data[-4 - 16 * 16 : -4]), "<u8").reshape(16, 2)
    off, size = (int(v) for v in index[5])
    data[off : off + size] = b"\x00" * size  # frame 5's bytes, index and checksum intact
    shard.write_bytes(bytes(data))
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert psnr(ro[4]["img"], imgs[4]) > 30  # its neighbours still read
        with pytest.raises(DamagedStoreError, match=r"step_data/img: row 5 \(chunk 0\) does not decode"):
            ro[np.arange(16)]
        with pytest.raises(DamagedStoreError, match="row 5"):
            ro[5]


@pytest.mark.parametrize("damage", ["checksum", "offset", "truncated"])
def test_damaged_shard_index_raises(tmp_path, damage):
    imgs = frames(8, (16, 16))
    with make(tmp_path / "s", (16, 16), "png", capacity=8, chunk_rows=8) as rb:
        fill(rb, imgs)
    shard = _shard_file(tmp_path / "s")
    data = bytearray(shard.read_bytes())
    if damage == "checksum":
        data[-1] ^= 0xFF
    elif damage == "offset":  # a frame placed past the end, with a checksum that matches
        import google_crc32c
        ib = len(data) - 4 - 16 * 8
        data[ib : ib + 8] = (2**40).to_bytes(8, "little")
        data[-4:] = google_crc32c.value(bytes(data[ib:-4])).to_bytes(4, "little")
    else:
        data = data[:20]
    shard.write_bytes(bytes(data))
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro, \
            pytest.raises(DamagedStoreError, match="step_data/img: chunk 0 does not decode"):
        ro[np.arange(8)]


def _rewrite_meta(store: Path, change) -> None:
    """Apply ``change`` to the image codec entry (the sharding codec's JSON) of every zarr.json."""
    def walk(obj):
        if isinstance(obj, dict):
            if obj.get("name") == "sharding_indexed":
                change(obj["configuration"])
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)
    for p in store.rglob("zarr.json"):
        meta = json.loads(p.read_text())
        walk(meta)
        p.write_text(json.dumps(meta))


@pytest.mark.parametrize("change", [
    lambda c: c["codecs"][0]["configuration"].update(format="bmp"),
    lambda c: c["codecs"][0].update(name="numcodecs.pickle"),
    lambda c: c["codecs"][0]["configuration"].update(level=500),
    lambda c: c.update(chunk_shape=[2, 16, 16]),
    lambda c: c.update(index_codecs=[{"name": "bytes", "configuration": {"endian": "little"}}])],
    ids=["format", "name", "level", "inner-chunks", "index-codecs"])
def test_unknown_image_codec_in_metadata_is_refused_at_open(tmp_path, change):
    with make(tmp_path / "s", (16, 16), "png", capacity=8, chunk_rows=8) as rb:
        fill(rb, frames(8, (16, 16)))
    _rewrite_meta(tmp_path / "s", change)
    with pytest.raises(DamagedStoreError, match="step_data/img"):
        ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True)


_NO_IMAGECODECS = "import sys; sys.modules['imagecodecs'] = None  # as if it were not installed\n"


def test_missing_imagecodecs_names_the_extra(tmp_path):
    with make(tmp_path / "s", (16, 16, 3), "jpeg:90", capacity=8, chunk_rows=8) as rb:
        fill(rb, frames(8, (16, 16, 3)))
    code = _NO_IMAGECODECS + (
        "import numpy as np\n"
        "from gymnasium.spaces import Box, Dict\n"
        "from trajstore import ReplayBuffer\n"
        "from trajstore.errors import MissingDependencyError\n"
        "try:\n"
        f"    ReplayBuffer.create(Dict({{'i': Box(0, 255, (8, 8), np.uint8)}}), cache_path={str(tmp_path / 'n')!r},\n"
        "                        capacity=4, compressor={'i': 'png'})\n"
        "except MissingDependencyError as e:\n"
        "    print('CREATE', e)\n"
        f"rb = ReplayBuffer.load_from({str(tmp_path / 's')!r}, read_only=True)\n"
        "print('LEN', len(rb))  # the store opens\n"
        "try:\n"
        "    rb[0]\n"
        "except MissingDependencyError as e:\n"
        "    print('READ', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    assert "CREATE" in out and "READ" in out and "LEN 8" in out, out
    assert out.count("pip install 'trajstore[images]'") == 2, out
    assert issubclass(MissingDependencyError, ImportError)


# -- crash safety ---------------------------------------------------------------------------------
_WRITER = """
import os, sys, numpy as np
sys.path.insert(0, {tests!r})
from test_image_fields import frames
from trajstore import ReplayBuffer
rb = ReplayBuffer.load_from({store!r})
log = os.open({log!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
imgs = frames(64, (24, 24, 3))
seq = len(rb)
open({ready!r}, "w").close()
while True:
    n = 1 + seq % 5
    rb.extend({{"img": imgs[(np.arange(seq, seq + n)) % 64], "seq": np.arange(seq, seq + n)}})
    seq += n
    if seq % 3 == 0:
        rb.flush()
        os.write(log, f"{{seq}}\\n".encode())
"""


def test_sigkill_during_appends_of_an_image_field(tmp_path):
    from trajstore.maintenance.verify import verify_store

    store, log, ready = tmp_path / "s", tmp_path / "log", tmp_path / "ready"
    with make(store, (24, 24, 3), "png", chunk_rows=16):
        pass
    imgs = frames(64, (24, 24, 3))
    rng = np.random.default_rng(0)
    for _round in range(3):
        ready.unlink(missing_ok=True)
        code = _WRITER.format(tests=str(Path(__file__).parent), store=str(store), log=str(log), ready=str(ready))
        p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT})
        try:
            deadline = time.monotonic() + 60
            while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(float(rng.uniform(0.2, 0.8)))
            assert p.poll() is None, "the writer died before it was killed"
            p.send_signal(signal.SIGKILL)
        finally:
            p.kill()
            p.wait(30)
        assert p.returncode == -signal.SIGKILL
        flushed = max([int(x) for x in log.read_text().split("\n")[:-1] if x.strip()] or [0])
        with ReplayBuffer.load_from(str(store), read_only=True) as ro:
            n = len(ro)
            assert n >= flushed, f"rows lost: {n} in the store, {flushed} committed before the kill"
            got = ro[:]
            assert np.array_equal(got["seq"], np.arange(n))
            assert np.array_equal(got["img"], imgs[np.arange(n) % 64])  # lossless: every frame exact
        report = verify_store(str(store), deep=True)
        assert report.ok, report


# -- stable-baselines3 buffers ----------------------------------------------------------------------
def _atari_like(t: int) -> np.ndarray:
    """A channel-first (4, 84, 84) frame stack that depends on ``t`` only."""
    y, x = np.mgrid[0:84, 0:84]
    return np.stack([(128 + 60 * np.sin((x + t + c) / 7) + 50 * np.cos(y / 9)).astype(np.uint8) for c in range(4)])


@pytest.mark.parametrize("compressor,omu", [({"obs": "png"}, False), ({"obs": "jpeg:90"}, True),
                                            ({"obs": "webp-lossless", "*": "zstd"}, False)])
def test_sb3_replay_buffer_with_an_image_codec(tmp_path, compressor, omu):
    pytest.importorskip("stable_baselines3")
    import gymnasium as gym

    from trajstore.sb3 import ZarrReplayBuffer

    obs_space, act = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), gym.spaces.Discrete(4)
    kw = {"cache_path": str(tmp_path / "b"), "n_envs": 2, "compressor": compressor, "optimize_memory_usage": omu,
          "handle_timeout_termination": not omu}
    rb = ZarrReplayBuffer(64, obs_space, act, **kw)
    for t in range(100):  # the ring wraps
        o = np.stack([_atari_like(t)] * 2)
        rb.add(o, np.stack([_atari_like(t + 1)] * 2), np.zeros((2, 1)), np.full(2, float(t)), np.zeros(2), [{}, {}])
    rb.close()
    rb = ZarrReplayBuffer(64, obs_space, act, resume=True, **kw)  # reopened: the frames come from the shards
    s = rb.sample(48)
    ts = s.rewards.numpy().ravel().astype(int)
    ref = np.stack([_atari_like(t) for t in ts])
    nxt = np.stack([_atari_like(t + 1) for t in ts])
    obs, next_obs = s.observations.numpy(), s.next_observations.numpy()
    if "png" in compressor["obs"] or "lossless" in compressor["obs"]:
        assert np.array_equal(obs, ref) and np.array_equal(next_obs, nxt)
    else:
        assert psnr(obs, ref) > 35 and psnr(next_obs, nxt) > 35
    rb.close()
    metas = [json.loads(p.read_text()) for p in (tmp_path / "b").rglob("obs.0/zarr.json")]
    assert metas and all(m["codecs"][0]["name"] == "sharding_indexed" for m in metas)


def test_sb3_compressor_key_that_names_nothing(tmp_path):
    pytest.importorskip("stable_baselines3")
    import gymnasium as gym

    from trajstore.sb3 import ZarrReplayBuffer

    with pytest.raises(BadOptionError, match="name nothing stored"):
        ZarrReplayBuffer(16, gym.spaces.Box(0, 255, (8, 8), np.uint8), gym.spaces.Discrete(2),
                         cache_path=str(tmp_path / "b"), compressor={"observation": "png"})


# -- Diffusion Policy's JPEG 2000 frames ----------------------------------------------------------
def _dp_jpeg2k_store(path: Path, imgs: np.ndarray) -> None:
    """A Diffusion Policy replay buffer (zarr format 2) whose frames are imagecodecs' JPEG 2000 chunks
    of one frame, as its real-robot datasets store them."""
    import numcodecs
    import zarr
    from imagecodecs.numcodecs import Jpeg2k

    numcodecs.register_codec(Jpeg2k)
    root = zarr.open_group(str(path), mode="w", zarr_format=2)
    a = root.create_array("data/img", shape=imgs.shape, chunks=(1, *imgs.shape[1:]), dtype="u1",
                          compressors=Jpeg2k(level=50))
    a[:] = imgs
    root.create_array("data/action", shape=(len(imgs), 2), chunks=(len(imgs), 2), dtype="f4")[:] = 0
    root.create_array("meta/episode_ends", shape=(2,), chunks=(2,), dtype="i8")[:] = [len(imgs) // 2, len(imgs)]


def test_diffusion_policy_jpeg2k_frames_import_and_stay_jpeg2k(tmp_path):
    import zarr

    from trajstore import TrajectoryReplayBuffer
    from trajstore.interop.diffusion_policy import import_diffusion_policy
    from trajstore.interop.dp_open import open_diffusion_policy

    imgs = frames(20, (48, 64, 3))
    _dp_jpeg2k_store(tmp_path / "dp.zarr", imgs)
    source = zarr.open_array(str(tmp_path / "dp.zarr" / "data" / "img"), mode="r")[:]  # JPEG 2000 decoded
    assert psnr(source, imgs) > 30
    import_diffusion_policy(str(tmp_path / "dp.zarr"), str(tmp_path / "ts")).close()
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "ts"), read_only=True) as tb:
        got = tb[:]["step_data"]["obs"]["img"]
    assert np.array_equal(got, source)  # kept as lossless JPEG 2000 of the decoded source: exact
    meta = json.loads((tmp_path / "ts" / "step_data" / "obs" / "img" / "zarr.json").read_text())
    assert meta["codecs"][0]["configuration"]["codecs"][0]["configuration"]["format"] == "jpeg2k"
    # A codec chosen by the user instead
    import_diffusion_policy(str(tmp_path / "dp.zarr"), str(tmp_path / "jpeg"), compressor={"obs/img": "jpeg:90"}).close()
    meta = json.loads((tmp_path / "jpeg" / "step_data" / "obs" / "img" / "zarr.json").read_text())
    assert meta["codecs"][0]["configuration"]["codecs"][0]["configuration"]["format"] == "jpeg"
    # Opened in place, the JPEG 2000 frames decode as zarr decodes them
    with open_diffusion_policy(str(tmp_path / "dp.zarr")) as dp:
        assert np.array_equal(dp[np.arange(20)]["step_data"]["img"], source)


# -- every read path decodes frames: sequences, torch datasets, DataLoader workers ---------------
def test_sequences_and_torch_dataloader_workers_read_image_frames(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from trajstore import TrajectoryReplayBuffer
    from trajstore.torch.datasets import TransitionDataset

    imgs = frames(60, (32, 32, 3))
    space = Dict({"img": Box(0, 255, (32, 32, 3), np.uint8), "t": Box(0, 100, (), np.int64)})
    with TrajectoryReplayBuffer.create(space, cache_path=str(tmp_path / "s"), compressor={"img": "png"},
                                       chunk_rows=16) as tb:
        for ep in range(3):
            tb.extend({"img": imgs[ep * 20 : ep * 20 + 20], "t": np.arange(ep * 20, ep * 20 + 20)})
            tb.mark_episode_end()
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        ti.set_decode_threads(2)  # the parent's pool exists before DataLoader forks its workers
        try:
            data, _valid = ro.get_sequences(np.array([5, 25, 59]), [-3, -2, -1, 0])
            windows = data["step_data"]["img"]
            for b, anchor in enumerate((5, 25, 59)):
                assert np.array_equal(windows[b], imgs[anchor - 3 : anchor + 1])
            data, _ = ro.sample_sequences(16, 4, rng=0, within_episode=True)
            t = data["step_data"]["t"]
            assert np.array_equal(data["step_data"]["img"], imgs[t])
            ds = TransitionDataset(str(tmp_path / "s"), ["img", "t"])
            loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork")
            seen = 0
            for batch in loader:
                assert torch.equal(batch["img"], torch.from_numpy(imgs[batch["t"].numpy()]))
                seen += len(batch["t"])
            assert seen == 60
        finally:
            ti.set_decode_threads(None)


def test_image_field_on_a_remote_store():
    """A non-local store (fsspec's memory filesystem): shards are written with one put each and
    fetched concurrently for a batch."""
    import uuid

    import fsspec

    url = f"memory://trajstore-image-tests/{uuid.uuid4().hex}"
    imgs = frames(40, (24, 32, 3))
    try:
        with make(url, (24, 32, 3), "webp-lossless", chunk_rows=8) as rb:
            fill(rb, imgs, step=6)
        with ReplayBuffer.load_from(url, read_only=True) as ro:
            idx = np.random.default_rng(2).integers(0, 40, 30)
            assert np.array_equal(ro[idx]["img"], imgs[idx])
            assert np.array_equal(ro[:]["img"], imgs)
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)


def test_set_at_and_remove_at_rewrite_image_rows(tmp_path):
    from trajstore.maintenance.verify import verify_store

    imgs, new = frames(40, (24, 24, 3)), frames(3, (24, 24, 3), seed=9)
    with make(tmp_path / "s", (24, 24, 3), "png", chunk_rows=8) as rb:
        fill(rb, imgs)
        rb.set_at(np.array([3, 17, 30]), {"img": new, "seq": np.array([100, 101, 102])})
        expect = imgs.copy()
        expect[[3, 17, 30]] = new
        assert np.array_equal(rb[:]["img"], expect)
        rb.remove_at(np.array([5]))
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert np.array_equal(ro[:]["img"], np.delete(expect, 5, axis=0))
    assert verify_store(str(tmp_path / "s"), deep=True).ok


def test_info_names_the_frames_codec(tmp_path):
    from trajstore.maintenance.summary import store_info

    with make(tmp_path / "s", (16, 16, 3), "jpeg:80", capacity=8) as rb:
        fill(rb, frames(8, (16, 16, 3)))
    rows = {r["path"]: r for r in store_info(str(tmp_path / "s"))["arrays"]}
    assert rows["step_data/img"]["codec"] == "jpeg:80" and rows["step_data/img"]["layout"] == "image"


def test_frame_of_another_size_is_damage_not_an_allocation(tmp_path):
    """A shard holding a valid image of another size (a hostile store's 200x300 frame in a 16x16
    field): the decoder refuses it before it allocates; DamagedStoreError names the row.  (A shard
    far larger than its frames could be is refused before any decode: see the assertion below.)"""
    import imagecodecs

    from trajstore.storage.fields.image import write_shard

    with make(tmp_path / "s", (16, 16, 3), "jpeg:90", capacity=8, chunk_rows=8) as rb:
        fill(rb, frames(8, (16, 16, 3)))
    big = imagecodecs.jpeg8_encode(np.zeros((200, 300, 3), np.uint8), level=10)
    _shard_file(tmp_path / "s").write_bytes(write_shard([b"", b"", big, b"", b"", b"", b"", b""]))
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert not ro[1]["img"].any()  # a row the index says was never written reads as 0
        with pytest.raises(DamagedStoreError, match=r"row 2 \(chunk 0\) does not decode"):
            ro[2]
    _shard_file(tmp_path / "s").write_bytes(write_shard([big * 8] * 8))
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro, \
            pytest.raises(DamagedStoreError, match="implausibly large"):
        ro[2]
