"""Regenerate every table of docs/benchmarks.md from today's code.

    python scripts/bench_all.py                      # every section (about 41 minutes on 2 quiet cores)
    python scripts/bench_all.py --only core,sb3      # these sections; the others are kept as they are
    python scripts/bench_all.py --quick --out /tmp/b.md   # tiny sizes, a smoke run of every section
    python scripts/bench_all.py --list               # the sections, their scripts and estimated times

Each section is one ``scripts/bench_*.py`` whose ``main(argv) -> str`` returns the section's
markdown (heading, command, date, machine, versions, runs per median, a few sentences, the
tables; scripts/benchdoc.py). Every script runs in a fresh interpreter (no section inherits
another's heap, mappings or imports).  The file is rewritten once at the end, atomically (a
temp file renamed over it), so an interrupted run leaves the old file whole.  A script missing
from this tree is skipped with a message and its old section kept; a section that fails keeps
its old text too, and the command exits 1.  ``--quick`` never writes docs/benchmarks.md: give
``--out``, or it only prints.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
DOC = ROOT / "docs" / "benchmarks.md"
END = "<!-- bench_all: end -->"
_MARK = re.compile(r"^<!-- bench_all: ([a-z0-9_]+) -->$", re.M)


@dataclass(frozen=True)
class Section:
    """One section: its name (``--only``), script, heading (what its ``main`` returns starts with
    ``## title``), arguments of a full and of a quick run, and the seconds a full run takes on 2
    quiet cores (estimated from its recorded runs)."""

    name: str
    script: str
    title: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    estimate_s: int


SECTIONS = (
    # estimates: the seconds each section took in its last full run (2026-12-06, 2 cores), rounded
    # up; versions: its script's own runs (its first full run came after)
    Section("core", "bench_core.py", "Core store (scripts/bench_core.py)", (), ("--quick",), 45),
    Section("sequences", "bench_trajectory.py", "Sequence sampling (scripts/bench_trajectory.py)",
            (), ("--quick", "--rounds", "1"), 40),
    Section("prioritized", "bench_prioritized.py", "Prioritized replay (scripts/bench_prioritized.py)",
            (), ("--quick",), 5),
    Section("images", "bench_images.py",
            "Image rows: every read path against the memmap limit (scripts/bench_images.py)",
            (), ("--quick", "--rows", "1000", "--sb3-sizes", "300", "--calls", "210"), 70),
    Section("sb3", "bench_sb3.py", "stable-baselines3 training (scripts/bench_sb3.py)", (), ("--quick",), 85),
    Section("offline", "bench_offline.py", "Offline datasets (scripts/bench_offline.py)", (), ("--quick",), 185),
    Section("shards", "bench_shards.py", "Sharded datasets (scripts/bench_shards.py)",
            (), ("--quick", "--rounds", "1"), 20),
    Section("ray", "bench_ray.py", "Ray actors (scripts/bench_ray.py)", (), ("--quick",), 120),
    Section("open_dp", "bench_open_dp.py", "Diffusion Policy stores in place (scripts/bench_open_dp.py)",
            (), ("--quick",), 30),
    Section("compressed", "bench_compressed.py",
            "Compressed image rows and remote batches (scripts/bench_compressed.py)",
            (), ("--quick",), 70),
    Section("codecs", "bench_codecs.py", "Image codecs: size and random reads (bench_codecs.py)",
            (), ("--quick",), 950),
    Section("video", "bench_video.py", "Video (scripts/bench_video.py)", (), ("--quick",), 100),
    Section("import", "bench_import.py", "Import time (scripts/bench_import.py)", (), ("--runs", "1"), 10),
    Section("lerobot", "bench_lerobot.py", "LeRobot datasets (scripts/bench_lerobot.py)", ("--episodes", "50"),
            ("--quick",), 520),
    Section("versions", "bench_versions.py", "Versions on icechunk (scripts/bench_versions.py)",
            (), ("--quick", "--batches", "2"), 25),
    Section("peers", "bench_peers.py", "Peer suite (scripts/bench_peers.py)",
            (), ("--quick", "--calls", "40", "--budget", "0.25"), 160),
)
BY_NAME = {s.name: s for s in SECTIONS}

PREAMBLE = """# Benchmarks

Every table below is written by one command from the code of the commit it names:
`python scripts/bench_all.py` (about {minutes} minutes on 2 cores; `--only NAME,...` reruns some
sections and keeps the others; `--list` names them). Each section states its own command, date,
machine, versions and how many runs stand behind each median. Unless a section says otherwise,
calls are timed in blocks of consecutive calls (as a training loop makes them), systems taking
turns, cold (the first calls after a fresh open) and steady reported apart, with no warm-up a
training loop would not do; the peers of a table are measured in the same run.

How these numbers were investigated (profiles, what was tried and rejected, earlier runs):
[performance-notes.md](performance-notes.md). Numbers quoted elsewhere in the docs are taken from
these tables (tests/test_benchmark_claims.py checks it).
"""


def split(text: str) -> dict[str, str]:
    """The sections of a benchmarks file by name (the text after each ``bench_all`` marker)."""
    text = text.split(END, 1)[0]
    marks = list(_MARK.finditer(text))
    return {m.group(1): text[m.end():(marks[i + 1].start() if i + 1 < len(marks) else len(text))].strip("\n")
            for i, m in enumerate(marks)}


def compose(sections: dict[str, str]) -> str:
    """The whole file: the preamble, then every section in :data:`SECTIONS` order."""
    minutes = round(sum(s.estimate_s for s in SECTIONS) / 60)
    out = [PREAMBLE.format(minutes=minutes)]
    for s in SECTIONS:
        body = sections.get(s.name) or (f"## {s.title}\n\nNot generated yet: "
                                         f"`python scripts/bench_all.py --only {s.name}`.")
        out.append(f"<!-- bench_all: {s.name} -->\n{body.strip()}\n")
    out.append(END + "\n")
    return "\n".join(out)


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by a temp file beside it renamed over it (readers see old or new, whole)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


_CHILD = ("import importlib, sys; sys.path.insert(0, sys.argv[1]); "
          "text = importlib.import_module(sys.argv[2]).main(sys.argv[4:]); "
          "open(sys.argv[3], 'w').write(text)")


def run_section(s: Section, quick: bool, extra: list[str], scratch: Path, scripts: Path = SCRIPTS) -> str | None:
    """Run one script in a fresh interpreter; its section's markdown, or None when it failed."""
    out = scratch / f"{s.name}.md"
    argv = [*(s.quick if quick else s.full), *extra]
    print(f"== {s.name}: python scripts/{s.script} {' '.join(argv)}", flush=True)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, str(scripts), s.script[:-3], str(out), *argv], cwd=ROOT)
    print(f"== {s.name}: exit {done.returncode} after {time.perf_counter() - t:.0f} s", flush=True)
    if done.returncode != 0 or not out.exists():
        return None
    return out.read_text()


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (the child runs there; the section's
    command line then reads ``--png docs/bench_peers.png``)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, every section in seconds (a smoke run)")
    ap.add_argument("--only", default="", help="comma-separated section names (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="file to rewrite (default docs/benchmarks.md; "
                                                            "with --quick: none, the result is printed)")
    ap.add_argument("--list", action="store_true", help="print the sections and exit")
    ap.add_argument("--scripts", type=Path, default=SCRIPTS, help=argparse.SUPPRESS)  # tests: stand-in scripts
    a = ap.parse_args(argv)
    if a.list:
        for s in SECTIONS:
            there = "" if (SCRIPTS / s.script).exists() else "  (script not in this tree)"
            print(f"{s.name:12s} scripts/{s.script:22s} about {s.estimate_s:4d} s{there}")
        print(f"total about {sum(s.estimate_s for s in SECTIONS) / 60:.0f} minutes on 2 cores")
        return 0
    names = [n for n in a.only.split(",") if n] or [s.name for s in SECTIONS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; expected some of {', '.join(BY_NAME)}")
    out = a.out if a.out is not None else (None if a.quick else DOC)
    old = split(out.read_text()) if out is not None and out.exists() else {}
    new, failed = dict(old), []
    with tempfile.TemporaryDirectory(prefix="bench_all_") as d:
        for name in names:
            s = BY_NAME[name]
            if not (a.scripts / s.script).exists():
                print(f"== {name}: skipped, scripts/{s.script} is not in this tree (its old section is kept)",
                      flush=True)
                continue
            extra = ["--png", _shown((out.parent if out is not None else Path(d)) / "bench_peers.png")] \
                if s.script == "bench_peers.py" else []
            text = run_section(s, a.quick, extra, Path(d), a.scripts)
            if text is None:
                failed.append(name)
            else:
                new[name] = text
    doc = compose(new)
    if out is None:
        print(doc)
    else:
        write_atomically(out, doc)
        print(f"wrote {out}")
    if failed:
        print(f"failed: {', '.join(failed)} (their old sections are kept)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
