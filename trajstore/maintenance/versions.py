"""Versions of a dataset kept in an icechunk repository (docs/versions.md): :func:`tag`,
:func:`load_version`, :func:`log` and :func:`diff`.

A store at an icechunk location (``icechunk://PATH``, ``icechunk+s3://BUCKET/PREFIX``) keeps every
commit as a snapshot; a tag names one for good.  Local memory-mapped stores have no versions of
their own: ``trajstore copy STORE icechunk://...`` (or :func:`trajstore.maintenance.sync.push`)
makes one.  Every function here reads only (except :func:`tag`, which writes a tag and nothing else).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
from typing import Any

import numpy as np

from trajstore.buffers.replay import ReplayBuffer
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.core.store import Store
from trajstore.errors import BadOptionError, NotATrajstoreError, StoreExistsError, VersionNotFoundError
from trajstore.storage.icechunk_location import (
    BRANCH,
    VERSION_OPTION,
    is_icechunk_url,
    open_repository,
    resolve_version,
)

__all__ = ["tag", "load_version", "log", "diff", "version_options", "repository", "snapshot_of"]

PathLike = str | os.PathLike[str]


def repository(path: PathLike, storage_options: dict[str, Any] | None = None) -> Any:
    """The icechunk repository holding the store at ``path``.

    Raises
    ------
    NotATrajstoreError
        ``path`` is no icechunk location (a local folder, a zip, another URL): versions are kept
        by icechunk locations only; ``trajstore copy STORE icechunk://...`` converts a store.
    StoreNotFoundError
        No repository there.
    """
    url = os.fspath(path)
    if not is_icechunk_url(url):
        raise NotATrajstoreError(f"{url}: versions are kept by icechunk locations only (icechunk://PATH, "
                                 "icechunk+s3://BUCKET/PREFIX); convert the store with `trajstore copy "
                                 f"{url} icechunk://NEW_PATH`")
    return open_repository(url, _plain(storage_options), create=False)


def _plain(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (storage_options or {}).items() if not k.startswith("trajstore_")}


def snapshot_of(path: PathLike, version: Any = None, storage_options: dict[str, Any] | None = None) -> str:
    """The snapshot id ``version`` names (a tag, a snapshot id, a datetime; None: the latest)."""
    repo = repository(path, storage_options)
    where = resolve_version(repo, os.fspath(path), version) if version is not None else {"branch": BRANCH}
    return str(repo.readonly_session(**where).snapshot_id)


def version_options(version: Any, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``storage_options`` that open ``version`` of an icechunk location (read-only)."""
    return {**(storage_options or {}), VERSION_OPTION: version}


def tag(path: PathLike, name: str, *, version: Any = None, storage_options: dict[str, Any] | None = None) -> str:
    """Name the latest snapshot (or ``version``) of the store at ``path`` ``name`` for good.

    Returns
    -------
    str
        The snapshot id tagged.

    Raises
    ------
    StoreExistsError
        A tag ``name`` exists already (tags never move).
    BadOptionError
        ``name`` is empty or holds ``/`` or ``@``.
    VersionNotFoundError, NotATrajstoreError, StoreNotFoundError
        See :func:`repository` and :func:`~trajstore.storage.icechunk_location.resolve_version`.
    """
    if not isinstance(name, str) or not name or "/" in name or "@" in name or name != name.strip():
        raise BadOptionError(f"tag name {name!r:.60}: expected a non-empty name without '/', '@' or spaces")
    repo = repository(path, storage_options)
    if name in repo.list_tags():
        raise StoreExistsError(f"{os.fspath(path)}: tag {name!r} exists already (on snapshot "
                               f"{repo.lookup_tag(name)}); tags never move: choose another name")
    snap = snapshot_of(path, version, storage_options)
    Store.open(path, None, read_only=True, multiprocessing=False,  # a trajstore store is there (else: refused)
               storage_options=version_options(snap, storage_options), options={}).close()
    repo.create_tag(name, snap)
    return snap


def load_version(path: PathLike, version: Any = None, *, storage_options: dict[str, Any] | None = None,
                 **kwargs: Any) -> ReplayBuffer | TrajectoryReplayBuffer:
    """Open ``version`` of the store at ``path`` read-only, as the buffer class its kind names.

    ``version``: a tag, a snapshot id, a ``datetime`` (the store as it was then), or None (the
    latest commit).  The buffer reads that one snapshot for its whole life.
    """
    url = os.fspath(path)
    opts = storage_options if version is None else version_options(version, storage_options)
    if version is not None:
        repository(url, storage_options)  # a version of a store that keeps none: say so
    store = Store.open(url, None, read_only=True, multiprocessing=False, storage_options=opts, options={})
    kind = store.attrs.get("kind")
    store.close()
    if kind == "ReplayBuffer":
        return ReplayBuffer.load_from(url, read_only=True, storage_options=opts, **kwargs)
    if kind == "TrajectoryReplayBuffer":
        return TrajectoryReplayBuffer.load_from(url, read_only=True, storage_options=opts, **kwargs)
    raise NotATrajstoreError(f"{url}: holds a {kind!r} store; load_from opens ReplayBuffer and "
                             "TrajectoryReplayBuffer stores")


def _kind_at(url: str, snap: str, storage_options: dict[str, Any] | None) -> Any:
    """The kind of store (its root attributes') in snapshot ``snap``."""
    store = Store.open(url, None, read_only=True, multiprocessing=False,
                       storage_options=version_options(snap, storage_options), options={})
    try:
        return store.attrs.get("kind")
    finally:
        store.close()


def _episodes_at(url: str, snap: str, storage_options: dict[str, Any] | None) -> int:
    """Episodes with steps in snapshot ``snap`` of a trajectory store, counted from its data (a
    commit whose metadata does not name them: written by an older trajstore, an edit)."""
    buf = TrajectoryReplayBuffer.load_from(url, read_only=True, storage_options=version_options(snap, storage_options))
    try:
        return len(buf.episodes()["episode_id"])
    finally:
        buf.close()


def log(path: PathLike, *, limit: int | None = None, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The commits of the store at ``path``, newest first; read from each snapshot's commit
    metadata (rows and, as the writer counted them, episodes), so no snapshot is opened except
    to count the episodes of a commit whose metadata does not (an edit, an older trajstore's).

    Returns
    -------
    list of dict
        ``snapshot`` (id), ``time`` (UTC ``datetime``), ``message``, ``rows`` (rows of the step
        table, or of the store's one table), ``episodes`` (episodes with steps; None for a
        ReplayBuffer) and ``tags`` (names on this snapshot); at most ``limit`` entries.
    """
    url = os.fspath(path)
    repo = repository(url, storage_options)
    tags: dict[str, list[str]] = {}
    for name in sorted(repo.list_tags()):
        tags.setdefault(str(repo.lookup_tag(name)), []).append(name)
    out: list[dict[str, Any]] = []
    kinds: list[Any] = []
    for snap in repo.ancestry(branch=BRANCH):
        meta = (snap.metadata or {}).get("trajstore")
        if not isinstance(meta, dict):
            continue  # the repository's own first commit, or another program's
        rows = meta.get("rows") or {}
        episodes = meta.get("episodes")
        if type(episodes) is int:
            kinds[:] = ["TrajectoryReplayBuffer"]  # (only a trajectory store's writer counts episodes)
        else:
            if not kinds:  # (a store's kind is the same in every version: read once)
                kinds.append(_kind_at(url, snap.id, storage_options))
            if kinds[0] != "TrajectoryReplayBuffer":
                episodes = None
            elif int(rows.get("step_data", 0)) == 0:
                episodes = 0  # (the create commit: before the buffer could count)
            else:
                episodes = _episodes_at(url, snap.id, storage_options)
        out.append({"snapshot": snap.id, "time": snap.written_at, "message": snap.message,
                    "rows": int(rows.get("step_data", sum(int(v) for v in rows.values()))),
                    "episodes": episodes, "tags": tags.get(snap.id, [])})
        if limit is not None and len(out) >= limit:
            break
    return out


def _fields_at(url: str, snap: str, storage_options: dict[str, Any] | None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{array path: (dtype, row shape)}`` of the store's fields at snapshot ``snap``."""
    store = Store.open(url, None, read_only=True, multiprocessing=False,
                       storage_options=version_options(snap, storage_options), options={})
    try:
        return {f.spec.array_path: (f.spec.dtype.str, tuple(f.spec.row_shape))
                for t in store.tables.values() for f in t.fields}
    finally:
        store.close()


def _episode_digests(buf: TrajectoryReplayBuffer) -> dict[int, str]:
    """A content digest of every episode's steps (each leaf's rows in row order) and episode data,
    read a bounded block of rows at a time (not an episode at a time)."""
    from trajstore.buffers.episode_edit import TABLE_COLUMNS, episode_columns
    from trajstore.maintenance.staged import step_blocks

    steps: dict[int, list[Any]] = {}  # episode id -> [rows, one hash per step leaf]
    for arrays, eids in step_blocks(buf, None):
        cut = np.flatnonzero(eids[1:] != eids[:-1]) + 1
        for a, b in zip(np.r_[0, cut].tolist(), np.r_[cut, len(eids)].tolist()):
            got = steps.setdefault(int(eids[a]), [0] + [hashlib.sha256() for _ in arrays])
            got[0] += b - a
            for h, arr in zip(got[1:], arrays):
                h.update(np.ascontiguousarray(arr[a:b]).data)
    cols = episode_columns(buf)
    names = [n for n in cols if n not in TABLE_COLUMNS]
    at = {int(e): i for i, e in enumerate(cols["episode_id"].tolist())}
    out: dict[int, str] = {}
    for eid, (n, *hashes) in steps.items():
        h = hashlib.sha256(f"{n}".encode())
        for lf, part in zip(buf.layout.step_plan.leaves, hashes):
            h.update(f"{np.dtype(lf.dtype).str}{tuple(lf.shape)}".encode() + part.digest())
        i = at.get(eid)
        if i is not None and cols["has_data"][i]:
            for name in names:
                value = np.ascontiguousarray(cols[name][i])
                h.update(f"{name}{value.dtype.str}{value.shape}".encode() + value.tobytes())
        out[eid] = h.hexdigest()
    return out


def _chunks_changed(repo: Any, a: str, b: str) -> int | None:
    """Chunks icechunk rewrote between snapshots ``a`` and ``b`` (either may be the older one);
    None when neither is an ancestor of the other."""
    if a == b:
        return 0
    for x, y in ((a, b), (b, a)):
        try:
            d = repo.diff(from_snapshot_id=x, to_snapshot_id=y)
        except Exception:  # icechunk.IcechunkError: y's ancestry does not include x
            continue
        return sum(len(v) for v in d.updated_chunks.values())
    return None


def diff(path: PathLike, a: Any, b: Any, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What changed from version ``a`` to version ``b`` of the store at ``path``.

    Returns
    -------
    dict
        ``a`` and ``b`` (snapshot ids), ``rows`` (``[rows in a, rows in b]``), ``fields``
        (``added``, ``removed``, ``changed``: array paths whose dtype or row shape differ),
        ``episodes`` (``added``, ``removed``, ``changed``: sorted episode ids; changed means the
        same id with other steps or episode data; empty for a ReplayBuffer) and
        ``chunks_changed`` (chunks icechunk rewrote between the two; None when neither version
        is an ancestor of the other).

    Raises
    ------
    VersionNotFoundError
        ``a`` or ``b`` names no version of this store.
    """
    url = os.fspath(path)
    repo = repository(url, storage_options)
    snaps = [snapshot_of(url, v, storage_options) for v in (a, b)]
    chunks = _chunks_changed(repo, *snaps)
    bufs = [load_version(url, s, storage_options=storage_options) for s in snaps]
    try:
        fa, fb = (_fields_at(url, s, storage_options) for s in snaps)
        out: dict[str, Any] = {
            "a": snaps[0], "b": snaps[1], "rows": [len(bufs[0]), len(bufs[1])], "chunks_changed": chunks,
            "fields": {"added": sorted(set(fb) - set(fa)), "removed": sorted(set(fa) - set(fb)),
                       "changed": sorted(k for k in set(fa) & set(fb) if fa[k] != fb[k])},
            "episodes": {"added": [], "removed": [], "changed": []},
        }
        if all(isinstance(buf, TrajectoryReplayBuffer) for buf in bufs):
            ea, eb = (_episode_digests(buf) for buf in bufs)  # type: ignore[arg-type]
            out["episodes"] = {"added": sorted(set(eb) - set(ea)), "removed": sorted(set(ea) - set(eb)),
                               "changed": sorted(k for k in set(ea) & set(eb) if ea[k] != eb[k])}
        return out
    finally:
        for buf in bufs:
            buf.close()


def check_version(value: str) -> Any:
    """A version as the command line writes it: an ISO datetime (``2026-05-01T12:00``) becomes a
    ``datetime``; anything else is a tag or snapshot id."""
    if not re.match(r"^\d{4}-\d{2}-\d{2}", value):
        return value  # (snapshot ids are 20 characters of Crockford base32: never a date)
    try:
        return datetime.datetime.fromisoformat(value)
    except ValueError:
        raise VersionNotFoundError(f"{value!r} is neither a tag, a snapshot id nor an ISO datetime") from None
