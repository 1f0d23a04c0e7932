"""The encoding of one episode's pictures, and the child process that does it for :mod:`.video_guard`.

:func:`encode_stream` turns pictures (each a frame as the encoder is fed it: ``rgb24`` (H, W, 3),
``gray`` (H, W) or ``yuv420p`` (H*3/2, W), uint8) into packets, one per frame in display order;
:meth:`~.video_codec.VideoCodec.encode` calls it in the writer's process, and :func:`serve` in a
child process started by :class:`~.video_guard.GuardedEncoder` (``python -P <this file>``).

This module imports only the standard library, numpy and PyAV (``av``), never ``trajstore``: the
child runs it as a script, so it starts in the time numpy and PyAV take to import.

The child's protocol, on its stdin (jobs) and stdout (replies); no pickle:

- a job: a u32 (little-endian) length and that many bytes of JSON: ``encoder`` (FFmpeg's name),
  ``width``, ``height``, ``pix_fmt``, ``gop``, ``options`` (strings), ``src`` (the pictures'
  format), ``shape`` (a picture's shape), ``frames`` (n) and optionally ``keys`` (frames forced to
  keyframes) and ``rate`` (frames per second); then the n pictures' bytes;
- a reply message: a kind byte and a u32 length (:data:`HEAD`), then that many bytes.  Kinds:
  :data:`READY` (once, when started), :data:`BEAT` (frames are going in), :data:`PACKET` /
  :data:`KEY_PACKET` (a packet, display order), :data:`DONE` (JSON ``{"packets": n}``: the job
  is over) and :data:`FAILED` (a message; the child exits with code 1).

The child exits when its stdin ends (the writer closed it) or when its parent process is gone
(checked each :data:`PARENT_CHECK_S` by a thread, which runs while PyAV waits in the encoder: PyAV
releases the GIL there): a writer killed with SIGKILL leaves no encoder, even one whose encoder hangs.
``PR_SET_PDEATHSIG`` is not used: it fires when the *thread* that started the child ends, and a
writer may encode from a thread it then ends.  Ctrl-C (SIGINT) is ignored: the writer handles it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["BEAT", "DONE", "FAILED", "HEAD", "KEY_PACKET", "PACKET", "PARENT_CHECK_S", "READY", "encode_stream",
           "serve"]

#: A reply's head: kind (one byte) and payload length (u32).
HEAD = struct.Struct("<cI")
READY, BEAT, PACKET, KEY_PACKET, DONE, FAILED = b"R", b"H", b"P", b"K", b"D", b"E"
#: Seconds between the child's checks that its parent is still there.
PARENT_CHECK_S = 0.5
#: Seconds between two BEAT messages at most one of (frames going in without a packet coming out).
BEAT_EVERY_S = 0.1


def encode_stream(av: Any, job: dict[str, Any], pictures: Iterable[np.ndarray],
                  fed: Callable[[int], None] | None = None) -> Iterator[tuple[bytes, bool]]:
    """Encode ``pictures`` with the settings of ``job`` (as a job's JSON: ``encoder``, ``width``,
    ``height``, ``pix_fmt``, ``gop``, ``options``, ``src``, and optionally ``keys``, the frames
    forced to keyframes (episode starts), and ``rate``, frames per second as ``"num/den"``, 30 if
    absent); yields ``(packet, keyframe)`` in
    display order as the encoder gives them (no B-frames: packet i is frame i).  ``fed(i)`` is
    called once picture i has gone into the encoder.  Raises what PyAV raises."""
    if job["encoder"] == "libsvtav1":
        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner to stderr unless told not to
    ctx = av.CodecContext.create(job["encoder"], "w")
    ctx.width, ctx.height = int(job["width"]), int(job["height"])
    rate = Fraction(str(job.get("rate", "30")))  # frames per second (rate control depends on it)
    ctx.pix_fmt, ctx.time_base, ctx.framerate = job["pix_fmt"], 1 / rate, rate
    ctx.gop_size, ctx.max_b_frames = int(job["gop"]), 0
    ctx.options = {str(k): str(v) for k, v in job["options"].items()}
    src, pix = job["src"], job["pix_fmt"]
    keys = frozenset(int(k) for k in job.get("keys", ()))
    reformatter = av.video.reformatter.VideoReformatter()  # one scaler for the stream (one per frame costs 3x)
    for i, pic in enumerate(pictures):
        vf = av.VideoFrame.from_ndarray(pic, format=src)
        if src != pix:
            vf = reformatter.reformat(vf, format=pix)
        vf.pts = i
        if i in keys:
            vf.pict_type = av.video.frame.PictureType.I
        for p in ctx.encode_lazy(vf):
            yield bytes(p), bool(p.is_keyframe)
        if fed is not None:
            fed(i)
    for p in ctx.encode_lazy(None):
        yield bytes(p), bool(p.is_keyframe)


def _read_exact(f: Any, n: int, buf: bytearray | None = None) -> bytearray | None:
    """``n`` bytes of the raw file ``f`` (into ``buf``, of ``n`` bytes, when given); None at its end
    (before or inside them)."""
    buf = bytearray(n) if buf is None else buf
    view, got = memoryview(buf), 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            return None
        got += k
    return buf


def _send(f: Any, kind: bytes, payload: bytes = b"") -> None:
    f.write(HEAD.pack(kind, len(payload)) + payload)


def _watch_parent(stdin_fd: int, parent: int) -> None:
    """Leave at once when the writer closes our stdin (POLLHUP) or its process is gone."""
    poller = select.poll()
    poller.register(stdin_fd, 0)  # no events asked for: woken only by a hang-up or an error
    while True:
        if poller.poll(PARENT_CHECK_S * 1000) or os.getppid() != parent:
            os._exit(0)


def _pictures(f: Any, job: dict[str, Any]) -> Iterator[np.ndarray]:
    """The job's pictures as they arrive, each in the same buffer (the encoder copies a picture in)."""
    shape = tuple(int(x) for x in job["shape"])
    size = int(np.prod(shape))
    buf = bytearray(size)
    pic = np.frombuffer(buf, np.uint8).reshape(shape)
    for _ in range(int(job["frames"])):
        if _read_exact(f, size, buf) is None:
            raise EOFError("the writer's frames end early")
        yield pic


def serve() -> None:
    """The child's loop: READY, then each job's packets and DONE until stdin ends; FAILED and
    exit code 1 on any error."""
    inp = open(os.dup(0), "rb", buffering=0)
    out = open(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # what a library prints on stdout goes to stderr, not into the replies
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the writer's to handle: it stops us
    threading.Thread(target=_watch_parent, args=(inp.fileno(), os.getppid()), daemon=True).start()
    import av

    _send(out, READY)
    while True:
        head = _read_exact(inp, 4)
        if head is None:
            return
        body = _read_exact(inp, struct.unpack("<I", head)[0])
        if body is None:
            return
        try:
            job = json.loads(body)
            last = [time.monotonic()]

            def fed(i: int) -> None:
                now = time.monotonic()
                if now - last[0] >= BEAT_EVERY_S:
                    _send(out, BEAT)
                    last[0] = now

            n = 0
            for packet, key in encode_stream(av, job, _pictures(inp, job), fed):
                _send(out, KEY_PACKET if key else PACKET, packet)
                last[0] = time.monotonic()
                n += 1
            _send(out, DONE, json.dumps({"packets": n}).encode())
        except Exception as e:  # noqa: BLE001  # whatever the encoder raises is reported, then we leave
            _send(out, FAILED, f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:4096])
            sys.exit(1)


if __name__ == "__main__":
    serve()
