"""Which filesystem a path lives on, from ``/proc/self/mountinfo`` (Linux; elsewhere: unknown).

What a reader may infer from the kernel depends on the filesystem: the shard watch uses inotify
only where every change goes through this machine's kernel (:mod:`trajstore.shards.watch`), and
:class:`trajstore.storage.head.HeadWatch` trusts ``fstat`` of the record it holds open only where
a replacement shows in the replaced file's own link count.
"""

from __future__ import annotations

import os

__all__ = ["mounts", "fs_type"]


def mounts() -> list[tuple[str, str]]:
    """``(mount point, filesystem type)`` of this process's mounts, longest mount point first
    (empty where there is no ``/proc/self/mountinfo``)."""
    out = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                parts, rparts = left.split(), right.split()
                if len(parts) >= 5 and rparts:
                    out.append((parts[4].replace("\\040", " "), rparts[0]))
    except OSError:
        return []
    return sorted(out, key=lambda m: len(m[0]), reverse=True)


def fs_type(path: str, table: list[tuple[str, str]]) -> str | None:
    """The filesystem type of the mount (of ``table``, as :func:`mounts` returns it) that holds
    ``path`` (links resolved), or None when no mount does."""
    real = os.path.realpath(path)
    for point, fs in table:
        if real == point or real.startswith(point.rstrip("/") + "/"):
            return fs
    return None
