"""Minari datasets: :func:`import_minari` and :func:`export_minari` (through minari's own reader and
storage writer, so every data format minari reads is read).

Minari keeps each episode's T+1 observations (the reset observation, then one per step), T
actions, rewards, terminations, truncations and T+1 infos; spaces and dataset metadata (env spec,
algorithm, author, ...) as JSON.  Episodes are read and written one at a time: memory is bounded by
the largest episode, not by the dataset.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
from gymnasium.spaces import Box, Dict

from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import (
    BadArgumentError,
    BadOptionError,
    BadValueError,
    DamagedStoreError,
    ForeignFileError,
    NotATrajstoreError,
    StoreNotFoundError,
    UnknownFieldError,
)
from trajstore.interop._common import (
    ImportWriter,
    StepBlocks,
    box_for,
    export_source,
    recorder_space,
    staged_path,
    step_leaves,
)
from trajstore.interop._minari_arrow import iterate_episodes
from trajstore.interop._minari_frames import MINARI_JPEG, MinariFrames, jpeg_leaves, passes_through
from trajstore.interop.foreign_gate import check_declared, check_folder, h5py_module, open_below, open_hdf5, parse_json
from trajstore.recording import EPISODE_SPACE
from trajstore.storage.confined import MAX_META_BYTES

__all__ = ["MINARI_JPEG", "import_minari", "export_minari", "minari_to_store"]


def _minari(what: str) -> Any:
    try:
        import minari  # type: ignore[import-untyped,import-not-found,unused-ignore]  # minari ships no type information
    except ImportError:
        from trajstore._optional import missing

        raise missing("minari", what) from None
    return minari


def _open(src: Any) -> tuple[Any, str]:
    """``(MinariDataset, what it was opened from)``: a dataset folder (or its ``data`` folder) or a
    dataset id resolved as minari resolves it (``MINARI_DATASETS_PATH``), checked by
    :func:`_check_dataset` before minari reads any of it."""
    _minari("import_minari")
    from minari.dataset.minari_dataset import MinariDataset  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from minari.storage import get_dataset_path  # type: ignore[import-untyped,import-not-found,unused-ignore]

    if not isinstance(src, (str, os.PathLike)):
        raise BadArgumentError(f"import_minari: src must be a dataset id or a path; got {type(src).__name__}")
    p = os.fspath(src)
    if not os.path.isdir(p):
        if os.path.exists(p):
            raise NotATrajstoreError(f"import_minari: {p} is a file; expected a Minari dataset folder or dataset id")
        folder = os.fspath(get_dataset_path(p))
        if not os.path.isdir(os.path.join(folder, "data")):
            raise StoreNotFoundError(f"import_minari: no local Minari dataset {p!r} (nothing at {folder}); datasets "
                                     "are looked up under MINARI_DATASETS_PATH (default ~/.minari/datasets); nothing "
                                     "is downloaded")
        p, where = folder, p
    else:
        where = ""
    data = p if os.path.isfile(os.path.join(p, "metadata.json")) else os.path.join(p, "data")
    if not os.path.isfile(os.path.join(data, "metadata.json")):
        raise NotATrajstoreError(f"import_minari: {p} is not a Minari dataset folder (expected data/metadata.json "
                                 "or metadata.json)")
    _check_dataset(p, data)
    try:
        return MinariDataset(data), where or os.path.abspath(data)
    except Exception as e:  # noqa: BLE001  # minari raises many kinds for a bad folder
        raise NotATrajstoreError(f"import_minari: {data} cannot be opened by minari ({type(e).__name__}: "
                                 f"{e})") from None


def _check_dataset(folder: str, data: str) -> None:
    """The dataset at ``folder`` (its data folder ``data``) through the foreign gate before minari
    opens any of it by path: no link or special file anywhere below ``folder``
    (:func:`~trajstore.interop.foreign_gate.check_folder`: ``data/main_data.hdf5`` linked out of
    the folder is refused), ``metadata.json`` bounded, with serialized spaces whose shapes fit a
    store (minari would otherwise make the environment ``env_spec`` names, running code the
    dataset chooses, or allocate a Box's bounds from its shape), and the HDF5 file's every link
    and dataset checked (:func:`~trajstore.interop.foreign_gate.open_hdf5`).

    Raises
    ------
    ForeignFileError
        Naming the file and the object.
    """
    what = "import_minari"
    check_folder(folder, what)
    with open_below(data, "metadata.json", what) as fobj:
        raw = fobj.read(MAX_META_BYTES + 1)
    meta = parse_json(raw, data, "metadata.json")
    if not isinstance(meta, dict):
        raise ForeignFileError(f"{data}: metadata.json holds a {type(meta).__name__}; expected an object")
    for key in ("observation_space", "action_space"):
        text = meta.get(key)
        if not isinstance(text, str):
            raise ForeignFileError(f"{data}: metadata.json has no serialized {key}; minari would build it by making "
                                   "the environment its env_spec names (code the dataset chooses), which an import "
                                   "never runs")
        _check_space(parse_json(text, data, f"metadata.json {key}"), f"{data}: metadata.json {key}")
    if meta.get("data_format", "hdf5") == "hdf5":
        h5py = h5py_module(what)
        with open_hdf5(h5py, "main_data.hdf5", what, below=data):
            pass


def _check_space(space: Any, where: str) -> None:
    """Every ``shape`` of a serialized space (minari's JSON) within
    :func:`~trajstore.interop.foreign_gate.check_declared`'s row limit (a Box's bounds are
    allocated from it); nesting is bounded by the JSON parse."""
    level = [space]
    while level:
        nxt: list[Any] = []
        for o in level:
            if isinstance(o, dict):
                shape = o.get("shape")
                if isinstance(shape, list):
                    if not all(type(d) is int and d >= 0 for d in shape):
                        raise ForeignFileError(f"{where}: shape {str(shape)[:80]}; expected non-negative integers")
                    check_declared((1, *shape), np.dtype(np.uint8), None, where)
                nxt.extend(o.values())
            elif isinstance(o, list):
                nxt.extend(o)
        level = nxt


def _tree(x: Any, f: Any) -> Any:
    if isinstance(x, dict):
        return {k: _tree(v, f) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_tree(v, f) for v in x)
    return f(np.asarray(x))


def _info_spaces(infos: Any, steps: int, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in infos.items():
        if isinstance(v, dict):
            sub = _info_spaces(v, steps, f"{where}/{k}")
            if sub:
                out[k] = Dict(sub)
            continue
        a = np.asarray(v)
        if a.ndim < 1 or a.shape[0] not in (steps, steps + 1):
            raise BadValueError(f"{where}/{k} has shape {a.shape}; expected ({steps + 1}, ...) (one per observation)")
        out[k] = box_for(a.dtype, tuple(a.shape[1:]), f"{where}/{k}")
    return out


def _step_infos(infos: Any, steps: int) -> Any:
    """Step infos of an episode: entries 1..T of T+1 (the reset info is dropped)."""
    return {k: _step_infos(v, steps) if isinstance(v, dict) else np.asarray(v)[-steps:] if steps else
            np.asarray(v)[:0] for k, v in infos.items()}


def _json_metadata(meta: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in dict(meta).items():
        v = v.tolist() if hasattr(v, "tolist") else sorted(v) if isinstance(v, (set, frozenset)) else v
        try:
            text = json.dumps(v, allow_nan=False)
        except (TypeError, ValueError):
            continue
        if len(text) <= 1 << 16:
            out[str(k)] = v
    return out


def _env_id(meta: dict[str, Any], where: str) -> str | None:
    """The id of the environment the dataset was recorded in (``env_spec``'s ``id``:
    ``"PointMaze_UMaze-v3"``), the task of every episode; None when the metadata has none."""
    spec = meta.get("env_spec")
    if isinstance(spec, str):
        try:
            spec = parse_json(spec, where, "metadata env_spec")
        except ForeignFileError:
            return None  # not JSON: kept as text in the dataset description only
    name = spec.get("id") if isinstance(spec, dict) else None
    return name if isinstance(name, str) else None


def minari_to_store(src: Any, cache_path: Any, *, tqdm: bool | None = None, overwrite: bool = False,
                    stats: bool = False,
                    **create_kwargs: Any) -> dict[str, Any]:
    """Write the Minari dataset ``src`` to a new store at ``cache_path`` (see :func:`import_minari`).

    Parameters
    ----------
    src : str or path
        A Minari dataset id or dataset folder.
    cache_path : path
        Destination: a local folder that does not exist yet (or is empty).
    tqdm : bool or None
        Progress bar: True / False force it; None shows it on a terminal.
    overwrite : bool
        Replace an existing store at ``cache_path`` (after the new one verified).
    stats : bool
        Store every episode's statistics (``buf.stats()``, docs/robot.md), computed at import.
    **create_kwargs
        Passed to :meth:`TrajectoryReplayBuffer.create`.

    Returns
    -------
    dict
        ``source``, ``destination``, ``steps``, ``episodes``, ``verified`` (True).
    """
    from trajstore.spaces.leaves import leaves

    ds, where = _open(src)
    obs_space, act_space = ds.observation_space, ds.action_space
    leaves(obs_space)  # an unsupported space is refused here, naming its leaf
    leaves(act_space)
    first = next(_read_episodes(ds, where), (None, None))[0]
    info = _info_spaces(first.infos or {}, len(first.rewards), f"{where}: infos") if first is not None else {}
    space = recorder_space(obs_space, act_space, next_obs=True, info=info)
    ep_space = Dict({**EPISODE_SPACE.spaces, "minari_id": Box(0, 2**62, (), np.int64)})
    meta = _json_metadata(ds.storage.metadata)
    with ImportWriter(cache_path, space, what="import_minari", create_kwargs=create_kwargs,
                      total=int(ds.total_steps), tqdm=tqdm, overwrite=overwrite, episode_space=ep_space) as w, \
            MinariFrames(ds, where) as jpegs:
        assert w.buf is not None
        fields = {f.spec.array_path: f for f in w.buf.row_source().table.fields}
        # Image leaves whose JPEG bytes go into both obs and next_obs fields as they are.
        through = [p for p in jpeg_leaves(ds) if all(passes_through(fields.get("/".join(("step_data", side, *p))))
                                                     for side in ("obs", "next_obs"))]
        for ep, seed in _read_episodes(ds, where):
            t = len(ep.rewards)
            if t == 0:
                continue
            passed = _passed_frames(jpegs, ep, t, through, fields, w.steps)
            w.set_episode_extra(w.episodes, {"minari_id": np.int64(ep.id),
                                             "seed": np.int64(-1 if seed is None else int(seed))})
            done = np.zeros(t, np.bool_)
            done[-1] = True
            block: dict[str, Any] = {"obs": _tree(ep.observations, lambda a: a[:t]),
                                     "next_obs": _tree(ep.observations, lambda a: a[1 : t + 1]),
                                     "action": _tree(ep.actions, lambda a: a), "reward": np.asarray(ep.rewards, np.float64),
                                     "terminated": np.asarray(ep.terminations, np.bool_),
                                     "truncated": np.asarray(ep.truncations, np.bool_)}
            if info:
                block["info"] = _step_infos({key: ep.infos[key] for key in info}, t)
            with contextlib.ExitStack() as stack:
                for field, phys_lo, frames, decoded in passed:
                    _put_leaf(block, field.spec.array_path.split("/")[1:], decoded)
                    stack.enter_context(field.frames_as_encoded(phys_lo, frames))
                w.write(block, done)
        out = w.finish({"imported_from": {"format": "minari", "source": where, "metadata": meta}}, stats=stats,
                       task=_env_id(meta, where))
    return {"source": where, **out}


def _passed_frames(jpegs: MinariFrames, ep: Any, t: int, paths: list[tuple[str, ...]], fields: dict[str, Any],
                   phys_lo: int) -> list[tuple[Any, int, list[bytes], np.ndarray]]:
    """``(field, first row, JPEG frames, the frames decoded by the field's codec)`` of the obs and
    next_obs fields of episode ``ep`` (``t`` steps, written from row ``phys_lo``) for each leaf in
    ``paths``: its T+1 stored JPEGs, the first T as obs, the last T as next_obs."""
    out = []
    for path in paths:
        blobs = jpegs.episode(int(ep.id), path, t + 1)
        obs = fields["/".join(("step_data", "obs", *path))]
        decoded = np.empty((t + 1, *obs.spec.row_shape), obs.spec.dtype)
        for i, b in enumerate(blobs):
            try:
                obs.codec.decode_into(b, decoded[i])
            except Exception as e:  # noqa: BLE001  # a frame is input: whatever garbage makes a codec raise
                raise DamagedStoreError(f"import_minari: episode {ep.id}: observations{''.join('/' + k for k in path)} "
                                        f"frame {i} does not decode ({type(e).__name__}: {e})") from None
        nxt = fields["/".join(("step_data", "next_obs", *path))]
        out += [(obs, phys_lo, blobs[:t], decoded[:t]), (nxt, phys_lo, blobs[1:], decoded[1:])]
    return out


def _put_leaf(block: dict[str, Any], keys: list[str], value: np.ndarray) -> None:
    """Set ``block[keys[0]][keys[1]]...`` to ``value``."""
    node = block
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value


def _read_episodes(ds: Any, where: str) -> Iterator[tuple[Any, Any]]:
    """``(episode, its seed or None)`` of the dataset, one at a time; a read error (a damaged
    dataset) as DamagedStoreError."""
    it = iterate_episodes(ds, where)
    k = 0
    while True:
        try:
            ep = next(it)
            seed = next(iter(ds.storage.get_episode_metadata([int(ep.id)]))).get("seed")
        except StopIteration:
            return
        except MemoryError:
            raise
        except Exception as e:  # noqa: BLE001  # minari and h5py raise many kinds for damaged data
            raise DamagedStoreError(f"import_minari: {where}: episode {k} cannot be read ({type(e).__name__}: "
                                    f"{e}); the dataset is damaged") from None
        k += 1
        yield ep, seed


def import_minari(src: Any, cache_path: Any, *, tqdm: bool | None = None, overwrite: bool = False,
                  stats: bool = False,
                  **create_kwargs: Any) -> TrajectoryReplayBuffer:
    """Import a Minari dataset into a new trajectory store with the recorders' schema.

    Each episode's T+1 observations become ``obs`` (the first T) and ``next_obs`` (the last T),
    so the last one is the last step's ``next_obs``; ``actions`` -> ``action``, ``rewards`` ->
    ``reward`` (float64), ``terminations`` / ``truncations`` -> ``terminated`` / ``truncated``,
    step infos (entries 1..T of T+1) -> ``info/<key>``.  The observation and action spaces are
    minari's own (Box, Discrete, Dict, Tuple, ...), kept exactly.  Episode data: ``seed`` (minari's,
    -1 when None), ``return``, ``length``, ``minari_id``.  Dataset metadata (env spec, algorithm,
    author, ...) goes to the dataset description (``trajstore info``); the env spec's ``id`` is every
    episode's task (``buf.tasks``, docs/robot.md).  Read and written one
    episode at a time, under a temporary name, verified, renamed.

    Parameters
    ----------
    src : str or path
        A Minari dataset id (resolved as minari resolves it, under ``MINARI_DATASETS_PATH``; never
        downloaded) or the path of a dataset folder (or its ``data`` folder).
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
        Image observations that minari stores JPEG-encoded (its default) keep their JPEG bytes,
        without a decode/encode round trip, where both their ``obs/<key>`` and ``next_obs/<key>``
        fields are given ``compressor`` ``"jpeg:75"`` (Pillow's quality, which minari writes
        with: ``trajstore.interop.minari.MINARI_JPEG``); any other compressor stores the decoded
        frames (raw by default, or encoded in that codec).

    Returns
    -------
    TrajectoryReplayBuffer
        The new store, open for writing (close it when done).

    Raises
    ------
    StoreNotFoundError
        No local dataset of that id.
    NotATrajstoreError
        A path that is not a Minari dataset folder.
    UnsupportedSpaceError
        A space trajstore cannot store (Text, Graph, ...), or infos that are not numbers.
    MissingDependencyError
        minari is not installed.
    DamagedStoreError
        An episode cannot be read (nothing is left at ``cache_path``).
    ForeignFileError
        The file holds what trajstore never reads (links or storage out of it, special files,
        sizes, nesting or link counts beyond a store's limits); see docs/reliability.md.
    """
    out = minari_to_store(src, cache_path, tqdm=tqdm, overwrite=overwrite, stats=stats, **create_kwargs)
    return TrajectoryReplayBuffer.load_from(out["destination"])


_DATASET_ID = re.compile(r"^(?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]+-v\d+$")
#: Minari data formats an export writes.
_FORMATS = ("hdf5", "arrow")

#: Metadata an export takes over from the source's import (the rest minari computes itself).
_KEPT = ("algorithm_name", "author", "author_email", "code_permalink", "env_spec", "eval_env_spec", "description",
         "ref_min_score", "ref_max_score", "num_episodes_average_score", "requirements")


def export_minari(src: Any, dataset_id: str, *, datasets_path: Any = None, data_format: str = "hdf5",
                  tqdm: bool | None = None, overwrite: bool = False, **metadata: Any) -> str:
    """Write a trajectory store as a Minari dataset (minari's ``hdf5`` or ``arrow`` data format).

    Each episode's ``obs`` (T rows) plus the last step's ``next_obs`` give Minari's T+1
    observations; ``action``, ``reward``, ``terminated``, ``truncated`` its actions, rewards,
    terminations and truncations; ``seed`` (episode data; -1: None) its seed.  The store's spaces
    are the dataset's spaces.  Metadata: what an import from Minari kept (algorithm, author, env
    spec, ...), updated by ``metadata``.  Written one episode at a time under a temporary name,
    opened with minari and counted, then renamed; afterwards ``minari.load_dataset(dataset_id)``
    (with ``MINARI_DATASETS_PATH`` at ``datasets_path``) iterates the same episodes.

    Parameters
    ----------
    src : path or TrajectoryReplayBuffer
        The store (a path is opened read-only): recorders' schema with ``next_obs``; episodes must
        not interleave.
    dataset_id : str
        ``"namespace/name-v0"`` as minari names datasets.
    datasets_path : path, optional
        Root of the datasets folder; default minari's (``MINARI_DATASETS_PATH`` or
        ``~/.minari/datasets``).
    data_format : {"hdf5", "arrow"}
        Minari's data format of the dataset (``"arrow"`` needs pyarrow); written by minari's own
        storage writer either way.
    tqdm : bool or None
        Progress bar: True / False force it; None shows it on a terminal.
    overwrite : bool
        Replace an existing dataset of that id.
    **metadata
        Dataset metadata (``algorithm_name``, ``author``, ``author_email``, ``code_permalink``,
        ``description``, ...), JSON values.

    Returns
    -------
    str
        The dataset's folder (``<datasets_path>/<dataset_id>``).

    Raises
    ------
    BadArgumentError
        ``dataset_id`` is not of the form ``[namespace/]name-v<version>``.
    BadOptionError
        ``data_format`` is not ``"hdf5"`` or ``"arrow"``.
    UnknownFieldError
        The store has no ``next_obs`` (Minari keeps T+1 observations) or lacks a schema field.
    UnsupportedSpaceError
        Step fields outside the schema, or interleaved episodes.
    StoreExistsError
        The dataset exists and ``overwrite`` is False.
    """
    minari = _minari("export_minari")
    from minari.dataset.minari_dataset import MinariDataset  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from minari.dataset.minari_storage import MinariStorage  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from minari.storage import get_dataset_path  # type: ignore[import-untyped,import-not-found,unused-ignore]

    from trajstore.core.progress import progress_bar
    from trajstore.metadata import get_dataset_info

    if not isinstance(dataset_id, str) or not _DATASET_ID.match(dataset_id) or ".." in dataset_id.split("/"):
        raise BadArgumentError(f"export_minari: dataset_id must look like 'namespace/name-v0'; got {dataset_id!r}")
    if data_format not in _FORMATS:
        raise BadOptionError(f"export_minari: data_format must be one of {_FORMATS}; got {data_format!r}")
    root = os.fspath(datasets_path) if datasets_path is not None else os.fspath(get_dataset_path(None))
    out = staged_path(os.path.join(root, dataset_id), "export_minari: dataset folder", overwrite)
    buf, own = export_source(src, "export_minari: src")
    try:
        step_leaves(buf, "export_minari", box_only=(), allowed_extra=("obs", "next_obs"))
        space: Any = buf.step_space
        if "next_obs" not in space.spaces:
            raise UnknownFieldError("export_minari: the store's step data has no next_obs; Minari keeps T+1 "
                                    "observations per episode and the last one is the last step's next_obs "
                                    "(record with record_next_obs=True)")
        blocks = StepBlocks(buf, "export_minari")
        table = buf.episodes()
        ids = table["episode_id"][np.argsort(table["start"], kind="stable")]
        info = get_dataset_info(buf).get("imported_from", {})
        meta = {k: v for k, v in (info.get("metadata") or {}).items() if k in _KEPT} if info.get("format") == \
            "minari" else {}
        meta.update(metadata)
        meta.update(dataset_id=dataset_id, minari_version=minari.__version__)
        json.dumps(meta, allow_nan=False)  # metadata must be JSON (a TypeError / ValueError names the value)
        for k in ("author", "author_email"):  # minari keeps these as sets
            if k in meta:
                meta[k] = {meta[k]} if isinstance(meta[k], str) else set(meta[k])
        with out as tmp:
            bar = progress_bar(blocks.count, f"export_minari {dataset_id}", tqdm, unit="step")
            try:
                os.makedirs(tmp)
                storage = MinariStorage.new(os.path.join(tmp, "data"), observation_space=space["obs"],
                                            action_space=space["action"], data_format=data_format,
                                            jpeg_encoding=False)  # exact values: minari JPEG-encodes images by default
                storage.update_metadata(meta)
                storage.update_episodes(_episodes(buf, ids, bar))
            finally:
                bar.close()
            check = MinariDataset(os.path.join(tmp, "data"))
            if (int(check.total_episodes), int(check.total_steps)) != (len(ids), blocks.count):
                raise DamagedStoreError(f"export_minari: the written dataset holds {check.total_episodes} episodes, "
                                        f"{check.total_steps} steps; expected {len(ids)}, {blocks.count}")
    finally:
        if own:
            buf.close()
    return out.dst


def _episodes(buf: TrajectoryReplayBuffer, ids: np.ndarray, bar: Any) -> Iterator[Any]:
    """Minari EpisodeBuffers of the store's episodes ``ids``, one read at a time."""
    from minari.data_collector.episode_buffer import EpisodeBuffer  # type: ignore[import-untyped,import-not-found,unused-ignore]

    has_seed = buf.layout.episode_plan is not None and any(leaf.name == "seed" for leaf in buf.layout.episode_plan.leaves)
    for k, eid in enumerate(ids.tolist()):
        ep: Any = buf.get_episode(eid)
        sd = ep["step_data"]
        obs = _tree2(sd["obs"], sd["next_obs"], lambda a, b: np.concatenate([a, b[-1:]]))
        seed = int(np.asarray(ep["episode_data"]["seed"])[0]) if has_seed else -1
        t = len(sd["reward"])
        bar.update(t)
        yield EpisodeBuffer(id=k, seed=None if seed < 0 else seed, observations=obs, actions=sd["action"],
                            rewards=np.asarray(sd["reward"]), terminations=np.asarray(sd["terminated"]),
                            truncations=np.asarray(sd["truncated"]), infos={})


def _tree2(x: Any, y: Any, f: Any) -> Any:
    if isinstance(x, dict):
        return {k: _tree2(x[k], y[k], f) for k in x}
    if isinstance(x, tuple):
        return tuple(_tree2(a, b, f) for a, b in zip(x, y))
    return f(np.asarray(x), np.asarray(y))
