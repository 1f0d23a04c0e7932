"""The writer lease of a remote (fsspec) store, and exclusive create.

Remote stores cannot be ``flock``-ed (:mod:`trajstore.storage.locks`): a writer there holds a
:class:`RemoteLease`, the object ``trajstore.lease.json`` created with exclusive-create semantics
(:func:`exclusive_put`: ``If-None-Match: *`` on S3, an exclusive create on ``memory://``), and
checks before every commit that the store's commit record is still the one it last wrote
(:meth:`RemoteLease.check`).  So a second writer is refused at open and a commit never silently
replaces another writer's.  docs/scale.md lists the guarantee per backend.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import uuid
from typing import Any

from zarr.core.sync import sync

from trajstore.errors import BadOptionError, DamagedStoreError, LockedError
from trajstore.storage.head import read_head
from trajstore.storage.location import Location

__all__ = ["LEASE_KEY", "LEASE_TTL_S", "RemoteLease", "exclusive_create_supported", "exclusive_put", "needs_lease"]

#: The lease object of a remote store's writer (JSON: owner token, host, pid, last renewal).
LEASE_KEY = "trajstore.lease.json"
#: A lease not renewed for this long belongs to a writer that is gone (another host's crash).
LEASE_TTL_S = 600.0
#: Bound on the lease object read back (it is input like every file of a store).
_MAX_LEASE_BYTES = 4096
_MAX_PID = 1 << 22  # Linux's pid_max limit; larger is not a process id
_MAX_TIME = 1e11  # seconds since the epoch (year 5138): anything later is not a clock reading
#: fsspec protocols whose ``pipe_file(..., mode="create")`` is an atomic exclusive create
#: (s3fs sends ``If-None-Match: *``; the memory filesystem opens with ``"xb"``).  Others are
#: written after an existence check: a race of two writers opening at the same instant is then
#: caught only by the generation check of the first commit.
_EXCLUSIVE_PROTOCOLS = frozenset({"memory", "s3", "s3a"})


def _protocols(loc: Location) -> set[str]:
    proto = getattr(getattr(loc.zstore, "fs", None), "protocol", ())
    return {proto} if isinstance(proto, str) else set(proto)


def needs_lease(loc: Location) -> bool:
    """Whether a writer of ``loc`` takes a :class:`RemoteLease`: an fsspec store (a URL).  Local
    folders have the flock :class:`WriterLock`; in-memory stores and zips have one writer by
    construction."""
    return loc.local_root is None and loc.url is not None and hasattr(loc.zstore, "fs")


def exclusive_create_supported(loc: Location) -> bool:
    """Whether :func:`exclusive_put` is atomic on ``loc`` (local folders, ``memory://``, S3)."""
    return loc.local_root is not None or bool(_protocols(loc) & _EXCLUSIVE_PROTOCOLS)


def exclusive_put(loc: Location, key: str, data: bytes) -> bool:
    """Create ``key`` holding ``data`` unless something is stored there already.

    Local folders: the bytes go to a temp file that is hard-linked onto the key (``link`` fails
    when the name exists, and the key never holds partial bytes).  ``memory://`` and S3: one
    exclusive-create write (``If-None-Match: *``).  Other fsspec filesystems: an existence check,
    then a write (not atomic; see :func:`exclusive_create_supported`).

    Returns
    -------
    bool
        True when this call created the key, False when it existed.
    """
    if loc.local_root is not None:
        return _link_new(loc, key, data)
    if exclusive_create_supported(loc):
        fs, full = loc.zstore.fs, f"{loc.zstore.path.rstrip('/')}/{key}"
        try:
            sync(fs._pipe_file(full, data, mode="create"))
        except FileExistsError:
            return False
        return True
    if loc.exists(key):
        return False
    loc.put(key, data)
    return True


def _link_new(loc: Location, key: str, data: bytes) -> bool:
    """:func:`exclusive_put` on a local folder: a temp file hard-linked onto ``key``."""
    dest = loc.path(key)
    for _ in range(100):
        tmp = loc.new_tmp_path()
        try:
            with open(tmp, "xb") as f:
                f.write(data)
        except FileNotFoundError:
            continue  # another writer removed the empty temp folder just now (below): make it again
        try:
            os.link(tmp, dest)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
            try:
                os.rmdir(tmp.parent)  # leave no empty temp folder behind in a dataset root
            except OSError:
                pass  # another writer's temp file is in it
        return True
    raise LockedError(f"{loc.url}: {key} could not be created: the temp folder kept vanishing")


class RemoteLease:
    """The writer lease of a remote store (see the module docstring).

    Taken at open by :meth:`acquire`; :meth:`check` runs before every commit record is written;
    :meth:`release` deletes the lease object when the writer closes.  A lease whose writer is
    gone is taken over: on the same host when its process no longer exists, from any host when
    it was not renewed for :data:`LEASE_TTL_S` seconds (a writer renews it at a commit once half
    of that has passed).
    """

    def __init__(self, loc: Location, record: dict[str, Any]) -> None:
        self.loc = loc
        self.record = record
        self.released = False

    @classmethod
    def acquire(cls, loc: Location, *, multiprocessing: bool = False) -> "RemoteLease":
        """Take the lease of ``loc`` (a writer opening or creating the store).

        Raises
        ------
        LockedError
            Another live writer holds it.
        BadOptionError
            ``multiprocessing=True``: a remote store has no inter-process lock; give every
            process a shard of its own (:func:`trajstore.shards.create_shard`).
        DamagedStoreError
            The lease object is not a lease (garbage, too large).
        """
        if multiprocessing:
            raise BadOptionError(f"{loc.url}: multiprocessing=True needs a local folder (its writers share a file "
                                 "lock); remote stores take one writer: give each process a shard of its own "
                                 "(trajstore.shards.create_shard)")
        record = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "renewed": time.time()}
        data = json.dumps(record).encode()
        for _ in range(3):
            if exclusive_put(loc, LEASE_KEY, data):
                return cls(loc, record)
            held = _read_lease(loc)
            if held is None:
                continue  # released meanwhile: try again
            if not _stale(held):
                raise LockedError(f"{loc.url}: another writer holds the store (lease {LEASE_KEY}: host "
                                  f"{held.get('host')!r}, pid {held.get('pid')!r}); open it with read_only=True, "
                                  "or write a shard of your own (trajstore.shards.create_shard)")
            loc.delete(LEASE_KEY)  # its writer is gone: take it over
        raise LockedError(f"{loc.url}: the writer lease {LEASE_KEY} kept changing hands while this writer opened")

    def check(self, generation: int) -> None:
        """Before a commit: the store's commit record must still be generation ``generation``
        (the one this writer last wrote or read); renew the lease when half its time has passed.

        Raises
        ------
        LockedError
            Another writer committed meanwhile (or took the lease over): this commit would replace
            its record and lose its rows.
        """
        loc = self.loc
        try:
            on_store = read_head(loc).generation
        except Exception as e:  # unreadable (any backend's error) or damaged: refuse, saying why
            raise LockedError(f"{loc.url}: the commit record could not be read to check that no other writer "
                              f"committed ({type(e).__name__}: {e}); refusing to commit") from e
        if on_store != generation:
            raise LockedError(f"{loc.url}: another writer committed to this store (its commit record is generation "
                              f"{on_store}, this writer's last was {generation}); refusing to overwrite it. Reopen "
                              "the store, or write a shard of your own")
        if time.time() - float(self.record["renewed"]) > LEASE_TTL_S / 2:
            held = _read_lease(loc)
            if held is None or held.get("owner") != self.record["owner"]:
                raise LockedError(f"{loc.url}: this writer's lease {LEASE_KEY} was taken over by another writer "
                                  f"({None if held is None else held.get('host')!r}); refusing to commit")
            self.record = dict(self.record, renewed=time.time())
            loc.put(LEASE_KEY, json.dumps(self.record).encode())

    def release(self) -> None:
        """Delete the lease object if it is still this writer's (idempotent; errors ignored: a
        lease left behind is taken over once stale)."""
        if self.released or self.record["pid"] != os.getpid():
            return  # a forked child's copy: the lease is its parent's
        self.released = True
        try:
            held = _read_lease(self.loc)
            if held is not None and held.get("owner") == self.record["owner"]:
                self.loc.delete(LEASE_KEY)
        except Exception:
            pass


def _read_lease(loc: Location) -> dict[str, Any] | None:
    raw = loc.get(LEASE_KEY, limit=_MAX_LEASE_BYTES)
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    if not (isinstance(obj, dict) and isinstance(obj.get("owner"), str) and isinstance(obj.get("host"), str)
            and type(obj.get("pid")) is int and 0 <= obj["pid"] < _MAX_PID
            and type(obj.get("renewed")) in (int, float) and 0 <= obj["renewed"] < _MAX_TIME
            and math.isfinite(obj["renewed"])):
        # (A lease is input: an integer of hundreds of digits would overflow float() or os.kill,
        # and NaN, which JSON allows, would never be stale.)
        raise DamagedStoreError(f"{loc.url}: {LEASE_KEY} is not a writer lease (expected a JSON object with owner, "
                                f"host, pid in [0, {_MAX_PID}), renewed in [0, {_MAX_TIME:.0e}) seconds since the "
                                "epoch); if no writer is running, delete it")
    return obj


def _stale(held: dict[str, Any]) -> bool:
    """Whether the writer named by lease ``held`` is gone."""
    if time.time() - float(held["renewed"]) > LEASE_TTL_S:
        return True
    if held["host"] != socket.gethostname():
        return False
    pid = int(held["pid"])
    if pid == os.getpid():
        return False  # this very process holds it (another buffer on the same store)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # exists, owned by another user
    return False
