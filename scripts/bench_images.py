"""Image rows: every read path of trajstore against the numpy memmap gather of the same rows (the
limit), and the SB3 buffers against SB3's in-RAM ones, as ratios measured side by side in one run.

Workloads, (84,84,4) uint8 frames (Atari-style), page cache warm, each system freshly opened:

- ``sample(256)``, ``rb[idx]``, a ``get_slice`` view and a ``get_column`` view indexed with 256
  random rows, numpy and torch backends;
- frame stacks: ``get_sequences(idx, offsets=[-3..0])`` and ``sample_sequences(256, 4)`` of a
  ``TrajectoryReplayBuffer`` against the memmap gather of the same 256 x 4 rows;
- ``ZarrReplayBuffer.sample(256)`` (obs and next_obs) and ``add`` against SB3's ``ReplayBuffer``.

How it is measured (docs/benchmarks.md): each read workload runs in a fresh interpreter that opens
both systems; they run in blocks of 25 consecutive calls, block after block, the order of the
systems rotated each round so neither gets the process's warm-up (allocator, page tables) for free;
no read pass before timing.  "cold" is the total time of the
first 200 calls after opening (the process's mappings cold), "steady" the total of the calls after
those.  Ratio = trajstore / baseline (lower is better).

    python scripts/bench_images.py                 # 50,000 frames (about 3 minutes on 2 cores)
    python scripts/bench_images.py --quick         # 3,000 frames (smoke test)
    python scripts/bench_images.py --markdown docs/benchmarks.md
    python scripts/bench_images.py --sb3-only --sb3-sizes 100000   # only the ZarrReplayBuffer rows
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gymnasium as gym
from bench_core import BLOCK, COLD, _write_markdown, run_blocks

from trajstore import ReplayBuffer, TrajectoryReplayBuffer

FRAME = (84, 84, 4)
BATCH = 256
Row = dict[str, Any]


def ratio_rows(what: str, times: dict[str, np.ndarray], ours: str, base: str, target: float) -> list[Row]:
    a, b = times[ours], times[base]
    return [{"what": what, "phase": phase, "ours": a[sl].sum() / n * 1e3, "base": b[sl].sum() / n * 1e3,
             "ours_name": ours, "base_name": base, "ratio": a[sl].sum() / b[sl].sum(), "target": target}
            for phase, sl, n in (("cold", slice(0, COLD), COLD), ("steady", slice(COLD, None), len(a) - COLD))]


def _frames(n: int, seed: int = 0) -> np.ndarray:
    """``n`` distinct-looking frames, cheap to make (a few base frames rolled)."""
    base = np.random.default_rng(seed).integers(0, 256, size=(16, *FRAME), dtype=np.uint8)
    return np.stack([np.roll(base[i % 16], i, axis=0) for i in range(n)])


def build_stores(tmp: Path, n: int) -> dict[str, Path]:
    """A Dict ReplayBuffer ({"obs": frame, "act": Discrete(4)}), a TrajectoryReplayBuffer of
    1000-step episodes and a memmap file of the same frames."""
    space = gym.spaces.Dict({"obs": gym.spaces.Box(0, 255, FRAME, np.uint8), "act": gym.spaces.Discrete(4)})
    mm = np.lib.format.open_memmap(tmp / "frames.npy", mode="w+", dtype=np.uint8, shape=(n, *FRAME))
    rb = ReplayBuffer.create(space, cache_path=tmp / "rb")
    tb = TrajectoryReplayBuffer.create(gym.spaces.Box(0, 255, FRAME, np.uint8), cache_path=tmp / "tb")
    for lo in range(0, n, 1000):
        frames = _frames(min(1000, n - lo), seed=lo)
        mm[lo : lo + len(frames)] = frames
        rb.extend({"obs": frames, "act": np.arange(len(frames)) % 4})
        tb.extend({"step_data": frames, "episode_ids": np.full(len(frames), lo // 1000)})
    mm.flush()
    del mm
    rb.close()
    tb.close()
    return {"rb": tmp / "rb", "tb": tmp / "tb", "mm": tmp / "frames.npy"}


def _read_workloads(paths: dict[str, Path], n: int) -> dict[str, tuple[str, str, float, Callable[[], dict[str, Callable[[], Any]]]]]:
    """name -> (ours, baseline, target, a function opening both systems and returning their calls)."""
    g = np.random.default_rng(1)
    offs = np.arange(-3, 1)

    def memmap() -> Callable[[], Any]:
        mm = np.load(paths["mm"], mmap_mode="r")
        return lambda: mm[g.integers(0, n, BATCH)]

    def mm_windows() -> Callable[[], Any]:
        mm = np.load(paths["mm"], mmap_mode="r")
        return lambda: mm[(g.integers(3, n, BATCH)[:, None] + offs).ravel()].reshape(BATCH, 4, *FRAME)

    def rb(backend: str = "numpy") -> ReplayBuffer:
        return ReplayBuffer.load_from(paths["rb"], read_only=True, backend=backend)

    def tb() -> TrajectoryReplayBuffer:
        return TrajectoryReplayBuffer.load_from(paths["tb"], read_only=True)

    def indexed(view: Any) -> Callable[[], Any]:
        return lambda: view[g.integers(0, n, BATCH)]

    def sampled(buf: Any) -> Callable[[], Any]:
        return lambda: buf.sample(BATCH)

    def windows(buf: TrajectoryReplayBuffer) -> Callable[[], Any]:
        return lambda: buf.get_sequences(g.integers(0, n, BATCH), offs)

    def sequences(buf: TrajectoryReplayBuffer) -> Callable[[], Any]:
        return lambda: buf.sample_sequences(BATCH, 4)

    return {
        "sample(256), numpy": ("trajstore", "memmap", 1.5, lambda: {"trajstore": sampled(rb()), "memmap": memmap()}),
        "sample(256), torch vs numpy backend": (
            "torch", "numpy", 1.2, lambda: {"torch": sampled(rb("torch")), "numpy": sampled(rb())}),
        "rb[idx], 256 random rows": ("trajstore", "memmap", 1.5, lambda: {"trajstore": indexed(rb()), "memmap": memmap()}),
        "get_slice(:)[idx], 256 random rows": (
            "trajstore", "memmap", 1.5, lambda: {"trajstore": indexed(rb().get_slice(slice(None))), "memmap": memmap()}),
        "get_column(['obs'])[idx], 256 random rows": (
            "trajstore", "memmap", 1.5, lambda: {"trajstore": indexed(rb().get_column(["obs"])), "memmap": memmap()}),
        "get_sequences(256 anchors, offsets -3..0)": (
            "trajstore", "memmap", 1.5,
            lambda: {"trajstore": windows(tb()), "memmap": mm_windows()}),
        "sample_sequences(256, 4)": (
            "trajstore", "memmap", 1.5,
            lambda: {"trajstore": sequences(tb()), "memmap": mm_windows()}),
    }


def bench_read(paths: dict[str, Path], n: int, calls: int, name: str) -> list[Row]:
    """One read workload, both systems freshly opened in this process."""
    ours, base, target, make = _read_workloads(paths, n)[name]
    return ratio_rows(name, run_blocks(make(), calls), ours, base, target)


def bench_reads(tmp: Path, paths: dict[str, Path], n: int, calls: int) -> list[Row]:
    """Every read workload in a fresh interpreter of its own (cold means cold for both systems:
    no mapping, allocator arena or page table left over from an earlier workload)."""
    rows: list[Row] = []
    for name in _read_workloads(paths, n):
        out = tmp / "rows.json"
        subprocess.run([sys.executable, __file__, "--one", name, "--dir", str(tmp), "--rows", str(n),
                        "--calls", str(calls), "--json", str(out)], check=True)
        rows += json.loads(out.read_text())
    return rows


def _sb3_add(buf: Any, frames: np.ndarray) -> Callable[[], None]:
    """One ``add`` of a (1, 84, 84, 4) frame pair per call, cycling through ``frames``."""
    act, rew, done, infos = np.zeros((1, 1), np.int64), np.zeros(1, np.float32), np.zeros(1, bool), [{}]
    k = [0]

    def go() -> None:
        i = k[0] = (k[0] + 1) % (len(frames) - 1)
        buf.add(frames[i], frames[i + 1], act, rew, done, infos)

    return go


def bench_sb3(tmp: Path, size: int, calls: int, with_add: bool) -> list[Row]:
    """ZarrReplayBuffer vs SB3's ReplayBuffer holding ``size`` transitions: sample(256) (obs and
    next_obs), and (``with_add``) ``add`` once the ring is full."""
    from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer

    from trajstore.sb3 import ZarrReplayBuffer

    obs_space, act_space = gym.spaces.Box(0, 255, FRAME, np.uint8), gym.spaces.Discrete(4)
    frames = _frames(64)[:, None]
    ref = SB3ReplayBuffer(size, obs_space, act_space, "cpu")
    path = tmp / f"sb3_{size}"
    ours = ZarrReplayBuffer(size, obs_space, act_space, "cpu", cache_path=path, overwrite=True)
    fill_ref, fill_ours = _sb3_add(ref, frames), _sb3_add(ours, frames)
    for _ in range(size):
        fill_ref()
        fill_ours()
    ours.close()
    ours = ZarrReplayBuffer(size, obs_space, act_space, "cpu", cache_path=path, resume=True)  # reopened
    try:
        t = run_blocks({"trajstore": lambda: ours.sample(BATCH), "sb3": lambda: ref.sample(BATCH)}, calls)
        rows = ratio_rows(f"ZarrReplayBuffer.sample(256), {size:,} transitions", t, "trajstore", "sb3", 1.0)
        if with_add:
            t = run_blocks({"trajstore": _sb3_add(ours, frames), "sb3": _sb3_add(ref, frames)}, max(4 * calls, COLD + 400))
            rows += ratio_rows(f"ZarrReplayBuffer.add, {size:,} transitions (ring full)", t, "trajstore", "sb3", 1.5)
    finally:
        ours.close()
    return rows


#: What profiling found (kept in docs/benchmarks.md with each rewrite of the section).
FINDINGS = """\
Where the time went (profiled, issue 12):

- `ValuePlan.from_arrays` nested the returned arrays with a self-recursive closure, a reference
  cycle that kept every batch alive until the garbage collector ran; each 7 MB image batch was
  then freed late and the next one faulted in fresh zeroed pages (`clear_page_erms` was 38% of
  `sample`'s time; 509 page faults per call against 0.2 for the same gather). Fixed.
- Opening the chunk files of a store on its first read cost three `lstat` and a pathlib walk per
  chunk; `openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS` does the same checks in one call.
- The cold phase (first 200 calls after opening): page faults. The kernel maps a 2 MiB page-cache
  folio with one fault, but only where the virtual address and the file offset agree modulo
  2 MiB. The memmap file starts on such a boundary; trajstore's 256-row chunks (7.2 MB for
  28,224-byte rows) lay end to end did not, so they were mapped 64 KiB per fault (fault-around):
  324 faults per `sample(256)` over the first 25 calls against the memmap's 74, and
  `get_slice`/`get_column`/`get_sequences` missed 1.5x cold. Chunks of at least 2 MiB now start
  on 2 MiB boundaries, a gap after each (`_vmap.slot_bytes`): about 115 faults against the
  memmap's 75 (each chunk's last 1.2 MB, short of 2 MiB, is still mapped 64 KiB at a time).
  This holds for stores written in large blocks (`extend`, imports, copies) or read back from disk;
  a ring written one step at a time (`ZarrReplayBuffer.add`, 18-row blocks) has small folios, which
  are mapped 64 KiB per fault in any layout (hence `ZarrReplayBuffer.sample` cold at 1e5 rows).
- `ZarrReplayBuffer.add` of a frame pair (about 25 us against SB3's 12): `pwrite` into the page
  cache is 8-9 us (a memory-bandwidth copy, 6 us per 56 KiB at best on this machine), staging the
  two frames 3.6 us, the block hand-over (ring bookkeeping, small leaves, eviction commits) about
  5 us, and the Python of `add` about 7 us. SB3 pays two copies into RAM (6.9 us) and little else.
  A background writer thread made it slower (42 -> 67 us on 2 cores). Staged blocks of 8 MiB
  (148 rows) instead of 1 MiB (18 rows) save 2-3.5 us. At 1e5 transitions the ring's dirty pages (5.6 GB) also exceed the kernel's
  dirty thresholds (20% of RAM), so writeback throttles `pwrite`.
- `add`, second pass (timers around drain/pwrite/commit, line_profiler; 20,000 rows, 2 cores
  shared with other jobs): a block's hand-over was 16-22 us per add, of which `pwrite` 9.5-12,
  eviction commits 2.2-3.6 (one per `Table.guard` = 625 rows at 20,000; 1.5-2.6 ms each: the head
  file written, renamed over the old one, the old one's descriptor closed), resolving chunk paths
  with pathlib to open them 0.8; staging five small leaves per add (copies, list building) 2-3.
  Now `add` stages only the two frames: action, reward, done, timeout and step are gathered from
  SB3's RAM arrays once per block (`RowStager.fill`); frames already of the stored shape and dtype
  skip `ObsLayout.batch`; chunk files are opened with one `openat2`; a block ends where a chunk
  ends and holds a whole 256-row chunk (16 MiB staging). scripts/bench_sb3.py's add row, same
  process and load for both versions: 2.03-2.17x before, 1.42-1.54x after; this script at 1e5
  transitions, steady: 1.86-2.13x before, 1.18 / 1.28 / 1.43 / 1.57x in four runs after (load 2-3).
  Cold (the first 200 adds after reopening, 62-217 us each) stays far above SB3: the first blocks
  meet the dirty pages the fill left (writeback throttling) and the ring's first eviction commit.
- Stored in place since (trajstore/sb3/_inplace.py): `add` writes each frame once, into the writer's
  mapping of its chunk file, and the hand-over copies nothing for it. Rejected at first: once
  writeback has cleaned the pages every page faults again through ext4's `page_mkwrite`, 18-26 us
  per 28 KB row (6.9 faults), and `MADV_POPULATE_WRITE` page by page did the same work. What
  changed: a block (a whole 256-row chunk) is prepared at once, after a committed record evicted
  its old rows: one `MADV_POPULATE_WRITE` call, which maps each 2 MiB page-cache folio (`pwrite`
  of whole blocks makes them) writable on one fault; and the block's pages are unmapped first
  (`MADV_DONTNEED`), because a 2 MiB folio mapped read-only (by the writer's own sampling, or
  write-protected by writeback) takes a write fault by splitting the mapping and faulting each
  4 KiB page: 1.2-1.6 ms per 256 rows against 0.3-0.6 ms. `MADV_HUGEPAGE` on the writer's
  mappings was tried and left out: no difference to add (1.23-1.28x with, 1.27-1.44x without, same
  runs, noise), and it makes every fault on an uncached page read 2-4 MiB whatever the readahead
  settings (200 random 28 KB rows of a cold file mapped `MADV_RANDOM`: 5.7 MB read, 312 MB with
  it), which a writer sampling a ring larger than RAM would pay per row. A block stays staged
  where in place loses: pages not all in the page cache (a ring larger than RAM: stores read each
  page from disk first, `pwrite` of whole pages reads nothing; with the ring's pages dropped,
  2.4-2.9x SB3 in place against 1.8x staged), the block after one that a read handed over part-filled (a training loop
  sampling after every add hands over 1-row blocks: preparing each in place cost 470 us per add
  against 73-96 us staged), and observation rows under 4 KiB (little to copy). This script,
  `--sb3-only`, load 0.9-2.7, runs alternating with the staged code: 20,000 transitions steady
  1.17-1.45x, median 1.25 (staged 1.66-2.21x), cold 1.59-2.43x (staged 1.56-5.89x); 1e5 steady
  1.21x (1.63x), cold 1.76x (5.28x). Cold includes the first block's eviction commit and
  preparation at the first add; the staged path's first hand-over comes at the 256th add, after
  the cold window. 2 of 13 runs in place and 1 of 13 staged stalled for the whole add phase
  (0.1-0.8 ms per add), not seen again in 12 instrumented runs (no add over 8 ms, nothing read).
  A training loop (add, then `sample(256)`) adds as before: 0.66-0.97x SB3 per add, in CPU time.
- Cold `add` (the first 200 adds after reopening a full 20,000-transition ring, timed add by
  add): all of its excess over steady state is the first add, which prepares the first 256-row
  block and commits the record that evicts its slots' rows: 4.2-4.7 ms, of which the commit
  2.7-3.0 ms against 1.6-1.7 ms for later ones. The first commit's publish read every array's
  `zarr.json` and the root again (0.8-1.1 ms) although the writer's open had just read them, and
  parsing checked JSON nesting with a walk costing 4x the parse (236 us for the root). Now the
  open's reads serve the first publish while each file's identity holds (`Publisher.seed`:
  0.17 ms) and the walk goes level by level (54 us); the block's residency check probes one page
  per MiB (`mincore` of every page cost 0.13-0.25 ms per field while the pages are unmapped:
  67 us). The first add then took 2.5-3.8 ms: the commit 1.5-2.1 ms and the block's
  `MADV_POPULATE_WRITE` 0.3-0.5 ms per field. Of the commit, `os.replace` of the record was
  0.4-5 ms: ext4 (default `auto_da_alloc`) starts writing a file's data inside a rename over an
  existing name. The record now moves into place by `renameat2(RENAME_EXCHANGE)` and an unlink
  of the old file (storage/_replace.py: 140-200 us against 380-430 for a 900-byte record); a
  writer's open empties the temp folder instead of removing it, and a temp name costs one
  `lstat`. A one-row `flush()` went from 920-1,010 to 570-600 us (unbounded store) and from
  590-640 to 400-470 us (ring). The first add now takes 1.9-2.6 ms in this workload (timed: the
  commit 0.8-1.1 ms, the populate 0.75-0.8 ms for both fields); every other add of the cold window
  is at SB3's speed or faster (median 12-21 us against SB3's 16-25). That first add is the price
  of a durable ring (the rows it overwrites leave the record before they are overwritten).
  `--sb3-only --sb3-sizes 20000`, runs of 2026-12-02 before the exchange: cold 1.58 / 1.59x
  (earlier sessions 1.37-1.91x); after: cold 1.50, 1.26, 1.36, 1.32, 1.45, 1.43, 1.20, 1.36,
  1.40, 1.56, 1.17, 1.18x (median 1.36), steady 1.14-1.29x. At 1e5 (`--sb3-sizes 100000`):
  cold 1.54 / 1.45x before the temp-folder change, 1.39 / 1.36x after; steady 1.11-1.22x. Full
  runs after all three changes (1e5, after the read workloads): cold 1.74, 1.54 (instrumented:
  the first add 2.1 ms, the median add 13 us against SB3's 17) and 1.35x (the table recorded then); steady
  0.93-1.19x. Before them, the full run recorded was cold 1.89x.
  Then `Location.put` moved the temp file through open fds of the key's folder and the temp
  folder (openat2) instead of makedirs' `mkdir` and path checks per file operation: a one-row
  `flush()` of a ring 302-378 us against 419-473 (alternating runs). Timed since, the first add's
  commit is 0.75-0.98 ms (of which the put 0.32-0.42) and the block's populate 1.0-1.6 ms for both
  fields (`ext4_page_mkwrite` walking each 2 MiB folio's buffer heads is most of it: perf); the
  `unlink` of the old record alone swings from 40 to 670 us with the journal. Populating the block
  in 1 MiB pieces as the adds reach them was tried and left out: steady 1.33-1.39x against
  1.17-1.32x in alternating runs (a piece costs more per page than the whole block), and per-row
  `pwrite` of the frames costs more than the copy into the mapping plus the populate (11-12 us
  per row and field against 7). Runs of 2026-12-02 after the put change: full runs (this table's
  command) cold 1.20, 1.21, 1.17, 1.24, 1.40 and 1.24x (this table), steady 1.07-1.15x, every
  row ok;
  `--sb3-only --sb3-sizes 20000`: cold 1.28, 1.38, 1.49, 1.40, 1.25, 1.44, 1.36, 1.38, 1.52, 1.33,
  1.54, 1.31, 1.58x (median 1.38; the code before it, in alternating runs the same morning: 1.36, 1.68, 1.44,
  1.25, 1.66, 1.46, 1.44, 1.33, 1.53, 1.45, median 1.44),
  steady 1.15-1.29x. The rest of the first add is the ring's durability (a record that evicts the
  block's rows, on a new inode, before any of them is overwritten) and the kernel's write faults.
  Earlier full runs at 1e5 stalled once after the read workloads had filled the page cache and
  SB3 held 5.6 GB (reclaim: 2.8 ms per cold add), and one instrumented 20,000 run of three
  stalled in the filesystem (a 73 ms commit, a 1.2 s block start) while the fill's 1.1 GB of
  dirty frames were written back.
- Folios (/proc/kpageflags of a ring written by `add`): with 148-row blocks straddling chunks,
  2 MiB folios cover 1,024 of a chunk's 1,764 pages and mapping a chunk takes 15 faults; with
  chunk-aligned 256-row blocks 1,536 pages and 10 faults (a chunk written in one 7.2 MB write: 7).
  Cold `sample` at 1e5 rows still maps nearly the whole ring during its first 200 calls (51,200 of
  100,000 rows drawn per field, each fault mapping a folio): about 60 faults per call against 2 in
  steady state. `MADV_POPULATE_READ` on a chunk at its first read was not done: it would map every
  page of every touched chunk at once (the first call touches 2 x 230 of 782 chunks), more page
  table work than the faults it saves, and on a store larger than RAM it reads whole chunks from
  disk for one row.
- `add` at 1e5 transitions on a quiet machine, staged (before in-place adds; the table of that
  time): cold 18 us (0.76x SB3), steady 77 us (3.36x). The ring is 5.6 GB of frames, more than the
  kernel's dirty-page limits, so once the fill's dirty pages meet the new ones every `pwrite` waits
  for writeback: 56 KB per add at 77 us is about 730 MB/s written back to disk. A disk-backed
  ring that large is bound by the disk (SB3 keeps it in RAM); at 20,000 transitions (1.1 GB,
  rewritten in the page cache faster than writeback expires it) add is 1.42-1.54x SB3. Runs with
  `--sb3-only` (only this ring dirty) did not meet writeback: steady 31-32 us staged, 22-28 us in
  place (load 1.2-1.6).
- SB3's in-RAM `sample` itself swings between 3 and 23 ms from run to run: its `th.tensor` copies
  and gathered arrays (7 MB each) come back from glibc as fresh pages when the heap top was
  trimmed or the block was mmap'ed (600-4,500 page faults per call, depending on the process's
  allocation history). Its floor is about 2.5-3.7 ms (no faults); compare cold ratios with that in
  mind.
"""


def table(rows: list[Row]) -> str:
    lines = ["| workload | phase | trajstore ms/call | baseline | baseline ms/call | ratio | target |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "ok" if r["ratio"] <= r["target"] else "MISSED"
        lines.append(f"| {r['what']} | {r['phase']} | {r['ours']:.3f} | {r['base_name']} | {r['base']:.3f} | "
                     f"{r['ratio']:.2f} | <= {r['target']} ({ok}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3,000 frames, fewer calls (a smoke test)")
    ap.add_argument("--rows", type=int, default=None, help="frames in the stores (default 50,000)")
    ap.add_argument("--sb3-sizes", type=str, default=None, help="comma-separated sizes (default 1000,10000,100000)")
    ap.add_argument("--sb3-only", action="store_true", help="only the ZarrReplayBuffer workloads (a quick check: SB3's sample time depends on the process's allocation history, which the read workloads change; see FINDINGS)")
    ap.add_argument("--markdown", type=Path, default=None, help="also (re)write this script's section of FILE")
    ap.add_argument("--calls", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one read workload
    ap.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    n = a.rows or (3000 if a.quick else 50_000)
    calls = a.calls or (250 if a.quick else 600)
    if a.one is not None:  # a child of bench_reads
        paths = {"rb": a.dir / "rb", "tb": a.dir / "tb", "mm": a.dir / "frames.npy"}
        a.json.write_text(json.dumps(bench_read(paths, n, calls, a.one)))
        return 0
    sizes = [int(s) for s in (a.sb3_sizes or ("1000" if a.quick else "1000,10000,100000")).split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_images_") as d:
        tmp = Path(d)
        t0 = time.perf_counter()
        rows = [] if a.sb3_only else bench_reads(tmp, build_stores(tmp, n), n, calls)
        for size in sizes:
            rows += bench_sb3(tmp, size, calls, with_add=size == sizes[-1])
        took = time.perf_counter() - t0
    text = (f"{n:,} frames of (84,84,4) uint8, {calls} calls per system (first {COLD} = cold), blocks of "
            f"{BLOCK}, took {took:.0f} s.\n\n" + table(rows))
    if a.markdown is not None:
        text = FINDINGS + "\n" + text
    print(text)
    if a.markdown is not None and not a.sb3_only:
        _write_markdown(a.markdown, "bench_images.py", a.quick, "## Image rows: every read path against the memmap limit",
                        text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
