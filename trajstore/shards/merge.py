"""``merge_shards``: every shard of a sharded dataset copied into one ordinary store.

The copy goes through the buffers' own ``extend_from`` (episode boundaries and episode data kept,
episodes renumbered in the new store), shard after shard in name order, so the merged store's
rows are the dataset's global rows.  It is built under a temporary name beside the destination
and renamed onto it when complete (local folders), so a copy cut short never looks like a store.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from trajstore.buffers.replay import ReplayBuffer
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import StoreExistsError
from trajstore.maintenance.staged import partial_path
from trajstore.shards.dataset import open_sharded
from trajstore.storage.publish import destination_full, publish, recover, remove_entry

__all__ = ["merge_shards"]


def merge_shards(path: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                 storage_options: dict[str, Any] | None = None, dst_storage_options: dict[str, Any] | None = None,
                 tqdm: bool | None = None) -> int:
    """Copy every committed row of the sharded dataset at ``path`` into a new store at ``dst``.

    Parameters
    ----------
    path : str or os.PathLike
        The dataset root.
    dst : str or os.PathLike
        A new store (local folder or URL); it must not exist.  Unbounded, with the dataset's
        recorded ``chunk_rows`` / ``compressor``.
    storage_options, dst_storage_options : dict, optional
        fsspec options of the dataset and of the destination.
    tqdm : bool, optional
        Progress bars of the copies (``extend_from``'s).

    Returns
    -------
    int
        Rows copied (steps of a trajectory dataset).

    Raises
    ------
    StoreExistsError
        ``dst`` exists.
    """
    d = os.fspath(dst)
    local = "://" not in d
    if local:
        recover(os.path.abspath(d))  # a publish a killed process left half done counts as there
    if (local and os.path.exists(d)) or (not local and _remote_exists(d, dst_storage_options)):
        raise StoreExistsError(f"{d}: exists; merge_shards writes a new store")
    ds = open_sharded(path, storage_options=storage_options)
    try:
        opts = {k: v for k, v in ds.options.items() if k in ("chunk_rows", "compressor")}
        build = partial_path(os.path.abspath(d)) if local else d
        if ds.kind == "TrajectoryReplayBuffer":
            out: Any = TrajectoryReplayBuffer.create(ds.step_space, cache_path=build,  # type: ignore[attr-defined]
                                                     episode_data_instance_space=ds.episode_space,  # type: ignore[attr-defined]
                                                     storage_options=dst_storage_options, **opts)
        else:
            out = ReplayBuffer.create(ds.single_space, cache_path=build, storage_options=dst_storage_options, **opts)
        try:
            for name in ds.shards["shard"]:
                out.extend_from(ds.shard(name), tqdm=tqdm)
            n = len(out)
            out.close()
        except BaseException as e:
            with contextlib.suppress(Exception):  # already failing (a full disk fails the close's commit too)
                out.close()
            if local:
                remove_entry(build)
            raise destination_full(e, d)  # e itself unless a full disk
        if local:
            publish([(build, os.path.abspath(d))], overwrite=False)
        return n
    finally:
        ds.close()


def _remote_exists(url: str, storage_options: dict[str, Any] | None) -> bool:
    from trajstore.storage.location import resolve_location

    return resolve_location(url, read_only=True, storage_options=storage_options, must_exist=False).exists("zarr.json")
