"""robomimic's HDF5 datasets: :func:`import_robomimic`.

A robomimic file holds one group per demonstration, ``data/demo_<i>``, each with ``obs/<key>``
(N, ...), ``next_obs/<key>``, ``actions`` (N, A), ``rewards`` (N,), ``dones`` (N,) and often
``states`` (N, S) (simulator states); ``data`` carries the attribute ``env_args`` (JSON), and the
optional group ``mask`` lists demos per split (``mask/train``, ``mask/valid``, ...: arrays of
demo names as bytes).
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
from gymnasium.spaces import Box, Dict

from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import BadValueError, ForeignFileError, NotATrajstoreError
from trajstore.interop._common import ImportWriter, block_rows, box_for, nest, recorder_space, source_file
from trajstore.interop.foreign_gate import check_rows, h5py_module, open_hdf5, parse_json, read_attr, read_rows
from trajstore.recording import EPISODE_SPACE

__all__ = ["import_robomimic", "robomimic_to_store"]

_DEMO = re.compile(r"^demo_(\d+)$")
#: Largest demo index (it becomes the int64 episode field ``demo``, a Box up to 2**62).
MAX_DEMO = 2**62
#: Per-step datasets of a demo that the schema names (the rest become ``info/<path>``).
_NAMED = ("actions", "rewards", "dones")


def _leaf_datasets(h5py: Any, group: Any, prefix: str = "") -> dict[str, Any]:
    """``{path below group: dataset}`` of every dataset under ``group`` (nested groups joined by '/')."""
    out: dict[str, Any] = {}
    for key in sorted(group.keys()):
        node = group[key]
        if isinstance(node, h5py.Group):
            out.update(_leaf_datasets(h5py, node, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = node
    return out


def _spaces(flat: dict[str, Box]) -> Dict:
    """Nested Dict spaces from ``{"a/b": Box}``."""
    def build(node: dict[str, Any]) -> Dict:
        return Dict({k: build(v) if isinstance(v, dict) else v for k, v in node.items()})

    return build(nest(flat))


def _layout(h5py: Any, f: Any, src: str) -> dict[str, Any]:
    """Demos in order, their datasets checked against the first demo's, masks; nothing written.

    Steps: the demo groups (:func:`_demo_names`), each demo's datasets (:func:`_demo_leaves`),
    the step space from the first demo (:func:`_step_space`), the masks (:func:`_masks`), the
    episode space and ``env_args`` (:func:`_env_args`)."""
    data, names = _demo_names(h5py, f, src)
    ref: dict[str, Any] | None = None
    demos: list[tuple[str, int, dict[str, Any]]] = []
    for name in names:
        leaves, n = _demo_leaves(h5py, data[name], src, name)
        sig = {p: (d.dtype, d.shape[1:]) for p, d in leaves.items()}
        if ref is None:
            ref = sig
        elif sig != ref:
            diff = sorted(set(sig) ^ set(ref)) or sorted(p for p in sig if sig[p] != ref[p])
            p = diff[0]
            raise BadValueError(f"{src}: data/{name} differs from data/{names[0]} at {p!r}: "
                                f"{sig.get(p, 'missing')} vs {ref.get(p, 'missing')}; every demo needs the same "
                                "datasets, dtypes and shapes")
        if n > 0:
            demos.append((name, int(name[5:]), leaves))
    space = _step_space(_leaf_datasets(h5py, data[names[0]]), src, names[0])
    masks = _masks(h5py, f, src)
    ep = dict(EPISODE_SPACE.spaces)
    ep["demo"] = Box(0, 2**62, (), np.int64)
    if masks:
        bool_box = Box(0, 1, (), np.bool_)  # type: ignore[arg-type]  # gymnasium annotates no bool dtype; Box takes it
        ep["mask"] = Dict({k: bool_box for k in masks})
    return {"demos": demos, "space": space, "episode_space": Dict(ep), "masks": masks, "env_args": _env_args(data, src),
            "skipped": [n for n in names if n not in {d[0] for d in demos}]}


def _demo_names(h5py: Any, f: Any, src: str) -> tuple[Any, list[str]]:
    """The group ``data`` and its ``demo_<i>`` groups' names, by index (at least one, each index
    at most :data:`MAX_DEMO`)."""
    data = f.get("data")
    if not isinstance(data, h5py.Group):
        raise NotATrajstoreError(f"{src}: expected a group 'data' holding demo_0, demo_1, ...; the file has "
                                 f"{sorted(f.keys())[:20]}")
    names = [k for k in data.keys() if _DEMO.match(k) and isinstance(data[k], h5py.Group)]
    if not names:
        raise NotATrajstoreError(f"{src}: data/ holds no demo_<i> groups; it has {sorted(data.keys())[:10]}")
    big = [k for k in names if len(k) > 24 or int(k[5:]) > MAX_DEMO]
    if big:
        raise ForeignFileError(f"{src}: data/{big[0][:40]}: a demo index beyond {MAX_DEMO} (the int64 episode field "
                               "'demo' holds it); not plausible")
    names.sort(key=lambda k: int(k[5:]))
    return data, names


def _demo_leaves(h5py: Any, g: Any, src: str, name: str) -> tuple[dict[str, Any], int]:
    """``({path: dataset}, steps)`` of the demo group ``g`` (``data/<name>``): it holds obs,
    actions, rewards and dones, every dataset has a row per step and rewards/dones are 1-D."""
    for need in ("obs", "actions", "rewards", "dones"):
        if need not in g:
            raise NotATrajstoreError(f"{src}: data/{name} has no {need!r}; a robomimic demo holds obs/*, "
                                     f"next_obs/*, actions, rewards, dones (it has {sorted(g.keys())[:20]})")
    leaves = _leaf_datasets(h5py, g)
    n = int(g["actions"].shape[0]) if g["actions"].ndim else -1
    for path, d in leaves.items():
        if d.ndim < 1 or d.shape[0] != n:
            raise BadValueError(f"{src}: data/{name}/{path} has shape {d.shape}; expected ({n}, ...) like "
                                f"data/{name}/actions")
    for k in ("rewards", "dones"):
        if leaves[k].shape != (n,):
            raise BadValueError(f"{src}: data/{name}/{k} has shape {leaves[k].shape}; expected ({n},)")
    return leaves, n


def _step_space(leaves0: dict[str, Any], src: str, first: str) -> Dict:
    """The recorder's step space from the first demo's datasets ``leaves0`` (``data/<first>``):
    obs, next_obs (the same keys), actions, and every other dataset under ``info``."""
    def box(path: str) -> Box:
        d = leaves0[path]
        return box_for(d.dtype, tuple(d.shape[1:]), f"{src}: data/{first}/{path}")

    obs = {p[len("obs/"):]: box(p) for p in leaves0 if p.startswith("obs/")}
    nxt = {p[len("next_obs/"):]: box(p) for p in leaves0 if p.startswith("next_obs/")}
    if nxt and set(nxt) != set(obs):
        raise BadValueError(f"{src}: next_obs keys {sorted(nxt)} differ from obs keys {sorted(obs)}")
    info = {p: box(p) for p in leaves0 if not p.startswith(("obs/", "next_obs/")) and p not in _NAMED}
    if leaves0["rewards"].dtype.kind not in "biuf" or leaves0["dones"].dtype.kind not in "biuf":
        raise BadValueError(f"{src}: rewards and dones must be numbers; got {leaves0['rewards'].dtype} and "
                            f"{leaves0['dones'].dtype}")
    return recorder_space(_spaces(obs), box("actions"), next_obs=bool(nxt),
                          info=_spaces(info).spaces if info else None)


def _masks(h5py: Any, f: Any, src: str) -> dict[str, set[str]]:
    """``{split: demo names}`` from the optional group ``mask`` (each a 1-D array of names)."""
    masks: dict[str, set[str]] = {}
    if isinstance(f.get("mask"), h5py.Group):
        for key in sorted(f["mask"].keys()):
            d = f["mask"][key]
            if not isinstance(d, h5py.Dataset) or d.ndim != 1 or d.dtype.kind not in "SOU":
                raise BadValueError(f"{src}: mask/{key} is not a 1-D array of demo names (got "
                                    f"{getattr(d, 'dtype', 'a group')} {getattr(d, 'shape', '')})")
            masks[key] = {v.decode() if isinstance(v, bytes) else str(v) for v in d[()]}  # demo names: small
    return masks


def _env_args(data: Any, src: str) -> Any:
    """``data``'s attribute ``env_args`` parsed as JSON; None when absent or not JSON text (a
    bomb is refused)."""
    env_args: Any = read_attr(data, "env_args", f"{src}: data")
    try:
        return parse_json(env_args, src, "data attribute env_args") if isinstance(env_args, (str, bytes)) else None
    except ForeignFileError as e:
        if "not valid JSON" not in str(e):  # text that is not JSON is left out; a bomb is refused
            raise
        return None


def _env_name(env_args: Any) -> str | None:
    """The environment robomimic recorded the demos in (``env_args["env_name"]``: ``"Lift"``), the
    task of every demo (robomimic's datasets hold one task each); None when absent."""
    name = env_args.get("env_name") if isinstance(env_args, dict) else None
    return name if isinstance(name, str) else None


def robomimic_to_store(path: Any, cache_path: Any, *, tqdm: bool | None = None, overwrite: bool = False,
                       stats: bool = False,
                       **create_kwargs: Any) -> dict[str, Any]:
    """Write the robomimic file ``path`` to a new store at ``cache_path`` (see
    :func:`import_robomimic`).

    Parameters
    ----------
    path : path
        A robomimic HDF5 file.
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
        ``source``, ``destination``, ``steps``, ``episodes``, ``skipped`` (empty demos), ``task``
        (the task given to every demo), ``stats`` (whether stored), ``verified`` (True).
    """
    h5py = h5py_module("import_robomimic")
    src = source_file(path, "import_robomimic: path")
    if os.path.isdir(src):
        raise NotATrajstoreError(f"import_robomimic: {src} is a folder; expected a robomimic HDF5 file (data/demo_<i>)")
    with open_hdf5(h5py, src, "import_robomimic") as f:
        lay = _layout(h5py, f, src)
        demos, masks = lay["demos"], lay["masks"]
        total = sum(int(leaves["actions"].shape[0]) for _, _, leaves in demos)
        check_rows(total, f"{src}: data")
        row_bytes = sum(int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize for d in demos[0][2].values())
        step = block_rows(row_bytes)
        info = {"imported_from": {"format": "robomimic", "path": src, "env_args": lay["env_args"],
                                  "masks": sorted(masks)}}
        with ImportWriter(cache_path, lay["space"], what="import_robomimic", create_kwargs=create_kwargs,
                          total=total, tqdm=tqdm, overwrite=overwrite, episode_space=lay["episode_space"]) as w:
            for k, (name, index, leaves) in enumerate(demos):
                extra: dict[str, Any] = {"demo": np.int64(index)}
                if masks:
                    extra["mask"] = {m: np.bool_(name in members) for m, members in masks.items()}
                w.set_episode_extra(k, extra)
                n = int(leaves["actions"].shape[0])
                for lo in range(0, n, step):
                    hi = min(lo + step, n)
                    rows = {p: read_rows(d, lo, hi, f"{src}: data/{name}/{p}") for p, d in leaves.items()}
                    done = np.zeros(hi - lo, np.bool_)
                    if hi == n:
                        done[-1] = True
                    term = rows.pop("dones") != 0
                    block: dict[str, Any] = {
                        "obs": nest({p[4:]: v for p, v in rows.items() if p.startswith("obs/")}),
                        "action": rows.pop("actions"), "reward": rows.pop("rewards").astype(np.float64),
                        "terminated": term, "truncated": done & ~term}
                    nxt = {p[len("next_obs/"):]: v for p, v in rows.items() if p.startswith("next_obs/")}
                    if nxt:
                        block["next_obs"] = nest(nxt)
                    other = {p: v for p, v in rows.items() if not p.startswith(("obs/", "next_obs/"))}
                    if other:
                        block["info"] = nest(other)
                    w.write(block, done)
            out = w.finish(info, stats=stats, task=_env_name(lay["env_args"]))
    return {"source": src, **out, "skipped": lay["skipped"]}


def import_robomimic(path: Any, cache_path: Any, *, tqdm: bool | None = None, overwrite: bool = False,
                     stats: bool = False,
                     **create_kwargs: Any) -> TrajectoryReplayBuffer:
    """Import a robomimic HDF5 dataset into a new trajectory store with the recorders' schema.

    Each demo ``data/demo_<i>`` (in order of i) becomes one episode: ``obs/<key>`` ->
    ``obs/<key>``, ``next_obs/<key>`` -> ``next_obs/<key>``, ``actions`` -> ``action``,
    ``rewards`` -> ``reward`` (float64), ``dones`` -> ``terminated``; ``truncated`` is True at a
    demo's last step when ``dones`` is not; every other per-step dataset (``states``,
    ``action_dict/*``, ...) -> ``info/<path>``.  Episode data: ``seed`` -1, ``return``,
    ``length``, ``demo`` (the i of ``demo_<i>``) and, when the file has ``mask/*``, ``mask/<split>``
    (bool: whether the demo is listed in that split).  ``data``'s ``env_args`` goes to the dataset
    description, and its ``env_name`` (``"Lift"``) is every demo's task (``buf.tasks``, docs/robot.md).  Demos with no steps are skipped.  Streams blocks of about 8 MiB; the store is
    built under a temporary name, verified, renamed.

    Parameters
    ----------
    path : path
        The robomimic HDF5 file; every demo with the same datasets, dtypes and shapes.
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
        Not an HDF5 file, no ``data/demo_<i>`` groups, or a demo without obs, actions, rewards or
        dones.
    BadValueError
        Datasets of unequal lengths, demos that differ in datasets, dtypes or shapes, a bad mask.
    DamagedStoreError
        A block of the file cannot be read (nothing is left at ``cache_path``).
    ForeignFileError
        The file holds what trajstore never reads (links or storage out of it, special files,
        sizes, nesting or link counts beyond a store's limits); see docs/reliability.md.
    """
    out = robomimic_to_store(path, cache_path, tqdm=tqdm, overwrite=overwrite, stats=stats, **create_kwargs)
    return TrajectoryReplayBuffer.load_from(out["destination"])

