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
from typing import Any, AsyncIterator, Iterable

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

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
from trajstore.storage.keys import CHECKSUMS_KEY, HEAD_KEY

__all__ = ["IcechunkSession", "SessionStore", "is_icechunk_url", "open_repository", "resolve_version",
           "FILES_GROUP", "BRANCH", "VERSION_OPTION"]

#: The zarr group under which trajstore's non-zarr files live inside a repository.
FILES_GROUP = "trajstore_files"
#: The branch trajstore writes and reads by default.
BRANCH = "main"
#: ``storage_options`` key naming the version a read-only open reads (tag, snapshot id, datetime).
VERSION_OPTION = "trajstore_version"
_SCHEMES = ("icechunk://", "icechunk+s3://")
_SNAPSHOT_ID = re.compile(r"^[0-9A-Z]{20}$")  # icechunk's ids: 12 bytes in Crockford base32
_ZARR_JSON = "zarr.json"


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
        if any(s.id == version for s in repo.ancestry(branch=BRANCH)):
            return {"snapshot_id": version}
        raise VersionNotFoundError(f"{url}: snapshot {version} is not a version of this dataset (not in the history "
                                   "of its branch); `trajstore log` lists its snapshots")
    tags = sorted(repo.list_tags())
    raise VersionNotFoundError(f"{url}: no version named {version!r}; its tags are {tags or 'none'} "
                               "(a snapshot id or a datetime also names a version)")


def file_node(key: str) -> str:
    """The array path that holds trajstore's file ``key`` inside a repository."""
    return f"{FILES_GROUP}/{key.encode().hex()}"


def _is_zarr_key(key: str) -> bool:
    """A key icechunk holds itself: node metadata and chunks of arrays (never trajstore's files,
    whose first part starts with ``trajstore.`` or ``.``)."""
    first = key.split("/", 1)[0]
    if first.startswith((".", "trajstore.")):
        return False
    return key == _ZARR_JSON or key.endswith("/" + _ZARR_JSON) or key.startswith("c/") or "/c/" in key


def _file_meta(key: str, n: int) -> bytes:
    """The ``zarr.json`` of the one-chunk ``uint8`` array holding ``n`` bytes of file ``key``."""
    return json.dumps({
        "zarr_format": 3, "node_type": "array", "shape": [n], "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(n, 1)]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0, "codecs": [{"name": "bytes"}], "attributes": {"trajstore_file": key},
        "dimension_names": ["byte"],
    }).encode()


_GROUP_META = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()


def _file_size(meta: bytes, key: str) -> int:
    """The size recorded in the ``zarr.json`` of file ``key``'s array (a repository is input).

    Raises
    ------
    DamagedStoreError
        The metadata is not that of a one-axis array of trajstore's.
    """
    try:
        obj = json.loads(meta) if len(meta) <= 1 << 16 else None
        shape = obj.get("shape") if isinstance(obj, dict) else None
        if isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0:
            return int(shape[0])
    except ValueError:
        pass
    raise DamagedStoreError(f"{file_node(key)}/zarr.json: expected the one-axis uint8 array holding trajstore's file "
                            f"{key!r}; found {meta[:80]!r}")


def _cut(data: bytes, r: ByteRequest) -> bytes:
    """The part of ``data`` a zarr byte request names."""
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

    if isinstance(r, RangeByteRequest):
        return data[r.start:r.end]
    if isinstance(r, OffsetByteRequest):
        return data[r.offset:]
    if isinstance(r, SuffixByteRequest):
        return data[-r.suffix:] if r.suffix else b""
    raise TypeError(f"unknown byte request {r!r}")


def _at_least(value: Buffer, rows: int) -> Buffer:
    """Array metadata ``value`` with ``shape[0]`` raised to ``rows`` (unchanged if it holds more)."""
    try:
        meta = json.loads(value.to_bytes())
        if meta.get("node_type") != "array" or meta["shape"][0] >= rows:
            return value
        meta["shape"][0] = rows
    except (ValueError, KeyError, TypeError, IndexError):
        return value
    return default_buffer_prototype().buffer.from_bytes(json.dumps(meta).encode())


class SessionStore(Store):
    """The zarr store of an :class:`IcechunkSession`: forwards to the store of its current
    session (a new one after every commit, as icechunk's sessions turn read-only when they
    commit), and keeps trajstore's non-zarr files as one-chunk arrays (module docstring)."""

    def __init__(self, owner: "IcechunkSession", read_only: bool) -> None:
        super().__init__(read_only=read_only)
        self._owner = owner
        # Rows (axis 0) each array was grown to hold chunks of this session (:meth:`_grow_to`):
        # metadata written later in the session never records fewer, as icechunk drops the
        # chunks a shape leaves out (the publisher's shapes lag the writer's rows).
        self.extents: dict[str, int] = {}
        #: ``{key: sha256 hex}`` every full read of a key is checked against (``None``: no checks).
        self.checksums: dict[str, str] | None = None
        #: Requests and bytes this store fetched from the repository (trajstore's reads).
        self.requests = 0
        self.bytes_read = 0

    @property
    def _inner(self) -> Any:
        return self._owner.session.store

    def __eq__(self, other: object) -> bool:
        return other is self

    __hash__ = object.__hash__

    @property
    def supports_writes(self) -> bool:
        """True: a writer's session takes writes (a reader's refuses them)."""
        return True

    @property
    def supports_deletes(self) -> bool:
        """True (as :attr:`supports_writes`)."""
        return True

    @property
    def supports_listing(self) -> bool:
        """True: keys are listed, trajstore's files under their own names."""
        return True

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        """The bytes of ``key`` (a file of trajstore's from its array), counted, and checked against
        the push's checksums when :attr:`checksums` is set; ``None`` when absent."""
        if self.checksums is not None and byte_range is not None:
            whole = await self.get(key, prototype)  # checked whole, then cut
            return None if whole is None else prototype.buffer.from_bytes(_cut(whole.to_bytes(), byte_range))
        out = await self._get(key, prototype, byte_range)
        if out is not None:
            self.requests += 1
            self.bytes_read += len(out)
            if self.checksums is not None:
                self._check(key, out.to_bytes())
        return out

    def _check(self, key: str, data: bytes) -> None:
        """Raise ChecksumError unless ``data`` is what the push recorded for ``key``."""
        assert self.checksums is not None
        if key == CHECKSUMS_KEY:
            return
        want = self.checksums.get(key)
        got = hashlib.sha256(data).hexdigest()
        if want != got:
            raise ChecksumError(f"{self._owner.url}: {key} does not match the checksum recorded at push (expected "
                                f"sha256 {want or 'none: the key was not pushed'}, read {got} of {len(data)} bytes); "
                                "the version was changed or damaged after its push")

    async def _get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None) -> Buffer | None:
        if _is_zarr_key(key):
            return await self._inner.get(key, prototype, byte_range)
        node = file_node(key)
        meta = await self._inner.get(f"{node}/{_ZARR_JSON}", prototype)
        if meta is None:
            return None
        if _file_size(meta.to_bytes(), key) == 0:
            return prototype.buffer.from_bytes(b"")
        return await self._inner.get(f"{node}/c/0", prototype, byte_range)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        """:meth:`get` of each ``(key, range)``."""
        return [await self.get(k, prototype, r) for k, r in key_ranges]

    async def exists(self, key: str) -> bool:
        """Whether ``key`` is stored."""
        return bool(await self._inner.exists(key if _is_zarr_key(key) else f"{file_node(key)}/{_ZARR_JSON}"))

    async def getsize(self, key: str) -> int:
        """Bytes stored under ``key`` (``FileNotFoundError`` when absent)."""
        if _is_zarr_key(key):
            return int(await self._inner.getsize(key))
        data = await self.get(key, default_buffer_prototype())
        if data is None:
            raise FileNotFoundError(key)
        return len(data)

    async def set(self, key: str, value: Buffer) -> None:
        """Store ``value`` under ``key`` in the writer's session (published by its next commit)."""
        self._owner.check_usable()
        if _is_zarr_key(key):
            path = key[: -len(_ZARR_JSON)].rstrip("/")
            if key.endswith(_ZARR_JSON) and path in self.extents:
                value = _at_least(value, self.extents[path])
            try:
                await self._inner.set(key, value)
            except Exception as e:  # icechunk.IcechunkError, whose kinds are told apart by message only
                if "invalid chunk index" not in str(e) or not await self._grow_to(key):
                    raise
                await self._inner.set(key, value)
            return
        proto = default_buffer_prototype()
        if not await self._inner.exists(f"{FILES_GROUP}/{_ZARR_JSON}"):
            await self._inner.set(f"{FILES_GROUP}/{_ZARR_JSON}", proto.buffer.from_bytes(_GROUP_META))
        node = file_node(key)
        await self._inner.set(f"{node}/{_ZARR_JSON}", proto.buffer.from_bytes(_file_meta(key, len(value))))
        if len(value):
            await self._inner.set(f"{node}/c/0", value)
        elif await self._inner.exists(f"{node}/c/0"):
            await self._inner.delete(f"{node}/c/0")

    async def _grow_to(self, chunk_key: str) -> bool:
        """Make the array of ``chunk_key`` long enough to hold that chunk (axis 0 only).

        icechunk refuses a chunk outside its array's shape, and trajstore writes an unbounded
        table's rows (the next commit's) past the shape plain readers see (storage/published.py
        publishes the committed rows around each commit record).  Returns False when the key is
        no chunk of a regular-grid array, or the chunk lies outside another axis."""
        path, _, coords = chunk_key.partition("/c/") if "/c/" in chunk_key else ("", "", chunk_key[2:])
        meta_key = f"{path}/{_ZARR_JSON}" if path else _ZARR_JSON
        raw = await self._inner.get(meta_key, default_buffer_prototype())
        try:
            meta = json.loads(raw.to_bytes()) if raw is not None else None
            index = [int(c) for c in coords.split("/")]
            chunks = meta["chunk_grid"]["configuration"]["chunk_shape"] if meta else None
        except (ValueError, KeyError, TypeError):
            return False
        if not meta or not chunks or len(index) != len(chunks) or len(index) != len(meta["shape"]):
            return False
        if any(i * c >= n for i, c, n in zip(index[1:], chunks[1:], meta["shape"][1:])):
            return False
        meta["shape"][0] = max(meta["shape"][0], (index[0] + 1) * chunks[0])
        self.extents[path] = meta["shape"][0]
        await self._inner.set(meta_key, default_buffer_prototype().buffer.from_bytes(json.dumps(meta).encode()))
        return True

    async def delete(self, key: str) -> None:
        """Remove ``key`` in the writer's session (a missing key is ignored)."""
        self._owner.check_usable()
        if _is_zarr_key(key):
            if await self._inner.exists(key):
                await self._inner.delete(key)
            return
        node = file_node(key)
        for part in (f"{node}/c/0", f"{node}/{_ZARR_JSON}"):
            if await self._inner.exists(part):
                await self._inner.delete(part)

    async def list(self) -> AsyncIterator[str]:
        """Every key."""
        async for key in self.list_prefix(""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        """Every key starting with ``prefix`` (trajstore's files under their own names)."""
        async for key in self._inner.list_prefix(""):
            if key.startswith(FILES_GROUP + "/") or key == FILES_GROUP:
                parts = key.split("/")
                if len(parts) == 3 and parts[2] == _ZARR_JSON:
                    name = bytes.fromhex(parts[1]).decode()
                    if name.startswith(prefix):
                        yield name
            elif key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        """The children of ``prefix`` (without the group of trajstore's files)."""
        async for key in self._inner.list_dir(prefix):
            if not (prefix.strip("/") == "" and key == FILES_GROUP):
                yield key

    def close(self) -> None:
        """Nothing to close: the session belongs to the location (:meth:`IcechunkSession.close`)."""


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
        self._last: tuple[int, dict[str, int]] | None = None  # (epoch, rows) of this writer's last commit
        self.session = (repo.readonly_session(**(version or {"branch": BRANCH})) if read_only
                        else repo.writable_session(BRANCH))
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
        except ValueError:
            obj, keys, ok = None, None, False
        if not ok or not isinstance(obj, dict) or not isinstance(keys, dict):
            raise ChecksumError(f"{self.url}: this version holds no checksums (it was not made by `trajstore push`); "
                                "pull a pushed version (`trajstore log` shows them), or pass --no-verify")
        if head is None or hashlib.sha256(head.to_bytes()).hexdigest() != obj.get("head"):
            raise ChecksumError(f"{self.url}: the commit record is not the one pushed with the checksums (the store "
                                "was committed to after its push); pull a pushed version, or pass --no-verify")
        self.zstore.checksums = {**keys, HEAD_KEY: str(obj.get("head"))}
        total = obj.get("bytes")
        self.pushed_bytes = total if type(total) is int else None

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
                              "next_episode_id": (head.get("state") or {}).get("next_episode_id")}}
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
