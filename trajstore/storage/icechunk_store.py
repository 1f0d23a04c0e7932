"""The zarr store of a location inside an icechunk repository (:mod:`trajstore.storage.icechunk_location`).

icechunk holds zarr keys only (``zarr.json`` files and chunks).  :class:`SessionStore` forwards
those to the store of its owner's current session, and keeps trajstore's own files (the commit
record, the checksums, the dataset card, the runs file, staged chunks) as one-chunk ``uint8`` arrays
under :data:`FILES_GROUP`, named by the key in hex, so the rest of trajstore sees the same keys as on
any other store and a plain zarr reader sees valid arrays.  It also grows an array whose chunk
icechunk refuses as outside its shape, counts what it reads, and checks reads against the
checksums of a push.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, AsyncIterator, Iterable

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from trajstore.errors import ChecksumError, DamagedStoreError
from trajstore.storage.keys import CHECKSUMS_KEY

__all__ = ["SessionStore", "FILES_GROUP", "file_node", "CHECK_BLOCK_BYTES", "block_digests"]

#: The zarr group under which trajstore's non-zarr files live inside a repository.
FILES_GROUP = "trajstore_files"
_ZARR_JSON = "zarr.json"
#: A push also records the SHA-256 of every block of this many bytes of each key longer than one,
#: so a read of part of a key (rows of a raw chunk) is checked by fetching only the blocks it
#: touches, not the whole key: at most one block more than asked at each end.
CHECK_BLOCK_BYTES = 64 << 10
_HEX = 64  # characters of one SHA-256 hex digest


def block_digests(data: bytes, block: int = CHECK_BLOCK_BYTES) -> str:
    """The SHA-256 hex digests of ``data``'s blocks of ``block`` bytes (the last may be shorter),
    concatenated: ``64 * ceil(len(data) / block)`` characters."""
    view = memoryview(data)
    return "".join(hashlib.sha256(view[i:i + block]).hexdigest() for i in range(0, len(data), block))


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


def _file_name(node: str) -> str:
    """The key a node of :data:`FILES_GROUP` holds (its name is the key in hex; a repository is input).

    Raises
    ------
    DamagedStoreError
        The name is no hex of a UTF-8 key.
    """
    try:
        return bytes.fromhex(node).decode()
    except ValueError:  # (UnicodeDecodeError is one)
        raise DamagedStoreError(f"{FILES_GROUP}/{node[:80]}: expected the hex name of a trajstore file") from None


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
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
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


def _bounds(r: ByteRequest, size: int) -> tuple[int, int]:
    """``[start, end)`` of a zarr byte request on ``size`` bytes, clipped to them."""
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

    if isinstance(r, RangeByteRequest):
        lo, hi = r.start, r.end
    elif isinstance(r, OffsetByteRequest):
        lo, hi = r.offset, size
    elif isinstance(r, SuffixByteRequest):
        lo, hi = size - r.suffix, size
    else:
        raise TypeError(f"unknown byte request {r!r}")
    lo = min(max(lo, 0), size)
    return lo, min(max(hi, lo), size)


def _at_least(value: Buffer, rows: int) -> Buffer:
    """Array metadata ``value`` with ``shape[0]`` raised to ``rows`` (unchanged if it holds more)."""
    try:
        meta = json.loads(value.to_bytes())
        if meta.get("node_type") != "array" or meta["shape"][0] >= rows:
            return value
        meta["shape"][0] = rows
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return value
    return default_buffer_prototype().buffer.from_bytes(json.dumps(meta).encode())


class SessionStore(Store):
    """The zarr store of an :class:`~trajstore.storage.icechunk_location.IcechunkSession`: forwards to the store of its current
    session (a new one after every commit, as icechunk's sessions turn read-only when they
    commit), and keeps trajstore's non-zarr files as one-chunk arrays (module docstring)."""

    def __init__(self, owner: Any, read_only: bool) -> None:
        super().__init__(read_only=read_only)
        self._owner = owner
        # Rows (axis 0) each array was grown to hold chunks of this session (:meth:`_grow_to`):
        # metadata written later in the session never records fewer, as icechunk drops the
        # chunks a shape leaves out (the publisher's shapes lag the writer's rows).
        self.extents: dict[str, int] = {}
        #: ``{key: sha256 hex}`` every full read of a key is checked against (``None``: no checks).
        self.checksums: dict[str, str] | None = None
        #: ``{key: (size, block digests)}`` (:func:`block_digests`) a read of part of a key is
        #: checked against, a block at a time; a key without them is fetched whole and checked.
        self.block_sums: dict[str, tuple[int, str]] = {}
        self.block_bytes = CHECK_BLOCK_BYTES
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
            if key in self.block_sums:
                return await self._get_blocks(key, prototype, byte_range)
            whole = await self.get(key, prototype)  # checked whole, then cut
            return None if whole is None else prototype.buffer.from_bytes(_cut(whole.to_bytes(), byte_range))
        out = await self._get(key, prototype, byte_range)
        if out is not None:
            self.requests += 1
            self.bytes_read += len(out)
            if self.checksums is not None:
                self._check(key, out.to_bytes())
        return out

    def set_block_sums(self, blocks: Any, block_bytes: Any) -> None:
        """Take a push's per-block digests (``{key: [size, digests]}``, blocks of ``block_bytes``);
        malformed entries are left out (those keys are then fetched whole and checked whole)."""
        self.block_sums = {}
        if type(block_bytes) is not int or block_bytes <= 0 or not isinstance(blocks, dict):
            return
        self.block_bytes = block_bytes
        for key, entry in blocks.items():
            if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int and isinstance(entry[1], str)):
                continue
            size, digests = entry
            if size >= 0 and len(digests) == _HEX * -(-size // block_bytes) and isinstance(key, str):
                self.block_sums[key] = (size, digests)

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

    async def _get_blocks(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest) -> Buffer | None:
        """Part of ``key``: the blocks holding it fetched (one ranged request), each checked
        against its digest (:attr:`block_sums`), then cut; ``None`` when absent."""
        from zarr.abc.store import RangeByteRequest

        size, digests = self.block_sums[key]
        lo, hi = _bounds(byte_range, size)
        if hi <= lo:
            return prototype.buffer.from_bytes(b"")
        b = self.block_bytes
        first, last = lo // b, -(-hi // b)
        a, z = first * b, min(last * b, size)
        out = await self._get(key, prototype, RangeByteRequest(a, z))
        if out is None:
            return None
        self.requests += 1
        self.bytes_read += len(out)
        data = out.to_bytes()
        for i in range(first, last):
            part = data[i * b - a:(i + 1) * b - a]
            if hashlib.sha256(part).hexdigest() != digests[i * _HEX:(i + 1) * _HEX]:
                raise ChecksumError(f"{self._owner.url}: {key} bytes {i * b}..{i * b + len(part) - 1} do not match the "
                                    f"checksum recorded at push (read {len(part)} bytes of {size}); the version was "
                                    "changed or damaged after its push")
        return prototype.buffer.from_bytes(data[lo - a:hi - a])

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
        except (ValueError, KeyError, TypeError, RecursionError):
            return False
        if not meta or not chunks or len(index) != len(chunks) or len(index) != len(meta["shape"]):
            return False
        if any(i * c >= n for i, c, n in zip(index[1:], chunks[1:], meta["shape"][1:])):
            return False
        # The fewest rows that keep this chunk: the commit publishes the committed rows' shape.
        meta["shape"][0] = max(meta["shape"][0], index[0] * chunks[0] + 1)
        self.extents[path] = max(self.extents.get(path, 0), meta["shape"][0])
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
                    name = _file_name(parts[1])
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
