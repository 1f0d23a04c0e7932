"""D4RL's flat HDF5 layout: :func:`import_d4rl` and :func:`export_d4rl`.

A D4RL file holds one row per transition in flat datasets: ``observations`` (N, *obs),
``actions`` (N, *act), ``rewards`` (N,), ``terminals`` (N,), ``timeouts`` (N,) and optionally
``next_observations`` (N, *obs) and ``infos/<key>`` (N, ...).  Episodes end after each step where
``terminals | timeouts``; steps after the last such step form a trailing, unfinished episode.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import numpy as np
from gymnasium.spaces import Dict

from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.core.progress import progress_bar
from trajstore.errors import BadValueError, DamagedStoreError, ForeignFileError, NotATrajstoreError
from trajstore.interop._common import (
    Checksums,
    ImportWriter,
    StepBlocks,
    block_rows,
    box_for,
    export_source,
    nest,
    recorder_space,
    source_file,
    staged_path,
    step_leaves,
)
from trajstore.interop.foreign_gate import check_rows, h5py_module, open_hdf5, read_attr, read_rows

__all__ = ["import_d4rl", "export_d4rl", "d4rl_to_store", "REQUIRED", "OPTIONAL"]

#: Datasets every D4RL file has (``timeouts`` is missing from some old files: then no step times out).
REQUIRED = ("observations", "actions", "rewards", "terminals")
#: Datasets read when present.
OPTIONAL = ("timeouts", "next_observations", "infos")
#: Root attributes kept in the dataset description (at most; each of at most 4 KiB).
MAX_ATTRS = 256


def _dataset(h5py: Any, f: Any, key: str, src: str) -> Any:
    node = f.get(key)
    if not isinstance(node, h5py.Dataset):
        has = sorted(itertools.islice(f.keys(), 100))[:20]
        what = "a group" if node is not None else "missing"
        raise NotATrajstoreError(f"{src}: {key!r} is {what}; a D4RL file has the datasets {', '.join(REQUIRED)} "
                                 f"(and timeouts, next_observations, infos/*); this file has {has}")
    return node


def _infos(h5py: Any, group: Any, n: int, src: str, prefix: str = "infos") -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """(info space dict, [(leaf path below infos, dataset)]) of the group ``infos``, nested groups
    becoming nested Dicts."""
    spaces: dict[str, Any] = {}
    leaves: list[tuple[str, Any]] = []
    for key in sorted(group.keys()):
        node = group[key]
        where = f"{src}: {prefix}/{key}"
        if isinstance(node, h5py.Group):
            sub, sub_leaves = _infos(h5py, node, n, src, f"{prefix}/{key}")
            if sub:
                spaces[key] = Dict(sub)
                leaves.extend((f"{key}/{p}", d) for p, d in sub_leaves)
            continue
        if node.ndim < 1 or node.shape[0] != n:
            raise BadValueError(f"{where} has shape {node.shape}; expected one row per step: ({n}, ...)")
        spaces[key] = box_for(node.dtype, tuple(node.shape[1:]), where)
        leaves.append((key, node))
    return spaces, leaves


def _layout(h5py: Any, f: Any, src: str) -> dict[str, Any]:
    """Every dataset the import reads, checked (shapes, dtypes), before anything is written."""
    ds = {k: _dataset(h5py, f, k, src) for k in REQUIRED}
    obs, act = ds["observations"], ds["actions"]
    if obs.ndim < 1:
        raise BadValueError(f"{src}: observations has shape {obs.shape}; expected (N, *obs_shape)")
    n = int(obs.shape[0])
    check_rows(n, f"{src}: observations")
    if act.ndim < 1 or act.shape[0] != n:
        raise BadValueError(f"{src}: actions has shape {act.shape}; expected ({n}, ...) like observations {obs.shape}")
    for k in ("rewards", "terminals"):
        if ds[k].shape != (n,):
            raise BadValueError(f"{src}: {k} has shape {ds[k].shape}; expected ({n},), one value per step")
    if "timeouts" in f:
        ds["timeouts"] = _dataset(h5py, f, "timeouts", src)
        if ds["timeouts"].shape != (n,):
            raise BadValueError(f"{src}: timeouts has shape {ds['timeouts'].shape}; expected ({n},), one per step")
    for k in ("terminals", "timeouts"):
        if k in ds and ds[k].dtype.kind not in "biuf":
            raise BadValueError(f"{src}: {k} has dtype {ds[k].dtype}; expected bool (or 0/1 numbers)")
    if ds["rewards"].dtype.kind not in "biuf":
        raise BadValueError(f"{src}: rewards has dtype {ds['rewards'].dtype}; expected floats")
    if "next_observations" in f:
        nxt = _dataset(h5py, f, "next_observations", src)
        if nxt.shape != obs.shape or nxt.dtype != obs.dtype:
            raise BadValueError(f"{src}: next_observations is {nxt.dtype} {nxt.shape}; expected {obs.dtype} "
                                f"{obs.shape} like observations")
        ds["next_observations"] = nxt
    infos: tuple[dict[str, Any], list[tuple[str, Any]]] = ({}, [])
    if "infos" in f:
        if not isinstance(f["infos"], h5py.Group):
            raise NotATrajstoreError(f"{src}: 'infos' is a dataset; D4RL keeps infos/<key> datasets in a group")
        infos = _infos(h5py, f["infos"], n, src)
    space = recorder_space(box_for(obs.dtype, tuple(obs.shape[1:]), f"{src}: observations"),
                           box_for(act.dtype, tuple(act.shape[1:]), f"{src}: actions"),
                           next_obs="next_observations" in ds, info=infos[0])
    return {"n": n, "ds": ds, "infos": infos[1], "space": space}


def _small_attrs(node: Any) -> dict[str, Any]:
    """HDF5 attributes that are JSON scalars or short lists (others are skipped; the first
    :data:`MAX_ATTRS` only, each read only when it stores at most 4 KiB)."""
    out: dict[str, Any] = {}
    for k in list(itertools.islice(node.attrs, MAX_ATTRS)):
        try:
            v = read_attr(node, k, "", 4096)
            v = v.decode() if isinstance(v, bytes) else v.tolist() if hasattr(v, "tolist") else v
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError, UnicodeDecodeError, OSError, ForeignFileError):
            continue
        if len(json.dumps(v)) <= 4096:
            out[str(k)] = v
    return out


def d4rl_to_store(path: Any, cache_path: Any, *, tqdm: bool | None = None, overwrite: bool = False,
                  stats: bool = False,
                  **create_kwargs: Any) -> dict[str, Any]:
    """Write the D4RL file ``path`` to a new store at ``cache_path`` (see :func:`import_d4rl`).

    Parameters
    ----------
    path : path
        A D4RL HDF5 file.
    cache_path : path
        Destination: a local folder that does not exist yet (or is empty).
    tqdm : bool or None
        Progress bar: True / False force it; None shows it on a terminal.
    overwrite : bool
        Replace an existing store at ``cache_path`` (after the new one verified).
    stats : bool
        Store every episode's statistics (``buf.stats()``, docs/robot.md), computed at import.
    **create_kwargs
        Passed to :meth:`TrajectoryReplayBuffer.create` (``compressor``, ``chunk_rows``, ...).

    Returns
    -------
    dict
        ``source``, ``destination``, ``steps``, ``episodes``, ``verified`` (True).
    """
    h5py = h5py_module("import_d4rl")
    src = source_file(path, "import_d4rl: path")
    if os.path.isdir(src):
        raise NotATrajstoreError(f"import_d4rl: {src} is a folder; expected a D4RL HDF5 file (observations, actions, "
                                 "rewards, terminals, timeouts)")
    with open_hdf5(h5py, src, "import_d4rl") as f:
        lay = _layout(h5py, f, src)
        n, ds, infos = lay["n"], lay["ds"], lay["infos"]
        row_bytes = sum(int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize
                        for d in [*ds.values(), *(d for _, d in infos)])
        step = block_rows(row_bytes)
        info = {"imported_from": {"format": "d4rl", "path": src, "attrs": _small_attrs(f)}}
        with ImportWriter(cache_path, lay["space"], what="import_d4rl", create_kwargs=create_kwargs, total=n,
                          tqdm=tqdm, overwrite=overwrite) as w:
            for lo in range(0, n, step):
                hi = min(lo + step, n)

                def rows(name: str, d: Any) -> np.ndarray:
                    return read_rows(d, lo, hi, f"{src}: {name}")

                term = rows("terminals", ds["terminals"]) != 0
                tout = rows("timeouts", ds["timeouts"]) != 0 if "timeouts" in ds else np.zeros(hi - lo, np.bool_)
                block: dict[str, Any] = {"obs": rows("observations", ds["observations"]),
                                         "action": rows("actions", ds["actions"]),
                                         "reward": rows("rewards", ds["rewards"]).astype(np.float64),
                                         "terminated": term, "truncated": tout}
                if "next_observations" in ds:
                    block["next_obs"] = rows("next_observations", ds["next_observations"])
                if infos:
                    block["info"] = nest({p: rows(f"infos/{p}", d) for p, d in infos})
                w.write(block, term | tout)
            out = w.finish(info, stats=stats)
    return {"source": src, **out}


def import_d4rl(path: Any, cache_path: Any, *, tqdm: bool | None = None, overwrite: bool = False,
                stats: bool = False,
                **create_kwargs: Any) -> TrajectoryReplayBuffer:
    """Import a D4RL HDF5 file into a new trajectory store with the recorders' schema.

    Mapping: ``observations`` -> ``obs``, ``actions`` -> ``action``, ``rewards`` -> ``reward``
    (float64), ``terminals`` -> ``terminated``, ``timeouts`` -> ``truncated`` (all False when the
    file has none), ``next_observations`` -> ``next_obs``, ``infos/<key>`` -> ``info/<key>``.
    An episode ends after each step with ``terminals | timeouts``; steps after the last end form
    a trailing episode that is kept.  Each episode gets ``seed`` -1, ``return`` (sum of its
    rewards) and ``length``.  The file's root attributes are kept in the dataset description
    (``imported_from``).  Streams blocks of about 8 MiB; the store is built under a temporary name,
    verified, then renamed (nothing is left behind on error).

    Parameters
    ----------
    path : path
        The HDF5 file: ``observations`` (N, *obs), ``actions`` (N, *act), ``rewards`` (N,),
        ``terminals`` (N,) bool, ``timeouts`` (N,) bool, optional ``next_observations`` (N, *obs)
        and ``infos/<key>`` (N, ...).  Numbers and bools only.
    cache_path : path
        Destination: a local folder that does not exist yet (or is empty).
    tqdm : bool or None
        Progress bar: True / False force it; None shows it on a terminal.
    overwrite : bool
        Replace an existing store at ``cache_path`` (after the new one verified).
    stats : bool
        Store every episode's statistics (``buf.stats()``, docs/robot.md), computed at import.
    **create_kwargs
        Passed to :meth:`TrajectoryReplayBuffer.create` (``compressor``, ``chunk_rows``, ...).

    Returns
    -------
    TrajectoryReplayBuffer
        The new store, open for writing (close it when done).

    Raises
    ------
    StoreNotFoundError
        ``path`` does not exist.
    NotATrajstoreError
        ``path`` is not an HDF5 file, or lacks a required dataset (the message lists what it has).
    BadValueError
        Datasets of unequal lengths or of the wrong shape or dtype.
    UnsupportedSpaceError
        A dataset of strings or other non-numbers.
    StoreExistsError
        ``cache_path`` exists and ``overwrite`` is False.
    DamagedStoreError
        A block of the file cannot be read (nothing is left at ``cache_path``).
    ForeignFileError
        The file holds what trajstore never reads (links or storage out of it, special files,
        sizes, nesting or link counts beyond a store's limits); see docs/reliability.md.
    """
    out = d4rl_to_store(path, cache_path, tqdm=tqdm, overwrite=overwrite, stats=stats, **create_kwargs)
    return TrajectoryReplayBuffer.load_from(out["destination"])


def export_d4rl(src: Any, path: Any, *, tqdm: bool | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write a trajectory store with the recorders' schema as a D4RL HDF5 file.

    Rows are written in store order: ``obs`` -> ``observations``, ``action`` -> ``actions``,
    ``reward`` -> ``rewards`` (float32, as D4RL), ``terminated`` -> ``terminals``, ``truncated``
    -> ``timeouts``, ``next_obs`` -> ``next_observations``, ``info/<key>`` -> ``infos/<key>``.
    D4RL marks episode ends only by ``terminals | timeouts``: the last step of an episode that has
    neither gets ``timeouts`` True (except the store's last episode: the end of the file ends it),
    so an import of the file gives the same episodes.  Episode data (seed, return, length) is not
    written.  The file is written under a temporary name, read back and compared (SHA-256 per
    dataset), then renamed.

    Parameters
    ----------
    src : path or TrajectoryReplayBuffer
        The store (a path is opened read-only).  Its step data must hold ``obs``, ``action``,
        ``reward``, ``terminated``, ``truncated`` (``obs`` and ``next_obs`` single arrays), and
        optionally ``next_obs`` and ``info/*``; its episodes must not interleave.
    path : path
        The HDF5 file to write (a local path).
    tqdm : bool or None
        Progress bar: True / False force it; None shows it on a terminal.
    overwrite : bool
        Replace an existing file at ``path``.

    Returns
    -------
    dict
        ``source``, ``destination``, ``steps``, ``episodes``, ``verified`` (True).

    Raises
    ------
    UnknownFieldError
        The step data lacks a field of the recorders' schema.
    UnsupportedSpaceError
        ``obs`` is a Dict or Tuple space, the store has other step fields, or its episodes
        interleave.
    StoreExistsError
        ``path`` exists and ``overwrite`` is False.
    """
    h5py = h5py_module("export_d4rl")
    out = staged_path(path, "export_d4rl: path", overwrite)
    buf, own = export_source(src, "export_d4rl: src")
    try:
        names = step_leaves(buf, "export_d4rl")
        blocks = StepBlocks(buf, "export_d4rl")
        n = blocks.count
        leaves = buf.layout.step_plan.leaves
        target = {"obs": "observations", "action": "actions", "reward": "rewards", "terminated": "terminals",
                  "truncated": "timeouts", "next_obs": "next_observations"}
        dsname = {k: target.get(name, "infos/" + name[len("info/"):]) for name, k in names.items()}
        dtypes = {k: (np.dtype(np.float32) if leaves[k].name == "reward" else
                      np.dtype(np.bool_) if leaves[k].name in ("terminated", "truncated") else leaves[k].dtype)
                  for k in names.values()}
        step = block_rows(buf.rows_table.row_bytes)
        sums = Checksums()
        with out as tmp:
            bar = progress_bar(n, f"export_d4rl to {os.path.basename(out.dst)}", tqdm, unit="step")
            try:
                with h5py.File(tmp, "w") as f:
                    dsets = {k: f.create_dataset(dsname[k], shape=(n, *leaves[k].shape), dtype=dtypes[k],
                                                 chunks=(min(step, n), *leaves[k].shape) if n else None)
                             for k in names.values()}
                    f.attrs["trajstore_source"] = str(buf.cache_path)
                    lo = 0
                    t_k, o_k = names["terminated"], names["truncated"]
                    for arrays, end in blocks:
                        hi = lo + len(end)
                        arrays = list(arrays)
                        arrays[o_k] = np.asarray(arrays[o_k], np.bool_) | (end & ~np.asarray(arrays[t_k], np.bool_))
                        for k, d in dsets.items():
                            a = np.asarray(arrays[k]).astype(dtypes[k], copy=False)
                            d[lo:hi] = a
                            sums.add(dsname[k], a)
                        bar.update(hi - lo)
                        lo = hi
            finally:
                bar.close()
            _check_written(h5py, tmp, sums.digest(), step, n)
    finally:
        if own:
            buf.close()
    return {"source": buf.cache_path, "destination": out.dst, "steps": n, "episodes": blocks.episodes, "verified": True}


def _check_written(h5py: Any, path: str, want: dict[str, str], step: int, n: int) -> None:
    """Read the file back in blocks and compare each dataset's SHA-256 with what was written."""
    got = Checksums()
    with h5py.File(path, "r") as f:
        for name in want:
            d = f[name]
            for lo in range(0, n, step):
                got.add(name, d[lo : min(lo + step, n)])
            if n == 0:
                got.add(name, d[:])
    if got.digest() != want:
        bad = sorted(k for k in want if got.digest().get(k) != want[k])
        raise DamagedStoreError(f"export_d4rl: {path}: datasets {bad} read back differ from what was written")
