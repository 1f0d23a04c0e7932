"""A store inside an icechunk repository (``icechunk://PATH``, ``icechunk+s3://BUCKET/PREFIX``).

icechunk is transactional, versioned Zarr: a writer works in a session on top of one snapshot and
``commit`` publishes its changes as a new snapshot of a branch, or fails with a conflict when the
branch moved on under it.  Here every trajstore commit record written (:func:`write_head`: a flush,
a close, an edit, a copy or an import) ends one icechunk commit, so:

- a reader (``read_only=True``) reads one snapshot for its whole life: consistent by construction,
  and nothing a later writer does can change what it reads;
- a writer's chunks go into its session, never over bytes a snapshot names: a stale writer (a
  paused VM) can never overwrite rows another writer committed; its commit fails instead
  (:class:`~trajstore.errors.ConcurrentWriteError`) unless icechunk can rebase it because the two
  changes touched different keys;
- a writer killed at any instant leaves the branch at its last commit.

icechunk holds zarr keys only (``zarr.json`` files and chunks).  trajstore's own files (the commit
record, the dataset card, the runs file, staged chunks) are kept as one-chunk ``uint8`` arrays under
:data:`FILES_GROUP`, named by the key in hex: :class:`SessionStore` maps them both ways, so the rest of
trajstore sees the same keys as on any other store, and a plain zarr reader sees valid arrays.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from typing import Any, Callable

from zarr.core.buffer import default_buffer_prototype

from trajstore._optional import missing
from trajstore.errors import (
    BadOptionError,
    ChecksumError,
    ConcurrentWriteError,
    DamagedStoreError,
    LockedError,
    NotATrajstoreError,
    ReadOnlyError,
    StoreNotFoundError,
    VersionNotFoundError,
)
from trajstore.storage.confined import file_kind
from trajstore.storage.icechunk_store import FILES_GROUP, SessionStore
from trajstore.storage.keys import CHECKSUMS_KEY, HEAD_KEY
from trajstore.storage.loop_exit import guard_zarr_loop
from trajstore.storage.tree_check import check_tree

__all__ = ["IcechunkSession", "SessionStore", "is_icechunk_url", "open_repository", "resolve_version",
           "branch_history", "FILES_GROUP", "BRANCH", "VERSION_OPTION"]

#: The branch trajstore writes and reads by default.
BRANCH = "main"
#: ``storage_options`` key naming the version a read-only open reads (tag, snapshot id, datetime).
VERSION_OPTION = "trajstore_version"
_SCHEMES = ("icechunk://", "icechunk+s3://")
_SNAPSHOT_ID = re.compile(r"^[0-9A-Z]{20}$")  # icechunk's ids: 12 bytes in Crockford base32


def is_icechunk_url(path: str) -> bool:
    """Whether ``path`` names an icechunk location."""
    return path.startswith(_SCHEMES)


_QUIETED: list[bool] = []  # (whether icechunk's log filter was set: once per process)


def _icechunk() -> Any:
    try:
        import icechunk
    except ImportError:
        raise missing("icechunk", "icechunk locations (icechunk:// and icechunk+s3:// paths)") from None
    if not _QUIETED and "ICECHUNK_LOG" not in os.environ:
        # icechunk logs a warning to stdout on every open of a local repository (that concurrent
        # commits are not safe there), which would corrupt `trajstore ... --json`; trajstore keeps
        # one writer per local repository at a time (_lock_folder).  ICECHUNK_LOG set: the user's filter.
        icechunk.set_logs_filter("error")
        _QUIETED.append(True)
    return icechunk


def _storage(url: str, options: dict[str, Any]) -> Any:
    """The icechunk ``Storage`` of ``url``; S3 credentials and endpoint from fsspec-style options
    (``key``, ``secret``, ``token``, ``endpoint_url``, ``client_kwargs.region_name``, ``anon``)."""
    ic = _icechunk()
    if url.startswith("icechunk://"):
        where = url[len("icechunk://"):]
        if not where:
            raise BadOptionError(f"{url!r}: name the repository's folder, e.g. icechunk:///data/run1 or icechunk://run1")
        return ic.local_filesystem_storage(os.path.abspath(os.path.expanduser(where)))
    bucket, _, prefix = url[len("icechunk+s3://"):].partition("/")
    if not bucket:
        raise BadOptionError(f"{url!r}: name the bucket, e.g. icechunk+s3://bucket/prefix")
    client = options.get("client_kwargs") or {}
    endpoint = options.get("endpoint_url") or client.get("endpoint_url")
    has_keys = "key" in options or "secret" in options
    return ic.s3_storage(
        bucket=bucket, prefix=prefix.strip("/") or None, region=client.get("region_name") or options.get("region"),
        endpoint_url=endpoint, allow_http=bool(endpoint and str(endpoint).startswith("http:")),
        access_key_id=options.get("key"), secret_access_key=options.get("secret"), session_token=options.get("token"),
        anonymous=bool(options.get("anon")) or None, from_env=None if has_keys or options.get("anon") else True,
        force_path_style=bool(endpoint))


def check_local_repository(url: str, folder: str) -> None:
    """Refuse a local repository holding a link or a special file anywhere below its folder.

    icechunk's local storage opens the repository's files itself: it follows links (reading a file
    outside the repository as a chunk) and its open of a FIFO blocks until a writer comes, which
    would hang every reader.  So the folder is walked once before icechunk reads anything
    (``trajstore.storage.tree_check``; one ``scandir`` per folder).

    Raises
    ------
    DamagedStoreError
        Naming the first link or special file found.
    """

    def refuse(path: str, mode: int | None) -> Exception:
        rel = os.path.relpath(path, folder)
        return DamagedStoreError(f"{url}: {rel} is a {file_kind(mode or 0)}, not a regular file; trajstore never "
                                 "follows links or opens special files inside a store")

    check_tree(folder, None, refuse)


def open_repository(url: str, options: dict[str, Any] | None, *, create: bool) -> Any:
    """The icechunk ``Repository`` at ``url`` (created when ``create`` and there is none).

    Raises
    ------
    StoreNotFoundError
        No repository there and ``create`` is false.
    NotATrajstoreError
        A local folder that holds files but no icechunk repository.
    """
    ic = _icechunk()
    if url.startswith("icechunk://"):
        # Checked before icechunk looks: its local storage creates the folder it is asked about.
        folder = os.path.abspath(os.path.expanduser(url[len("icechunk://"):]))
        if os.path.lexists(folder) and not os.path.isdir(folder):
            raise NotATrajstoreError(f"{url}: is a file, not an icechunk repository folder")
        if not os.path.isdir(folder) and not create:
            raise StoreNotFoundError(f"no store at {url!r}: no icechunk repository there (the folder does not exist)")
        if os.path.isdir(folder) and os.listdir(folder) and not os.path.isdir(os.path.join(folder, "refs")):
            raise NotATrajstoreError(f"{url}: the folder holds files but no icechunk repository (expected refs/, "
                                     "snapshots/ ...); name an empty or new folder, or the repository's")
        if os.path.isdir(folder):
            check_local_repository(url, folder)
    storage = _storage(url, options or {})
    if ic.Repository.exists(storage):
        return ic.Repository.open(storage)
    if not create:
        raise StoreNotFoundError(f"no store at {url!r}: no icechunk repository there")
    return ic.Repository.create(storage)


def resolve_version(repo: Any, url: str, version: Any) -> dict[str, Any]:
    """The ``readonly_session`` arguments reading ``version``: a tag, a branch, a snapshot id of this
    repository, or a ``datetime`` (the branch as it was then).

    Raises
    ------
    VersionNotFoundError
        No tag, branch or snapshot of this repository has that name (a snapshot id of another
        dataset included), or the datetime is before its first commit.
    """
    if isinstance(version, datetime.datetime):
        when = version if version.tzinfo else version.replace(tzinfo=datetime.timezone.utc)
        first = min(s.written_at for s in repo.ancestry(branch=BRANCH))
        if when < first:
            raise VersionNotFoundError(f"{url}: nothing was committed by {when.isoformat()} (the first commit is of "
                                       f"{first.isoformat()})")
        return {"branch": BRANCH, "as_of": when}
    if not isinstance(version, str) or not version:
        raise BadOptionError(f"version must be a tag name, a snapshot id or a datetime; got {version!r:.60}")
    if version in repo.list_tags():
        return {"tag": version}
    if version in repo.list_branches():
        return {"branch": version}
    if _SNAPSHOT_ID.match(version):
        if version in branch_history(repo):
            return {"snapshot_id": version}
        raise VersionNotFoundError(f"{url}: snapshot {version} is not a version of this dataset (not in the history "
                                   "of its branch); `trajstore log` lists its snapshots")
    tags = sorted(repo.list_tags())
    raise VersionNotFoundError(f"{url}: no version named {version!r}; its tags are {tags or 'none'} "
                               "(a snapshot id or a datetime also names a version)")


#: The snapshot ids of each branch tip's history, newest tips last (a snapshot's parents never
#: change, so the history of a tip is cached for good; a few tips are kept).
_HISTORIES: dict[str, frozenset[str]] = {}
_HISTORIES_KEPT = 8


def branch_history(repo: Any, branch: str = BRANCH) -> frozenset[str]:
    """The ids of every snapshot in the history of ``branch`` (its tip included): one walk of the
    ancestry per tip, cached, so resolving many snapshot ids (``trajstore log``, ``diff``) reads
    each snapshot once rather than once per id."""
    tip = str(repo.lookup_branch(branch))
    got = _HISTORIES.get(tip)
    if got is None:
        got = frozenset(s.id for s in repo.ancestry(snapshot_id=tip))
        _HISTORIES[tip] = got
        while len(_HISTORIES) > _HISTORIES_KEPT:
            del _HISTORIES[next(iter(_HISTORIES))]
    return got


class IcechunkSession:
    """The transaction of a :class:`~trajstore.storage.location.Location` on one branch (a writer)
    or one snapshot (a reader) of an icechunk repository: its ``zstore`` is the location's store,
    and :meth:`record_written` is called after each commit record is put.

    Parameters
    ----------
    repo : icechunk.Repository
        The open repository.
    url : str
        The location's address as the user wrote it.
    read_only : bool
        A reader: one read-only session for the location's life.
    version : dict or None
        ``readonly_session`` arguments of the version a reader reads (:func:`resolve_version`);
        ``None``: the branch's latest snapshot.
    """

    def __init__(self, repo: Any, url: str, *, read_only: bool, version: dict[str, Any] | None = None) -> None:
        self.repo = repo
        self.broken: str | None = None  # why this writer may write no more (a lost conflict)
        self.message: str | None = None  # the next commit's message, when a caller names it
        self.pushed_bytes: int | None = None  # the size of the version's keys, as its push recorded it
        #: A one-pass reader (a pull): raw chunks' rows are fetched as byte ranges, not whole chunks
        #: kept in a cache (storage/fields/ranges.py); ``storage_options["trajstore_ranges"]``.
        self.ranged_reads = False
        #: A writer's buffer may describe each commit record (``{"episodes": n}``) for the
        #: snapshot's metadata, so ``trajstore log`` reads no data (trajstore/buffers/trajectory.py).
        self.describe: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self._last: tuple[int, dict[str, int]] | None = None  # (epoch, rows) of this writer's last commit
        self.session = (repo.readonly_session(**(version or {"branch": BRANCH})) if read_only
                        else repo.writable_session(BRANCH))
        guard_zarr_loop()  # icechunk's tokio threads complete futures on zarr's loop (storage/loop_exit.py)
        self.url = url
        self.zstore = SessionStore(self, read_only)
        # (a file object: a location dropped without close, e.g. by a failed open, is unlocked when collected)
        self._lock: Any = _lock_folder(url) if not read_only and url.startswith("icechunk://") else None

    @property
    def snapshot_id(self) -> str:
        """The snapshot this location reads (a writer: the one its session started from)."""
        return str(self.session.snapshot_id)

    def require_checksums(self) -> None:
        """Check every later read against the checksums recorded when this version was pushed.

        Raises
        ------
        ChecksumError
            The version holds no checksums (it was never pushed), or its commit record is not the
            one they were recorded with (committed to after its push).
        """
        from zarr.core.sync import sync

        proto = default_buffer_prototype()
        raw = sync(self.zstore.get(CHECKSUMS_KEY, proto))
        head = sync(self.zstore.get(HEAD_KEY, proto))
        try:
            obj = json.loads(raw.to_bytes()) if raw is not None else None
            keys = obj.get("keys") if isinstance(obj, dict) else None
            ok = isinstance(keys, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items())
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            obj, keys, ok = None, None, False
        if not ok or not isinstance(obj, dict) or not isinstance(keys, dict):
            self._refuse_foreign()
            raise ChecksumError(f"{self.url}: this version holds no checksums (it was not made by `trajstore push`); "
                                "pull a pushed version (`trajstore log` shows them), or pass --no-verify")
        if head is None or hashlib.sha256(head.to_bytes()).hexdigest() != obj.get("head"):
            raise ChecksumError(f"{self.url}: the commit record is not the one pushed with the checksums (the store "
                                "was committed to after its push); pull a pushed version, or pass --no-verify")
        self.zstore.checksums = {**keys, HEAD_KEY: str(obj.get("head"))}
        self.zstore.set_block_sums(obj.get("blocks"), obj.get("block_bytes"))
        total = obj.get("bytes")
        self.pushed_bytes = total if type(total) is int else None

    def _refuse_foreign(self) -> None:
        """Raise NotATrajstoreError when the snapshot's root is another program's zarr data (a
        version without checksums is first of all no trajstore store then)."""
        from zarr.core.sync import sync

        raw = sync(self.zstore.get("zarr.json", default_buffer_prototype()))
        try:
            obj = json.loads(raw.to_bytes()) if raw is not None and len(raw) <= 1 << 20 else None
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            obj = None
        attrs = obj.get("attributes") if isinstance(obj, dict) else None
        if raw is not None and not (isinstance(attrs, dict) and "trajstore" in attrs):
            raise NotATrajstoreError(f"{self.url}: not a trajstore store (zarr.json has no 'trajstore' attributes)")

    def check_usable(self) -> None:
        """Raise when this location may not write: read-only, or its writer lost a conflict."""
        if self.session.read_only:
            raise ReadOnlyError(f"{self.url}: open read-only (one snapshot); nothing may be written")
        if self.broken is not None:
            raise ConcurrentWriteError(self.broken)

    def record_written(self, data: bytes) -> None:
        """The commit record ``data`` was put: commit the session as one icechunk snapshot, and go
        on in a new session on top of it.

        Raises
        ------
        ConcurrentWriteError
            Another writer committed changes to the same keys since this session began (always
            so for two writers appending to one store: both change the commit record); nothing
            of this session is published and this writer writes no more.
        """
        ic = _icechunk()
        head = json.loads(data)
        rows = {name: int(t["end"]) - int(t["start"]) for name, t in head.get("tables", {}).items()}
        message = self.message or _default_message(head, rows, self._last)
        self.message = None
        meta = {"trajstore": {"generation": head.get("generation"), "epoch": head.get("epoch"), "rows": rows,
                              "next_episode_id": (head.get("state") or {}).get("next_episode_id"),
                              **(self.describe(head) if self.describe is not None else {})}}
        try:
            # A rebase is tried only where it is safe: the other commit changed none of the keys this
            # one changed (ConflictDetector); a change of the commit record always conflicts.
            self.session.commit(message, metadata=meta, rebase_with=ic.ConflictDetector(), rebase_tries=3)
        except (ic.ConflictError, ic.RebaseFailedError) as e:
            self.broken = (f"{self.url}: another writer committed to the branch {BRANCH!r} since this writer's session "
                           f"began ({type(e).__name__}: {str(e).splitlines()[0][:200]}); this writer's rows since its last "
                           "commit were not published. Reopen the store with load_from to write after that commit.")
            raise ConcurrentWriteError(self.broken) from None
        self.session = self.repo.writable_session(BRANCH)
        self.zstore.extents.clear()
        self._last = (int(head.get("epoch", 0)), rows)

    def close(self) -> None:
        """Drop uncommitted changes of a writer (a commit names everything trajstore keeps) and
        release a local repository's writer lock."""
        if not self.session.read_only and self.session.has_uncommitted_changes:
            self.session.discard_changes()
        if self._lock is not None:
            self._lock.close()  # (closing the descriptor releases its flock)
            self._lock = None


#: The lock file of a local repository's writer (icechunk's local storage does not refuse the
#: second of two concurrent commits, as object stores do: one writer at a time there).
LOCAL_LOCK = "trajstore.writer.lock"


def _lock_folder(url: str) -> Any:
    """An exclusive ``flock`` on the local repository's :data:`LOCAL_LOCK`; its open file.

    Raises
    ------
    LockedError
        Another writer holds it.
    """
    import fcntl

    path = os.path.join(os.path.abspath(os.path.expanduser(url[len("icechunk://"):])), LOCAL_LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockedError(f"{url}: another writer has this local repository open (one writer at a time on local "
                          "disk; several writers need an object store such as icechunk+s3://); open it with "
                          "read_only=True") from None
    return os.fdopen(fd, "r+b", buffering=0)


def _default_message(head: dict[str, Any], rows: dict[str, int], last: tuple[int, dict[str, int]] | None) -> str:
    """A commit message from the record: what kind of change (create, append, edit), and the rows
    of each table against this writer's previous commit."""
    if head.get("generation") == 0:
        kind = "create"
    elif head.get("pending") or (last is not None and int(head.get("epoch", 0)) != last[0]):
        kind = "edit"
    else:
        kind = "append"
    before = last[1] if last is not None else {}
    counts = ", ".join(f"{name} {n}" + (f" ({n - before[name]:+d})" if name in before else "")
                       for name, n in sorted(rows.items()))
    return f"{kind}: {counts or 'no rows'}"
