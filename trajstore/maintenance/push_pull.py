"""Publish a store as a version of a remote dataset, and pull part of a version back as a local
store (docs/versions.md): :func:`push` and :func:`pull`.

``push`` uploads only the keys whose bytes the remote's last pushed version lacks (SHA-256 of each
key, kept in the repository as :data:`~trajstore.storage.keys.CHECKSUMS_KEY` with the commit record
they belong to), and commits them, the checksums and the record as one icechunk commit: a push cut
short publishes nothing.  ``pull`` opens one version read-only with every key it reads checked
against those checksums, and writes the episodes and fields asked for into a local memory-mapped
store built under a temporary name, verified, and put into place by
:mod:`trajstore.storage.publish`; on any error nothing appears at the destination.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

import gymnasium
import numpy as np

from trajstore.buffers.episode_edit import TABLE_COLUMNS, episode_columns
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.core.progress import progress_bar
from trajstore.core.store import Store
from trajstore.errors import (
    BadOptionError,
    DatasetMismatchError,
    NotATrajstoreError,
    StoreExistsError,
    UnknownFieldError,
)
from trajstore.maintenance.staged import StagedFolders, check_free, local_path, step_blocks, verify_written
from trajstore.maintenance.versions import load_version, repository, version_options
from trajstore.maintenance.where import compile_where, where_fields
from trajstore.spaces.leaves import leaves
from trajstore.spaces.values import ValuePlan
from trajstore.storage.array_meta import read_root
from trajstore.storage.fields.video_copy import linked_copy
from trajstore.storage.head import write_head
from trajstore.storage.icechunk_store import CHECK_BLOCK_BYTES, block_digests
from trajstore.storage.keys import CHECKSUMS_KEY, HEAD_KEY
from trajstore.storage.location import Location, resolve_location

__all__ = ["push", "pull", "split_version"]

PathLike = str | os.PathLike[str]
#: The root attributes that say which dataset a store is: a push onto a remote whose store differs
#: in any of them is refused (:class:`DatasetMismatchError`) unless forced.
_IDENTITY = ("kind", "created_at", "tables", "spaces")


def split_version(remote: str) -> tuple[str, str | None]:
    """``"icechunk+s3://b/p@v1"`` as ``("icechunk+s3://b/p", "v1")``; no ``@``: ``(remote, None)``."""
    base, at, version = remote.rpartition("@")
    if not at or "/" in version or not base:
        return remote, None
    return base, version


def _remote_checksums(target: Location) -> dict[str, str]:
    """The checksums of the remote's last push, when its commit record is still the one pushed
    with them (else nothing is known: every key is uploaded)."""
    raw, head = target.get(CHECKSUMS_KEY, limit=256 << 20), target.get(HEAD_KEY)
    try:
        obj = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return {}
    if not isinstance(obj, dict) or head is None or obj.get("head") != hashlib.sha256(head).hexdigest():
        return {}
    keys = obj.get("keys")
    return {k: v for k, v in keys.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(keys, dict) else {}


def _check_same_dataset(src: Store, target: Location, remote: str) -> None:
    root = read_root(target)
    if root is None:
        return
    theirs = (root.get("attributes") or {}).get("trajstore")
    if not isinstance(theirs, dict):
        raise DatasetMismatchError(f"{remote}: holds zarr data that is not a trajstore store; push to a new "
                                   "repository")
    differ = [k for k in _IDENTITY if src.attrs.get(k) != theirs.get(k)]
    if differ:
        raise DatasetMismatchError(f"{remote}: holds another dataset (its {', '.join(differ)} differ from "
                                   f"{src.loc.url}'s: a {theirs.get('kind')!r} store created "
                                   f"{theirs.get('created_at')}); push to a new repository, or pass force=True "
                                   "(--force) to make this store its next version")


def push(local: PathLike, remote: str, *, tag: str | None = None, force: bool = False, message: str | None = None,
         storage_options: dict[str, Any] | None = None, remote_options: dict[str, Any] | None = None,
         progress: bool | None = None) -> dict[str, Any]:
    """Publish the store at ``local`` as the next version of the dataset at ``remote`` (an icechunk
    location), uploading only the keys whose bytes the remote's last pushed version lacks.

    Returns
    -------
    dict
        ``snapshot`` (the new version's id), ``tag``, ``keys`` (in the store), ``uploaded`` (keys
        uploaded), ``bytes`` (of all keys), ``uploaded_bytes``, ``unchanged`` (keys already there), ``deleted`` (keys the
        remote had that the store no longer has).

    Raises
    ------
    BadOptionError
        ``remote`` is no icechunk location, or the store has a rewrite not yet moved into place.
    DatasetMismatchError
        The remote holds another dataset (unless ``force``).
    StoreExistsError
        The tag exists already.
    ConcurrentWriteError
        Another push committed to the remote meanwhile; nothing of this one was published.
    """
    src = Store.open(local, None, read_only=True, multiprocessing=False, storage_options=storage_options, options={})
    target: Location | None = None
    try:
        if src.committed.pending:
            raise BadOptionError(f"{src.loc.url}: a rewrite is not finished; open the store as a writer once "
                                 "(it completes it), then push")
        repo = repository(remote, remote_options)  if _exists(remote, remote_options) else None
        if tag is not None and repo is not None and tag in repo.list_tags():
            raise StoreExistsError(f"{remote}: tag {tag!r} exists already; tags never move: choose another name")
        if repo is not None and not force:  # checked on a reader: a refused push writes nothing (no lock file)
            seen = resolve_location(remote, read_only=True, storage_options=remote_options, must_exist=False)
            try:
                _check_same_dataset(src, seen, remote)
            finally:
                seen.close()
        target = resolve_location(remote, read_only=False, storage_options=remote_options, must_exist=False)
        if target.transaction is None:
            raise BadOptionError(f"{remote}: push needs an icechunk location (icechunk://PATH or "
                                 "icechunk+s3://BUCKET/PREFIX)")
        if not force:
            _check_same_dataset(src, target, remote)  # (again on the writer's snapshot: a push may have landed since)
        out = _upload(src, target, progress)
        head = src.committed.copy()
        data = head.to_json()
        sums = {"format": 1, "algorithm": "sha256", "head": hashlib.sha256(data).hexdigest(), "keys": out.pop("sums"),
                "bytes": out["bytes"], "block_bytes": CHECK_BLOCK_BYTES, "blocks": out.pop("blocks")}
        target.put(CHECKSUMS_KEY, json.dumps(sums, separators=(",", ":")).encode())
        target.transaction.message = message or f"push from {src.loc.url}"
        write_head(target, head)  # the icechunk commit: keys, checksums and record at once
        snap = str(target.transaction.repo.lookup_branch("main"))
        if tag is not None:
            target.transaction.repo.create_tag(tag, snap)
        return {"snapshot": snap, "tag": tag, **out}
    finally:
        src.close()
        if target is not None:
            target.close()


def _exists(remote: str, options: dict[str, Any] | None) -> bool:
    from trajstore.errors import StoreNotFoundError

    try:
        repository(remote, options)
    except StoreNotFoundError:
        return False
    return True


def _upload(src: Store, target: Location, progress: bool | None) -> dict[str, Any]:
    known = _remote_checksums(target)
    keys = src.data_keys()
    sums: dict[str, str] = {}
    blocks: dict[str, list[Any]] = {}  # keys of more than one block: their blocks' digests (partial reads)
    uploaded = uploaded_bytes = total = 0
    bar = progress_bar(len(keys), f"push to {target.url}", progress)
    try:
        for key in keys:
            data = linked_copy(src.loc, key) or src.loc.get(key)  # a linked video segment: its packets, held
            if data is None:
                continue
            sums[key] = digest = hashlib.sha256(data).hexdigest()
            if len(data) > CHECK_BLOCK_BYTES:
                blocks[key] = [len(data), block_digests(data)]
            total += len(data)
            if known.get(key) != digest:
                target.put(key, data)
                uploaded += 1
                uploaded_bytes += len(data)
            bar.update(1)
    finally:
        bar.close()
    keep = set(sums) | {HEAD_KEY, CHECKSUMS_KEY}
    gone = [k for k in target.list_prefix("") if k not in keep]
    for key in gone:
        target.delete(key)
    return {"keys": len(sums), "bytes": total, "uploaded": uploaded, "uploaded_bytes": uploaded_bytes,
            "unchanged": len(sums) - uploaded, "deleted": len(gone), "sums": sums, "blocks": blocks}


def _sub_space(space: gymnasium.Space[Any], fields: Sequence[str]) -> gymnasium.Space[Any]:
    """The Dict ``space`` with only its top-level keys ``fields`` (in the space's order)."""
    if not isinstance(space, gymnasium.spaces.Dict):
        raise BadOptionError(f"fields: the step space is {type(space).__name__}, not a Dict; pull every field")
    unknown = [f for f in fields if f not in space.spaces]
    if unknown:
        raise UnknownFieldError(f"fields {unknown}: the step space has {list(space.spaces)}")
    return gymnasium.spaces.Dict({k: v for k, v in space.spaces.items() if k in fields})


def _select(buf: TrajectoryReplayBuffer, episodes: tuple[int, int] | None, where: str | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The sorted ids of the episodes to pull, and the episode columns (with every data field)."""
    cols = episode_columns(buf)
    ids = cols["episode_id"]
    keep = np.ones(len(ids), bool)
    if episodes is not None:
        keep &= (ids >= episodes[0]) & (ids < episodes[1])
    if where is not None:
        names = [n for n in cols if n not in TABLE_COLUMNS]
        compile_where(where, list(TABLE_COLUMNS) + names)  # unknown fields: before anything is read
        where_fields(where)
        keep &= np.asarray(compile_where(where, cols)(cols), bool)
    return np.sort(ids[keep]).astype(np.int64), cols


def _write(src: TrajectoryReplayBuffer, space: gymnasium.Space[Any], ids: np.ndarray, keep: list[int],
           cols: dict[str, np.ndarray], tmp: str, bar: Any) -> int:
    """A store at ``tmp`` with step space ``space`` (the leaves ``keep`` of ``src``'s), the steps of
    episodes ``ids`` (ids kept) and their episode data (from ``cols``)."""
    out = TrajectoryReplayBuffer.create(space, episode_data_instance_space=src.episode_space, cache_path=tmp)
    steps = 0
    try:
        plan = ValuePlan(space)
        if len(ids):
            for arrays, eids in step_blocks(src, ids, keep):
                out.extend({"step_data": plan.from_arrays(arrays), "episode_ids": eids})
                bar.update(len(eids))
                steps += len(eids)
        if src.episode_space is not None and len(ids):
            ep_plan = ValuePlan(src.episode_space)
            names = [lf.name or "value" for lf in leaves(src.episode_space)]
            at = {int(e): i for i, e in enumerate(cols["episode_id"].tolist())}
            for eid in ids.tolist():
                i = at[int(eid)]
                if cols["has_data"][i]:
                    out.set_episode_data_at(int(eid), ep_plan.from_arrays([cols[n][i] for n in names]))
        out.mark_episode_end()
    finally:
        out.close()
    return steps


def pull(remote: str, local: PathLike, *, version: Any = None, episodes: tuple[int, int] | None = None,
         where: str | None = None, fields: Sequence[str] | None = None, verify: bool = True,
         overwrite: bool = False, storage_options: dict[str, Any] | None = None,
         progress: bool | None = None) -> dict[str, Any]:
    """Write the episodes and fields asked for of a version of ``remote`` into a new local store.

    Parameters
    ----------
    remote : str
        An icechunk location, optionally ``@VERSION`` (a tag or snapshot id; ``version`` overrides).
    local : path
        A local folder that does not exist (``overwrite=True`` replaces a store there).
    episodes : (int, int), optional
        Episode ids ``lo <= id < hi`` only.
    where : str, optional
        Only episodes for which this :mod:`trajstore.maintenance.where` expression holds.
    fields : sequence of str, optional
        Top-level keys of a Dict step space to keep (default: all).
    verify : bool
        Check every key read against the checksums recorded at push (default).

    Returns
    -------
    dict
        ``source``, ``snapshot``, ``destination``, ``episodes``, ``of``, ``steps``, ``fields``,
        ``requests`` and ``bytes_read`` (what was fetched from the repository), ``remote_bytes``
        (the pushed version's size, as its push recorded it; None unverified), ``verified``.

    Raises
    ------
    ChecksumError
        A key read differs from its checksum, or the version holds none (``verify``).
    VersionNotFoundError, DatasetMismatchError, UnknownFieldError, BadOptionError, StoreExistsError
        Before anything is written at ``local``.
    """
    base, at = split_version(remote)
    version = version if version is not None else at
    out_path = local_path(local, "pull: local")
    check_free(out_path, overwrite)
    # (ranges: each row is read once, so a run of rows of a raw chunk is fetched alone, not the chunk)
    opts = {**(storage_options or {}), "trajstore_checksums": verify, "trajstore_ranges": True}
    if version is not None:
        opts = version_options(version, opts)
    src = load_version(base, None, storage_options=opts)
    staged = StagedFolders()
    try:
        tx = src.location.transaction
        if not isinstance(src, TrajectoryReplayBuffer):
            raise NotATrajstoreError(f"{base}: holds a ReplayBuffer store; pull copies trajectory stores (copy a "
                                     "ReplayBuffer with `trajstore copy`)")
        space = src.step_space if not fields else _sub_space(src.step_space, fields)
        ids, cols = _select(src, episodes, where)
        names = [lf.name for lf in leaves(src.step_space)]
        keep = [names.index(lf.name) for lf in leaves(src.step_space)
                if not fields or lf.path[0] in fields]
        tmp = staged.new(out_path)
        total = int(cols["length"][np.isin(cols["episode_id"], ids)].sum())
        bar = progress_bar(total, f"pull into {os.path.basename(out_path)}", progress, unit="step")
        try:
            steps = _write(src, space, ids, keep, cols, tmp, bar)
        finally:
            bar.close()
        verify_written(tmp)
        staged.commit(overwrite)
        return {"source": base, "snapshot": tx.snapshot_id, "destination": out_path, "episodes": int(len(ids)),
                "of": int(len(cols["episode_id"])), "steps": steps, "fields": [lf.name for lf in leaves(space)],
                "requests": tx.zstore.requests, "bytes_read": tx.zstore.bytes_read,
                "remote_bytes": tx.pushed_bytes, "verified": verify}
    except BaseException as e:
        raise staged.failed(e)
    finally:
        src.close()
