"""A clean interpreter exit while a native thread hands a result to the event loop.

icechunk's Python API is asynchronous through ``pyo3-async-runtimes``: a Rust (tokio) thread
completes each future by calling the event loop's ``call_soon_threadsafe``, which queues the
callback and then wakes the loop through a socket.  The loop may run the callback, and the awaiting
code go on to the end of the program, while that thread is still inside the socket send with the
GIL released.  When it asks for the GIL back the interpreter is finalizing, and CPython (3.11 and
3.12) ends such a thread with ``pthread_exit``, whose unwinding through Rust frames aborts the whole
process (SIGABRT, exit code 134, after the program's output was complete).  Seen in CI on a docs
example that read two versions of an icechunk repository; reproduced here about once in 30 runs on a
loaded machine, with the tokio thread's stack under ``gdb`` showing exactly that path.

:func:`guard_loop` counts the calls of ``call_soon_threadsafe`` in progress on a loop, and an
``atexit`` hook (run before zarr's own, which stops the loop: hooks run last-registered first)
waits, the GIL released, until none is, for at most :data:`DRAIN_S` seconds.  A result a program
used has always been queued by a counted call, so the hook waits for exactly the threads that could
abort the exit.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import time
from typing import Any

#: The longest the exit waits for a native thread to leave ``call_soon_threadsafe`` (seconds).
DRAIN_S = 2.0

_lock = threading.Lock()
_in_flight = 0
_guarded: set[int] = set()


def in_flight() -> int:
    """Calls of ``call_soon_threadsafe`` in progress on guarded loops."""
    return _in_flight


def guard_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Count ``loop``'s ``call_soon_threadsafe`` calls in progress, and make the interpreter's exit
    wait for them (once per loop; the first call registers the exit hook)."""
    with _lock:
        if id(loop) in _guarded:
            return
        if not _guarded:
            atexit.register(drain)
        _guarded.add(id(loop))
    original = loop.call_soon_threadsafe

    def call_soon_threadsafe(*args: Any, **kwargs: Any) -> Any:
        global _in_flight
        with _lock:
            _in_flight += 1
        try:
            return original(*args, **kwargs)
        finally:
            with _lock:
                _in_flight -= 1

    # An instance attribute: what pyo3-async-runtimes looks up by name on the loop it was given.
    loop.call_soon_threadsafe = call_soon_threadsafe  # type: ignore[method-assign,assignment]


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def guard_zarr_loop() -> None:
    """:func:`guard_loop` on the loop zarr runs its stores' coroutines on (icechunk's futures
    complete there)."""
    from zarr.core.sync import sync

    guard_loop(sync(_running_loop()))


def drain(timeout: float = DRAIN_S) -> bool:
    """Wait until no guarded ``call_soon_threadsafe`` is in progress (sleeping, so the GIL is
    free for the threads inside it); False if some still were after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while _in_flight:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True
