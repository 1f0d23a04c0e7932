"""The folder of one stable-baselines3 buffer: ``sb3.json`` plus trajstore stores inside it.

Layout of ``cache_path`` (a local folder or an fsspec URL)::

    sb3.json            what the buffer is: kind, spaces (JSON), n_envs, per-env capacity, flags;
                        written once when the buffer is created, checked on every reopen
    transitions/        trajstore ReplayBuffer stores (replay buffers) ...
    pending/, rollout/, history/, env_0/ ...   ... or rollout / facade parts (see each class)

Every part is an ordinary trajstore store (``trajstore info cache_path/transitions``).
``sb3.json`` is written last at creation, so a folder without it holds no finished buffer.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import uuid
import weakref
from typing import Any

import fsspec
import gymnasium

from trajstore.errors import (
    BadOptionError,
    DamagedStoreError,
    FormatVersionError,
    NotATrajstoreError,
    SpaceMismatchError,
    StoreExistsError,
)
from trajstore.spaces import space_from_json, space_to_json
from trajstore.storage.location import fsspec_options, resolve_location
from trajstore.storage.schema import load_json

__all__ = ["StoreRoot", "NewBufferWarning", "building_algorithm", "record_path", "announce_new", "CONFIG_KEY", "register", "unregister", "lookup", "storage_split", "space_config"]

CONFIG_KEY = "sb3.json"
#: Bytes of an ``sb3.json`` record read at most (it holds two spaces and a few sizes).
MAX_CONFIG_BYTES = 1 << 20
CONFIG_VERSION = 1

#: Open buffers of this process by root key (see :func:`register`).
_OPEN: dict[str, "weakref.ReferenceType[Any]"] = {}

CREATE_ONLY_OPTIONS = ("chunk_rows", "compressor")


def storage_split(storage_kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(create options, open options)`` of the trajstore storage options a buffer was given.

    Chunking and codecs are fixed when a store is created; reopening (``SAC.load`` passes the
    same kwargs again) keeps only ``fsync`` and ``commit_interval``.
    """
    opts = dict(storage_kwargs)
    return opts, {k: v for k, v in opts.items() if k not in CREATE_ONLY_OPTIONS}


def part_compressor(compressor: Any, leaves: list[str], strict: bool) -> Any:
    """The ``compressor`` option of one part, whose stored leaves are ``leaves`` (``"obs.0"``,
    ``"next_obs.0"``, ``"obs.0.image"``, ``"action"``...).

    A dict by SB3 name applies to each leaf it names: ``"obs"`` the observations and next
    observations of every env, a Dict observation's key (``"image"``) that key's leaves, any other
    key the leaf of that name (``"*"``: the others).  ``strict``: refuse (BadOptionError) a key that
    names no leaf (the main part holds every name; another part may hold few).
    """
    if not isinstance(compressor, dict):
        return compressor

    def names(key: str, leaf: str) -> bool:
        parts = leaf.split(".")
        head = parts[0].removeprefix("next_")
        return key in (leaf, parts[0], head) or (head == "obs" and len(parts) > 2 and key == ".".join(parts[2:]))

    out = {leaf: v for leaf in leaves for k, v in compressor.items() if k != "*" and names(k, leaf)}
    unknown = [k for k in compressor if k != "*" and not any(names(k, leaf) for leaf in leaves)]
    if strict and unknown:
        raise BadOptionError(f"compressor keys {unknown} name nothing stored; the buffer stores {leaves}")
    if "*" in compressor:
        out["*"] = compressor["*"]
    return out


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("trajstore", "stable-baselines3"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "unknown"
    return out


class StoreRoot:
    """Where one buffer lives, and its ``sb3.json`` record.

    Parameters
    ----------
    cache_path : str, path-like or None
        ``None`` makes a fresh temporary folder that :meth:`remove` deletes (``temporary``).
    storage_options : dict, optional
        fsspec options for URLs.
    """

    def __init__(self, cache_path: str | os.PathLike[str] | None, storage_options: dict[str, Any] | None) -> None:
        self.temporary = cache_path is None
        if cache_path is None:
            cache_path = tempfile.mkdtemp(prefix="trajstore-sb3-")
        path = os.fspath(cache_path)
        if path.startswith("file://"):
            path = path[len("file://"):]
        self.is_url = "://" in path
        self.path = path.rstrip("/") if self.is_url else os.path.abspath(os.path.expanduser(path))
        self.storage_options = storage_options
        self.fs, self._fs_root = fsspec.core.url_to_fs(self.path, **fsspec_options(storage_options))

    # -- paths ----------------------------------------------------------------------------------
    @property
    def key(self) -> str:
        """Identity of the root within this process (registry key)."""
        return self.path if self.is_url else os.path.realpath(self.path)

    def sub(self, name: str) -> str:
        """Path or URL of part ``name`` (``"transitions"``, ``"env_3"``, ``"history/env_0"``)."""
        return f"{self.path}/{name}" if self.is_url else os.path.join(self.path, *name.split("/"))

    def _fs_path(self, name: str) -> str:
        return f"{self._fs_root.rstrip('/')}/{name}"

    def exists(self, name: str) -> bool:
        """Whether part ``name`` (a file or folder under the root) exists."""
        return bool(self.fs.exists(self._fs_path(name)))

    def names(self) -> list[str]:
        """Names of the entries at the top of the folder."""
        if not self.fs.exists(self._fs_root):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self._fs_root, detail=False))

    def is_empty(self) -> bool:
        """Whether the root folder is missing or holds nothing."""
        root = self._fs_root
        if not self.fs.exists(root):
            return True
        return not self.fs.ls(root, detail=False)

    # -- sb3.json ---------------------------------------------------------------------------------
    def read_config(self) -> dict[str, Any] | None:
        """The stored record, or ``None`` when there is none."""
        p = self._fs_path(CONFIG_KEY)
        if not self.fs.exists(p):
            return None
        # Read as a store's files are (a local link or FIFO refused, at most MAX_CONFIG_BYTES), and
        # parsed with the store's own bounds: a record nested past JSON's depth is damage too.
        loc = resolve_location(self.path, read_only=True, storage_options=self.storage_options, must_exist=False)
        try:
            raw = loc.get(CONFIG_KEY, limit=MAX_CONFIG_BYTES)
            if raw is None:
                return None
            cfg = load_json(raw, self.path, CONFIG_KEY)
        except (DamagedStoreError, OSError) as e:
            raise NotATrajstoreError(f"{self.path}: {CONFIG_KEY} cannot be read ({e})") from None
        finally:
            loc.close()
        if not isinstance(cfg, dict) or "trajstore_sb3" not in cfg:
            raise NotATrajstoreError(f"{self.path}: {CONFIG_KEY} is not a trajstore stable-baselines3 record")
        if not isinstance(cfg["trajstore_sb3"], int) or cfg["trajstore_sb3"] > CONFIG_VERSION:
            raise FormatVersionError(f"{self.path}: {CONFIG_KEY} has version {cfg['trajstore_sb3']!r}, newer than this "
                                     f"trajstore reads ({CONFIG_VERSION}); upgrade trajstore")
        return cfg

    def write_config(self, cfg: dict[str, Any]) -> None:
        """Write the record (atomically on local folders: temp file + rename)."""
        data = json.dumps({"trajstore_sb3": CONFIG_VERSION, **cfg, "created_by": _versions()}, indent=1,
                          allow_nan=False).encode()
        if self.is_url:
            self.fs.pipe_file(self._fs_path(CONFIG_KEY), data)
            return
        os.makedirs(self.path, exist_ok=True)
        tmp = os.path.join(self.path, f".{CONFIG_KEY}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(self.path, CONFIG_KEY))

    def prepare(self, kind: str, config: dict[str, Any], parts: list[str], overwrite: bool,
                resume: bool | None = None) -> bool:
        """Decide between reopening and creating; return True when the buffer must be created.

        An existing record of the same ``kind`` whose ``config`` matches is reopened (never
        truncated), unless ``resume=False``, which refuses it (the caller announces a reopen made
        with ``resume=None``: see :func:`announce_resume`).  With ``overwrite=True`` nothing is erased here: the caller replaces the
        parts (trajstore's ``create(overwrite=True)`` takes each part's writer lock before
        erasing it, so a buffer another process writes is never touched), then
        :meth:`drop_parts` removes the parts it did not recreate and :meth:`write_config`
        replaces the record.  A folder that holds anything but ``parts`` and no record is
        refused unless ``overwrite``.

        Raises
        ------
        NotATrajstoreError
            The record describes another kind of buffer.
        SpaceMismatchError
            A space, ``n_envs``, capacity or layout flag differs from the record (the message
            names the stored and the given value).
        StoreExistsError
            The folder holds something that is not a buffer and ``overwrite`` is False, or it holds
            a buffer and ``resume=False``.
        """
        cfg = None if self.temporary else self.read_config()
        if cfg is not None and not overwrite:
            self._validate(kind, cfg, config)
            if resume is False:
                raise StoreExistsError(f"{self.path}: holds a {kind} from an earlier run and resume=False; pass "
                                       "resume=True to continue with its data, or overwrite=True to start empty")
            return False
        if cfg is None and not overwrite and not self.is_empty():
            names = set(self.fs.ls(self._fs_root, detail=False))
            ours = {self._fs_path(p.split("/")[0]) for p in parts}
            if not names <= ours:  # parts of an unfinished create are ours to replace
                raise StoreExistsError(f"{self.path}: the folder is not empty and holds no trajstore "
                                       f"stable-baselines3 buffer ({CONFIG_KEY} missing); pass overwrite=True "
                                       "to use it anyway")
        return True

    def drop_parts(self, parts: list[str], keep: set[str]) -> None:
        """Remove the top-level folders of ``parts`` that are not in ``keep`` (after a create)."""
        for name in sorted({p.split("/")[0] for p in parts} - keep):
            if self.exists(name):
                self.fs.rm(self._fs_path(name), recursive=True)

    def _validate(self, kind: str, cfg: dict[str, Any], config: dict[str, Any]) -> None:
        if cfg.get("kind") != kind:
            raise NotATrajstoreError(f"{self.path}: holds a {cfg.get('kind')!r} buffer; expected {kind!r}")
        for name, want in config.items():
            have = cfg.get(name)
            if name.endswith("_space"):
                stored = space_from_json(have) if have is not None else None
                given = space_from_json(want)
                if stored != given:
                    raise SpaceMismatchError(f"{self.path}: the stored {name} {stored} differs from the given {given}")
                continue
            if have != want:
                raise SpaceMismatchError(f"{self.path}: the buffer was created with {name}={have!r}; got {name}={want!r} "
                                         "(reopen it with the same value, or pass overwrite=True to replace it)")

    def remove(self) -> None:
        """Delete the folder (temporary roots only)."""
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)


class ResumedBufferWarning(UserWarning):
    """A stable-baselines3 buffer reopened an existing ``cache_path`` because ``resume`` was not
    given: training continues with the data of an earlier run.  Pass ``resume=True`` to say so
    (and silence this), ``resume=False`` to refuse, or ``overwrite=True`` to start empty."""


def announce_resume(resume: bool | None, kind: str, path: str, held: str) -> None:
    """Warn that ``kind`` at ``path`` reopened ``held`` (e.g. "1,200 transitions") from an earlier
    run, unless the caller asked for it with ``resume=True``."""
    if resume is None:
        import warnings

        warnings.warn(f"{kind}: {path} already holds a buffer; reopened it with {held} from an earlier run. "
                      "Pass resume=True to continue with them (silences this warning), overwrite=True to start "
                      "empty, or resume=False to refuse an existing buffer", ResumedBufferWarning, stacklevel=3)


class NewBufferWarning(UserWarning):
    """A model that has trained (``SAC.load`` of a saved run) got a new, empty buffer: nothing was
    at its ``cache_path``.  The message names the folder; pass the run's folder with
    ``replay_buffer_kwargs=dict(cache_path=...)`` to ``load`` to continue with its data, or
    ``resume=False`` (or ``overwrite=True``) to say that a new buffer is wanted."""


def building_algorithm() -> Any | None:
    """The stable-baselines3 algorithm whose ``_setup_model`` is constructing a buffer now, or None.

    A buffer cannot be told which model it serves (SB3 passes only ``replay_buffer_kwargs``), but
    two things need the model: recording the resolved ``cache_path`` in the kwargs the model saves,
    and refusing a prioritized buffer to an algorithm that never updates priorities.  The model is
    the ``self`` of the ``_setup_model`` frame a few frames up; a buffer made by hand finds none.
    """
    from stable_baselines3.common.base_class import BaseAlgorithm

    frame = sys._getframe(1)
    for _ in range(16):  # the buffer's own constructors lie between; never further than this
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        if frame.f_code.co_name == "_setup_model":
            algo = frame.f_locals.get("self")
            return algo if isinstance(algo, BaseAlgorithm) else None
    return None


def record_path(algo: Any | None, given: Any, root: StoreRoot) -> None:
    """Replace a relative ``cache_path`` in ``algo.replay_buffer_kwargs`` by the folder it resolved
    to, so the saved model reopens this buffer from any working directory."""
    kwargs = getattr(algo, "replay_buffer_kwargs", None)
    if root.temporary or root.is_url or not isinstance(kwargs, dict) or kwargs.get("cache_path") is not given:
        return
    if not (isinstance(given, str) and os.path.isabs(given)):  # relative, or a path object: the resolved str
        kwargs["cache_path"] = root.path


def announce_new(algo: Any | None, kind: str, root: StoreRoot) -> None:
    """Warn that a model that has already trained got a new, empty ``kind`` at ``root``."""
    steps = int(getattr(algo, "num_timesteps", 0) or 0)
    if algo is None or root.temporary or steps <= 0:
        return
    import warnings

    warnings.warn(f"{kind}: {type(algo).__name__} has trained {steps:,} timesteps but {root.path} held no buffer; "
                  "a new, empty one was created there.  If the run's buffer is elsewhere (a relative cache_path "
                  "saved from another working directory), load with replay_buffer_kwargs=dict(cache_path=<that "
                  "folder>); pass resume=False to say a new buffer is what you want", NewBufferWarning, stacklevel=4)


def space_config(observation_space: gymnasium.Space, action_space: gymnasium.Space) -> dict[str, Any]:
    """The spaces as JSON for ``sb3.json`` (never pickled)."""
    return {"observation_space": space_to_json(observation_space), "action_space": space_to_json(action_space)}


# -- buffers open in this process ---------------------------------------------------------------
def register(root: StoreRoot, buf: Any) -> None:
    """Record that ``buf`` holds ``root``; a live previous holder is closed first.

    A second writer on one store would be refused by its lock; within one process the usual
    reason is ``SAC.load`` rebuilding a buffer that an older model still holds, so the older
    buffer is committed and closed and the new one takes over.
    """
    if root.temporary:
        return
    old = lookup(root.key)
    if old is not None and old is not buf:
        import warnings

        warnings.warn(f"{type(old).__name__} on {root.path} was still open in this process; it is committed and "
                      f"closed so the new {type(buf).__name__} can open the same cache_path", stacklevel=4)
        old.close()
    _OPEN[root.key] = weakref.ref(buf)


def unregister(root: StoreRoot, buf: Any) -> None:
    """Forget that ``buf`` holds ``root`` (when it closes); another buffer registered since is kept."""
    ref = _OPEN.get(root.key)
    if ref is not None and ref() is buf:
        del _OPEN[root.key]


def lookup(key: str) -> Any | None:
    """The live, open buffer holding root ``key`` in this process, if any."""
    ref = _OPEN.get(key)
    buf = ref() if ref is not None else None
    if buf is None or getattr(buf, "closed", True):
        return None
    return buf

