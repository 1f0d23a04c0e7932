"""Child program of ``test_publish.py``: one overwriting operation (Python or CLI) that stops, when
asked, at a chosen instant of publishing its result, so the parent's SIGKILL lands right there.

Stops (``stop``), installed by wrapping the publish module's own steps in this process only:

``journal``
    The journal naming the new stores is written; no destination was touched yet.
``exchanged``
    ``renameat2(RENAME_EXCHANGE)`` put the new store in place; the old one waits under the
    temporary name, not yet removed.
``aside``
    The portable path (no exchange): the old store was renamed aside, the new one not yet in.
``second``
    A split: the first destination is published, the second not yet.
``none``
    No stop: the parent kills at a random instant (``ready`` is touched before the operation).
"""

from __future__ import annotations

import os
import time
from typing import Any

import _workers as W


def _stop(ready: str) -> None:
    W.touch(ready)
    time.sleep(60)  # the parent's SIGKILL ends this
    os._exit(4)


def _install(stop: str, ready: str) -> None:
    from trajstore.storage import _replace, publish

    if stop == "journal" or stop == "second":
        real_one = publish._publish_one
        calls = {"n": 0}
        at = 1 if stop == "journal" else 2

        def one(parent: str, entry: dict[str, Any], *args: Any, **kw: Any) -> None:
            if not entry["destination"].startswith("."):  # a destination, not a temporary folder
                calls["n"] += 1
                if calls["n"] == at:
                    _stop(ready)
            real_one(parent, entry, *args, **kw)

        publish._publish_one = one  # type: ignore[assignment]
    elif stop == "exchanged":
        real_exchange = publish.exchange

        def exchange(a: Any, b: Any, **kw: Any) -> bool:
            done = real_exchange(a, b, **kw)
            if done and not os.path.basename(os.fspath(b)).startswith("."):  # a store published, not a commit record
                _stop(ready)
            return done

        publish.exchange = exchange  # type: ignore[assignment]
    elif stop == "aside":
        _replace._renameat2 = None
        real_rename = os.rename

        def rename(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
            real_rename(src, dst, *args, **kw)
            if ".trajstore-partial-" in os.path.basename(os.fspath(dst)) and not os.path.basename(
                    os.fspath(src)).startswith("."):  # a destination's old store moved aside
                _stop(ready)

        os.rename = rename  # type: ignore[assignment]
    else:
        W.touch(ready)


def run(op: str, args: list[str], stop: str, ready: str) -> None:
    """Run ``op`` with ``args`` (paths), stopping at ``stop``; exits 0 when it completes."""
    _install(stop, ready)
    from trajstore.cli import main

    if op == "combine":
        from trajstore.maintenance.combine import combine

        combine(args[:-1], args[-1], overwrite=True, tqdm=False)
    elif op == "filter":
        from trajstore.maintenance.combine import filter_store

        filter_store(args[0], args[1], "length >= 0", overwrite=True, tqdm=False)
    elif op == "split":
        from trajstore.maintenance.combine import split

        split(args[0], {"train": 0.5, "val": 0.5}, args[1], overwrite=True, tqdm=False)
    elif op == "import":
        from trajstore.interop.d4rl import d4rl_to_store

        d4rl_to_store(args[0], args[1], overwrite=True, tqdm=False)
    elif op == "dumps":
        from trajstore import TrajectoryReplayBuffer

        with TrajectoryReplayBuffer.load_from(args[0], read_only=True) as buf:
            buf.dumps(args[1], progress=False)
    elif op.startswith("cli-"):
        argv = {"cli-combine": ["combine", *args, "--overwrite"],
                "cli-import": ["import", "d4rl", args[0], args[1], "--overwrite"],
                "cli-filter": ["filter", args[0], args[1], "--where", "length >= 0", "--overwrite"],
                "cli-split": ["split", args[0], args[1], "--ratios", "train=0.5,val=0.5", "--overwrite"],
                "cli-copy": ["copy", args[0], args[1], "--overwrite"]}[op]
        rc = main([*argv, "--json"])
        os._exit(rc)
    else:
        raise ValueError(op)
    os._exit(0)
