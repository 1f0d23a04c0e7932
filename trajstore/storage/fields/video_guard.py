"""Video encoding under a watchdog: an encoder that hangs is killed and the episode encoded again.

libsvtav1 (the AV1 encoder in PyAV's FFmpeg) once deadlocked under load: every one of its threads
waiting on a futex inside ``svt_av1_enc_send_picture``, no CPU used, forever.  In the writer's own
process nothing could stop it, and the recorder would hang.  So an episode of a codec in
:data:`GUARDED` is encoded by a child process (:mod:`.video_worker`, ``python -P <its file>``:
numpy and PyAV only), one per :class:`GuardedEncoder` (one per video field of a writer), started
at the first episode, reused for the next ones and closed with the field:

- the frames go to the child through a pipe, as the pictures the encoder is fed, while its
  packets come back (a kind byte, a length, the bytes; no pickle), both ends polled;
- *progress* is any byte going in or coming out (the child also beats while frames go in without
  a packet coming out); no progress for :data:`STALL_LIMIT_S` (:data:`START_LIMIT_S` for the
  child to start) is a stall: the child is killed (SIGKILL) and reaped;
- a stall, a child that exits or reports an error, or a packet count other than the frame count
  is a failed attempt; the episode is encoded again from its first frame by a fresh child,
  :data:`ATTEMPTS` attempts in all, and then :class:`~trajstore.errors.EncoderError` names the
  encoder, the rows and what happened each time.  Nothing of the episode is written before its
  packets are all back: the commit that encodes it fails, the store stays at its last commit,
  and the frames stay held (the next commit tries them again);
- the child leaves when its stdin ends or its parent is gone (a thread checks), so a writer
  killed with SIGKILL leaves no encoder behind.

Codecs not in :data:`GUARDED` are encoded in the writer's process (docs/performance-notes.md
"Guarded encoding" gives the cost of the child per episode, which decided it), and so is every
codec where the child cannot run (:data:`CAN_GUARD`: Windows, a frozen application).
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import numpy as np

from trajstore.errors import EncoderError
from trajstore.storage.fields import video_worker as worker
from trajstore.storage.fields.video_codec import VIDEO_CODECS, Frames, VideoCodec, as_blocks, load_av

__all__ = ["ATTEMPTS", "CAN_GUARD", "GUARDED", "START_LIMIT_S", "STALL_LIMIT_S", "GuardedEncoder"]

#: Codecs (:data:`~.video_codec.VIDEO_CODECS` names) encoded in a child process under the watchdog.
GUARDED = frozenset({"av1"})
#: Seconds without progress (a frame taken, a packet given) after which an encoder counts as hung.
#: Read at each episode (tests lower it).
STALL_LIMIT_S = 120.0
#: Seconds a fresh child may take to import numpy and PyAV and say it is ready.
START_LIMIT_S = 120.0
#: Attempts at one episode, each with a fresh child, before EncoderError.
ATTEMPTS = 3
#: Whether this process can run the encoder child: POSIX pipes that ``poll`` watches, and an
#: interpreter to run it (a frozen application's executable runs no script).  Elsewhere (Windows)
#: every codec is encoded in the writer's process, unguarded.
CAN_GUARD = (hasattr(select, "poll") and os.name == "posix" and bool(sys.executable)
             and not getattr(sys, "frozen", False))
_F_SETPIPE_SZ = 1031  # Linux: a pipe's buffer size (fcntl)
_PIPE_BYTES = 1 << 20


class _Failed(Exception):
    """One attempt failed: ``why`` says how (stalled, exited, reported an error)."""


def _kill(proc: subprocess.Popen[bytes], owner: int) -> None:
    """Kill and reap ``proc`` (started by process ``owner``; a forked copy of the writer leaves it)."""
    if os.getpid() != owner:
        return
    try:
        proc.kill()
        proc.wait(timeout=10)  # a SIGKILLed process goes at once (stopped or not), unless the kernel holds it
    except (OSError, subprocess.TimeoutExpired):
        pass  # left to the kernel: never wait on it forever
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


class _Child:
    """One encoder process: its pipes, the bytes read from it not yet parsed, and its deadline."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner to stderr unless told not to
        self.proc = subprocess.Popen([sys.executable, "-P", worker.__file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, close_fds=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.owner = os.getpid()
        self.kill = weakref.finalize(self, _kill, self.proc, self.owner)
        self.win, self.rin = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        for fd in (self.win, self.rin):
            os.set_blocking(fd, False)
            try:
                import fcntl

                fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
            except (ImportError, OSError):
                pass  # not Linux, or above the system's pipe-max-size: the default buffer
        self.buf = bytearray()
        self.last = time.monotonic()
        try:
            self.expect(worker.READY, START_LIMIT_S)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        """The child's process id."""
        return int(self.proc.pid)

    def _exited(self) -> _Failed:
        """The child closed its end: reap it and say how it ended."""
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return _Failed("closed its pipe without exiting")
        why = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return _Failed(why)

    def _pump(self, limit: float, out: memoryview | None) -> int:
        """Wait (at most until ``limit`` seconds after the last progress) until the child's
        replies can be read or ``out`` (bytes for its stdin) can be written; read what there is,
        write what fits.  Returns how many bytes of ``out`` were written."""
        poller = select.poll()
        poller.register(self.rin, select.POLLIN)
        if out is not None and len(out):
            poller.register(self.win, select.POLLOUT)
        left = limit - (time.monotonic() - self.last)
        events = dict(poller.poll(max(0.0, left) * 1000)) if left > 0 else {}
        if not events:
            raise _Failed(f"stalled: no progress for {limit:g} s")
        wrote = 0
        if self.rin in events:
            data = os.read(self.rin, 1 << 20)
            if not data:
                raise self._exited()
            self.buf += data
            self.last = time.monotonic()
        if self.win in events:
            try:
                wrote = os.write(self.win, out) if out is not None else 0
            except BlockingIOError:
                wrote = 0
            except BrokenPipeError:
                raise self._exited() from None
            if wrote:
                self.last = time.monotonic()
        return wrote

    def message(self) -> tuple[bytes, memoryview] | None:
        """The next whole reply in the buffer (kind, payload), or None."""
        if len(self.buf) < worker.HEAD.size:
            return None
        kind, n = worker.HEAD.unpack_from(self.buf)
        if len(self.buf) < worker.HEAD.size + n:
            return None
        payload = memoryview(bytes(self.buf[worker.HEAD.size : worker.HEAD.size + n]))
        del self.buf[: worker.HEAD.size + n]
        return kind, payload

    def expect(self, kind: bytes, limit: float) -> memoryview:
        """Wait for the next reply, which must be of ``kind``; its payload."""
        while True:
            got = self.message()
            if got is not None:
                if got[0] != kind:
                    raise _Failed(f"replied {got[0]!r} where {kind!r} was due")
                return got[1]
            self._pump(limit, None)

    def run(self, job: dict[str, Any], pictures: Iterator[np.ndarray]) -> tuple[list[bytes], list[bool]]:
        """Send ``job`` and its ``pictures``, gathering the packets as they come; raises _Failed."""
        body = json.dumps(job).encode()
        pending: list[memoryview] = [memoryview(struct.pack("<I", len(body)) + body)]
        packets: list[bytes] = []
        keys: list[bool] = []
        self.last = time.monotonic()
        while True:
            if not pending:
                pic = next(pictures, None)
                if pic is not None:
                    pending.append(memoryview(pic.data).cast("B"))
            wrote = self._pump(STALL_LIMIT_S, pending[0] if pending else None)
            if wrote:
                pending[0] = pending[0][wrote:]
                if not len(pending[0]):
                    pending.pop(0)
            while (got := self.message()) is not None:
                kind, payload = got
                if kind in (worker.PACKET, worker.KEY_PACKET):
                    packets.append(payload.tobytes())
                    keys.append(kind == worker.KEY_PACKET)
                elif kind == worker.DONE:
                    return packets, keys
                elif kind == worker.FAILED:
                    raise _Failed(f"reported {bytes(payload).decode('utf-8', 'replace')}")
                elif kind != worker.BEAT:
                    raise _Failed(f"replied {kind!r} (no reply of this protocol)")

    def close(self) -> None:
        """Kill and reap the child."""
        self.kill()


class GuardedEncoder:
    """Encodes the episodes of one video field: a codec of :data:`GUARDED` in a child process
    under a watchdog (the module's docstring), others in this process.  The child is started at
    the first guarded episode and kept for the next ones until :meth:`close`."""

    def __init__(self) -> None:
        self._child: _Child | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The process id of the encoder child now running (None: none)."""
        child = self._child
        return None if child is None else child.pid

    def encode(self, codec: VideoCodec, frames: Frames, where: str, keys: tuple[int, ...] = (),
               rate: Fraction = Fraction(30)) -> tuple[list[bytes], list[bool]]:
        """``frames`` (:data:`~.video_codec.Frames`, n in all) as n packets (display order) and
        their keyframe flags (``keys``: frames forced to keyframes besides the first, e.g. episode
        starts; ``rate``: frames per second, which rate control takes into account).

        Raises
        ------
        EncoderError
            Every attempt failed (a stall, an exit, an error the encoder reported, another
            packet count), naming ``codec``'s encoder, ``where`` (the field and rows) and each
            failure.
        MissingDependencyError
            PyAV is not installed.
        """
        if codec.codec not in GUARDED or not CAN_GUARD:
            return codec.encode(frames, keys, rate)
        load_av()  # MissingDependencyError naming the extra, here rather than three failed children
        enc = VIDEO_CODECS[codec.codec][0]
        blocks = as_blocks(frames)
        n = sum(len(b) for b in blocks)
        job = codec.job(tuple(blocks[0].shape[1:]), n, keys, rate)
        whys: list[str] = []
        with self._lock:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    packets, flags = self._attempt(codec, blocks, job)
                    if len(packets) == n:
                        return packets, flags
                    whys.append(f"gave {len(packets)} packets for {n} frames")
                except _Failed as e:
                    whys.append(str(e))
                except OSError as e:  # the child could not be started (no memory, no processes left)
                    whys.append(f"could not start ({type(e).__name__}: {e})")
                except BaseException:  # KeyboardInterrupt, MemoryError...: the child is mid-job, never reused
                    self._stop()
                    raise
                self._stop()
                if attempt < ATTEMPTS:
                    warnings.warn(f"{where}: the {enc} encoder {whys[-1]} (attempt {attempt} of {ATTEMPTS}); "
                                  "encoding the episode again with a fresh one", RuntimeWarning, stacklevel=2)
        told = "; ".join(f"attempt {i + 1}: {w}" if i == 0 or w != whys[i - 1] else f"attempt {i + 1}: the same"
                         for i, w in enumerate(whys))
        raise EncoderError(f"{where}: the {enc} encoder ({codec.label}) failed {ATTEMPTS} times on an episode of "
                           f"{n} frames, each time with a fresh encoder process ({told}); nothing of the "
                           "episode was written")

    def _attempt(self, codec: VideoCodec, blocks: list[np.ndarray],
                 job: dict[str, Any]) -> tuple[list[bytes], list[bool]]:
        child = self._child
        if child is not None and (child.owner != os.getpid() or child.proc.poll() is not None):
            self._stop()  # a forked copy of the writer, or a child that has gone: a fresh one
            child = None
        if child is None:
            child = self._child = _Child()
        if job["src"] == "rgb24":  # the frames are the pictures: each block sent as it lies
            return child.run(job, (np.ascontiguousarray(b) for b in blocks if len(b)))
        return child.run(job, codec.sources(blocks))

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.close()

    def close(self) -> None:
        """Stop the child (killed: it holds nothing to keep)."""
        with self._lock:
            self._stop()

