"""``create_shard``: a new shard (one writer's own store) under a sharded dataset's root.

The first shard records the dataset's kind, spaces and create options in the root record; every
later shard is checked against it before a byte of the shard is written, and takes the recorded
options as its defaults.  The first shard's writer publishes the record before it creates its
shard, with an exclusive create: of two first shards created at the same instant one writes it,
and the other is checked against it (``SpaceMismatchError`` before its shard exists).
"""

from __future__ import annotations

import json
import os
from typing import Any

from trajstore.buffers.replay import ReplayBuffer
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import BadOptionError, DamagedStoreError, SpaceMismatchError, StoreExistsError
from trajstore.shards.layout import (
    KINDS,
    OPTION_KEYS,
    ROOT_KEY,
    SHARDS_DIR,
    RootRecord,
    check_shard_name,
    default_shard_name,
    list_shards,
    read_root_record,
    root_location,
    shard_url,
)
from trajstore.spaces import space_from_json, space_to_json
from trajstore.storage.keys import HEAD_KEY
from trajstore.storage.lease import exclusive_put

__all__ = ["create_shard"]


def create_shard(path: str | os.PathLike[str], space: Any, *, shard: str | None = None, kind: str = "trajectory",
                 **create_kwargs: Any) -> TrajectoryReplayBuffer | ReplayBuffer:
    """Create a shard of the sharded dataset at ``path`` and return its writer.

    Parameters
    ----------
    path : str or os.PathLike
        The dataset root: a local folder or an fsspec URL (``s3://bucket/data``, ``memory://...``).
    space : gymnasium.Space or None
        The step space (``kind="trajectory"``) or row space (``kind="replay"``); None takes the
        dataset's recorded space (a later shard).
    shard : str, optional
        The shard's name: letters, digits, ``.``, ``_``, ``-``.  Default: ``<host>-<pid>-<random>``,
        unique across processes and machines.  Shards are read in name order.
    kind : {"trajectory", "replay"}
        A :class:`~trajstore.TrajectoryReplayBuffer` or a :class:`~trajstore.ReplayBuffer` per shard.
    **create_kwargs
        Passed to the buffer's ``create`` (``episode_data_instance_space``, capacities, ``chunk_rows``,
        ``compressor``, ``commit_interval``, ``storage_options``, ...).  The first shard records the
        JSON-scalar ones (:data:`~trajstore.shards.layout.OPTION_KEYS`) as the dataset's defaults;
        a trajectory shard without ``episode_data_instance_space`` takes the dataset's.

    Returns
    -------
    TrajectoryReplayBuffer or ReplayBuffer
        The shard's writer, with every guarantee of a single store (commits, crash safety, the
        writer lock: a second writer of the same shard is refused, also on remote stores).

    Raises
    ------
    SpaceMismatchError
        The dataset's shards hold other spaces (or another kind); nothing is written.
    BadOptionError
        A bad ``kind`` or ``shard`` name.
    StoreExistsError
        A shard of that name exists.
    """
    if kind not in KINDS:
        raise BadOptionError(f"kind must be one of {sorted(KINDS)}; got {kind!r}")
    name = check_shard_name(default_shard_name() if shard is None else shard, str(path))
    if "cache_path" in create_kwargs:
        raise BadOptionError("create_shard places the shard under the dataset root: pass no cache_path")
    for given in (space, create_kwargs.get("episode_data_instance_space")):
        if given is not None:
            space_to_json(given)  # an unsupported space is refused before the root is touched
    root_path = os.fspath(path)
    storage_options = create_kwargs.get("storage_options")
    loc = root_location(root_path, read_only=False, storage_options=storage_options)
    where = str(loc.url)
    store_kind = KINDS[kind]
    root = read_root_record(loc)
    if root is not None:
        _check_kind(root, store_kind, where)
        create_kwargs = {**root.options, **create_kwargs}
        if space is None:
            space = space_from_json(root.spaces["step_data"])
        if kind == "trajectory" and "episode_data" in root.spaces and "episode_data_instance_space" not in create_kwargs:
            create_kwargs["episode_data_instance_space"] = space_from_json(root.spaces["episode_data"])
    elif space is None:
        raise BadOptionError(f"{where}: the first shard of a dataset must name its space (space=None takes the "
                             "dataset's, and there is none yet)")
    spaces = _spaces(space, create_kwargs.get("episode_data_instance_space") if kind == "trajectory" else None)
    if root is not None:
        root.check_spaces(spaces, where)  # before anything is written
    if loc.exists(f"{SHARDS_DIR}/{name}/zarr.json") or loc.exists(f"{SHARDS_DIR}/{name}/{HEAD_KEY}"):
        raise StoreExistsError(f"{where}: shard {name!r} exists; each writer creates a shard of its own (shard=None "
                               "picks a unique name), or reopens its shard with load_from")
    cls = TrajectoryReplayBuffer if kind == "trajectory" else ReplayBuffer
    # The root record goes first: a shard is never on disk without the record that says what a
    # shard of this dataset holds (a first writer killed between the two leaves a dataset of no
    # shards, not a shard that a later first writer's record might contradict).
    published = root is None and _record_root(loc, RootRecord(store_kind, spaces, _options(create_kwargs)), where)
    try:
        return cls.create(space, cache_path=shard_url(root_path, name), **create_kwargs)
    except BaseException:
        if published and not list_shards(loc):
            loc.delete(ROOT_KEY)  # refused options: they must not become every later shard's defaults
        raise


def _spaces(space: Any, episode_space: Any) -> dict[str, Any]:
    out = {"step_data": space_to_json(space)}
    if episode_space is not None:
        out["episode_data"] = space_to_json(episode_space)
    return out


def _options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The create options a root record keeps: JSON scalars of :data:`OPTION_KEYS`."""
    out = {}
    for k in OPTION_KEYS:
        v = kwargs.get(k)
        if v is not None and isinstance(v, (bool, int, float, str)):
            out[k] = v
    json.dumps(out)
    return out


def _check_kind(root: RootRecord, store_kind: str, where: str) -> None:
    if root.kind != store_kind:
        raise SpaceMismatchError(f"{where}: the dataset's shards are {root.kind} stores; this shard would be a "
                                 f"{store_kind}")


def _record_root(loc: Any, record: RootRecord, where: str) -> bool:
    """Publish the root record (exclusive create): True when this call wrote it.  When another
    first shard won the race, this shard is checked against the record it wrote."""
    if exclusive_put(loc, ROOT_KEY, record.to_json()):
        return True
    winner = read_root_record(loc)
    if winner is None:
        raise DamagedStoreError(f"{where}: {ROOT_KEY} could not be created, nor read back")
    _check_kind(winner, record.kind, where)
    winner.check_spaces(record.spaces, where)
    return False
