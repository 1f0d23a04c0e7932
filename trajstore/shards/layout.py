"""The on-disk layout of a sharded dataset: its root record and its shard folders.

::

    <root>/trajstore.shards.json      the root record: kind, spaces, create options (written once)
    <root>/shards/<name>/             one ordinary trajstore store per shard (one writer each)

The root record is published with exclusive-create semantics (:func:`trajstore.storage.lease.exclusive_put`),
so of two first shards created at once exactly one records the dataset's spaces.  Everything here
reads the root as input (docs/design.md 3.7): the record is a bounded regular file, checked field by field;
a shard name read from a listing is used only when it is a plain name (no ``/``, no ``..``, nothing
hidden) and, locally, only when it is a real folder inside ``<root>/shards`` (never a symbolic link).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import stat
from dataclasses import dataclass
from typing import Any

from zarr.core.sync import sync

from trajstore.errors import (
    DamagedStoreError,
    FormatVersionError,
    NotATrajstoreError,
    SpaceMismatchError,
    StoreNotFoundError,
    TrajstoreError,
)
from trajstore.spaces import space_from_json
from trajstore.storage.keys import HEAD_KEY
from trajstore.storage.location import Location, resolve_location
from trajstore.storage.schema import load_json

__all__ = ["is_sharded_root", "ROOT_KEY", "SHARDS_DIR", "MAX_SHARDS", "KINDS", "RootRecord", "default_shard_name", "check_shard_name",
           "root_location", "read_root_record", "list_shards", "shard_url", "shard_ready"]

#: The dataset root's record (JSON object).
ROOT_KEY = "trajstore.shards.json"
#: The folder holding one store per shard.
SHARDS_DIR = "shards"
#: Format of the root record; a newer one is refused with FormatVersionError.
ROOT_FORMAT_VERSION = 1
#: Bounds on what is read from the root (a dataset root is input).
MAX_ROOT_BYTES = 1 << 20
MAX_SHARDS = 1 << 16
MAX_NAME_CHARS = 128
#: ``kind`` argument -> the store kind recorded (and the buffer class name).
KINDS = {"trajectory": "TrajectoryReplayBuffer", "replay": "ReplayBuffer"}
#: Create options a root record may carry (JSON scalars only): later shards default to them.
OPTION_KEYS = ("step_data_capacity", "episode_data_capacity", "capacity", "chunk_rows", "compressor", "fsync",
               "commit_interval")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass
class RootRecord:
    """What ``trajstore.shards.json`` holds.

    Attributes
    ----------
    kind : str
        ``"TrajectoryReplayBuffer"`` or ``"ReplayBuffer"``: the kind of every shard.
    spaces : dict
        The spaces JSON of every shard's store (``{"step_data": ..., "episode_data": ...}`` or
        ``{"step_data": ...}`` for a ReplayBuffer), as the stores' own attributes hold it.
    options : dict
        Create options of the first shard (JSON scalars), the defaults of later shards.
    """

    kind: str
    spaces: dict[str, Any]
    options: dict[str, Any]

    def to_json(self) -> bytes:
        """The record as ``trajstore.shards.json`` holds it."""
        return json.dumps({"format": "trajstore-sharded", "format_version": ROOT_FORMAT_VERSION, "kind": self.kind,
                           "spaces": self.spaces, "options": self.options}, sort_keys=True).encode()

    def check_spaces(self, spaces: dict[str, Any], where: str) -> None:
        """Raise :class:`SpaceMismatchError` when ``spaces`` (a new shard's) differ from the dataset's."""
        if _canonical(spaces) != _canonical(self.spaces):
            have = {k: repr(space_from_json(v)) for k, v in self.spaces.items()}
            got = {k: repr(space_from_json(v)) for k, v in spaces.items()}
            raise SpaceMismatchError(f"{where}: the dataset's shards hold {have}; this shard's spaces are {got}")


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)


def default_shard_name() -> str:
    """A name no other writer picks: ``<host>-<pid>-<8 random hex digits>`` (host made a plain name)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname() or "host")[:64].lstrip("._-") or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


def check_shard_name(name: Any, where: str, *, from_disk: bool = False) -> str:
    """``name`` if it is a plain shard name (letters, digits, ``.``, ``_``, ``-``; not starting with
    a dot or dash; at most 128 characters), else an error: ``BadOptionError`` for a name given by
    the caller, ``DamagedStoreError`` for one found on disk."""
    if isinstance(name, str) and len(name) <= MAX_NAME_CHARS and _NAME.fullmatch(name):
        return name
    if from_disk:
        raise DamagedStoreError(f"{where}: {SHARDS_DIR}/ holds an entry named {name!r}; a shard is a plain name "
                                f"(letters, digits, '.', '_', '-', at most {MAX_NAME_CHARS} characters)")
    from trajstore.errors import BadOptionError

    raise BadOptionError(f"shard must be a plain name (letters, digits, '.', '_', '-', not starting with '.' or "
                         f"'-', at most {MAX_NAME_CHARS} characters); got {name!r}")


def shard_url(root: str, name: str) -> str:
    """Where shard ``name`` of the dataset at ``root`` lives (a folder or a URL)."""
    if "://" in root:
        return f"{root.rstrip('/')}/{SHARDS_DIR}/{name}"
    return os.path.join(root, SHARDS_DIR, name)


def root_location(path: Any, *, read_only: bool, storage_options: dict[str, Any] | None) -> Location:
    """The dataset root as a :class:`Location` (local folder or fsspec URL; a ``.zip`` is refused)."""
    p = os.fspath(path)
    if "://" not in p and p.endswith(".zip") and not os.path.isdir(p):
        raise NotATrajstoreError(f"{p!r}: a sharded dataset is a folder or a URL, not a .zip")
    if "://" not in p and read_only and not os.path.isdir(p):
        raise StoreNotFoundError(f"no sharded dataset at {p!r}: the folder does not exist")
    return resolve_location(p, read_only=read_only, storage_options=storage_options, must_exist=False)


def is_sharded_root(path: Any, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` (a folder or fsspec URL) is a sharded dataset's root: it holds a root
    record.  False for anything else (a single store, a ``.zip``, nothing there, a location that
    cannot be reached), which the per-store code then opens and judges."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    p = os.fspath(path)
    if "://" not in p and "::" not in p:
        return os.path.isdir(p) and os.path.lexists(os.path.join(p, ROOT_KEY))
    try:
        loc = root_location(p, read_only=True, storage_options=storage_options)
    except (TrajstoreError, OSError, ValueError):
        return False  # not reachable as a folder-like location: the per-store open says why
    try:
        return loc.exists(ROOT_KEY)
    except (TrajstoreError, OSError, ValueError):
        return False
    finally:
        loc.close()


def read_root_record(loc: Location) -> RootRecord | None:
    """The root record, checked (None when there is none yet).

    Raises
    ------
    DamagedStoreError
        The record is too large, not JSON, not an object, or a field has the wrong type or value.
    FormatVersionError
        Written by a newer trajstore.
    """
    where = str(loc.url)
    raw = loc.get(ROOT_KEY, limit=MAX_ROOT_BYTES)
    if raw is None:
        return None
    obj = load_json(raw, where, ROOT_KEY, strict_numbers=True)
    if not isinstance(obj, dict) or obj.get("format") != "trajstore-sharded":
        raise DamagedStoreError(f"{where}: {ROOT_KEY} is not a sharded dataset's record (expected an object with "
                                "\"format\": \"trajstore-sharded\")")
    version = obj.get("format_version")
    if type(version) is not int or version < 1:
        raise DamagedStoreError(f"{where}: {ROOT_KEY} format_version is {version!r}; expected a positive integer")
    if version > ROOT_FORMAT_VERSION:
        raise FormatVersionError(f"{where}: {ROOT_KEY} has format version {version}; this trajstore reads up to "
                                 f"{ROOT_FORMAT_VERSION}: upgrade trajstore")
    kind, spaces, options = obj.get("kind"), obj.get("spaces"), obj.get("options")
    if kind not in KINDS.values():
        raise DamagedStoreError(f"{where}: {ROOT_KEY} kind is {kind!r}; expected one of {list(KINDS.values())}")
    expected = ({"step_data"}, {"step_data", "episode_data"}) if kind == "TrajectoryReplayBuffer" else ({"step_data"},)
    if not isinstance(spaces, dict) or set(spaces) not in expected:
        raise DamagedStoreError(f"{where}: {ROOT_KEY} spaces must be an object with keys "
                                f"{' or '.join(str(sorted(e)) for e in expected)}; got {_short(spaces)}")
    for key, obj_space in spaces.items():
        try:
            space_from_json(obj_space)
        except Exception as e:  # the space JSON is input: anything it makes gymnasium raise
            raise DamagedStoreError(f"{where}: {ROOT_KEY} space {key!r} cannot be decoded ({type(e).__name__}: "
                                    f"{e})") from None
    if not isinstance(options, dict) or any(k not in OPTION_KEYS or not _scalar(v) for k, v in options.items()):
        raise DamagedStoreError(f"{where}: {ROOT_KEY} options must map {list(OPTION_KEYS)} to JSON scalars; "
                                f"got {_short(options)}")
    return RootRecord(str(kind), spaces, options)


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) and (not isinstance(v, str) or len(v) <= 64)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 200 else text[:200] + "..."


def list_shards(loc: Location) -> list[str]:
    """Names of the entries of ``<root>/shards``, sorted, each checked to be a plain name and
    (locally) a real folder; at most :data:`MAX_SHARDS`.

    Raises
    ------
    DamagedStoreError
        ``shards`` (or an entry) is a link or not a folder, a name is not plain, or too many entries.
    """
    where = str(loc.url)
    names: list[str] = []
    if loc.local_root is not None:
        folder = loc.local_root / SHARDS_DIR
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            return []
        if not stat.S_ISDIR(st.st_mode):
            raise DamagedStoreError(f"{where}: {SHARDS_DIR} is not a folder (a link or a file); a sharded dataset's "
                                    "shards live in a real folder inside it")
        with os.scandir(folder) as it:
            for entry in it:
                if len(names) >= MAX_SHARDS:
                    raise DamagedStoreError(f"{where}: {SHARDS_DIR}/ holds more than {MAX_SHARDS} entries")
                check_shard_name(entry.name, where, from_disk=True)
                if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
                    raise DamagedStoreError(f"{where}: {SHARDS_DIR}/{entry.name} is not a folder (a link or a "
                                            "file); every shard is a store folder inside the dataset")
                names.append(entry.name)
        return sorted(names)

    async def collect() -> list[str]:
        out: list[str] = []
        async for key in loc.zstore.list_dir(SHARDS_DIR):
            if len(out) >= MAX_SHARDS:
                raise DamagedStoreError(f"{where}: {SHARDS_DIR}/ holds more than {MAX_SHARDS} entries")
            out.append(str(key).rstrip("/"))
        return out

    for name in sync(collect()):
        names.append(check_shard_name(name, where, from_disk=True))
    return sorted(set(names))


def shard_ready(loc: Location, name: str) -> bool:
    """Whether shard ``name`` has a commit record (its creation finished); a shard whose writer was
    killed while creating it never gets one and is left out of the dataset."""
    return loc.exists(f"{SHARDS_DIR}/{name}/{HEAD_KEY}")
