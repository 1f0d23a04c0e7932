"""Cost of the guarded encoder (trajstore.storage.fields.video_guard) per episode: the same episode
encoded in this process (:meth:`VideoCodec.encode`, as before the guard) and through the encoder
child (:meth:`GuardedEncoder.encode`: frames down a pipe, packets back, the child kept between
episodes), AV1 and H.264 (each forced through the child here, whatever ``GUARDED`` says), in
blocks of consecutive calls alternating between the two in one process.  Also the start of a
fresh child (its first episode minus a warm one).  Then ``export_lerobot``'s MP4 writer
(:class:`Mp4Writer`: each episode by a fresh encoder, AV1 through the child, packets muxed) next to
the writer it replaced, written out here (one encoder for the whole file, each episode's first
frame forced to a keyframe, encoded and muxed in this process), 3 episodes per file.

Run from the repository root: ``python scripts/probe_encoder_guard.py [--rounds 3] [--frames 200]``.
Prints, per codec and frame size, the median seconds per episode in process and guarded, their
difference per episode and per frame, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trajstore.interop.lerobot_video import Mp4Writer  # noqa: E402
from trajstore.storage.fields import video_guard  # noqa: E402
from trajstore.storage.fields.video_codec import parse_video_compressor  # noqa: E402


def episode(n: int, h: int, w: int) -> np.ndarray:
    """``n`` smooth (h, w, 3) uint8 frames drifting over time (a camera watching a scene move)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    out = np.empty((n, h, w, 3), np.uint8)
    for i in range(n):
        for c in range(3):
            out[i, ..., c] = (128 + 60 * np.sin((x + 2 * i + 5 * c) / (w / 9)) + 50 * np.cos((y - i) / (h / 7))
                              ).clip(0, 255).astype(np.uint8)
    return out


def old_writer(path: str, eps: list[np.ndarray], codec: str) -> None:
    """The MP4 writer before the guard: one encoder for the file, episodes from forced keyframes."""
    import av

    c = av.open(path, "w", format="mp4")
    s = c.add_stream("libsvtav1" if codec == "av1" else "libx264", rate=10)
    s.height, s.width = eps[0].shape[1:3]
    s.pix_fmt = "yuv420p"
    s.options = {"crf": "30" if codec == "av1" else "23", "g": "2", "preset": "12" if codec == "av1" else "veryfast"}
    if codec == "h264":
        s.codec_context.max_b_frames = 0
    n = 0
    for f in eps:
        for i, fr in enumerate(f):
            vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(fr), format="rgb24")
            vf.pts = n
            n += 1
            if i == 0:
                vf.pict_type = av.video.frame.PictureType.I
            for p in s.encode(vf):
                c.mux(p)
    for p in s.encode(None):
        c.mux(p)
    c.close()


def new_writer(path: str, eps: list[np.ndarray], codec: str) -> None:
    w = Mp4Writer(path, 10, eps[0].shape[1:3], codec)
    for f in eps:
        w.add(f, new_episode=True)
    w.close()


def exports(args: argparse.Namespace, tmp: str) -> None:
    for comp in ("av1", "h264"):
        for h, w in ((84, 84), (480, 640)):
            eps = [episode(args.frames, h, w)[::-1].copy() if e % 2 else episode(args.frames, h, w) for e in range(3)]
            times: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(args.rounds):
                for name, fn in (("old", old_writer), ("new", new_writer)):
                    t = time.perf_counter()
                    fn(os.path.join(tmp, f"{name}.mp4"), eps, comp)
                    times[name].append(time.perf_counter() - t)
            a, b = statistics.median(times["old"]), statistics.median(times["new"])
            sa, sb = (os.path.getsize(os.path.join(tmp, f"{n}.mp4")) for n in ("old", "new"))
            print(f"export {comp:5s} {h}x{w}x3, 3 x {args.frames}: one stream {a * 1e3:8.1f} ms ({sa} B), "
                  f"per episode{' guarded' if comp in video_guard.GUARDED else ''} {b * 1e3:8.1f} ms ({sb} B) "
                  f"({(b - a) / a * 100:+5.1f} %)")


def main() -> None:
    os.environ.setdefault("SVT_LOG", "1")  # no SVT-AV1 banner from the in-process encoders
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frames", type=int, default=200)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        exports(args, tmp)
    print(f"load average: {os.getloadavg()}")
    video_guard.GUARDED = frozenset({"av1", "h264"})  # both through the child, to measure it
    for comp in ("av1", "h264"):
        for h, w in ((84, 84), (480, 640)):
            f = episode(args.frames, h, w)
            codec = parse_video_compressor(comp, f.shape[1:], np.uint8)
            assert codec is not None
            block = 6 if h < 100 else 2
            t = time.perf_counter()
            g = video_guard.GuardedEncoder()
            g.encode(codec, f, "probe")
            first = time.perf_counter() - t
            inproc, guarded = [], []
            for _ in range(args.rounds):
                t = time.perf_counter()
                for _ in range(block):
                    codec.encode(f)
                inproc.append((time.perf_counter() - t) / block)
                t = time.perf_counter()
                for _ in range(block):
                    g.encode(codec, f, "probe")
                guarded.append((time.perf_counter() - t) / block)
            g.close()
            a, b = statistics.median(inproc), statistics.median(guarded)
            print(f"{comp:5s} {h}x{w}x3 x {args.frames}: in process {a * 1e3:8.1f} ms, guarded {b * 1e3:8.1f} ms "
                  f"(+{(b - a) * 1e3:6.1f} ms, {(b - a) / a * 100:+5.1f} %, "
                  f"{(b - a) / args.frames * 1e6:+7.1f} us/frame); "
                  f"first guarded episode {first * 1e3:.0f} ms (child start {max(first - b, 0) * 1e3:.0f} ms)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
