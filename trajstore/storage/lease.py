"""The writer lease of a remote (fsspec) store, and exclusive create.

Remote stores cannot be ``flock``-ed (:mod:`trajstore.storage.locks`): a writer there holds a
:class:`RemoteLease`, the object ``trajstore.lease.json`` created with exclusive-create semantics
(:func:`exclusive_put`: ``If-None-Match: *`` on S3, an exclusive create on ``memory://``), and
checks before every commit that the store's commit record is still the one it last wrote
(:meth:`RemoteLease.check`).  So a second writer is refused at open and a commit never silently
replaces another writer's.  docs/scale.md lists the guarantee per backend.

Why a lease is never taken over on a timer.  A check followed by a write is not a fence: a
writer can be paused (SIGSTOP, a suspended VM, a long stall) between its last check and its
chunk writes for any length of time, and on resuming it writes its chunks whatever the store
holds by then.  Had the lease passed to a second writer meanwhile, those chunks would land on the
second writer's committed rows (issue 37: rows lost with a real SIGSTOP on S3).  A real fence
needs a condition the store checks on every write: S3 (and moto) honour ``If-Match`` on a PUT,
but trajstore's chunk writes go through zarr's store API, and ``memory://`` and most fsspec
filesystems have no such condition at all.  So the lease only changes hands when its writer is
known to be dead:

- it was released (``close``);
- it names a process of this very kernel and pid namespace (:func:`_kernel_identity`: the boot
  id and the pid namespace, not the host name, which containers and clones share) that no longer
  exists (a killed writer; a pid reused by a later process, told by the start time the lease
  records, counts as gone);
- a person says so: :func:`break_lease` (refused while the holder is alive on this kernel).

Any other holder, however long ago it renewed its lease, makes a new writer raise
:class:`~trajstore.errors.LeaseHeldError`, which says how old the lease is and how to break it.
A takeover first creates, exclusively, a tombstone named after the exact lease bytes it read
(under :data:`BROKEN_DIR`), and only its creator deletes the lease: two writers taking over the
same dead lease at once can never delete each other's new one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import socket
import time
import uuid
from typing import Any

from zarr.core.sync import sync

from trajstore.errors import BadOptionError, DamagedStoreError, LeaseHeldError, LockedError
from trajstore.storage.head import read_head
from trajstore.storage.location import Location, resolve_location

__all__ = ["BROKEN_DIR", "LEASE_KEY", "LEASE_TTL_S", "RemoteLease", "break_lease", "exclusive_create_supported",
           "exclusive_put", "needs_lease", "tombstone_key"]

#: The lease object of a remote store's writer (JSON: owner token, host, pid, kernel, last renewal).
LEASE_KEY = "trajstore.lease.json"
#: Tombstones of leases taken over (one small object per takeover, never deleted: see the module
#: docstring); copies and ``overwrite=True`` leave them alone.
BROKEN_DIR = "trajstore.lease.broken"
#: A lease not renewed for this long is reported as looking abandoned (it is still never taken
#: over on that ground alone: see the module docstring).
LEASE_TTL_S = 600.0
#: Bound on the lease object read back (it is input like every file of a store).
_MAX_LEASE_BYTES = 4096
_MAX_PID = 1 << 22  # Linux's pid_max limit; larger is not a process id
_MAX_TIME = 1e11  # seconds since the epoch (year 5138): anything later is not a clock reading
_MAX_KERNEL_ID = 200  # characters of a lease's kernel identity (a boot id and a namespace link)
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
    :meth:`release` deletes the lease object when the writer closes.  A lease is taken over only
    when its writer is known to be dead (a process of this kernel that no longer exists) or
    after :func:`break_lease`; a writer renews it at a commit once :data:`LEASE_TTL_S` / 2 has
    passed, so that its age tells a person whether its writer still runs.
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
        LeaseHeldError
            Another writer holds it and is not known to be dead (also when its lease expired).
        LockedError
            The lease kept changing hands while this writer opened.
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
        record = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                  "kernel": _kernel_identity(), "started": _start_time(os.getpid()), "renewed": time.time()}
        data = json.dumps(record).encode()
        contested = False
        for attempt in range(5):
            if exclusive_put(loc, LEASE_KEY, data):
                return cls(loc, record)
            raw = loc.get(LEASE_KEY, limit=_MAX_LEASE_BYTES)
            if raw is None:
                continue  # released meanwhile: try again
            held = _parse_lease(loc, raw)
            if _alive_here(held) is not False:
                raise LeaseHeldError(_held_message(loc, held))
            # Its writer is gone for certain: take it over, unless a rival's tombstone was first
            # (then the rival deletes it: look again shortly).
            if not _take_over(loc, raw):
                contested = True
                time.sleep(0.05 * (attempt + 1))
        if contested:
            raise LeaseHeldError(f"{loc.url}: the lease {LEASE_KEY} of a writer that is gone (pid {held['pid']} of "
                                 "this machine) is being taken over by another writer, which has not finished (its "
                                 f"tombstone is in {BROKEN_DIR}/); if no other writer is opening this store (one "
                                 f"killed while taking over), remove the lease: trajstore.break_lease({loc.url!r})")
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
        lease left behind is taken over once this process is gone, from this machine, or removed
        with :func:`break_lease`)."""
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
    return None if raw is None else _parse_lease(loc, raw)


def _parse_lease(loc: Location, raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        obj = None
    if not (isinstance(obj, dict) and isinstance(obj.get("owner"), str) and isinstance(obj.get("host"), str)
            and type(obj.get("pid")) is int and 0 <= obj["pid"] < _MAX_PID
            and type(obj.get("renewed")) in (int, float) and 0 <= obj["renewed"] < _MAX_TIME
            and math.isfinite(obj["renewed"])
            and (obj.get("kernel") is None or (isinstance(obj["kernel"], str)
                                                and len(obj["kernel"]) <= _MAX_KERNEL_ID))
            and (obj.get("started") is None or (type(obj["started"]) is int and 0 <= obj["started"] < 1 << 63))):
        # (A lease is input: an integer of hundreds of digits would overflow float() or os.kill,
        # and NaN, which JSON allows, would never be stale.)
        raise DamagedStoreError(f"{loc.url}: {LEASE_KEY} is not a writer lease (expected a JSON object with owner, "
                                f"host, pid in [0, {_MAX_PID}), renewed in [0, {_MAX_TIME:.0e}) seconds since the "
                                f"epoch, kernel a string of at most {_MAX_KERNEL_ID} characters or null, started a "
                                "non-negative integer or null); if no "
                                "writer is running, delete it")
    return obj


@functools.lru_cache(maxsize=1)
def _kernel_identity() -> str | None:
    """Which pids a lease's ``pid`` is one of: this kernel's boot id and this process's pid
    namespace (Linux); ``None`` where the system tells neither.  Two machines or containers that
    share a host name differ here, so a pid that is missing here is never taken for a dead
    writer that ran elsewhere."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read(64).decode("ascii", "replace").strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot}/{namespace}"


def _alive_here(held: dict[str, Any]) -> bool | None:
    """Whether the writer named by lease ``held`` is alive: True or False when it is a process of
    this kernel and pid namespace (and host name), ``None`` when it cannot be told from here."""
    if held["host"] != socket.gethostname() or held.get("kernel") != _kernel_identity():
        return None  # (without a kernel identity on either side: the host name alone, as before)
    pid = int(held["pid"])
    if pid == os.getpid():
        return True  # this very process holds it (another buffer on the same store)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # exists, owned by another user
    started = held.get("started")
    if started is not None and _start_time(pid) not in (None, started):
        return False  # the pid was reused by a process started later: the writer is gone
    return True  # (a stopped process is alive: it may resume and write)


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux ``/proc/<pid>/stat`` field
    22), or ``None`` where the system does not tell: with the pid it names one process for good."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read(4096).rsplit(b")", 1)[1].split()  # (the command name may hold spaces)
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _held_message(loc: Location, held: dict[str, Any]) -> str:
    """What :class:`LeaseHeldError` says about the holder of lease ``held``."""
    age = max(0.0, time.time() - float(held["renewed"]))
    who = f"{LEASE_KEY}: host {held['host']!r}, pid {held['pid']}, renewed {age:.0f} s ago"
    if age <= LEASE_TTL_S or _alive_here(held):
        return (f"{loc.url}: another writer holds the store (lease {who}); open it with read_only=True, or write a "
                "shard of your own (trajstore.shards.create_shard)")
    return (f"{loc.url}: another writer holds the store (lease {who}, more than {LEASE_TTL_S:.0f} s). Its writer "
            "looks gone, but a paused writer (SIGSTOP, a suspended VM) looks the same, and one that resumed would "
            "write over the next writer's rows, so the lease is not taken over. Only when you know that writer is "
            f"dead: trajstore.break_lease({loc.url!r}), then open again. Several writers at once need a shard each "
            "(trajstore.shards.create_shard) or a location with transactions (e.g. icechunk)")


def tombstone_key(raw: bytes) -> str:
    """The key of the tombstone of the lease whose bytes are ``raw`` (named by their hash: a lease
    is input, and its owner string never becomes part of a key)."""
    return f"{BROKEN_DIR}/{hashlib.sha256(raw).hexdigest()[:32]}.json"


def _take_over(loc: Location, raw: bytes) -> bool:
    """Delete the lease whose bytes are ``raw`` if this call is the one to take it over: the
    tombstone named after those bytes is created exclusively, and only its creator deletes.

    Returns
    -------
    bool
        False when another writer's tombstone was there first (it deletes the lease; this caller
        looks again).
    """
    if not exclusive_put(loc, tombstone_key(raw), json.dumps({"broken": time.time(), "by": socket.gethostname()}).encode()):
        return False
    loc.delete(LEASE_KEY)
    return True


def break_lease(cache_path: str, *, storage_options: dict[str, Any] | None = None) -> bool:
    """Remove the writer lease of the remote store at ``cache_path``, whose writer you know is dead.

    A new writer never takes over a lease whose writer may still run (see
    :class:`~trajstore.errors.LeaseHeldError`): a paused writer that resumed would write over its
    rows.  Call this only when the holder named in that error is gone for good (its machine or
    container stopped, its process killed); then open the store again.  A takeover that another
    writer began and never finished (killed between its tombstone and its delete) is finished here.

    Parameters
    ----------
    cache_path : str
        The store's URL (``s3://...``, ``memory://...``).
    storage_options : dict, optional
        Passed to fsspec, as to ``load_from``.

    Returns
    -------
    bool
        True when a lease was removed, False when there was none.

    Raises
    ------
    BadOptionError
        ``cache_path`` is not a remote store (local folders are locked with ``flock``, which the
        system drops when the writer dies: there is nothing to break).
    LeaseHeldError
        The holder is a process of this machine that is still alive (a stopped one too): end it first.
    DamagedStoreError
        The lease object is larger than a lease can be: delete it by hand.
    """
    loc = resolve_location(cache_path, read_only=False, storage_options=storage_options, must_exist=True)
    if not needs_lease(loc):
        raise BadOptionError(f"{loc.url}: break_lease takes a remote store (an fsspec URL); a local folder's writer "
                             "lock is dropped by the system when its writer dies, and other stores have no lease")
    for _ in range(3):
        raw = loc.get(LEASE_KEY, limit=_MAX_LEASE_BYTES)
        if raw is None:
            return False
        try:
            held: dict[str, Any] | None = _parse_lease(loc, raw)
        except DamagedStoreError:
            held = None  # garbage: nothing to ask about, remove it
        if held is not None and _alive_here(held):
            raise LeaseHeldError(f"{loc.url}: the writer holding {LEASE_KEY} is alive on this machine (pid "
                                 f"{held['pid']}); close it (or kill it) before breaking its lease")
        if _take_over(loc, raw):
            return True
        if loc.get(LEASE_KEY, limit=_MAX_LEASE_BYTES) == raw:
            # A takeover of this very lease was begun and not finished (its writer killed between
            # tombstone and delete): the caller says no writer runs, so finish it.
            loc.delete(LEASE_KEY)
            return True
    raise LockedError(f"{loc.url}: the writer lease {LEASE_KEY} kept changing hands while it was being broken")
