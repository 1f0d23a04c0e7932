"""Folders that hold several stores: a stable-baselines3 buffer's ``cache_path`` and the shards of
a sharded dataset, for ``info``, ``ls``, ``episodes``, ``stats`` and ``verify``.

A stable-baselines3 buffer (:mod:`trajstore.sb3`) keeps ``sb3.json`` at the top of its
``cache_path`` and its data in ordinary stores inside it: ``transitions`` (replay buffers),
``pending``, ``rollout``, ``history`` or ``history/env_<i>`` (rollout buffers), ``env_<i>/...``
(``DummyVecRolloutBuffer``, each a buffer folder of its own).  Such a folder is recognised by its
``sb3.json`` (and no ``zarr.json`` beside it); its stores are found by walking the folder, at most
:data:`MAX_DEPTH` levels and :data:`MAX_ENTRIES` entries deep, never through links, so a folder
the command is given cannot make it read anything outside it.  The commands then run on every
store found and print each under its name.  The record is only read as JSON here, so this works
without stable-baselines3 installed.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Callable

from zarr.core.sync import sync

from trajstore.cli._common import print_json
from trajstore.errors import DamagedStoreError, TrajstoreError
from trajstore.storage.location import Location, resolve_location

__all__ = ["Folder", "SB3_RECORD", "sb3_folder", "shard_folder", "run_on_parts", "folder_hint"]

#: The record a stable-baselines3 buffer writes at the top of its ``cache_path``.
SB3_RECORD = "sb3.json"
#: A store's root metadata: a folder holding it is a store.
STORE_META = "zarr.json"
#: How deep stores are looked for below a buffer folder (``env_0/history/env_1`` is 3).
MAX_DEPTH = 3
#: Entries read while looking for stores, at most (a folder full of files is not walked forever).
MAX_ENTRIES = 4096
#: Largest ``sb3.json`` read (the record is a few KiB: spaces and a few numbers).
MAX_RECORD_BYTES = 1 << 20

#: The store each kind of buffer cannot reopen without (``DummyVecRolloutBuffer``: ``env_<i>``).
REQUIRED = {"ZarrReplayBuffer": "transitions", "ZarrDictReplayBuffer": "transitions",
            "ZarrHerReplayBuffer": "transitions", "ZarrNStepReplayBuffer": "transitions",
            "ZarrPrioritizedReplayBuffer": "transitions", "ZarrPrioritizedDictReplayBuffer": "transitions",
            "ZarrRolloutBuffer": "rollout", "ZarrDictRolloutBuffer": "rollout"}


@dataclass
class Folder:
    """A folder of stores: ``layout`` ``"sb3"`` or ``"sharded"``, what it is (``kind``: the buffer
    class, or the shards' kind), its stores ``parts`` (``(name, path or URL)``, name order) and,
    for a buffer folder, its record and the problems found with it (``problems``)."""

    path: str
    layout: str
    kind: str
    parts: list[tuple[str, str]]
    record: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: what the folder is and how many stores it holds."""
        if self.layout == "sharded":
            return f"sharded dataset {self.path}: {len(self.parts)} shard(s) of {self.kind}"
        rec = self.record or {}
        extra = ", ".join(f"{k}={rec[k]}" for k in ("n_envs", "buffer_size") if k in rec)
        return (f"stable-baselines3 {self.kind} at {self.path}" + (f" ({extra})" if extra else "")
                + f": {len(self.parts)} store(s) inside")


def _join(path: str, name: str) -> str:
    return f"{path.rstrip('/')}/{name}" if "://" in path else os.path.join(path, *name.split("/"))


def _subfolders(loc: Location, prefix: str, budget: list[int]) -> list[str]:
    """Names of the folders directly under ``prefix`` (``""``: the top), links left out."""
    names: list[str] = []
    if loc.local_root is not None:
        folder = loc.local_root / prefix if prefix else loc.local_root
        try:
            it = os.scandir(folder)
        except (FileNotFoundError, NotADirectoryError):
            return []
        with it:
            for entry in it:
                budget[0] -= 1
                if budget[0] < 0:
                    raise DamagedStoreError(f"{loc.url}: more than {MAX_ENTRIES} entries while looking for its stores")
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and not entry.name.startswith("."):
                    names.append(entry.name)
        return sorted(names)

    async def collect() -> list[str]:
        out: list[str] = []
        async for key in loc.zstore.list_dir(prefix):
            budget[0] -= 1
            if budget[0] < 0:
                raise DamagedStoreError(f"{loc.url}: more than {MAX_ENTRIES} entries while looking for its stores")
            out.append(str(key).rstrip("/"))
        return out

    found = sync(collect())
    # A listed name with no object of its own is a folder (object stores have no folders).
    return sorted(n for n in set(found) if n and not n.startswith(".") and not loc.exists(f"{prefix}/{n}" if prefix else n))


def _stores_under(loc: Location, prefix: str, depth: int, budget: list[int]) -> list[str]:
    """Relative names of the stores at or below ``prefix`` (a store's insides are not walked)."""
    if prefix and loc.exists(f"{prefix}/{STORE_META}"):
        return [prefix]
    if depth >= MAX_DEPTH:
        return []
    out: list[str] = []
    for name in _subfolders(loc, prefix, budget):
        out += _stores_under(loc, f"{prefix}/{name}" if prefix else name, depth + 1, budget)
    return out


def _read_record(loc: Location) -> tuple[dict[str, Any] | None, str | None]:
    raw = loc.get(SB3_RECORD, limit=MAX_RECORD_BYTES)
    if raw is None:
        return None, f"{SB3_RECORD} is gone"
    try:
        rec = json.loads(raw)
    except (ValueError, RecursionError) as e:  # not JSON, or nested past the parser's depth
        return None, f"{SB3_RECORD} is not JSON ({e})"
    if not isinstance(rec, dict) or "trajstore_sb3" not in rec or not isinstance(rec.get("kind"), str):
        return None, f"{SB3_RECORD} is not a trajstore stable-baselines3 record (no trajstore_sb3 and kind)"
    return rec, None


def sb3_folder(path: str, storage_options: dict[str, Any] | None) -> Folder | None:
    """The stable-baselines3 buffer folder at ``path``, or None when ``path`` is not one (it has
    no ``sb3.json``, or it is a store itself, or it cannot be reached: the per-store code then
    opens it and says why).

    Raises
    ------
    DamagedStoreError
        The folder holds more than :data:`MAX_ENTRIES` entries on the way to its stores.
    """
    p = os.fspath(path)
    if "://" not in p and "::" not in p and not os.path.isdir(p):
        return None
    try:
        loc = resolve_location(p, read_only=True, storage_options=storage_options, must_exist=False)
    except (TrajstoreError, OSError, ValueError):
        return None
    try:
        if not loc.exists(SB3_RECORD) or loc.exists(STORE_META):
            return None
        rec, problem = _read_record(loc)
        names = _stores_under(loc, "", 0, [MAX_ENTRIES])
    finally:
        loc.close()
    kind = str(rec["kind"]) if rec else "buffer"
    out = Folder(p, "sb3", kind, [(n, _join(p, n)) for n in names], rec, [problem] if problem else [])
    need = [REQUIRED[kind]] if kind in REQUIRED else []
    if kind == "DummyVecRolloutBuffer" and rec is not None and isinstance(rec.get("n_envs"), int):
        need = [f"env_{i}" for i in range(min(rec["n_envs"], MAX_ENTRIES))]
    for part in need:
        if not any(n == part or n.startswith(part + "/") for n in names):
            out.problems.append(f"store {part!r} is missing: the {kind} cannot be reopened")
    return out


def shard_folder(path: str, storage_options: dict[str, Any] | None) -> Folder | None:
    """The shards of the sharded dataset at ``path`` as a :class:`Folder`, or None when ``path``
    is not a dataset root."""
    from trajstore.shards.layout import is_sharded_root, list_shards, read_root_record, root_location, shard_url

    if not is_sharded_root(path, storage_options):
        return None
    loc = root_location(path, read_only=True, storage_options=storage_options)
    try:
        root = read_root_record(loc)
        names = list_shards(loc)
    finally:
        loc.close()
    return Folder(os.fspath(path), "sharded", root.kind if root is not None else "?",
                  [(f"shards/{n}", shard_url(os.fspath(path), n)) for n in names])


def run_on_parts(folder: Folder, as_json: bool, compute: Callable[[str], Any], show: Callable[[Any], None],
                 to_json: Callable[[Any], Any] = lambda r: r) -> list[Any]:
    """Run ``compute(url)`` on every store of ``folder`` and print each result: under a line
    ``== NAME (URL)`` with ``show``, or (``as_json``) as one JSON object ``{path, layout, kind,
    record, problems, parts: {name: to_json(result)}}``.  Returns the results, in the order of the
    parts."""
    results = [compute(url) for _name, url in folder.parts]
    if as_json:
        print_json({"path": folder.path, "layout": folder.layout, "kind": folder.kind, "record": folder.record,
                    "problems": folder.problems,
                    "parts": {n: to_json(r) for (n, _u), r in zip(folder.parts, results)}})
        return results
    print(folder.describe())
    for problem in folder.problems:
        print(f"problem: {problem}")
    for (name, url), r in zip(folder.parts, results):
        print(f"\n== {name} ({url})")
        show(r)
    return results


def folder_hint(path: Any, storage_options: dict[str, Any] | None) -> str:
    """For an error about ``path`` not being a store: which stores it holds when it is a
    stable-baselines3 buffer folder or a dataset root ("" otherwise)."""
    if not isinstance(path, (str, os.PathLike)):
        return ""
    try:
        folder = sb3_folder(os.fspath(path), storage_options) or shard_folder(os.fspath(path), storage_options)
    except (TrajstoreError, OSError, ValueError):
        return ""
    if folder is None:
        return ""
    names = ", ".join(url for _n, url in folder.parts[:4]) + (", ..." if len(folder.parts) > 4 else "")
    return f"; this is the {folder.describe()}: give this command one of its stores ({names or 'none found'})"
