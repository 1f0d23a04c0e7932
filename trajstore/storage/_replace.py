"""Moving a finished temp file onto a key, atomically, without the flush ext4 adds to a rename.

ext4 (mounted with its default ``auto_da_alloc``) treats ``rename(tmp, existing)`` as "replace
via rename" and starts writing ``tmp``'s data to disk inside the rename, so that an application
that never calls ``fsync`` still finds the old or the new file after a power loss.  For the
commit record that made every commit cost 0.4-0.5 ms on this VM, and up to several ms for the
first commit after a store is opened (measured: ``os.replace`` of a 900-byte file 380-430 us per
call, the exchange below and the unlink of the old file 140-200 us).

:func:`replace_file` swaps the two names with ``renameat2(RENAME_EXCHANGE)`` instead (just as
atomic for readers: the key names the old file or the new one, never neither) and then removes
the temp name, which now holds the old file.  A kill between the two leaves the old file in the
temp folder, which every writer's open clears (and which repair ranks by its generation like any
record found there).  Power loss is covered, as before, only by ``fsync``: the caller fsyncs the
file before and the folder after, as :meth:`trajstore.storage.location.Location.put` does.

Only for temp files that nothing rolls forward (the temp folder): a staged file moved into place
must not be exchanged, since a kill would leave the old bytes under the staged name.  Where the
system has no ``renameat2`` (not Linux, an old libc) or the filesystem refuses the exchange
(``EINVAL``), and where the key is missing or is not a file or link, this is ``os.replace``.

:func:`exchange` is the swap itself, also for folders: :mod:`trajstore.storage.publish` puts a
store built beside its destination into place with it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from typing import Any

__all__ = ["exchange", "replace_file"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _bind() -> Any:
    """libc's ``renameat2`` (glibc 2.28+), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


#: ``renameat2`` from libc; tests set it to None to take the portable path.
_renameat2: Any = _bind()


def exchange(a: str | os.PathLike[str], b: str | os.PathLike[str], *, a_dir_fd: int | None = None,
             b_dir_fd: int | None = None) -> bool:
    """Swap the names ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``): files, links or
    folders, of the same kind or not; at every instant each name holds one of the two.

    Parameters
    ----------
    a, b : path
        Two existing entries on the same filesystem.
    a_dir_fd, b_dir_fd : int, optional
        Open folders that ``a`` and ``b`` are relative to.

    Returns
    -------
    bool
        True when swapped; False, with nothing changed, where the system has no ``renameat2`` (not
        Linux, an old libc) or the filesystem cannot exchange (``EINVAL``, ``ENOSYS``,
        ``EOPNOTSUPP``): the caller then takes a portable path.

    Raises
    ------
    OSError
        Any other error of the call (``ENOENT`` for a missing name, ``EXDEV`` across filesystems);
        nothing was changed.
    """
    if _renameat2 is None:
        return False
    a_at = _AT_FDCWD if a_dir_fd is None else a_dir_fd
    b_at = _AT_FDCWD if b_dir_fd is None else b_dir_fd
    if _renameat2(a_at, os.fsencode(a), b_at, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def replace_file(tmp: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                 src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
    """Put the file ``tmp`` under the name ``dest`` atomically (replacing what is there) and remove
    the name ``tmp``, as ``os.replace`` does.

    Parameters
    ----------
    tmp : path
        A regular file in the store's temp folder, complete (and fsynced, if it must be durable).
    dest : path
        Where it goes; a link there is replaced, never written through.
    src_dir_fd, dst_dir_fd : int, optional
        Open folders that ``tmp`` and ``dest`` are relative to (as ``os.replace``'s): names
        resolved from them pass through no folder path again.

    Raises
    ------
    OSError
        What ``os.replace`` raises (the old file then stays under ``dest``).
    """
    if _renameat2 is not None:
        try:
            mode = os.lstat(dest, dir_fd=dst_dir_fd).st_mode
        except FileNotFoundError:
            mode = 0
        if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
            try:
                swapped = exchange(tmp, dest, a_dir_fd=src_dir_fd, b_dir_fd=dst_dir_fd)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.EXDEV):
                    raise
                swapped = False  # gone meanwhile, or another filesystem: os.replace says what is wrong
            if swapped:
                try:
                    os.unlink(tmp, dir_fd=src_dir_fd)  # the old file (a writer's open clears it if this is never reached)
                except OSError:
                    pass
                return
    os.replace(tmp, dest, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
