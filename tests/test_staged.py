"""Temporary names of stores built all-or-nothing (combine, split, filter, imports, exports,
merged shards): what a killed operation left on this machine is removed by the next one for the
same destination; other machines' and live processes' names, and anything a link points to, are not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trajstore.maintenance import staged
from trajstore.storage import publish


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid  # reaped: no process has it (until the kernel reuses it)


def test_partial_path_removes_only_dead_leftovers_of_this_machine(tmp_path: Path) -> None:
    dst = str(tmp_path / "out")
    host = publish.HOST
    dead = tmp_path / f".out.trajstore-partial-{host}-{_dead_pid()}-0123abcd"
    (dead / "step_data").mkdir(parents=True)
    (dead / "step_data" / "c").write_bytes(b"x" * 1000)
    live = tmp_path / f".out.trajstore-partial-{host}-{os.getppid()}-0123abcd"  # a running process
    live.mkdir()
    other_host = tmp_path / f".out.trajstore-partial-{'f' * 8 if host != 'f' * 8 else 'e' * 8}-{_dead_pid()}-0123abcd"
    other_host.mkdir()
    other_dst = tmp_path / f".outer.trajstore-partial-{host}-{_dead_pid()}-0123abcd"
    other_dst.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    link = tmp_path / f".out.trajstore-partial-{host}-{_dead_pid()}-4567abcd"
    os.symlink(outside, link)

    tmp = staged.partial_path(dst)

    assert os.path.dirname(tmp) == str(tmp_path) and os.path.basename(tmp).startswith(f".out.trajstore-partial-{host}-")
    assert not os.path.exists(tmp)  # a name only
    assert not dead.exists() and not os.path.lexists(link)
    assert (outside / "keep").read_text() == "keep"  # the link was removed, not followed
    assert live.is_dir() and other_host.is_dir() and other_dst.is_dir()
