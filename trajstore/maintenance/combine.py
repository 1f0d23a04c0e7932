"""Whole-store episode editing: :func:`combine`, :func:`split` and :func:`filter_store` (issue 16).

Each writes new trajectory stores from existing ones, streaming a bounded block of steps at a
time (about 8 MiB, as ``extend_from``), and is all or nothing: a destination is built under a
temporary name in its parent folder (``.<name>.trajstore-partial-<pid>-<random>``), verified
(:mod:`trajstore.maintenance.staged`), and only then renamed into place; on any
error every temporary folder is removed and no destination appears.  Bad input (unequal spaces,
bad ratios, an unknown field, an existing destination) is refused before a byte is written.
Destinations are local folders.

Episode ids: :func:`combine` gives every episode a fresh id (0, 1, ... in the order of the
sources, then of the episodes' first steps) and records where it came from in the episode field
``source``; :func:`split` and :func:`filter_store` keep the source's ids, so a split's episodes
can be matched with the original store.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np

from trajstore.buffers.episode_edit import TABLE_COLUMNS, episode_columns
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.core.progress import progress_bar
from trajstore.errors import (
    BadArgumentError,
    BadOptionError,
    SpaceMismatchError,
    UnsupportedSpaceError,
)
from trajstore.maintenance.robot_meta import carry_robot_info, check_task_strings, merge_tasks, robot_infos
from trajstore.maintenance.staged import (
    StagedFolders,
    adopt_video,
    block_rows,
    check_free,
    copy_steps,
    kept_compressors,
    local_path,
    not_a_source,
    open_source,
    verify_written,
    video_compressors,
)
from trajstore.maintenance.where import compile_where, where_fields
from trajstore.storage.robot_files import RobotInfo

__all__ = ["combine", "split", "filter_store", "SOURCE_FIELD", "combined_episode_space", "space_difference"]

#: The episode field :func:`combine` adds: the index of the episode's source in ``sources``.
SOURCE_FIELD = "source"

PathLike = str | os.PathLike[str]


def _episode_blocks(buf: TrajectoryReplayBuffer, ids: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray,
                                                                                   list[np.ndarray]]]:
    """``(ids, has_data, arrays)`` for blocks of episodes ``ids``: their episode-data leaves (zeros
    where an episode has none)."""
    if buf.layout.episode_plan is None:
        return
    fields = list(range(len(buf.layout.episode_plan.leaves)))
    step = block_rows(buf.layout.episode_table.row_bytes if buf.layout.episode_table is not None else 1)
    for lo in range(0, len(ids), step):
        part = ids[lo : lo + step]
        yield part, buf.episode_index.lookup(part) >= 0, buf.layout.episode_rows(buf.episode_index, part, fields)


def space_difference(got: gymnasium.Space | None, want: gymnasium.Space | None, got_name: str = "the first",
                     want_name: str = "the second", at: str = "") -> str:
    """Where two unequal spaces first differ, for messages: ``"at key 'obs/pos': Box(...) in A, Box(...)
    in B"``, ``"key 'reward' is in B, not in A"`` (Dict and Tuple spaces are walked key by key), or
    the two spaces themselves."""
    if isinstance(got, gymnasium.spaces.Dict) and isinstance(want, gymnasium.spaces.Dict):
        for key in want.spaces:
            if key not in got.spaces:
                return f"key {at + key!r} is in {want_name}, not in {got_name}"
            if got.spaces[key] != want.spaces[key]:
                return space_difference(got.spaces[key], want.spaces[key], got_name, want_name, f"{at}{key}/")
        extra = [key for key in got.spaces if key not in want.spaces]
        if extra:
            return f"key {at + extra[0]!r} is in {got_name}, not in {want_name}"
    if (isinstance(got, gymnasium.spaces.Tuple) and isinstance(want, gymnasium.spaces.Tuple)
            and len(got.spaces) == len(want.spaces)):
        for i, (g, w) in enumerate(zip(got.spaces, want.spaces)):
            if g != w:
                return space_difference(g, w, got_name, want_name, f"{at}{i}/")
    where = f"at key {at.rstrip('/')!r}: " if at else ""
    return f"{where}{got} in {got_name}, {want} in {want_name}"


def _spaces_equal(bufs: Sequence[TrajectoryReplayBuffer], names: Sequence[str]) -> None:
    first = bufs[0]
    for k, b in enumerate(bufs[1:], 1):
        for what, got, want in (("step", b.step_space, first.step_space),
                                ("episode", b.episode_space, first.episode_space)):
            if got != want:
                raise SpaceMismatchError(f"combine: the {what} space of {names[k]} differs from that of {names[0]}, "
                                         f"{space_difference(got, want, str(names[k]), str(names[0]))}")


def combined_episode_space(episode_space: gymnasium.Space | None, n_sources: int) -> gymnasium.spaces.Dict:
    """The episode space of a store combined from ``n_sources`` stores of ``episode_space``.

    Parameters
    ----------
    episode_space : gymnasium.Space or None
        The sources' episode space.
    n_sources : int
        How many sources.

    Returns
    -------
    gymnasium.spaces.Dict
        ``episode_space`` plus ``source``, ``Box(0, n_sources - 1, (), int64)``: a Dict keeps its
        keys (a ``source`` key is replaced), no space gives ``Dict(source=...)``, any other space
        becomes ``Dict(value=episode_space, source=...)``.

    Raises
    ------
    UnsupportedSpaceError
        A Dict episode space whose ``source`` is not a scalar integer Box (it could not hold the
        index).
    """
    src_box = gymnasium.spaces.Box(0, max(n_sources - 1, 0), (), np.int64)
    if episode_space is None:
        return gymnasium.spaces.Dict({SOURCE_FIELD: src_box})
    if isinstance(episode_space, gymnasium.spaces.Dict):
        old = episode_space.spaces.get(SOURCE_FIELD)
        if old is not None and not (isinstance(old, gymnasium.spaces.Box) and old.shape == ()
                                    and np.dtype(old.dtype).kind in "iu"):
            raise UnsupportedSpaceError(f"combine: the sources' episode field {SOURCE_FIELD!r} is {old}; expected a "
                                        f"scalar integer Box to hold the source index (rename that field first)")
        return gymnasium.spaces.Dict({**{k: v for k, v in episode_space.spaces.items() if k != SOURCE_FIELD},
                                      SOURCE_FIELD: src_box})
    return gymnasium.spaces.Dict({"value": episode_space, SOURCE_FIELD: src_box})


# -- combine ---------------------------------------------------------------------------------------
def combine(sources: Sequence[PathLike | TrajectoryReplayBuffer], dst: PathLike, *, tqdm: bool | None = None,
            overwrite: bool = False) -> dict[str, Any]:
    """One trajectory store at ``dst`` holding every episode of ``sources``.

    Episodes keep their steps (in the order of the sources, then of the rows) and their episode
    data, get fresh ids ``0, 1, ...`` and an episode field ``source``: the index of their store in
    ``sources`` (int64).  The episode space is the sources' plus ``source``
    (:func:`combined_episode_space`); episodes without episode data get zeros in the other fields.

    Parameters
    ----------
    sources : sequence of paths or TrajectoryReplayBuffer
        At least one store; equal step spaces and equal episode spaces.  Paths are opened
        read-only; buffers are read as they are (and left open).
    dst : path
        A local folder that does not exist yet (or is empty; ``overwrite=True`` replaces it).
    tqdm : bool or None
        Progress bar: True / False force it; None shows it on a terminal.
    overwrite : bool
        Replace an existing store at ``dst`` (only after the new one was written and verified).

    Returns
    -------
    dict
        ``destination``, ``sources`` (names), ``episodes`` (per source), ``steps`` (per source),
        ``verified`` (True).

    Raises
    ------
    BadArgumentError
        No sources, or a source that is neither a path nor a trajectory buffer.
    SpaceMismatchError
        Two sources' step or episode spaces differ (the message names both).
    StoreExistsError
        ``dst`` exists and ``overwrite`` is False.
    """
    if isinstance(sources, (str, os.PathLike)) or not len(sources):
        raise BadArgumentError("combine: sources must be a non-empty sequence of stores (paths or buffers); got "
                               f"{sources!r}")
    out_path = local_path(dst, "combine: dst")
    not_a_source(out_path, sources)
    check_free(out_path, overwrite)
    opened: list[tuple[TrajectoryReplayBuffer, bool]] = []
    staged = StagedFolders()
    try:
        for k, s in enumerate(sources):
            opened.append(open_source(s, f"combine: sources[{k}]"))
        bufs = [b for b, _ in opened]
        names = [b.cache_path or f"sources[{k}]" for k, b in enumerate(bufs)]
        _spaces_equal(bufs, names)
        videos = [video_compressors(b) for b in bufs]
        if any(v != videos[0] for v in videos[1:]):  # a second lossy encoding is never chosen silently
            k = next(k for k, v in enumerate(videos) if v != videos[0])
            raise BadOptionError(f"combine: the video fields of {names[0]} ({videos[0]}) and {names[k]} "
                                 f"({videos[k]}) differ; combine stores whose video settings are equal")
        ep_space = combined_episode_space(bufs[0].episode_space, len(bufs))
        tables = [b.episodes() for b in bufs]
        total = sum(len(b) for b in bufs)
        bar = progress_bar(total, f"combine into {os.path.basename(out_path)}", tqdm, unit="step")
        infos = robot_infos(bufs, names)  # differing frame rates: refused before a byte is written
        tmp = staged.new(out_path)
        try:
            out = TrajectoryReplayBuffer.create(bufs[0].step_space, episode_data_instance_space=ep_space,
                                                cache_path=tmp, compressor=kept_compressors(bufs[0]))
            try:
                next_id = 0
                merged = RobotInfo(infos[0].fps)
                for k, (b, table) in enumerate(zip(bufs, tables)):
                    src_ids = np.sort(table["episode_id"])
                    # Fresh ids in order of the episodes' first steps.
                    fresh = np.empty(len(src_ids), np.int64)
                    fresh[np.searchsorted(src_ids, table["episode_id"])] = np.arange(next_id, next_id + len(src_ids))
                    next_id += len(src_ids)
                    adopt_video(b, None, out)  # video segments byte for byte (same settings as the first source)
                    for n in copy_steps(b, out, None, lambda e: fresh[np.searchsorted(src_ids, e)]):
                        bar.update(n)
                    _combine_episode_data(b, out, src_ids, fresh, k)
                    merge_tasks(merged, infos[k], src_ids, fresh)
                out.mark_episode_end()
                if merged.fps is not None or merged.tasks:
                    out.put_robot_info(merged)
            finally:
                out.close()
        finally:
            bar.close()
        verify_written(tmp)
        staged.commit(overwrite)
    except BaseException as e:
        raise staged.failed(e)  # e itself, or a StoreFullError naming the destination (cause: e)
    finally:
        for b, own in opened:
            if own:
                b.close()
    return {"destination": out_path, "sources": names, "episodes": [len(t["episode_id"]) for t in tables],
            "steps": [int(t["length"].sum()) for t in tables], "verified": True}


def _combine_episode_data(src: TrajectoryReplayBuffer, out: TrajectoryReplayBuffer, src_ids: np.ndarray,
                          fresh: np.ndarray, k: int) -> None:
    """Episode data of every episode of ``src`` (zeros where it has none) plus ``source = k``."""
    source = np.int64(k)
    ep = src.episode_space
    if src.layout.episode_plan is None:
        for new in fresh.tolist():
            out.set_episode_data_at(new, {SOURCE_FIELD: source})
        return
    plan = src.layout.episode_plan
    pos = 0
    for part, _has, arrays in _episode_blocks(src, src_ids):
        for i in range(len(part)):
            value = plan.from_arrays([a[i] for a in arrays])
            row = ({**{key: v for key, v in value.items() if key != SOURCE_FIELD}, SOURCE_FIELD: source}
                   if isinstance(ep, gymnasium.spaces.Dict) else {"value": value, SOURCE_FIELD: source})
            out.set_episode_data_at(int(fresh[pos + i]), row)
        pos += len(part)


# -- split and filter ------------------------------------------------------------------------------
def _check_ratios(ratios: Any) -> dict[str, float]:
    if not isinstance(ratios, Mapping) or not ratios:
        raise BadArgumentError(f"split: ratios must be a non-empty mapping of split names to fractions, e.g. "
                               f"{{'train': 0.9, 'val': 0.1}}; got {ratios!r}")
    out: dict[str, float] = {}
    for name, r in ratios.items():
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or os.sep in name:
            raise BadOptionError(f"split: split names must be non-empty names without '/'; got {name!r}")
        if isinstance(r, bool) or not isinstance(r, (int, float, np.integer, np.floating)) or not np.isfinite(r) \
                or r < 0:
            raise BadOptionError(f"split: ratio of {name!r} must be a number >= 0; got {r!r}")
        out[name] = float(r)
    total = sum(out.values())
    if abs(total - 1.0) > 1e-6:
        raise BadOptionError(f"split: ratios must sum to 1; got {total:g} from {out}")
    return out


def split_counts(n: int, ratios: Mapping[str, float]) -> dict[str, int]:
    """Episodes per split: ``floor(n * ratio)`` each, the remaining episodes to the splits with the
    largest remainders (ties: in the order given), so the counts add up to ``n``.

    Parameters
    ----------
    n : int
        Episodes to share out.
    ratios : mapping of str to float
        Fractions summing to 1.

    Returns
    -------
    dict of str to int
        Counts in the order of ``ratios``, summing to ``n``.
    """
    names = list(ratios)
    exact = np.array([n * ratios[k] for k in names], np.float64)
    base = np.floor(exact + 1e-9).astype(np.int64)
    rest = n - int(base.sum())
    order = np.argsort(-(exact - base), kind="stable")
    base[order[:rest]] += 1
    return dict(zip(names, base.tolist()))


def _write_selection(src: TrajectoryReplayBuffer, ids: np.ndarray, tmp: str, bar: Any) -> int:
    """A store at ``tmp`` with the spaces of ``src`` and its episodes ``ids`` (sorted), ids kept."""
    out = TrajectoryReplayBuffer.create(src.step_space, episode_data_instance_space=src.episode_space, cache_path=tmp,
                                        compressor=kept_compressors(src))
    steps = 0
    try:
        if len(ids):
            adopt_video(src, ids, out)  # video segments of whole episodes byte for byte
            for n in copy_steps(src, out, ids, lambda e: e):
                bar.update(n)
                steps += n
            if src.layout.episode_plan is not None:
                plan = src.layout.episode_plan
                for part, has, arrays in _episode_blocks(src, ids):
                    for i in np.flatnonzero(has).tolist():
                        out.set_episode_data_at(int(part[i]), plan.from_arrays([a[i] for a in arrays]))
        out.mark_episode_end()
        carry_robot_info(src, ids, out)
    finally:
        out.close()
    return steps


def split(src: PathLike | TrajectoryReplayBuffer, ratios: Mapping[str, float] | None = None,
          dst_prefix: PathLike | None = None, *, seed: int = 0, tqdm: bool | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Split the episodes of ``src`` into stores ``dst_prefix + name``, one per entry of ``ratios``.

    Every episode (with steps) goes to exactly one split, with its steps, its episode data and its
    id.  Which episodes go where is a seeded random permutation: the same ``src``, ``ratios`` and
    ``seed`` always give the same splits.  Split ``name`` gets ``floor(E * ratio)`` episodes, the
    remaining ones going to the largest remainders (:func:`split_counts`).

    Parameters
    ----------
    src : path or TrajectoryReplayBuffer
        The store to split (a path is opened read-only).
    ratios : mapping of str to float
        Split names to fractions >= 0 summing to 1; default ``{"train": 0.9, "val": 0.1}``.
    dst_prefix : path, optional
        Each split is written to ``dst_prefix + name`` (``"out/pendulum_"`` gives
        ``out/pendulum_train``; ``"out/"`` gives ``out/train``).  Default: next to the source,
        ``<src>_`` (``data/pendulum`` gives ``data/pendulum_train``, ``data/pendulum_val``); a
        source without a folder (in memory, a URL) needs one.
    seed : int
        Seed of the permutation of episodes.
    tqdm : bool or None
        Progress bar: True / False force it; None shows it on a terminal.
    overwrite : bool
        Replace existing stores at the destinations.

    Returns
    -------
    dict
        ``source``, ``seed``, ``splits``: per name ``{"destination", "episodes", "steps",
        "episode_ids"}``, ``verified`` (True).

    Raises
    ------
    BadArgumentError
        ``ratios`` is not a non-empty mapping; ``src`` is not a path or a trajectory buffer.
    BadOptionError
        A ratio < 0 or not a number, ratios not summing to 1, a bad split name.
    StoreExistsError
        A destination exists and ``overwrite`` is False.
    """
    r = _check_ratios({"train": 0.9, "val": 0.1} if ratios is None else ratios)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise BadArgumentError(f"split: seed must be an int; got {seed!r}")
    if dst_prefix is None:
        where = src.cache_path if isinstance(src, TrajectoryReplayBuffer) else src
        if where is None or "://" in os.fspath(where) or os.fspath(where).endswith(".zip"):
            raise BadArgumentError(f"split: pass dst_prefix; the source {where!r} is not a local folder to "
                                   "write the splits next to")
        dst_prefix = os.fspath(where).rstrip("/\\") + "_"
    prefix = os.fspath(dst_prefix)
    dsts = {name: local_path(prefix + name, f"split: destination of {name!r}") for name in r}
    for d in dsts.values():
        not_a_source(d, [src])
        check_free(d, overwrite)
    buf, own = open_source(src, "split: src")
    staged = StagedFolders()
    try:
        ids = buf.episodes()["episode_id"]
        perm = np.random.default_rng(seed).permutation(ids)
        counts = split_counts(len(ids), r)
        report: dict[str, Any] = {}
        bar = progress_bar(len(buf), f"split {os.path.basename(os.fspath(buf.cache_path or 'buffer'))}", tqdm,
                        unit="step")
        try:
            lo = 0
            for name, c in counts.items():
                mine = np.sort(perm[lo : lo + c])
                lo += c
                tmp = staged.new(dsts[name])
                steps = _write_selection(buf, mine, tmp, bar)
                verify_written(tmp)
                report[name] = {"destination": dsts[name], "episodes": int(c), "steps": steps,
                                "episode_ids": mine.tolist()}
        finally:
            bar.close()
        staged.commit(overwrite)
        return {"source": buf.cache_path, "seed": int(seed), "splits": report, "verified": True}
    except BaseException as e:
        raise staged.failed(e)  # e itself, or a StoreFullError naming the destination (cause: e)
    finally:
        if own:
            buf.close()


def filter_store(src: PathLike | TrajectoryReplayBuffer, dst: PathLike,
                 where: str | Callable[[dict[str, np.ndarray]], Any], *, tqdm: bool | None = None,
                 overwrite: bool = False) -> dict[str, Any]:
    """Write the episodes of ``src`` for which ``where`` holds to a new store at ``dst`` (ids,
    steps and episode data kept).

    Parameters
    ----------
    src : path or TrajectoryReplayBuffer
        The store to filter (a path is opened read-only).
    dst : path
        A local folder that does not exist yet (``overwrite=True`` replaces it).
    where : str or callable
        An expression of :mod:`trajstore.maintenance.where` over the episode fields (``"return >
        100 and length >= 10"``, ``"task == 'pick cube'"``), or a function as ``filter_episodes`` takes.
        The kept episodes' tasks and the store's fps go along (docs/robot.md).
    tqdm : bool or None
        Progress bar: True / False force it; None shows it on a terminal.
    overwrite : bool
        Replace an existing store at ``dst``.

    Returns
    -------
    dict
        ``source``, ``destination``, ``where`` (the expression, or None for a function),
        ``episodes`` (kept), ``of`` (episodes in ``src``), ``steps`` (kept), ``verified`` (True).

    Raises
    ------
    BadOptionError
        ``where`` is not an expression of the language, or does not give true/false.
    UnknownFieldError
        ``where`` names a field the store's episodes do not have (the message lists them).
    UnknownTaskError
        ``where`` compares ``task`` with a string that is no task of the store.
    StoreExistsError
        ``dst`` exists and ``overwrite`` is False.
    """
    out_path = local_path(dst, "filter: dst")
    not_a_source(out_path, [src])
    check_free(out_path, overwrite)
    buf, own = open_source(src, "filter: src")
    staged = StagedFolders()
    try:
        if callable(where):
            mask = buf.filter_episodes(where).episode_ids
            cols = episode_columns(buf, names=[])
        else:
            names = where_fields(where)
            data_names = [leaf.name or "value" for leaf in buf.layout.episode_plan.leaves] if buf.layout.episode_plan is not None else []
            text = check_task_strings(buf, where) if "task" in names and "task" not in data_names else []
            compile_where(where, list(TABLE_COLUMNS) + data_names + text)  # unknown fields: before reading anything
            cols = episode_columns(buf, names=[n for n in names if n in data_names])
            if text:
                cols["task"] = buf.task_column(cols["episode_id"]).astype(str)
            mask = cols["episode_id"][compile_where(where, cols)(cols)]
        ids = np.sort(np.asarray(mask, np.int64))
        tmp = staged.new(out_path)
        total = int(cols["length"][np.isin(cols["episode_id"], ids)].sum())
        bar = progress_bar(total, f"filter into {os.path.basename(out_path)}", tqdm, unit="step")
        try:
            steps = _write_selection(buf, ids, tmp, bar)
        finally:
            bar.close()
        verify_written(tmp)
        staged.commit(overwrite)
        return {"source": buf.cache_path, "destination": out_path, "where": where if isinstance(where, str) else None,
                "episodes": int(len(ids)), "of": int(len(cols["episode_id"])), "steps": steps, "verified": True}
    except BaseException as e:
        raise staged.failed(e)  # e itself, or a StoreFullError naming the destination (cause: e)
    finally:
        if own:
            buf.close()
