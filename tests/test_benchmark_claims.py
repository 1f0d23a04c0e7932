"""Every performance number written in README.md and docs/*.md prose is a number of
docs/benchmarks.md's tables (which scripts/bench_all.py writes from today's code), or is on the
short allow-list below with the reason it is not one. A ratio such as "1.16x" or a time such as
"0.4 ms" in prose that the tables do not contain fails here: cite the table instead of copying a
number that the next regeneration changes, or move the history to docs/performance-notes.md.

Scanned: text outside fenced code blocks; numbers followed by ``x`` (ratios, ranges such as
``1.2-1.5x``), by a time unit (``ms``, ``us``, ``µs``) or by a rate (``samples/s``, ``rows/s``,
``steps/s``, ``frames/s``). Not scanned: docs/benchmarks.md itself and docs/performance-notes.md
(history, each figure naming its run)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "benchmarks.md"
NOT_SCANNED = {"benchmarks.md", "performance-notes.md"}

NUM = r"\d[\d,]*(?:\.\d+)?"
RANGE = rf"({NUM})(?:\s*(?:-|to|/)\s*({NUM}))?"
RATIO = re.compile(rf"(?<![\w.]){RANGE}x(?!\w)")
UNIT = re.compile(rf"(?<![\w.]){RANGE}\s*[kM]?\s*(?:ms|us|µs|samples/s|rows/s|steps/s|frames/s)(?!\w)")
# phrases that claim a speed without a number (the "at numpy-memmap speed")
PHRASES = re.compile(r"memmap speed|as fast as (?:a |the )?(?:numpy|memmap)|x faster|times faster", re.I)

#: (file, the number as written) -> why it is not a number of benchmarks.md
ALLOWED: dict[tuple[str, str], str] = {
    ("docs/design.md", "1.5x"): "a goal (appends within 1.5x of SB3's add), not a measurement",
    ("docs/sampling.md", "2x"): "the target of prioritized sampling, not a measurement",
    ("docs/reliability.md", "1.5x"): "a test's batch size (up to 1.5x the capacity), not a speed",
    ("docs/format.md", "16 ms"): "what building the run index costs, the reason it is saved (format design)",
    ("docs/format.md", "0.4 ms"): "a commit's cost on ext4, the bound on refilling a tiny ring (format design)",
    ("docs/format.md", "0.6 ms"): "a commit's cost on ext4, the bound on refilling a tiny ring (format design)",
    ("docs/format.md", "0.4-5 ms"): "why the record is moved by RENAME_EXCHANGE (format design)",
    ("docs/reliability.md", "25 us"): "a commit's cost on tmpfs, why a full ring's writer is slower (ring_fullness.py)",
    ("docs/reliability.md", "1.5 ms"): "a commit's cost on ext4, why a full ring's writer is slower (ring_fullness.py)",
    ("docs/reliability.md", "1 us"): "the same commit cost spread over a guard's rows",
    ("docs/reliability.md", "1 ms"): "the foreign-file walk's cost, measured by tests/test_interop_d4rl.py's counts",
    ("docs/reliability.md", "1-10 ms"): "ext4 journal faults, why imports write by pwrite",
    ("docs/reliability.md", "5-6 ms"): "per-key import cost, held constant by test_import_cost_per_info_key_is_constant",
}


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of ``path`` outside fenced code blocks."""
    out, fenced = [], False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((i, line))
    return out


def claims(text: str) -> list[tuple[str, list[str]]]:
    """Each number claim in ``text``: (as written, its numbers)."""
    found = []
    for rx in (RATIO, UNIT):
        for m in rx.finditer(text):
            found.append((m.group(0).strip(), [g for g in m.groups() if g]))
    return found


def in_tables(number: str, tables: str) -> bool:
    """``number`` (e.g. ``1.16`` or ``81,157``) is a whole number of the tables' text."""
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|[.,]\d)", tables) is not None


def docs() -> list[Path]:
    return [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in NOT_SCANNED)]


def test_every_number_in_prose_is_in_the_benchmark_tables() -> None:
    tables = BENCH.read_text()
    bad = []
    for path in docs():
        rel = str(path.relative_to(ROOT))
        for i, line in prose(path):
            for written, numbers in claims(line):
                if (rel, written) in ALLOWED:
                    continue
                if not all(in_tables(n, tables) for n in numbers):
                    bad.append(f"{rel}:{i}: {written!r} is not in docs/benchmarks.md: {line.strip()[:100]}")
            if PHRASES.search(line):
                bad.append(f"{rel}:{i}: a speed claim without a table's number: {line.strip()[:100]}")
    assert not bad, "\n".join(bad)


def test_the_allow_list_holds_only_what_the_docs_still_say() -> None:
    """An entry whose number left the docs goes too (the list stays short and true)."""
    written = {(str(p.relative_to(ROOT)), w) for p in docs() for _, line in prose(p) for w, _ in claims(line)}
    assert set(ALLOWED) <= written, sorted(set(ALLOWED) - written)


def test_the_scanner_finds_what_it_must_and_skips_what_it_must() -> None:
    assert [w for w, _ in claims("raw sample at 1.16x, lz4 1.2-1.5x; 0.4 ms a commit, 29.6k samples/s")] == \
        ["1.16x", "1.2-1.5x", "0.4 ms", "29.6k samples/s"]
    assert claims("64x64x3 frames, zarr 2.x, 3.1.x, an (84,84,4) box, 10x10 grid") == []
    assert in_tables("1.16", "| a | 1.16x |") and not in_tables("1.1", "| a | 1.16x |")
    assert not in_tables("81", "| 81,157 |") and in_tables("81,157", "| 81,157 |")
    assert PHRASES.search("reads at numpy-memmap speed")


def _slug(title: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_links_into_the_benchmarks_name_sections_that_bench_all_writes() -> None:
    """A link such as ``benchmarks.md#offline-datasets-scriptsbench_offlinepy`` names the heading of
    one of scripts/bench_all.py's sections (it stays valid whenever the file is regenerated)."""
    from _bench import bench_all

    anchors = {_slug(s.title) for s in bench_all().SECTIONS}
    assert _slug("Offline datasets (scripts/bench_offline.py)") == "offline-datasets-scriptsbench_offlinepy"
    bad = [f"{p.name}: #{a}" for p in docs() for a in re.findall(r"benchmarks\.md#([\w\-]+)", p.read_text())
           if a not in anchors]
    assert not bad, bad
