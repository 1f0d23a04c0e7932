"""Putting a store built beside its destination into place: at every instant the destination is
the old store or the new one, and a publish that a kill interrupted is completed by the next
operation on that destination.

Every operation that writes a whole new local store or file (combine, split, filter, the imports
and exports, ``dumps`` to another folder, ``trajstore copy``, merged shards) builds it under a
temporary name next to its destination and then calls :func:`publish`.  The names in the
destination's parent folder (``<host>``: a hash of this machine's name, ``<pid>``: the process):

``.<name>.trajstore-partial-<host>-<pid>-<random>`` (:func:`partial_path`)
    A store being built, or an old store being removed.  A dead process's is removed by the next
    :func:`partial_path` for the same name: nothing complete is ever only there (a verified new
    store is named by a journal first; an old one only once its replacement is in place).
``.<name>.trajstore-publish-<host>-<pid>-<random>.json`` (the journal)
    Written and fsynced once every destination of an operation was built and verified, before the
    first one is touched: for each, the partial name, the destination's name and the identity
    (device, inode) of the new store.  Removed once every destination is published.

Publishing one destination: ``renameat2(RENAME_EXCHANGE)`` swaps the new store and the old one
(:func:`trajstore.storage._replace.exchange`; the partial name then holds the old store), then the
old one is removed.  Where the system or filesystem cannot exchange, the old store is renamed
aside (another partial name, in the journal), the new one renamed in, the old one removed: the
destination is missing between the two renames, and that instant is completed as any other.

:func:`recover` (called by :func:`partial_path` and by every operation's destination check) reads
the journals of dead processes of this machine that name the destination and finishes them: a
destination that holds the journal's new store keeps it (the old one left beside it is removed); a
new store still under its partial name is put into place.  Each completion is reported with a
:class:`PublishRecoveredWarning`; a journal it cannot follow (its new store is gone) is reported and
left on disk.  Names are only ever taken from the destination's own folder: a journal naming
anything else is reported and not followed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import warnings
from collections.abc import Sequence
from typing import Any

from trajstore.errors import StoreExistsError, StoreFullError
from trajstore.storage._replace import exchange
from trajstore.storage.locks import lock_backend

__all__ = ["HOST", "partial_path", "publish", "recover", "remove_entry", "destination_full",
           "PublishRecoveredWarning"]

#: This machine in temporary names (a hash: host names may hold any character).
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]

_JOURNAL_MAX = 1 << 20  # a journal names a few destinations: anything longer is not one of ours
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # (Windows has none, and no links to follow by default)


class PublishRecoveredWarning(UserWarning):
    """An operation on a destination found the journal of a publish that a killed process left
    half done, and completed it (or could not, and says why)."""


def _partial_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(name)}\.trajstore-partial-{HOST}-(\d{{1,7}})-[0-9a-f]{{8}}")


_JOURNAL_RE = re.compile(rf"\..+\.trajstore-publish-{HOST}-(\d{{1,7}})-[0-9a-f]{{8}}\.json")


def partial_path(dst: str) -> str:
    """A fresh temporary name next to ``dst`` (nothing is created), to be published to ``dst``:
    ``.<name>.trajstore-partial-<host>-<pid>-<random>``.

    First completes what a killed publish left for ``dst`` (:func:`recover`), then removes what a
    killed operation on this machine left under a temporary name for the same ``dst`` (its process
    is gone), so a rerun does not leave two copies on disk.  Names from other machines (a shared
    folder) and from live processes are left alone.
    """
    parent, name = os.path.split(dst)
    recover(dst)
    _remove_dead_partials(parent, name)
    return _fresh_partial(parent, name)


def _fresh_partial(parent: str, name: str) -> str:
    return os.path.join(parent, f".{name}.trajstore-partial-{HOST}-{os.getpid()}-{secrets.token_hex(4)}")


def _remove_dead_partials(parent: str, name: str) -> None:
    pattern = _partial_re(name)
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return  # no parent yet: nothing left there
    for e in entries:
        m = pattern.fullmatch(e.name)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        remove_entry(e.path)


def remove_entry(path: str) -> None:
    """Remove a folder (never following a link inside it), a file or a link (never followed);
    errors are ignored (what cannot be removed stays, under a name the next run clears)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _fsync_folder(path: str) -> None:
    if not hasattr(os, "O_DIRECTORY"):
        return  # Windows: a folder is not opened
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a folder
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- publishing --------------------------------------------------------------------------------------
def publish(pairs: Sequence[tuple[str, str]], *, overwrite: bool) -> None:
    """Put each built store (or file) ``tmp`` at its destination ``dst``, for ``(tmp, dst)`` in
    ``pairs``, so that each destination is at every instant its old content or its new one.

    A journal naming every pair is written (and fsynced) first: a kill at any later instant leaves
    each destination old or new, and the next operation on any of them (:func:`recover`) puts the
    remaining new stores into place; a kill before it leaves every destination as it was.

    Parameters
    ----------
    pairs : sequence of (str, str)
        Absolute paths: a complete, verified store (folder) or file ``tmp``, built under
        :func:`partial_path` of ``dst``; every ``dst`` in the same folder.
    overwrite : bool
        Replace what is at a destination.  Without it a destination must be missing or an empty
        folder.

    Raises
    ------
    StoreExistsError
        ``overwrite`` is False and something other than an empty folder appeared at a destination.
    OSError
        The journal cannot be written (a full disk: nothing was published), or a rename failed.
    """
    if not pairs:
        return
    parent = os.path.dirname(pairs[0][1])
    if any(os.path.dirname(t) != parent or os.path.dirname(d) != parent for t, d in pairs):
        raise ValueError(f"publish: every store and destination must be in one folder; got {list(pairs)}")
    entries = []
    for tmp, dst in pairs:
        ident = _identity(tmp)
        if ident is None:
            raise FileNotFoundError(errno.ENOENT, "the store to publish is missing", tmp)
        aside = _fresh_partial(parent, os.path.basename(dst)) if overwrite else None
        entries.append({"partial": os.path.basename(tmp), "destination": os.path.basename(dst), "dev": ident[0],
                        "ino": ident[1], "aside": None if aside is None else os.path.basename(aside)})
    name = os.path.basename(pairs[0][1])
    journal = os.path.join(parent, f".{name}.trajstore-publish-{HOST}-{os.getpid()}-{secrets.token_hex(4)}.json")
    fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    locks = lock_backend()
    done = False  # the journal is removed once closed (Windows removes no open file)
    try:
        locks.acquire(fd)  # held while publishing: no recover() takes this journal
        try:
            os.write(fd, json.dumps({"overwrite": overwrite, "pairs": entries}).encode())
            os.fsync(fd)
            _fsync_folder(parent)
        except BaseException:
            done = True  # nothing published yet: every destination is as it was
            raise
        done = True  # from here on, an error is raised to the caller (who removes what is left), not left to recover
        for e in entries:
            _publish_one(parent, e, overwrite)
    finally:
        locks.forget(fd)
        os.close(fd)
        if done:
            os.unlink(journal)


def _publish_one(parent: str, e: dict[str, Any], overwrite: bool) -> None:
    tmp, dst = os.path.join(parent, e["partial"]), os.path.join(parent, e["destination"])
    if not overwrite or not os.path.lexists(dst):
        try:
            if os.path.isdir(dst) and not os.path.islink(dst):
                os.rmdir(dst)  # an empty folder (checked before writing); a non-empty one: OSError below
            os.rename(tmp, dst)
        except OSError as err:
            if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise StoreExistsError(f"{dst}: something appeared there while the new store was written; it is "
                                       "kept and the new store is not published") from None
            raise
        return
    if exchange(tmp, dst):
        remove_entry(tmp)  # the old store, now under the partial name
        return
    aside = os.path.join(parent, e["aside"])
    os.rename(dst, aside)
    os.rename(tmp, dst)
    remove_entry(aside)


def destination_full(e: BaseException, dst: str) -> BaseException:
    """What to raise after the new store for ``dst`` failed with ``e`` and was removed: a full
    filesystem (``ENOSPC``/``EDQUOT``, also a :class:`StoreFullError` that names the temporary
    store) as a :class:`StoreFullError` naming ``dst``; anything else as it is."""
    full = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    if not isinstance(e, OSError) or e.errno not in full or (isinstance(e, StoreFullError) and e.filename == dst):
        return e
    assert e.errno is not None  # it is in full
    err = StoreFullError(e.errno, f"{dst}: {os.strerror(e.errno)} while writing the new store; nothing changed there "
                                  "and what was written is removed; free space and run again", dst)
    err.__cause__ = e
    return err


# -- recovery ----------------------------------------------------------------------------------------
def recover(dst: str) -> None:
    """Complete every publish that a dead process of this machine left half done and whose journal
    names ``dst`` (with a :class:`PublishRecoveredWarning` for each): afterwards each destination
    of that journal holds its new store, the old stores and the journal are gone.

    Parameters
    ----------
    dst : str
        An absolute destination path.
    """
    parent, name = os.path.split(dst)
    try:
        names = [e.name for e in os.scandir(parent) if _JOURNAL_RE.fullmatch(e.name)]
    except OSError:
        return
    for j in names:
        m = _JOURNAL_RE.fullmatch(j)
        assert m is not None
        if int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        _recover_journal(parent, j, name)


def _read_journal(fd: int, path: str) -> dict[str, Any] | None:
    """The journal's content, checked to name only entries of its own folder; None when it is torn
    (its process died while writing it: nothing was published)."""
    data = os.read(fd, _JOURNAL_MAX + 1)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: not ours
        return None
    ok = (isinstance(doc, dict) and isinstance(doc.get("overwrite"), bool) and isinstance(doc.get("pairs"), list)
          and len(data) <= _JOURNAL_MAX)
    for e in doc.get("pairs", []) if ok else []:
        ok = ok and isinstance(e, dict) and isinstance(e.get("destination"), str) and all(
            isinstance(e.get(k), int) for k in ("dev", "ino"))
        if not ok:
            break
        dname = e["destination"]
        ok = (dname not in ("", ".", "..") and "/" not in dname and os.sep not in dname
              and all(isinstance(e.get(k), str) and _partial_re(dname).fullmatch(e[k]) is not None
                      for k in ("partial",) + (("aside",) if doc["overwrite"] else ())))
    if not ok:
        warnings.warn(f"{path}: not a publish journal of trajstore (or damaged); left as it is",
                      PublishRecoveredWarning, stacklevel=4)
        return {}
    return doc


def _recover_journal(parent: str, jname: str, dst_name: str) -> None:
    path = os.path.join(parent, jname)
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return  # gone (another process completed it), or not a file
    locks = lock_backend()
    done = False  # the journal is removed once closed (Windows removes no open file)
    try:
        if not locks.try_exclusive(fd):
            return  # another process is completing it
        st = os.fstat(fd)
        if _identity(path) != (st.st_dev, st.st_ino):
            return  # completed and removed while we opened it
        doc = _read_journal(fd, path)
        if doc is None:
            done = True  # torn: written before anything was published
            return
        if not doc or all(e["destination"] != dst_name for e in doc["pairs"]):
            return
        lost = [e["partial"] for e in doc["pairs"] if not _recover_one(parent, e, doc["overwrite"])]
        if lost:
            warnings.warn(f"{path}: the new stores {lost} that this publish journal names are gone; their "
                          "destinations are left as they are and the journal is kept for inspection",
                          PublishRecoveredWarning, stacklevel=4)
        done = not lost
    finally:
        locks.forget(fd)
        os.close(fd)
        if done:
            with contextlib.suppress(FileNotFoundError):  # (another process completed it meanwhile)
                os.unlink(path)


def _recover_one(parent: str, e: dict[str, Any], overwrite: bool) -> bool:
    """Complete one destination of a journal; False (reported) when its new store is gone."""
    tmp, dst = os.path.join(parent, e["partial"]), os.path.join(parent, e["destination"])
    aside = os.path.join(parent, e["aside"]) if e.get("aside") else None
    new = (e["dev"], e["ino"])
    if _identity(dst) == new:
        for leftover in (tmp, aside):  # the old store (after an exchange, or renamed aside)
            if leftover is not None and os.path.lexists(leftover) and _identity(leftover) != new:
                remove_entry(leftover)
        return True
    if _identity(tmp) == new:
        if aside is not None and not os.path.lexists(dst) and os.path.lexists(aside):
            os.rename(tmp, dst)  # killed between the portable path's two renames
            remove_entry(aside)
        else:
            _publish_one(parent, e, overwrite)
        warnings.warn(f"{dst}: completed the publish of a new store that a killed process had built and verified "
                      f"(it waited at {tmp})", PublishRecoveredWarning, stacklevel=5)
        return True
    if aside is not None and not os.path.lexists(dst) and os.path.lexists(aside):
        os.rename(aside, dst)  # the new store is gone: the old one goes back
    return False
