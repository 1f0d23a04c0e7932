"""LeRobot datasets benchmark: import_lerobot's time and sizes, open_lerobot's windows.

    python scripts/bench_lerobot.py --episodes 50   # issue 32's size: 50 x 300 frames, 2 cameras 480x640 AV1, 14-dim
    python scripts/bench_lerobot.py                 # 10 episodes (what bench_all runs, within its time budget)
    python scripts/bench_lerobot.py --quick         # 6 episodes x 60 frames, 96x128 (smoke test)
    python scripts/bench_lerobot.py --lerobot-python /work/venvs/lerobot/bin/python   # LeRobot side by side

``main`` returns the section of docs/benchmarks.md (scripts/bench_all.py writes it there).

The dataset is written per LeRobot v3.0's specification (tests/lerobot_fixture.py: one Parquet
file, one MP4 per camera, libsvtav1 crf 30 g 2 as LeRobot encodes, every episode from a keyframe).
Measured: the import (packets kept: nothing decoded), the time to read every file of the dataset
once (the floor an import cannot beat), bytes before and after; ``open_lerobot``'s windows of
Diffusion Policy's defaults (2 observation frames of both cameras and the state, 16 actions, as
``delta_timestamps``) in frames decoded per second; the same windows over 1e2 and 1e4 episodes
(tiny frames) for flatness; LeRobot's own ``LeRobotDataset`` over the same anchors and files, in a
child process (scripts/bench_lerobot_peer.py) run by ``--lerobot-python`` (LeRobot pins its own
torch: give a virtual environment's Python), or "not installed" where it does not import.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from benchdoc import section  # noqa: E402
from lerobot_fixture import write_v3  # noqa: E402

from trajstore.interop import import_lerobot, open_lerobot  # noqa: E402

CAMS = ("observation.images.top", "observation.images.wrist")
PEER = Path(__file__).resolve().parent / "bench_lerobot_peer.py"


def folder_bytes(path: Path, part: str = "") -> int:
    """Bytes on disk (allocated blocks: a store's mapped files are sparse) of the files under ``path``
    whose path contains ``part``."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and part in str(p.relative_to(path)))


def own_bytes(path: Path, part: str = "") -> int:
    """:func:`folder_bytes`, less files with other hard links (a linked store's packs are the
    source's MP4s: they add no bytes to the disk)."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*")
               if p.is_file() and p.stat().st_nlink == 1 and part in str(p.relative_to(path)))


def read_once(path: Path) -> float:
    """Seconds to read every file under ``path`` once."""
    t = time.perf_counter()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass
    return time.perf_counter() - t


def copy_once(src: Path, dst: Path) -> float:
    """Seconds to copy the folder ``src`` to ``dst`` (read and write every file once)."""
    t = time.perf_counter()
    shutil.copytree(src, dst)
    return time.perf_counter() - t


def read_checksummed(path: Path) -> float:
    """Seconds to read every MP4 under ``path`` once and crc32c its bytes (what an import that
    links the MP4s instead of copying them would do to checksum them; 1 MiB preads)."""
    import google_crc32c

    t = time.perf_counter()
    for p in sorted(path.rglob("*.mp4")):
        fd, off, crc = os.open(p, os.O_RDONLY), 0, 0
        try:
            while data := os.pread(fd, 1 << 20, off):
                crc = google_crc32c.extend(crc, data)
                off += len(data)
        finally:
            os.close(fd)
    return time.perf_counter() - t


def import_rounds(src: Path, tmp: Path, rounds: int) -> tuple[dict[str, list[float]], dict[str, object]]:
    """``rounds`` rounds of: read the files once, read the MP4s with a crc32c, copy the folder,
    import it, import it linked (``link=True``) (each round in that order, so a loaded machine's
    drift falls on all alike).  Returns the seconds per measurement and the last import's result
    with ``bytes_before``, ``bytes_after``, ``video_ratio``, ``linked_bytes`` (the linked store's
    own bytes: its packs are hard links of the MP4s) and the linked import's ``linked`` and
    ``link_fallbacks`` added."""
    times: dict[str, list[float]] = {"import": [], "import --link": [], "read": [], "read+crc32c": [], "copy": []}
    out: dict[str, object] = {}
    for _ in range(rounds):
        times["read"].append(read_once(src))
        times["read+crc32c"].append(read_checksummed(src / "videos"))
        times["copy"].append(copy_once(src, tmp / "copy"))
        shutil.rmtree(tmp / "copy")
        t = time.perf_counter()
        out = import_lerobot(src, tmp / "store")
        times["import"].append(time.perf_counter() - t)
        out["bytes_before"], out["bytes_after"] = folder_bytes(src), folder_bytes(tmp / "store")
        out["video_ratio"] = folder_bytes(tmp / "store", "/video/") / max(folder_bytes(src, "videos"), 1)
        shutil.rmtree(tmp / "store")
        t = time.perf_counter()
        linked = import_lerobot(src, tmp / "linked", link=True)
        times["import --link"].append(time.perf_counter() - t)
        out["linked_bytes"] = own_bytes(tmp / "linked")
        out["linked"], out["link_fallbacks"] = linked["linked"], linked["link_fallbacks"]
        shutil.rmtree(tmp / "linked")
    return times, out


def import_only(args: argparse.Namespace) -> str:
    """``--import-only``: the import part alone, ``--rounds`` rounds (medians), on ``--source`` or a
    dataset written here; plain text (not a docs/benchmarks.md section)."""
    eps, n, size = (6, 60, (96, 128)) if args.quick else (args.episodes, 300, (480, 640))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(args.source) if args.source else Path(tmp) / "lerobot"
        if not args.source:
            write_v3(str(src), [n] * eps, CAMS, fps=30, size=size, dims=(14, 14))
        times, out = import_rounds(src, Path(tmp), args.rounds)
    lines = [f"{src}: {out['episodes']} episodes, {out['steps']} steps; adopted {out['adopted']}, "
             f"transcoded {out['transcoded']}",
             f"bytes before {out['bytes_before']}, after {out['bytes_after']}, video after / before "
             f"{out['video_ratio']:.4f}",
             f"linked import: linked {out['linked']}, link fallbacks {out['link_fallbacks']}, bytes the store adds "
             f"{out['linked_bytes']} (its packs are hard links of the MP4s: no bytes)"]
    for k, v in times.items():
        lines.append(f"{k:13s} median {float(np.median(v)):.3f} s  (min {min(v):.3f}, max {max(v):.3f}, "
                     f"{len(v)} rounds)")
    lines.append(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return "\n".join(lines)


def _deltas(fps: int) -> dict[str, list[float]]:
    """Diffusion Policy's defaults: 2 frames of both cameras and the state, 16 actions."""
    return {cam: [-1 / fps, 0.0] for cam in CAMS} | {"observation.state": [-1 / fps, 0.0],
                                                     "action": [i / fps for i in range(16)]}


def anchors_for(rows: int, rounds: int, batches: int, batch: int, seed: int) -> np.ndarray:
    """(rounds + 1, batches, batch) random anchor rows, sorted within each batch; round 0 warms up."""
    g = np.random.default_rng(seed)
    return np.sort(g.integers(0, rows, (rounds + 1, batches, batch)), axis=-1)


class Peer:
    """LeRobot's ``LeRobotDataset`` over one dataset in a child process (scripts/bench_lerobot_peer.py
    run by ``python``: LeRobot may live in another virtual environment), timed round by round."""

    def __init__(self, python: str, root: Path, deltas: dict[str, list[float]], anchors: Path,
                 backend: str | None) -> None:
        self.err = anchors.with_suffix(".stderr")
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen([python, str(PEER), str(root), json.dumps(deltas), str(anchors)]
                                         + ([backend] if backend else []), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True)
        line = (self.proc.stdout.readline() if self.proc.stdout else "").strip()
        self.about: dict[str, object] | None = json.loads(line[6:]) if line.startswith("ready ") else None
        if self.about is not None:
            self.note = f"LeRobotDataset (lerobot {self.about['lerobot']}, torch {self.about['torch']}, " \
                        f"{self.about['backend']} video backend)"
        elif line.startswith("missing ImportError") or line.startswith("missing ModuleNotFoundError"):
            self.note = f"LeRobot not installed for {python} ({line[8:]})"
        else:
            tail = self.err.read_text().strip().splitlines()[-1:] if self.err.exists() else []
            self.note = f"LeRobot did not run: {line[8:] or (tail[0] if tail else self.proc.poll())}"
        if self.about is None:
            self.close()

    def round(self, k: int) -> float | None:
        """Seconds LeRobot took to read the windows of anchor round ``k`` (None: it failed, and
        ``note`` says why)."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(f"round {k}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().strip()
        try:
            return float(line)
        except ValueError:
            self.note = f"LeRobot failed: {line[6:] if line.startswith('error ') else 'exit ' + str(self.proc.poll())}"
            self.about = None
            self.close()
            return None

    def close(self) -> None:
        """End the child."""
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def window_rates(roots: list[Path], fps: int, batches: int, batch: int, rounds: int, peer_python: str | None = None,
                 backend: str | None = None) -> list[dict[str, object]]:
    """Per dataset: trajstore's ``get_time_windows`` over random sorted anchors (batches of
    ``batch``), and LeRobot's loader (``peer_python``, one window at a time) over the same anchors;
    the median of ``rounds`` rounds, the datasets and loaders taking turns each round (a loaded
    machine's drift falls on all of them alike).  Each entry: ``ts`` and ``lr`` (windows/s, frames
    delivered/s; ``lr`` None where LeRobot does not run) and ``note`` (LeRobot's versions, or why not)."""
    deltas = _deltas(fps)
    frames = sum(len(v) for k, v in deltas.items() if k in CAMS)
    bufs = [open_lerobot(r) for r in roots]
    peers: list[Peer | None] = []
    try:
        anchors = []
        for i, (r, lr) in enumerate(zip(roots, bufs)):
            a = anchors_for(len(lr), rounds, batches, batch, i)
            anchors.append(a)
            np.save(r.parent / f"{r.name}.anchors.npy", a)
            lr.get_time_windows(a[0, 0], deltas)  # opens the shards' packet index
            peers.append(Peer(peer_python, r, deltas, r.parent / f"{r.name}.anchors.npy", backend)
                         if peer_python else None)
        times: list[list[float]] = [[] for _ in bufs]
        peer_times: list[list[float]] = [[] for _ in bufs]
        for k in range(1, rounds + 1):
            for i, lr in enumerate(bufs):
                t = time.perf_counter()
                for b in range(batches):
                    lr.get_time_windows(anchors[i][k, b], deltas)
                times[i].append(time.perf_counter() - t)
                p = peers[i]
                if p is not None and p.about is not None:
                    took = p.round(k)
                    if took is None:
                        peer_times[i].clear()
                    else:
                        peer_times[i].append(took)
    finally:
        for lr in bufs:
            lr.close()
        for p in peers:
            if p is not None:
                p.close()
    out: list[dict[str, object]] = []
    for i, ts in enumerate(times):
        n = batches * batch
        rate = n / float(np.median(ts))
        p = peers[i]
        lr_rate = n / float(np.median(peer_times[i])) if peer_times[i] else None
        out.append({"ts": (rate, rate * frames), "lr": None if lr_rate is None else (lr_rate, lr_rate * frames),
                    "note": "LeRobot not asked (no --lerobot-python)" if p is None else p.note})
    return out


def _rate_cells(r: dict[str, object]) -> str:
    ts = r["ts"]
    lr = r["lr"]
    assert isinstance(ts, tuple)
    if not isinstance(lr, tuple):
        why = "not installed" if str(r["note"]).startswith("LeRobot not installed") else "did not run"
        return f"{ts[0]:.1f} | {ts[1]:.0f} | {why} | | "
    return f"{ts[0]:.1f} | {ts[1]:.0f} | {lr[0]:.1f} | {lr[1]:.0f} | {ts[0] / lr[0]:.2f}x"


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; return the markdown section."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    ap.add_argument("--episodes", type=int, default=10, help="episodes of 300 frames of the import dataset "
                    "(issue 32 asks for 50; 10 fit bench_all's time budget)")
    ap.add_argument("--lerobot-python", default=os.environ.get("LEROBOT_PYTHON", sys.executable),
                    help="the Python whose LeRobot reads the same windows (default: $LEROBOT_PYTHON, else this one)")
    ap.add_argument("--lerobot-backend", default=None, help="LeRobot's video_backend (default: LeRobot's default)")
    ap.add_argument("--import-only", action="store_true", help="time the import part alone (read once, "
                    "read with a crc32c, copy, import; --rounds rounds, medians) and print plain text")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of --import-only (default 5)")
    ap.add_argument("--source", default=None, help="--import-only: an existing LeRobot v3 folder to import "
                    "(default: write the --episodes dataset in a temporary folder)")
    args = ap.parse_args(argv)
    if args.import_only:
        return import_only(args)
    started = time.perf_counter()
    eps, n, size = (6, 60, (96, 128)) if args.quick else (args.episodes, 300, (480, 640))
    flat = (100, 1000) if args.quick else (100, 10000)
    fps = 30
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "lerobot"
        write_v3(str(src), [n] * eps, CAMS, fps=fps, size=size, dims=(14, 14))
        floor = read_once(src)
        copy = copy_once(src, Path(tmp) / "copy")
        shutil.rmtree(Path(tmp) / "copy")
        t = time.perf_counter()
        out = import_lerobot(src, Path(tmp) / "store")
        dt = time.perf_counter() - t
        before, after = folder_bytes(src), folder_bytes(Path(tmp) / "store")
        v_before, v_after = folder_bytes(src, "videos"), folder_bytes(Path(tmp) / "store", "/video/")
        shutil.rmtree(Path(tmp) / "store")
        t = time.perf_counter()
        linked = import_lerobot(src, Path(tmp) / "linked", link=True)
        dt_link = time.perf_counter() - t
        after_link, v_link = own_bytes(Path(tmp) / "linked"), own_bytes(Path(tmp) / "linked", "/video/")
        shutil.rmtree(Path(tmp) / "linked")
        (main_rate,) = window_rates([src], fps, 5 if args.quick else 10, 32, 1 if args.quick else 3,
                                    args.lerobot_python, args.lerobot_backend)
        rows = [f"| import_lerobot | {dt:.2f} s | {floor:.2f} s | {copy:.2f} s | {before / 1e6:.1f} MB | {after / 1e6:.1f} MB | "
                f"{v_after / max(v_before, 1):.3f} |",
                f"| import_lerobot(link=True) | {dt_link:.2f} s | {floor:.2f} s | {copy:.2f} s | {before / 1e6:.1f} MB | "
                f"{after_link / 1e6:.1f} MB added | {v_link / max(v_before, 1):.3f} added |"]
        fallbacks = linked["link_fallbacks"]
        shutil.rmtree(src)
        flat_rows, dirs, imports = [], [], []
        for count in flat:
            d = Path(tmp) / f"flat{count}"
            write_v3(str(d), [8] * count, CAMS, fps=fps, size=(32, 32))
            t = time.perf_counter()
            import_lerobot(d, Path(tmp) / f"flat{count}.store")
            imports.append(time.perf_counter() - t)
            shutil.rmtree(Path(tmp) / f"flat{count}.store")
            dirs.append(d)
        rates = window_rates(dirs, fps, 10, 32, 3 if args.quick else 7, args.lerobot_python, args.lerobot_backend)
        for count, r, it in zip(flat, rates, imports):
            flat_rows.append(f"| {count} | {_rate_cells(r)} | {it:.2f} s |")
    ts_flat = [r["ts"][0] for r in rates]  # type: ignore[index]
    note = main_rate["note"]
    body = f"""A LeRobot v3.0 dataset of {eps} episodes x {n} frames, 2 cameras {size[0]}x{size[1]} AV1 (crf 30,
g 2, as LeRobot encodes) and 14-dim state and action, imported with the cameras' packets kept
(adopted per camera: {out['adopted']}; transcoded: {out['transcoded']}), against reading every file
of the dataset once and copying the folder (the files were just written: they are in the page
cache). Bytes are allocated blocks on disk. Video ratio: the store's video segments' bytes over the
MP4s' bytes. The import reads each MP4's packet index from its `moov` sample table, copies each
episode's packets file to file into its segment (`copy_file_range`), commits per batch of episodes and
verifies the store (segments' frame tables, not their packets) before renaming it. The linked import
(`link=True`) hard-links each MP4 into the store instead and writes linked segments naming the
packets there, reading each episode's packets once for their crc32c; a hard link adds no bytes to
the disk, so its bytes after are what the store adds beside the dataset (MP4s it could not link and
copied: {fallbacks}).

| what | time | read files once | copy files once | bytes before | bytes after | video after / before |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Windows of Diffusion Policy's defaults as `delta_timestamps` (2 frames of both cameras and the
state, 16 actions) at the same random anchors over the same files: `open_lerobot`'s
`get_time_windows` in batches of 32 sorted anchors, and LeRobot's own `LeRobotDataset[i]` one window
at a time (as a DataLoader worker reads it) in a child process; the loaders take turns each round
(median of rounds). Frames/s: camera frames delivered (4 per window). LeRobot: {note}.

| dataset | trajstore windows/s | trajstore frames/s | LeRobot windows/s | LeRobot frames/s | trajstore / LeRobot |
|---|---|---|---|---|---|
| {eps} x {n}, {size[0]}x{size[1]} | {_rate_cells(main_rate)} |

Flatness: the same windows over datasets of 8-frame episodes, 32x32 frames (median of rounds in
which the datasets take turns), and their import. trajstore {flat[0]} / {flat[1]} episodes:
{ts_flat[0] / ts_flat[1]:.2f}x (the issue asks within 1.3x).

| episodes | trajstore windows/s | trajstore frames/s | LeRobot windows/s | LeRobot frames/s | trajstore / LeRobot | import |
|---|---|---|---|---|---|---|
{chr(10).join(flat_rows)}
"""
    return section("LeRobot datasets (scripts/bench_lerobot.py)", "bench_lerobot.py", argv or [],
                   runs="one run per number (import once; windows over the stated batches)", body=body,
                   quick=args.quick, started=started, packages=("av", "pyarrow"), store_dir=Path(tempfile.gettempdir()))


if __name__ == "__main__":
    print(main(sys.argv[1:]))
    os._exit(0)
