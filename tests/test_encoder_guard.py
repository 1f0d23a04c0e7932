"""The guarded video encoder (storage/fields/video_guard.py): an AV1 episode is encoded in a child
process under a watchdog, so an encoder that hangs (libsvtav1 deadlocked once in this suite) is
killed and the episode encoded again, and three failures raise EncoderError with the store at its
last commit.

Real stores, real encoder children stopped with a real SIGSTOP or killed with SIGKILL once their
encoder is running (seen from /proc: SVT-AV1's threads), a real writer process killed with SIGKILL
while its child encodes.  Linux only (/proc).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from trajstore import TrajectoryReplayBuffer
from trajstore.errors import EncoderError
from trajstore.maintenance.verify import verify_store
from trajstore.storage.fields import video_guard
from trajstore.storage.fields.video import write_segment
from trajstore.storage.fields.video_codec import parse_video_compressor

pytest.importorskip("av")
if not os.path.isdir("/proc/self/task"):
    pytest.skip("needs Linux's /proc", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from test_video_fields import SPACE, H, W, frames, psnr  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1])
#: An encoder child with at least this many threads has an SVT-AV1 encoder open (idle: 3).
ENCODING_THREADS = 8


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of process ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return rest[0], int(rest[1])


def encoders_of(parent: int) -> list[int]:
    """Pids of the live encoder children (video_worker.py) of process ``parent``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st is None or st[1] != parent or st[0] == "Z":
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if b"video_worker.py" in f.read():
                    out.append(int(name))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


@pytest.fixture
def mine() -> Callable[[], set[int]]:
    """The encoder children of this process started since the test began (others of this xdist
    worker, from stores another test left to the garbage collector, are not this test's)."""
    before = set(encoders_of(os.getpid()))
    return lambda: set(encoders_of(os.getpid())) - before


def threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


class Hitter(threading.Thread):
    """Sends ``sig`` (0: none) to each of the first ``times`` encoder children of ``parent`` seen
    encoding (an SVT-AV1 encoder open), once each.  One thread scans /proc for children (slow),
    this one watches their thread counts closely (an encode of small frames is short)."""

    def __init__(self, sig: int, times: int, parent: int | None = None) -> None:
        super().__init__(daemon=True)
        self.sig, self.times, self.parent = sig, times, parent or os.getpid()
        self.hit: list[int] = []
        self.known: list[int] = []
        self.stop = threading.Event()

    def busy(self) -> bool:
        return not self.stop.is_set() and len(self.hit) < self.times

    def scan(self) -> None:
        while self.busy():
            self.known += [p for p in encoders_of(self.parent) if p not in self.known]
            time.sleep(0.002)

    def run(self) -> None:
        threading.Thread(target=self.scan, daemon=True).start()
        while self.busy():
            for pid in [p for p in self.known if p not in self.hit]:
                if threads(pid) >= ENCODING_THREADS:
                    os.kill(pid, self.sig)
                    self.hit.append(pid)
            time.sleep(0.0002)


def append_episodes(tb: TrajectoryReplayBuffer, lengths: list[int], t0: int = 0) -> np.ndarray:
    allf = np.concatenate([frames(n, seed=t0 + e) for e, n in enumerate(lengths)])
    for i, f in enumerate(allf):
        tb.append({"obs": f, "t": np.int64(t0 + i)})
        if i + 1 in np.cumsum(lengths):
            tb.mark_episode_end()
    return allf


def check_store(path: Path, allf: np.ndarray) -> None:
    with TrajectoryReplayBuffer.load_from(str(path), read_only=True) as ro:
        got = ro[:]["step_data"]
        assert len(ro) == len(allf)
        assert np.array_equal(got["t"], np.arange(len(allf)))
        assert psnr(got["obs"], allf) >= 30
    report = verify_store(str(path), deep=True)
    assert report.ok, report


def test_a_stalled_encoder_is_killed_and_the_episode_encoded_again(tmp_path, monkeypatch, mine):
    monkeypatch.setattr(video_guard, "STALL_LIMIT_S", 2.0)
    hitter = Hitter(signal.SIGSTOP, 1)
    hitter.start()
    with pytest.warns(RuntimeWarning, match=r"libsvtav1 encoder stalled: no progress for 2 s \(attempt 1 of 3\)"):
        with TrajectoryReplayBuffer.create(SPACE, cache_path=str(tmp_path / "s"), compressor={"obs": "av1"},
                                           commit_interval=3600) as tb:
            allf = append_episodes(tb, [150, 150, 150])
            tb.flush()
            assert len(hitter.hit) == 1
            assert not alive(hitter.hit[0])  # killed and reaped, not left stopped
            assert mine() and not mine() & set(hitter.hit)  # a fresh child did the episode
    hitter.stop.set()
    assert not mine()  # closed with the store
    check_store(tmp_path / "s", allf)
    codec = parse_video_compressor("av1", (H, W, 3), np.uint8)
    assert codec is not None
    for lo in (0, 150, 300):  # the encoder is deterministic: each segment is what an unguarded encode makes
        seg = (tmp_path / "s" / "step_data" / "obs" / "video" / str(lo)).read_bytes()
        assert seg == write_segment(*codec.encode(allf[lo : lo + 150]))


def test_a_crashed_encoder_is_replaced_and_the_episode_encoded_again(tmp_path):
    hitter = Hitter(signal.SIGKILL, 1)
    hitter.start()
    with pytest.warns(RuntimeWarning, match=r"libsvtav1 encoder was killed by signal 9 \(attempt 1 of 3\)"):
        with TrajectoryReplayBuffer.create(SPACE, cache_path=str(tmp_path / "s"), compressor={"obs": "av1"},
                                           commit_interval=3600) as tb:
            allf = append_episodes(tb, [150, 150, 150])
    hitter.stop.set()
    assert len(hitter.hit) == 1
    check_store(tmp_path / "s", allf)


def test_three_stalls_raise_encoder_error_and_the_store_stays_at_its_last_commit(tmp_path, monkeypatch):
    path = tmp_path / "s"
    with TrajectoryReplayBuffer.create(SPACE, cache_path=str(path), compressor={"obs": "av1"},
                                       commit_interval=3600) as tb:
        first = append_episodes(tb, [20])
        tb.flush()
        monkeypatch.setattr(video_guard, "STALL_LIMIT_S", 1.0)
        hitter = Hitter(signal.SIGSTOP, 3)
        hitter.start()
        more = append_episodes(tb, [200], t0=20)
        with pytest.warns(RuntimeWarning), pytest.raises(EncoderError) as e:
            tb.flush()
        hitter.stop.set()
        assert isinstance(e.value, RuntimeError)
        msg = str(e.value)
        assert "step_data/obs: rows 20..219" in msg and "libsvtav1 encoder" in msg and "failed 3 times" in msg
        assert "attempt 1: stalled: no progress for 1 s; attempt 2: the same; attempt 3: the same" in msg, msg
        assert len(hitter.hit) == 3 and not any(alive(p) for p in hitter.hit)
        check_store(path, first)  # a reader sees the last commit, and it verifies
        monkeypatch.setattr(video_guard, "STALL_LIMIT_S", 120.0)
        later = append_episodes(tb, [30], t0=220)  # still writable: the held episode goes out with the next
    check_store(path, np.concatenate([first, more, later]))


def test_bad_frames_are_refused_before_an_encoder_starts(tmp_path, mine):
    with TrajectoryReplayBuffer.create(SPACE, cache_path=str(tmp_path / "s"), compressor={"obs": "av1"}) as tb:
        with pytest.raises(Exception) as e:
            tb.append({"obs": np.zeros((8, 8, 3), np.uint8), "t": np.int64(0)})
        assert type(e.value).__module__ == "trajstore.errors"
        assert not mine()
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert len(ro) == 0


def test_an_error_the_encoder_reports_is_tried_three_times_then_encoder_error(mine):
    from trajstore.storage.fields.video_codec import VideoCodec

    enc = video_guard.GuardedEncoder()
    refused = VideoCodec("av1")
    refused.preset = "zzz"  # past the settings check (which refuses it at create): SVT-AV1 refuses it when it opens
    try:
        with pytest.warns(RuntimeWarning, match=r"attempt [12] of 3"), pytest.raises(EncoderError) as e:
            enc.encode(refused, frames(4), "here")
        assert enc.pid is None and not mine()
        msg = str(e.value)
        assert msg.startswith("here: the libsvtav1 encoder (av1:crf=30:g=2:pix_fmt=yuv420p:preset=zzz) failed 3 times")
        assert "attempt 1: reported ArgumentError" in msg and "attempt 3: the same" in msg, msg
        packets, keys = enc.encode(VideoCodec("av1"), frames(4), "here")  # the same encoder goes on
        assert len(packets) == 4 and keys[0] and mine() == {enc.pid}
    finally:
        enc.close()
    assert not mine()


_WRITER = """
import os, sys, numpy as np
sys.path.insert(0, {tests!r})
from test_video_fields import frames
from trajstore import TrajectoryReplayBuffer
tb = TrajectoryReplayBuffer.load_from({store!r}, commit_interval=3600)
imgs = frames(64)
t = len(tb)
while True:
    for _ in range(150):
        tb.append({{"obs": imgs[t % 64], "t": np.int64(t)}})
        t += 1
    tb.mark_episode_end()
    tb.flush()
"""


def test_sigkill_of_the_writer_leaves_no_encoder_and_the_last_commit(tmp_path):
    store = tmp_path / "s"
    with TrajectoryReplayBuffer.create(SPACE, cache_path=str(store), compressor={"obs": "av1"}) as tb:
        first = append_episodes(tb, [10])
    code = _WRITER.format(tests=str(Path(__file__).parent), store=str(store))
    p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT})
    try:
        seen = Hitter(0, 1, parent=p.pid)  # signal 0: only find the child while it encodes
        seen.start()
        seen.join(60)
        assert seen.hit, "the writer's encoder never started"
        child = seen.hit[0]
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.wait(30)
    assert p.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(child), "the encoder outlived its writer"
    with TrajectoryReplayBuffer.load_from(str(store), read_only=True) as ro:
        n = len(ro)
        assert n >= 10 and (n - 10) % 150 == 0
        got = ro[:]["step_data"]
        assert np.array_equal(got["t"], np.arange(n))
        assert psnr(got["obs"][:10], first) >= 30
        assert psnr(got["obs"][10:], frames(64)[np.arange(10, n) % 64]) >= 30 if n > 10 else True
    report = verify_store(str(store), deep=True)
    assert report.ok, report


def _camera_store(path: Path, lengths: list[int]) -> np.ndarray:
    """A store whose camera (raw 96x128 frames) export_lerobot writes as an MP4; its frames."""
    from gymnasium.spaces import Box, Dict

    space = Dict({"cam": Box(0, 255, (96, 128, 3), np.uint8)})
    allf = np.concatenate([frames(n, seed=e) for e, n in enumerate(lengths)]).repeat(2, 1).repeat(2, 2)
    with TrajectoryReplayBuffer.create(space, cache_path=str(path), commit_interval=3600) as tb:
        for e, n in enumerate(lengths):
            a = sum(lengths[:e])
            tb.extend({"cam": allf[a : a + n]})
            tb.mark_episode_end()
    return allf


def test_export_lerobot_encodes_a_piece_again_after_a_stall(tmp_path, monkeypatch, mine):
    pytest.importorskip("pyarrow")
    from trajstore.interop import export_lerobot
    from trajstore.interop.lerobot_video import episode_frames

    allf = _camera_store(tmp_path / "s", [100, 100, 100])
    monkeypatch.setattr(video_guard, "STALL_LIMIT_S", 2.0)
    hitter = Hitter(signal.SIGSTOP, 1)
    hitter.start()
    with pytest.warns(RuntimeWarning, match=r"export_lerobot: .* libsvtav1 encoder stalled"):
        export_lerobot(tmp_path / "s", tmp_path / "ex", fps=10)
    hitter.stop.set()
    assert len(hitter.hit) == 1 and not alive(hitter.hit[0]) and not mine()
    with open(tmp_path / "ex" / "videos" / "cam" / "chunk-000" / "file-000.mp4", "rb") as f:
        got = episode_frames(f, "ex", 0.0, 30.0, 10, 300, (96, 128))
    assert psnr(got, allf) >= 30


def test_export_lerobot_raises_encoder_error_after_three_stalls_and_leaves_nothing(tmp_path, monkeypatch, mine):
    pytest.importorskip("pyarrow")
    from trajstore.interop import export_lerobot

    _camera_store(tmp_path / "s", [250])
    monkeypatch.setattr(video_guard, "STALL_LIMIT_S", 1.0)
    hitter = Hitter(signal.SIGSTOP, 3)
    hitter.start()
    with pytest.warns(RuntimeWarning), pytest.raises(EncoderError, match="export_lerobot: .*failed 3 times"):
        export_lerobot(tmp_path / "s", tmp_path / "ex2", fps=10)
    hitter.stop.set()
    assert len(hitter.hit) == 3 and not any(alive(p) for p in hitter.hit) and not mine()
    assert not (tmp_path / "ex2").exists() and not [p for p in tmp_path.iterdir() if "partial" in p.name]


_FORKING_WRITER = """
import os, sys, time, numpy as np
sys.path.insert(0, {tests!r})
from test_video_fields import frames
from trajstore import TrajectoryReplayBuffer
tb = TrajectoryReplayBuffer.load_from({store!r}, commit_interval=3600)
imgs = frames(64)
for t in range(10, 40):
    tb.append({{"obs": imgs[t % 64], "t": np.int64(t)}})
tb.mark_episode_end()
tb.flush()  # the encoder child is started, and now idle
pid = os.fork()  # a copy of the writer that holds the child's pipes open: no hang-up reaches it
if pid == 0:
    time.sleep(120)
    os._exit(0)
open({ready!r}, "w").write(str(pid))
time.sleep(120)
"""


def test_an_idle_encoder_leaves_when_its_writer_is_killed_though_a_fork_holds_its_pipes(tmp_path):
    """The child's thread checks its parent's pid: stdin's hang-up never comes while a forked copy
    of the writer holds the pipe open."""
    store, ready = tmp_path / "s", tmp_path / "ready"
    with TrajectoryReplayBuffer.create(SPACE, cache_path=str(store), compressor={"obs": "av1"}) as tb:
        append_episodes(tb, [10])
    code = _FORKING_WRITER.format(tests=str(Path(__file__).parent), store=str(store), ready=str(ready))
    p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT})
    fork = None
    try:
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.read_text()) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        fork = int(ready.read_text())
        children = encoders_of(p.pid)
        assert len(children) == 1
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        deadline = time.monotonic() + 30
        while alive(children[0]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not alive(children[0]), "the encoder outlived its writer"
    finally:
        p.kill()
        p.wait(30)
        if fork is not None:
            os.kill(fork, signal.SIGKILL)
    with TrajectoryReplayBuffer.load_from(str(store), read_only=True) as ro:
        assert len(ro) == 40
