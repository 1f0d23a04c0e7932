"""Diffusion Policy's zarr replay buffers: :func:`import_diffusion_policy` and
:func:`export_diffusion_policy`.

Diffusion Policy (``diffusion_policy/common/replay_buffer.py``) keeps one zarr group: ``data/<key>``
arrays of N rows each (``action``, ``state``, ``img``, ``keypoint``, ...) and ``meta/episode_ends``
(E,) int64, the cumulative end of each episode (episode e is rows ``ends[e-1]:ends[e]``).  Its code
writes zarr format 2 with zarr 2.x, in a folder or a ``.zarr.zip`` file; zarr format 3 is read too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np
from gymnasium.spaces import Dict

from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.core.progress import progress_bar
from trajstore.errors import (
    BadOptionError,
    BadValueError,
    DamagedStoreError,
    NotATrajstoreError,
    TrajstoreError,
    UnsupportedSpaceError,
)
from trajstore.interop._common import (
    Checksums,
    ImportWriter,
    StepBlocks,
    block_rows,
    box_for,
    export_source,
    recorder_space,
    source_file,
    staged_path,
    step_leaves,
)
from trajstore.interop.foreign_gate import check_expansion, check_folder, check_rows, open_zarr, zarr_stored_bytes
from trajstore.storage.fields.foreign import foreign_spec
from trajstore.storage.fields.image_codecs import register_numcodecs_jpeg2k, unreadable_codec

__all__ = ["import_diffusion_policy", "export_diffusion_policy", "diffusion_policy_to_store", "CHUNK_BYTES",
           "check_layout", "read_layout"]

#: Exported arrays are chunked along rows in chunks of about this many bytes (the widest array's).
CHUNK_BYTES = 1 << 20


def _is_zip(path: str) -> bool:
    return path.endswith(".zip") and os.path.isfile(path)


def _open_group(path: str, what: str, zip_file: bool | None = None) -> tuple[Any, Any]:
    """``(root group, zip store or None)`` of a Diffusion Policy store, read-only (``zip_file``:
    whether ``path`` is a zip; None: a file named ``*.zip``)."""
    import zarr

    zs = None
    try:
        if _is_zip(path) if zip_file is None else zip_file:
            zs = zarr.storage.ZipStore(path, mode="r")
            root = zarr.open_group(zs, mode="r")
        else:
            root = zarr.open_group(path, mode="r")
    except Exception as e:  # noqa: BLE001  # zarr raises many kinds for "not a group here"
        if zs is not None:
            zs.close()
        raise NotATrajstoreError(f"{what}: {path} is not a zarr group ({type(e).__name__}: {e}); expected a Diffusion "
                                 "Policy replay buffer (data/<key> arrays and meta/episode_ends)") from None
    return root, zs


#: At most this many episodes are read from ``meta/episode_ends`` (1 GiB of int64).
MAX_EPISODES = 1 << 27
#: ``meta/episode_ends`` is read and checked this many entries at a time.
_ENDS_BLOCK = 1 << 20


def _episode_ends(ends_arr: Any, src: str) -> np.ndarray:
    """``meta/episode_ends`` as (E,) int64, read in blocks and checked as it is read: 1-D integers,
    strictly increasing from a value > 0, at most :data:`MAX_EPISODES` (a store is input: a
    claimed length is never allocated before the values that fill it were seen)."""
    if ends_arr.ndim != 1 or np.dtype(ends_arr.dtype).kind not in "iu":
        raise BadValueError(f"{src}: meta/episode_ends is {ends_arr.dtype} {ends_arr.shape}; expected 1-D integers")
    e = int(ends_arr.shape[0])
    if e > MAX_EPISODES:
        raise BadValueError(f"{src}: meta/episode_ends has {e} entries; at most {MAX_EPISODES} episodes are read")
    parts: list[np.ndarray] = []
    prev = 0
    for lo in range(0, e, _ENDS_BLOCK):
        hi = min(lo + _ENDS_BLOCK, e)
        raw = _read(ends_arr, lo, hi, f"{src}: meta/episode_ends")
        if raw.dtype.kind == "u" and raw.size and int(raw.max()) > np.iinfo(np.int64).max:
            raise BadValueError(f"{src}: meta/episode_ends[{lo}:{hi}] holds values beyond int64")
        block = raw.astype(np.int64)
        steps = np.diff(np.concatenate([[prev], block]))
        if (steps <= 0).any():
            k = lo + int(np.argmax(steps <= 0))
            raise BadValueError(f"{src}: meta/episode_ends must increase strictly from a value > 0 (cumulative "
                                f"episode ends); entry {k} is {int(block[k - lo])} after {prev if k == lo else int(block[k - lo - 1])}")
        prev = int(block[-1])
        parts.append(block)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def check_layout(root: Any, src: str) -> dict[str, Any]:
    """The arrays of a Diffusion Policy store, checked: ``data/`` holds arrays only (``action``
    among them), ``meta/episode_ends`` as :func:`_episode_ends` reads it, and every data array has
    ``ends[-1]`` rows.  Returns ``n`` (rows), ``ends`` (E,) int64, ``arrays`` (key -> zarr array,
    sorted by key) and ``zarr_format``."""
    import zarr

    def node(key: str) -> Any:
        try:
            return root[key]
        except KeyError:
            return None

    data, meta = node("data"), node("meta")
    if not isinstance(data, zarr.Group) or not isinstance(meta, zarr.Group):
        raise NotATrajstoreError(f"{src}: expected the groups data/ and meta/ of a Diffusion Policy replay buffer; "
                                 f"found {sorted(root.keys())}")
    ends_arr = node("meta/episode_ends")
    if not isinstance(ends_arr, zarr.Array):
        raise NotATrajstoreError(f"{src}: expected the array meta/episode_ends; meta/ holds {sorted(meta.keys())}")
    register_numcodecs_jpeg2k()  # real-robot datasets keep frames as imagecodecs' JPEG 2000
    try:
        arrays = {k: a for k, a in sorted(data.arrays())}
    except Exception as e:  # noqa: BLE001  # only a codec it does not know is turned into another error
        err = unreadable_codec(e, src)
        if err is None:
            raise
        raise err from None
    groups = sorted(k for k, _ in data.groups())
    if groups:
        raise NotATrajstoreError(f"{src}: data/ holds groups {groups}; Diffusion Policy keeps one array per key there")
    if "action" not in arrays:
        raise NotATrajstoreError(f"{src}: expected the array data/action; data/ holds {sorted(arrays)}")
    zero_d = [k for k, a in arrays.items() if a.ndim < 1]
    if zero_d:
        raise BadValueError(f"{src}: data/{zero_d[0]} is a 0-d array; expected one row per step along axis 0")
    for k, a in arrays.items():  # lengths first: ends are read only for a store whose arrays agree
        if a.shape[0] != arrays["action"].shape[0]:
            raise BadValueError(f"{src}: data/{k} has shape {a.shape} and data/action {arrays['action'].shape}; "
                                "expected one row per step in every data array")
    n = int(arrays["action"].shape[0])
    if ends_arr.ndim == 1 and int(ends_arr.shape[0]) > n:
        raise BadValueError(f"{src}: meta/episode_ends has {ends_arr.shape[0]} entries for {n} steps; expected at "
                            "most one episode per step")
    ends = _episode_ends(ends_arr, src)
    if (int(ends[-1]) if len(ends) else 0) != n:
        raise BadValueError(f"{src}: meta/episode_ends ends at {int(ends[-1]) if len(ends) else 0} but the data "
                            f"arrays have {n} rows; expected meta/episode_ends[-1] == rows of data/<key>")
    return {"n": n, "ends": ends, "arrays": arrays, "zarr_format": int(root.metadata.zarr_format)}


def read_layout(root: Any, src: str, what: str) -> dict[str, Any]:
    """:func:`check_layout` of a store opened through
    :func:`~trajstore.interop.foreign_gate.open_zarr`, plus ``specs`` (key -> the array's
    :func:`~trajstore.storage.fields.foreign.foreign_spec`: its declared shape, chunks and dtype
    checked against trajstore's own limits) and the rows checked to fit a store; whatever zarr
    raises for metadata it cannot parse is a DamagedStoreError naming ``src``."""
    try:
        lay = check_layout(root, src)
        specs = {key: foreign_spec(a, f"data/{key}", f"{src}: data/{key}") for key, a in lay["arrays"].items()}
    except (TrajstoreError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001  # metadata zarr cannot parse: every kind it raises
        raise DamagedStoreError(f"{what}: {src}: the arrays' metadata cannot be read ({type(e).__name__}: "
                                f"{e})") from None
    check_rows(lay["n"], src)
    return {**lay, "specs": specs}


def _layout(root: Any, src: str) -> dict[str, Any]:
    """:func:`read_layout` plus the recorders' space an import writes."""
    lay = read_layout(root, src, "import_diffusion_policy")
    specs = lay["specs"]
    obs: dict[str, gymnasium.Space[Any]] = {k: box_for(s.dtype, s.row_shape, f"{src}: data/{k}")
                                            for k, s in specs.items() if k != "action"}
    if not obs:
        raise NotATrajstoreError(f"{src}: data/ holds only action; expected observation arrays too (state, img, ...)")
    act = box_for(specs["action"].dtype, specs["action"].row_shape, f"{src}: data/action")
    return {**lay, "space": recorder_space(Dict(obs), act, next_obs=False, info=None)}


def _read(a: Any, lo: int, hi: int, where: str) -> np.ndarray:
    try:
        return np.asarray(a[lo:hi])
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001  # a damaged chunk: a codec error of any kind
        raise DamagedStoreError(f"{where}: rows {lo}:{hi} cannot be read ({type(e).__name__}: {e}); the store is "
                                "damaged") from None


def _keep_jpeg2k(arrays: dict[str, Any], create_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``create_kwargs`` where frames stored as JPEG 2000 stay JPEG 2000: each such ``data/<key>``
    (uint8/uint16 frames) gets compressor ``"jpeg2k"`` (lossless, so the frames are the source's
    decoded pixels exactly) unless a ``compressor`` is given for it or for all fields."""
    comp = create_kwargs.get("compressor", {})
    if not isinstance(comp, dict):
        return create_kwargs
    keep = {f"obs/{k}": "jpeg2k" for k, a in arrays.items()
            if k != "action" and getattr(getattr(a.metadata, "compressor", None), "codec_id", None) == "imagecodecs_jpeg2k"
            and a.dtype in (np.uint8, np.uint16) and a.ndim in (3, 4)}
    return {**create_kwargs, "compressor": {**keep, **comp}} if keep else create_kwargs


def diffusion_policy_to_store(path: Any, cache_path: Any, *, tqdm: bool | None = None, overwrite: bool = False,
                              stats: bool = False,
                              **create_kwargs: Any) -> dict[str, Any]:
    """Write the Diffusion Policy store ``path`` to a new store at ``cache_path`` (see
    :func:`import_diffusion_policy`).

    Parameters
    ----------
    path : path
        A zarr folder or ``.zarr.zip`` file (format 2 or 3).
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
    src = source_file(path, "import_diffusion_policy: path")
    if os.path.isdir(src):  # every link or special file refused before the destination exists
        check_folder(src, "import_diffusion_policy")
    loc, root = open_zarr(src, "import_diffusion_policy")
    try:
        lay = _layout(root, src)
        n, ends, arrays = lay["n"], lay["ends"], lay["arrays"]
        for k, spec in lay["specs"].items():  # an import reads every row: they must be in the store
            check_expansion(n * spec.row_bytes, zarr_stored_bytes(src, f"data/{k}"), f"{src}: data/{k}", slack=1 << 20)
        row_bytes = sum(int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize for a in arrays.values())
        step = block_rows(row_bytes)
        info = {"imported_from": {"format": "diffusion_policy", "path": src, "zarr_format": lay["zarr_format"],
                                  "keys": sorted(arrays)}}
        done_all_at = ends - 1  # last row of each episode
        create_kwargs = _keep_jpeg2k(arrays, create_kwargs)
        with ImportWriter(cache_path, lay["space"], what="import_diffusion_policy", create_kwargs=create_kwargs,
                          total=n, tqdm=tqdm, overwrite=overwrite) as w:
            for lo in range(0, n, step):
                hi = min(lo + step, n)
                done = np.zeros(hi - lo, np.bool_)
                sel = done_all_at[(done_all_at >= lo) & (done_all_at < hi)]
                done[sel - lo] = True
                obs = {k: _read(a, lo, hi, f"{src}: data/{k}") for k, a in arrays.items() if k != "action"}
                w.write({"obs": obs, "action": _read(arrays["action"], lo, hi, f"{src}: data/action"),
                         "reward": np.zeros(hi - lo), "terminated": np.zeros(hi - lo, np.bool_),
                         "truncated": done}, done)
            out = w.finish(info, stats=stats)
    finally:
        loc.close()
    return {"source": src, **out}


def import_diffusion_policy(path: Any, cache_path: Any, *, tqdm: bool | None = None, overwrite: bool = False,
                            stats: bool = False,
                            **create_kwargs: Any) -> TrajectoryReplayBuffer:
    """Import a Diffusion Policy replay buffer (zarr format 2 or 3, folder or ``.zarr.zip``) into a
    new trajectory store with the recorders' schema.

    Mapping: ``data/action`` -> ``action``; every other ``data/<key>`` (N, ...) -> ``obs/<key>``
    (a Dict observation space, dtypes and shapes kept; frames stored as imagecodecs' JPEG 2000, as
    real-robot datasets keep them, stay JPEG 2000: an image field of compressor ``"jpeg2k"``,
    lossless, unless ``compressor`` says otherwise, e.g. ``compressor={"obs/img": "jpeg:90"}``); ``meta/episode_ends`` -> episode ids 0, 1,
    ... (episode e is rows ``ends[e-1]:ends[e]``).  Diffusion Policy records demonstrations
    without rewards or terminal states: ``reward`` is 0, ``terminated`` False, ``truncated`` True
    at the last step of each episode.  Episode data: ``seed`` -1, ``return`` 0, ``length``.
    Streams blocks of about 8 MiB; the store is built under a temporary name, verified, renamed.

    Parameters
    ----------
    path : path
        The zarr folder or ``.zarr.zip`` file: ``data/<key>`` arrays of N rows (``action``
        required), ``meta/episode_ends`` (E,) integers, strictly increasing, ``ends[-1] == N``.
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
        ``path`` is not a zarr group, or lacks ``data/action`` or ``meta/episode_ends``.
    BadValueError
        ``episode_ends`` not strictly increasing, or arrays whose length is not ``ends[-1]``.
    DamagedStoreError
        A chunk cannot be read (nothing is left at ``cache_path``).
    ForeignFileError
        The file holds what trajstore never reads (links or storage out of it, special files,
        sizes, nesting or link counts beyond a store's limits); see docs/reliability.md.
    """
    out = diffusion_policy_to_store(path, cache_path, tqdm=tqdm, overwrite=overwrite, stats=stats, **create_kwargs)
    return TrajectoryReplayBuffer.load_from(out["destination"])


def _data_keys(names: dict[str, int], leaves: Any) -> dict[int, str]:
    """``{step leaf index: Diffusion Policy key}``: ``action``, and each ``obs`` leaf as ``data/<key>``
    (a single-array ``obs``: ``obs``).

    Raises
    ------
    UnsupportedSpaceError
        An ``obs`` leaf nested below a Dict's keys, or an ``obs`` key ``action``.
    """
    keys: dict[int, str] = {}
    for name, k in names.items():
        if name == "action":
            keys[k] = "action"
        elif name == "obs" or (name.startswith("obs/") and name.count("/") == 1):
            keys[k] = name.split("/")[-1] if "/" in name else "obs"
        elif name.startswith("obs/"):
            raise UnsupportedSpaceError(f"export_diffusion_policy: obs leaf {name!r} is nested; Diffusion Policy "
                                        "keeps one flat data/<key> array per key (a Box or a Dict of Boxes)")
    if "action" in [keys[k] for k in keys if leaves[k].name != "action"]:
        raise UnsupportedSpaceError("export_diffusion_policy: obs has a key 'action', which would collide with "
                                    "data/action")
    return keys


def export_diffusion_policy(src: Any, path: Any, *, zarr_format: int = 2, tqdm: bool | None = None,
                            overwrite: bool = False) -> dict[str, Any]:
    """Write a trajectory store as a Diffusion Policy replay buffer.

    ``obs`` leaves become ``data/<key>`` (a Dict observation's keys; a single-array ``obs`` becomes
    ``data/obs``), ``action`` becomes ``data/action``, and the episode boundaries
    ``meta/episode_ends`` (int64).  Chunks of about 1 MiB along rows, Blosc lz4 (Diffusion Policy's
    default); ``meta/episode_ends`` uncompressed.  The store is read back and compared (SHA-256
    per array), then renamed into place.

    Parameters
    ----------
    src : path or TrajectoryReplayBuffer
        The store (a path is opened read-only), recorders' schema; ``obs`` a Box or a flat Dict of
        Boxes / Discretes; episodes must not interleave.
    path : path
        Destination: a folder (``.zarr``) or a zip file (a name ending in ``.zip``).
    zarr_format : int
        2 (what Diffusion Policy's zarr 2.x code reads) or 3.
    tqdm : bool or None
        Progress bar: True / False force it; None shows it on a terminal.
    overwrite : bool
        Replace an existing file or folder at ``path``.

    Returns
    -------
    dict
        ``source``, ``destination``, ``steps``, ``episodes``, ``zarr_format``, ``verified`` (True).

    Raises
    ------
    BadOptionError
        ``zarr_format`` is not 2 or 3.
    UnknownFieldError
        The step data lacks a field of the recorders' schema.
    UnsupportedSpaceError
        ``obs`` nested deeper than one Dict level, other step fields, or interleaved episodes.
    StoreExistsError
        ``path`` exists and ``overwrite`` is False.
    """
    import numcodecs
    import zarr

    if zarr_format not in (2, 3):
        raise BadOptionError(f"export_diffusion_policy: zarr_format must be 2 or 3; got {zarr_format!r}")
    out = staged_path(path, "export_diffusion_policy: path", overwrite)
    zip_out = out.dst.endswith(".zip")
    buf, own = export_source(src, "export_diffusion_policy: src")
    try:
        names = step_leaves(buf, "export_diffusion_policy", box_only=(), allowed_extra=("obs", "next_obs"))
        leaves = buf.layout.step_plan.leaves
        keys = _data_keys(names, leaves)
        blocks = StepBlocks(buf, "export_diffusion_policy")
        n = blocks.count
        # Chunks of about 1 MiB (the widest array's) along rows, each written once and whole (a zip
        # cannot replace an entry): rows are regrouped from the store's blocks into whole chunks.
        step = max(1, CHUNK_BYTES // max(1, sum(leaves[k].dtype.itemsize * int(np.prod(leaves[k].shape,
                                                                                         dtype=np.int64))
                                                for k in keys)))
        sums = Checksums()
        ends: list[int] = []
        with out as tmp:
            zs = zarr.storage.ZipStore(tmp, mode="w") if zip_out else None
            bar = progress_bar(n, f"export_diffusion_policy to {os.path.basename(out.dst)}", tqdm, unit="step")
            try:
                root = zarr.open_group(zs if zs is not None else tmp, mode="w", zarr_format=2 if zarr_format == 2 else 3)
                root.require_group("data")
                root.require_group("meta")
                comp = (numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.NOSHUFFLE) if zarr_format == 2
                        else zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="noshuffle"))
                arrs = {k: root.create_array(f"data/{key}", shape=(n, *leaves[k].shape), dtype=leaves[k].dtype,
                                             chunks=(max(1, min(step, n)), *leaves[k].shape), compressors=comp)
                        for k, key in keys.items()}
                lo = 0
                for arrays, end in _whole_chunks(blocks, list(keys), step):
                    hi = lo + len(end)
                    for k, a in arrs.items():
                        a[lo:hi] = arrays[k]
                        sums.add(f"data/{keys[k]}", arrays[k])
                    ends.extend((lo + np.flatnonzero(end) + 1).tolist())
                    bar.update(hi - lo)
                    lo = hi
                if n and (not ends or ends[-1] != n):
                    ends.append(n)
                e = root.create_array("meta/episode_ends", shape=(len(ends),), dtype=np.int64,
                                      chunks=(max(1, len(ends)),), compressors=None)
                if ends:
                    e[:] = np.asarray(ends, np.int64)
                sums.add("meta/episode_ends", np.asarray(ends, np.int64))
            finally:
                bar.close()
                if zs is not None:
                    zs.close()
            _check_written(tmp, zip_out, sums.digest(), step, n)
    finally:
        if own:
            buf.close()
    return {"source": buf.cache_path, "destination": out.dst, "steps": n, "episodes": len(ends),
            "zarr_format": zarr_format, "verified": True}


def _whole_chunks(blocks: Any, fields: list[int], rows: int) -> Iterator[tuple[dict[int, np.ndarray], np.ndarray]]:
    """The steps of ``blocks`` (``(arrays, end)`` of any length) regrouped into runs of exactly
    ``rows`` rows (the last one shorter): ``({field: rows of it}, end flags)``."""
    parts: list[tuple[dict[int, np.ndarray], np.ndarray]] = []
    have = 0

    def take(count: int) -> tuple[dict[int, np.ndarray], np.ndarray]:
        nonlocal have
        out_arrays: dict[int, list[np.ndarray]] = {k: [] for k in fields}
        out_end: list[np.ndarray] = []
        need = count
        while need:
            arrays, end = parts[0]
            m = min(need, len(end))
            for k in fields:
                out_arrays[k].append(arrays[k][:m])
            out_end.append(end[:m])
            if m == len(end):
                parts.pop(0)
            else:
                parts[0] = ({k: arrays[k][m:] for k in fields}, end[m:])
            need -= m
        have -= count
        return {k: np.concatenate(v) for k, v in out_arrays.items()}, np.concatenate(out_end)

    for arrays, end in blocks:
        parts.append(({k: np.asarray(arrays[k]) for k in fields}, np.asarray(end)))
        have += len(end)
        while have >= rows:
            yield take(rows)
    if have:
        yield take(have)


def _check_written(path: str, zip_file: bool, want: dict[str, str], step: int, n: int) -> None:
    """Read the written store back in blocks and compare each array's SHA-256."""
    root, zs = _open_group(path, "export_diffusion_policy", zip_file)
    try:
        got = Checksums()
        for name in want:
            a = root[name]
            if name == "meta/episode_ends":
                got.add(name, np.asarray(a[:], np.int64))
                continue
            for lo in range(0, n, step):
                got.add(name, np.asarray(a[lo : min(lo + step, n)]))
        if got.digest() != want:
            bad = sorted(k for k in want if got.digest().get(k) != want[k])
            raise DamagedStoreError(f"export_diffusion_policy: {path}: arrays {bad} read back differ from what was "
                                    "written")
    finally:
        if zs is not None:
            zs.close()

