"""``check_tree``: a local folder holds only real folders and regular files.

For folders whose files trajstore does not open itself: a foreign dataset's folder (the import
gate, ``trajstore.interop.foreign_gate``) and a local icechunk repository, whose files icechunk's
own storage opens (following links, and blocking on a FIFO until a writer comes).  Walking the
folder once before anything in it is read is what keeps those readers inside the folder and
unblocked; a store's own files go through :class:`trajstore.storage.confined.Confinement` at each
open instead.
"""

from __future__ import annotations

import os
from typing import Callable

__all__ = ["check_tree"]


def check_tree(root: str, max_entries: int | None, refuse: Callable[[str, int | None], Exception]) -> int:
    """Walk the folder ``root`` without following anything below it: every entry must be a real
    folder or a regular file, and there may be at most ``max_entries`` (None: no bound).

    Parameters
    ----------
    root : str
        The folder (itself possibly reached through a link the caller named).
    max_entries : int or None
        The most files and folders below ``root``.
    refuse : callable
        ``refuse(path, st_mode)`` builds the exception raised for the first entry that is a link or
        a special file; ``refuse(root, None)`` the one for more than ``max_entries`` entries.

    Returns
    -------
    int
        The entries walked.
    """
    count = 0
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for e in entries:
                count += 1
                if max_entries is not None and count > max_entries:
                    raise refuse(root, None)
                # d_type answers for almost every entry without a system call; lstat otherwise.
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif not e.is_file(follow_symlinks=False):
                    raise refuse(e.path, e.stat(follow_symlinks=False).st_mode)
    return count
