"""The benchmark sections of docs/benchmarks.md keep working: each runs at --quick sizes through
scripts/bench_all.py (timings are printed, never asserted). The sections of other modules' tests:
sb3 (test_sb3_training.py), prioritized (test_prioritized.py), peers (test_bench_peers.py), offline
(test_bench_offline.py), compressed (test_compressed_reads.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _bench import ROOT, quick_section

# rows every section's table must have (the quick sizes' names where a row names its size)
ROWS = {
    "core": ["| append transitions (obs + next_obs 17 f32, action (6,), reward, done), 1 per call | trajstore |",
             "| append transitions (obs + next_obs 84x84x4 u8, action (6,), reward, done), 1 per call | SB3 |",
             "| sample(256) transitions, obs 17 f32 | 5,000 | numpy memmap |",
             "| sample(256) transitions, obs 84x84x4 u8 | 300 | trajstore, torch backend |",
             "| `ReplayBuffer.load_from(path, read_only=True)`, 5,000 rows |", "| none | 1 (raw) |", "| zstd |"],
    "sequences": ["| sample_sequences(256, 32) | 100,000 |", "Ratio 100,000 rows / 10,000 rows",
                  "| numpy in-RAM gather of the same windows | 10,000 |"],
    "images": ["| sample(256), numpy | cold |", "| sample(256), torch vs numpy backend | steady |",
               "| rb[idx], 256 random rows |", "| get_slice(:)[idx]", "| get_column(['obs'])[idx]",
               "| get_sequences(256 anchors", "| sample_sequences(256, 4) |",
               "| ZarrReplayBuffer.sample(256), 300 transitions | cold |",
               "| ZarrReplayBuffer.add, 300 transitions (ring full) | steady |"],
    "import": ["| cached |", "| compiled afresh |"],
    "shards": ["| sample(256) | 64 shards |", "| sample_sequences(256, 8) | one store |"],
    "open_dp": ["| sample(256) | in place |", "| `import_diffusion_policy` |"],
    "lerobot": ["| import_lerobot |", "| 100 |", "| 1000 |"],
}


@pytest.mark.parametrize("name", list(ROWS))
def test_section_quick(name: str, tmp_path: Path) -> None:
    text = quick_section(name, tmp_path)
    for row in ROWS[name]:
        assert row in text, row


def test_ring_fullness_quick() -> None:
    """A reader of a full ring that a writer fills flat out sees it full within 2 * guard rows."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "ring_fullness.py"), "--capacity", "1000",
                          "--seconds", "1.5", "--check"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "capacity     1,000: writer" in out.stdout and "0 sample errors" in out.stdout


def test_bench_codecs_quick(tmp_path: Path) -> None:
    """The codec benchmark's smoke run: every table of its section, and main() returns the section."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_codecs.py"), "--quick", "--codecs", "jpeg:90",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for what in ("| photos | 84x84x3 | jpeg:90 | cold |", "| photos | 480x640x3 | jpeg:90 | steady |",
                 "Disk, 128 frames of 480x640x3 as jpeg:90", "| default | 2 | ", "| 1 | 2 | "):
        assert what in out.stdout, what
    assert list(tmp_path.iterdir()) == []  # its stores removed
    assert out.stdout.startswith("## Image codecs: size and random reads (bench_codecs.py)") or \
        "\n## Image codecs: size and random reads (bench_codecs.py)\n" in out.stdout
