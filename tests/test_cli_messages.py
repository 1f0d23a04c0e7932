"""Issue 36.8: the small things a new user tripped over, each checked on the real thing.

``--version``; ``TrajectoryReplayBuffer.create(capacity=)``; ``recording.step_space`` documented;
S3's bare "Forbidden" (a real moto server on 127.0.0.1 refusing the credentials) naming the URL;
a combine space mismatch naming the key; ``--where`` with ``&&``; and docs/cli.md's sample output,
compared line by line with what today's code prints for the same commands.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import shlex
import socket
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from test_cli import cli  # the CLI run in this process, its output captured

import trajstore
from trajstore import TrajectoryReplayBuffer
from trajstore.errors import BadArgumentError, BadOptionError, SpaceMismatchError
from trajstore.maintenance.where import compile_where

ROOT = Path(__file__).resolve().parents[1]


def test_version_of_the_package_and_the_command() -> None:
    assert trajstore.__version__ == version("trajstore") and "__version__" in trajstore.__all__
    out = subprocess.run([sys.executable, "-m", "trajstore", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"trajstore {trajstore.__version__}"


def test_trajectory_create_with_capacity_names_the_right_arguments(tmp_path: Path) -> None:
    with pytest.raises(BadArgumentError, match="step_data_capacity=.*episode_data_capacity=.*not capacity=; got "
                                               "capacity=100"):
        TrajectoryReplayBuffer.create(gym.spaces.Box(-1, 1, (2,), np.float32), cache_path=tmp_path / "t", capacity=100)
    assert not (tmp_path / "t").exists()


def test_step_space_is_documented_with_its_arguments() -> None:
    from trajstore.recording import step_space

    doc = inspect.getdoc(step_space) or ""
    assert "Parameters" in doc and "Returns" in doc
    for name in inspect.signature(step_space).parameters:
        assert re.search(rf"^{name} :", doc, re.M), name
    assert "float64" in doc and "bool" in doc


@pytest.fixture
def refusing_s3(monkeypatch: pytest.MonkeyPatch):
    """A moto S3 server on 127.0.0.1 with a bucket, then refusing every request (moto's own auth
    switch: requests with unknown credentials get 403 Forbidden, as a real bucket without access)."""
    import boto3
    import moto.settings
    import s3fs
    from moto import server as moto_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket="trajstore-forbidden")
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    try:
        yield {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
               "client_kwargs": {"region_name": "us-east-1"}, "use_listings_cache": False}
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def test_forbidden_names_the_url(refusing_s3, capsys) -> None:
    url = "s3://trajstore-forbidden/buf"
    code, _out, err = cli(capsys, "info", url, "--storage-options", json.dumps(refusing_s3))
    assert code == 1 and "Forbidden" in err and url in err and "credentials" in err
    code, _out, err = cli(capsys, "verify", url, "--storage-options", json.dumps(refusing_s3))
    assert code == 1 and url in err


def test_combine_space_mismatch_names_the_key(tmp_path: Path) -> None:
    def store(name: str, obs_dtype, extra: bool = False) -> str:
        space = {"obs": gym.spaces.Box(-1, 1, (3,), obs_dtype), "reward": gym.spaces.Box(-1, 1, (), np.float32)}
        if extra:
            space["cost"] = gym.spaces.Box(-1, 1, (), np.float32)
        with TrajectoryReplayBuffer.create(gym.spaces.Dict(space), cache_path=tmp_path / name) as tb:
            tb.append({k: np.zeros(v.shape, v.dtype) for k, v in space.items()})
        return str(tmp_path / name)

    a, b, c = store("a", np.float32), store("b", np.float64), store("c", np.float32, extra=True)
    with pytest.raises(SpaceMismatchError, match=r"step space of .*b differs from that of .*a, at key 'obs': "
                                                 r"Box\(.*float64\) in .*b, Box\(.*float32\) in .*a"):
        trajstore.combine([a, b], tmp_path / "out")
    with pytest.raises(SpaceMismatchError, match=r"key 'cost' is in .*c, not in .*a"):
        trajstore.combine([a, c], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("expr,word", [("return > 1 && length > 2", "and"), ("return > 1 || length > 2", "or"),
                                       ("!(return > 1)", "not"), ("(return > 1) & (length > 2)", "and")])
def test_where_with_other_languages_operators_suggests_ours(expr: str, word: str) -> None:
    with pytest.raises(BadOptionError, match=f"use '{word}' instead of"):
        compile_where(expr, ["return", "length"])
    assert compile_where("return != 1 and not length > 2", ["return", "length"])  # != is ours


# -- docs/cli.md's sample output ----------------------------------------------------------------------------
_SIZE = re.compile(r"\d+(\.\d+)? (B|KiB|MiB|GiB|TiB)\b")
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00")


def _doc_steps(text: str) -> list[tuple[str, str, list[str]]]:
    """``("python", code, [])`` and ``("shell", command, sample lines)`` of every python and console
    block of a doc, in order."""
    steps: list[tuple[str, str, list[str]]] = []
    for lang, body in re.findall(r"^```(python|console)\n(.*?)^```", text, re.M | re.S):
        if lang == "python":
            steps.append(("python", body, []))
            continue
        for line in body.splitlines():
            if line.startswith("$ "):
                steps.append(("shell", line[2:], []))
            elif steps:
                steps[-1][2].append(line)
    return steps


def _norm(line: str, home: str) -> str:
    """A line as compared: the user's folder, timestamps, sizes and runs of spaces made neutral."""
    line = line.replace(home, "/home/me/")
    line = _TIME.sub("TIME", _SIZE.sub("SIZE", line))
    return " ".join(line.split())


def _matches(sample: list[str], actual: list[str], home: str) -> str | None:
    """None when every sample line appears in ``actual`` in order ("..." skips any lines, a line
    ending in " ..." matches a line starting with the rest); else the first line not found."""
    got = [_norm(a, home) for a in actual]
    pos = 0
    for line in sample:
        want = _norm(line, home)
        if want in ("", "..."):
            continue
        prefix = want.endswith(" ...")
        want = want[:-4] if prefix else want
        while pos < len(got) and not (got[pos].startswith(want) if prefix else got[pos] == want):
            pos += 1
        if pos == len(got):
            return line
        pos += 1
    return None


@pytest.mark.slow
def test_cli_md_sample_output_is_what_the_commands_print(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every console block of docs/cli.md that runs locally: its sample lines are printed by
    today's code (format v2, the demo's fields, the buffer-folder and convert sections)."""
    monkeypatch.chdir(tmp_path)
    home = str(tmp_path) + "/"
    compared = 0
    for kind, code, sample in _doc_steps((ROOT / "docs" / "cli.md").read_text()):
        if kind == "python":
            exec(compile(code, "docs/cli.md", "exec"), {"__name__": "__main__"})
            continue
        argv = shlex.split(code)
        if argv[0] != "trajstore" or any("s3://" in a for a in argv):
            continue
        out = subprocess.run([sys.executable, "-m", "trajstore", *argv[1:]], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
        assert out.returncode == 0, f"{code}: {out.stderr}"
        missing = _matches(sample, out.stdout.splitlines(), home)
        assert missing is None, f"docs/cli.md: `{code}` does not print {missing!r}; it printed:\n{out.stdout}"
        compared += bool([s for s in sample if s.strip()])
    assert compared >= 8  # info, episodes, the sharded and the buffer-folder samples, convert, filter


# -- 36.9: the README's first screen -------------------------------------------------------------------------
def test_readme_opens_with_the_commands_then_what_and_why_then_sb3() -> None:
    text = (ROOT / "README.md").read_text()
    head = re.match(r"# trajstore\n\n```bash\n(.*?)\n```\n\n(.*?)\n\n", text, re.S)
    assert head, "README.md must start with its title and the two commands"
    commands = head.group(1).splitlines()
    assert len(commands) == 2 and all(c.startswith("python3 -m venv .venv && ") for c in commands)
    first = head.group(2)  # the paragraph right after the commands: what trajstore is, and why
    assert first.startswith("trajstore is a disk-backed trajectory and replay store") and "Why:" in first
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings.index("stable-baselines3") < headings.index("Quick start") == 1
    # Measured ratios live in docs/benchmarks.md (regenerated by the scripts), linked from the README.
    assert not re.search(r"\d(\.\d+)?x\b", text), re.search(r".*\d(\.\d+)?x\b.*", text).group(0)
    assert "docs/benchmarks.md" in text
