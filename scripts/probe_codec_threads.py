"""The codec library's own ceiling for 2 decode threads (issue 31): imagecodecs decoding the same
84x84x3 frames on 1 thread and on 2 Python threads (each decoding half of them into one array),
outside any store.

The store's "2 vs 1 thread" (docs/benchmarks.md "Image codecs") cannot exceed what the library
allows: a decoder that holds the GIL for part of each call caps it whatever the store does.  Each
round times one pass on 1 thread, then one on 2; printed: microseconds per frame on 1 thread and the
median of the rounds' 2-vs-1 ratios, under CPython's default switch interval and under the one the
store's decode threads use (``trajstore.images.DECODE_SWITCH_INTERVAL``).

    python scripts/probe_codec_threads.py                # gymnasium renders (else noise frames), 7 rounds
    python scripts/probe_codec_threads.py --quick        # a smoke test (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_codecs as bc  # noqa: E402

import trajstore.storage.fields.image as image_fields  # noqa: E402

SHAPE = (84, 84, 3)


def codecs() -> dict[str, tuple[Callable[[np.ndarray], bytes], Callable[..., Any]]]:
    """name -> (encode, decode(data, out=...)) through imagecodecs."""
    import imagecodecs

    return {
        "jpeg:90": (lambda a: imagecodecs.jpeg8_encode(a, level=90), imagecodecs.jpeg8_decode),
        "png": (imagecodecs.png_encode, imagecodecs.png_decode),
        "webp-lossless": (lambda a: imagecodecs.webp_encode(a, lossless=True), imagecodecs.webp_decode),
    }


def frames(n: int) -> tuple[np.ndarray, str]:
    """``n`` frames of SHAPE: gymnasium renders where pygame is importable, else seeded noise."""
    got, what = bc.renders(n, SHAPE)
    if got is not None:
        return got, what
    return np.random.default_rng(0).integers(0, 256, (n, *SHAPE), dtype=np.uint8), "seeded noise"


def ratio(blobs: list[bytes], decode: Callable[..., Any], rounds: int) -> tuple[float, float]:
    """(microseconds per frame on 1 thread, median 2-vs-1 ratio over ``rounds``)."""
    out = np.empty((len(blobs), *SHAPE), np.uint8)

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            decode(blobs[i], out=out[i])

    half, ratios, one = len(blobs) // 2, [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run(0, len(blobs))
        t1 = time.perf_counter()
        other = threading.Thread(target=run, args=(0, half))
        other.start()
        run(half, len(blobs))
        other.join()
        t2 = time.perf_counter()
        one.append((t1 - t0) / len(blobs) * 1e6)
        ratios.append((t1 - t0) / (t2 - t1))
    return statistics.median(one), statistics.median(ratios)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=2400, help="frames decoded per pass")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="64 frames, 2 rounds")
    a = ap.parse_args(argv)
    n, rounds = (64, 2) if a.quick else (a.frames, a.rounds)
    pool, what = frames(min(n, 600))
    lines = [f"{n} frames of {'x'.join(map(str, SHAPE))} ({what}), {rounds} rounds, imagecodecs decoding"]
    default = sys.getswitchinterval()
    try:
        for name, (encode, decode) in codecs().items():
            blobs = [encode(pool[i % len(pool)]) for i in range(n)]
            for label, interval in (("default", default), ("store's", image_fields.DECODE_SWITCH_INTERVAL)):
                sys.setswitchinterval(interval if interval is not None else default)
                us, r = ratio(blobs, decode, rounds)
                lines.append(f"{name:14s} switch interval {label:8s} {us:6.1f} us/frame on 1 thread, "
                             f"2 vs 1 thread {r:.2f}")
    finally:
        sys.setswitchinterval(default)
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
