"""The ``trajstore`` command line on real stores: demo, info (table and --json), errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from trajstore import ReplayBuffer
from trajstore.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trajstore", *args], capture_output=True, text=True, timeout=120)


def test_demo_records_reopens_and_prints_info(tmp_path: Path) -> None:
    out = run_cli("demo", str(tmp_path / "demo"), "--episodes", "3")
    assert out.returncode == 0, out.stderr
    assert "recorded 3 episodes of CartPole-v1" in out.stdout
    assert "kind           ReplayBuffer" in out.stdout
    rb = ReplayBuffer.load_from(tmp_path / "demo", read_only=True)
    # Random CartPole episodes end with exactly three terminal or truncated rows.
    flags = rb.get_column(["terminated"]).to_numpy()[:, 0] | rb.get_column(["truncated"]).to_numpy()[:, 0]
    assert int(flags.sum()) == 3 and flags[-1] == 1
    # Within an episode, each row's next_obs is the following row's obs.
    cont = ~flags[:-1].astype(bool)
    np.testing.assert_array_equal(rb[:-1]["next_obs"][cont], rb[1:]["obs"][cont])
    rb.close()


def test_info_json_matches_the_python_api(tmp_path: Path, capsys) -> None:
    import gymnasium as gym

    space = gym.spaces.Dict({"obs": gym.spaces.Box(-1, 1, (17,), np.float32), "a": gym.spaces.Discrete(3)})
    with ReplayBuffer.create(space, cache_path=tmp_path / "s", capacity=100, compressor="lz4") as rb:
        for i in range(130):
            rb.append({"obs": np.full(17, i, np.float32), "a": i % 3})
        count, offset = rb.count, rb.offset
    assert main(["info", str(tmp_path / "s"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "ReplayBuffer" and info["format_version"] == 1
    assert info["tables"]["step_data"] == {"rows": count, "capacity": 100, "offset": offset}
    assert {a["path"] for a in info["arrays"]} == {"step_data/obs", "step_data/a"}
    assert all(a["codec"] == "blosc" for a in info["arrays"])
    assert info["stored_bytes"] > 0 and info["logical_bytes"] == 100 * (17 * 4 + 8)

    assert main(["info", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    assert "rows=100 capacity=100" in text and "obs: Box" in text


def test_errors_are_one_line_with_exit_status(tmp_path: Path) -> None:
    out = run_cli("info", str(tmp_path / "missing"))
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "no store at" in out.stderr
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("hi")
    out = run_cli("info", str(tmp_path / "junk"))
    assert out.returncode == 1 and "not a trajstore store" in out.stderr
    out = run_cli("frobnicate")
    assert out.returncode == 2
    assert run_cli("--help").returncode == 0 and run_cli("info", "--help").returncode == 0
