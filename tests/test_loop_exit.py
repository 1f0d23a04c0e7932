"""The interpreter's exit waits for a thread inside a guarded loop's ``call_soon_threadsafe``
(trajstore/storage/loop_exit.py: icechunk's tokio threads abort the process when they are still
there as it finalizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# A thread hands a result to zarr's loop through a call_soon_threadsafe that is slow after queuing
# the callback (as a tokio thread's socket send can be on a loaded machine): the main thread gets the
# result and the program ends while that thread is still inside the call.
CHILD = r"""
import asyncio, sys, threading, time
from zarr.core.sync import sync
from trajstore.storage import loop_exit

async def running():
    return asyncio.get_running_loop()

loop = sync(running())
original = loop.call_soon_threadsafe

def slow(*args):
    out = original(*args)
    if threading.current_thread() is not threading.main_thread():  # (zarr's exit hook calls it too)
        time.sleep(0.3)
        open(sys.argv[1], "w").write("left call_soon_threadsafe")
    return out

loop.call_soon_threadsafe = slow
if sys.argv[2] == "guarded":
    loop_exit.guard_loop(loop)

async def wait_for_thread():
    fut = asyncio.get_running_loop().create_future()
    threading.Thread(target=lambda: loop.call_soon_threadsafe(fut.set_result, 7), daemon=True).start()
    return await fut

assert sync(wait_for_thread()) == 7
print("in flight at the end of the program:", loop_exit.in_flight())
"""


@pytest.mark.parametrize("mode", ["guarded", "unguarded"])
def test_exit_waits_for_a_thread_inside_call_soon_threadsafe(tmp_path: Path, mode: str) -> None:
    marker = tmp_path / "left"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(marker), mode], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    if mode == "guarded":
        assert "in flight at the end of the program: 1" in proc.stdout
        assert marker.read_text() == "left call_soon_threadsafe"
    else:  # the control: without the guard the exit does not wait (the race the guard closes)
        assert not marker.exists()


def test_drain_returns_at_once_when_nothing_is_in_flight() -> None:
    from trajstore.storage import loop_exit

    assert loop_exit.in_flight() == 0 and loop_exit.drain(timeout=0.0)
