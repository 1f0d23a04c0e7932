"""What every import and export shares: the recorders' schema, destinations built under a
temporary name (removed on error, renamed into place once verified), streamed step writing with
episode data, and checks of the stores an export reads.

Imports write local folders only (as :func:`trajstore.maintenance.combine.combine`); exports
write a file or folder next to the destination first and rename it at the end.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np
from gymnasium.spaces import Box, Dict

from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.core.progress import progress_bar
from trajstore.errors import (
    BadArgumentError,
    BadOptionError,
    DamagedStoreError,
    StoreExistsError,
    StoreNotFoundError,
    UnknownFieldError,
    UnsupportedSpaceError,
)
from trajstore.maintenance.staged import (
    BLOCK_BYTES,
    StagedFolders,
    block_rows,
    check_free,
    local_path,
    open_source,
    partial_path,
    step_blocks,
    verify_written,
)
from trajstore.recording import EPISODE_SPACE, step_space
from trajstore.storage.publish import destination_full, publish, remove_entry

__all__ = ["BLOCK_BYTES", "box_for", "ImportWriter", "staged_path", "export_source", "step_leaves",
           "StepBlocks", "source_file", "block_rows", "Checksums", "recorder_space", "check_destination", "nest"]

#: create_kwargs an import does not take (the import decides them).
_RESERVED = ("cache_path", "step_data_capacity", "step_episode_id_capacity", "episode_data_capacity",
             "episode_data_instance_space", "multiprocessing")


def box_for(dtype: np.dtype[Any], shape: tuple[int, ...], where: str) -> Box:
    """The Box a stored array of ``dtype`` and per-row ``shape`` becomes (the widest bounds of its
    dtype); ``where`` names it in the error for a dtype that is not a number or bool."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return Box(0, 1, shape, np.bool_)  # type: ignore[arg-type]  # gymnasium annotates no bool dtype; Box takes it
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return Box(info.min, info.max, shape, dt)
    if dt.kind == "f":
        return Box(-np.inf, np.inf, shape, dt)
    raise UnsupportedSpaceError(f"{where} has dtype {dt}; expected numbers or bools (ints, floats, bool)")


def source_file(path: Any, what: str) -> str:
    """``path`` as an absolute local path that exists (StoreNotFoundError otherwise)."""
    if not isinstance(path, (str, os.PathLike)):
        raise BadArgumentError(f"{what} must be a path (str or os.PathLike); got {type(path).__name__}")
    p = os.path.abspath(os.fspath(path))
    if not os.path.exists(p):
        raise StoreNotFoundError(f"{what} {p}: no such file or folder")
    return p


def _check_create_kwargs(kwargs: dict[str, Any], what: str) -> None:
    bad = sorted(k for k in kwargs if k in _RESERVED)
    if bad:
        raise BadOptionError(f"{what}: {', '.join(bad)} cannot be chosen for an import (it writes a new unbounded "
                             f"store with the recorders' episode data at cache_path)")


def check_destination(dst: Any, overwrite: bool, create_kwargs: dict[str, Any], what: str) -> None:
    """The checks :class:`ImportWriter` makes of its destination and options, for an import that
    wants them before a long read."""
    _check_create_kwargs(create_kwargs, what)
    check_free(local_path(dst, f"{what}: cache_path"), overwrite)


class ImportWriter:
    """A new trajectory store written under a temporary name next to ``dst`` with the recorders'
    schema; :meth:`finish` closes, verifies and renames it into place, and any exception inside
    the ``with`` block removes it.

    Steps arrive in blocks with a done flag per step (``terminated | truncated``, or any other
    episode end); episode ids are 0, 1, ... in order, an episode ends after a step whose done flag
    is set, and each episode gets ``seed`` (-1), ``return`` (sum of rewards) and ``length`` once
    it ends (the trailing episode at :meth:`finish`).  Extra episode fields are set with
    :meth:`set_episode_extra`.
    """

    def __init__(self, dst: Any, space: Dict, *, what: str, create_kwargs: dict[str, Any], total: int,
                 tqdm: bool | None, overwrite: bool, episode_space: Dict | None = None) -> None:
        _check_create_kwargs(create_kwargs, what)
        self.out_path = local_path(dst, f"{what}: cache_path")
        check_free(self.out_path, overwrite)
        self.what, self.overwrite = what, overwrite
        self.space = space
        self.episode_space = episode_space or EPISODE_SPACE
        self.create_kwargs = create_kwargs
        self.total = total
        self.tqdm = tqdm
        self.next_id = 0  # id of the episode the next step belongs to
        self.ret = 0.0
        self.length = 0
        self.steps = 0
        self.episodes = 0
        self.extras: dict[int, dict[str, Any]] = {}
        self.staged = StagedFolders()
        self.buf: TrajectoryReplayBuffer | None = None
        self.bar: Any = None

    def __enter__(self) -> ImportWriter:
        try:
            tmp = self.staged.new(self.out_path)
            self.buf = TrajectoryReplayBuffer.create(self.space, episode_data_instance_space=self.episode_space,
                                                     cache_path=tmp, **self.create_kwargs)
            self.bar = progress_bar(self.total, f"{self.what} into {os.path.basename(self.out_path)}", self.tqdm,
                                 unit="step")
        except BaseException as e:
            self._discard()
            raise destination_full(e, self.out_path)  # e itself unless a full disk
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is not None:
            self._discard()
            err = destination_full(exc, self.out_path)
            if err is not exc:
                raise err

    def _discard(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.buf is not None:
            try:
                self.buf.close()
            except Exception:  # noqa: BLE001  # already failing: removing the folder matters more
                pass
            self.buf = None
        self.staged.discard()

    def set_episode_extra(self, episode: int, values: dict[str, Any]) -> None:
        """Extra episode fields (keys of ``episode_space`` beyond seed/return/length) of episode
        number ``episode``, written when it ends."""
        self.extras[episode] = values

    def _episode_row(self, ret: float, length: int) -> dict[str, Any]:
        row: dict[str, Any] = {"seed": np.int64(-1), "return": np.float64(ret), "length": np.int64(length)}
        row.update(self.extras.pop(self.episodes, {}))
        return row

    def write(self, step: dict[str, Any], done: np.ndarray) -> None:
        """Append a block of steps (step data with a leading axis of B rows, ``done`` (B,) bool)."""
        assert self.buf is not None
        done = np.asarray(done, np.bool_)
        n = len(done)
        if not n:
            return
        before = np.concatenate([[0], np.cumsum(done[:-1], dtype=np.int64)])
        ids = self.next_id + before
        self.buf.extend({"step_data": step, "episode_ids": ids})
        rewards = np.asarray(step["reward"], np.float64)
        ends = np.flatnonzero(done)
        lo = 0
        for e in ends.tolist():
            self.ret += float(rewards[lo : e + 1].sum())
            self.length += e + 1 - lo
            self.buf.set_episode_data_at(self.next_id, self._episode_row(self.ret, self.length))
            self.episodes += 1
            self.next_id += 1
            self.ret, self.length, lo = 0.0, 0, e + 1
        self.ret += float(rewards[lo:].sum())
        self.length += n - lo
        self.steps += n
        self.bar.update(n)

    def finish(self, dataset_info: dict[str, Any] | None = None, *, stats: bool = False,
               task: str | None = None) -> dict[str, Any]:
        """Close the trailing episode (kept even without an end), give every episode the task
        ``task`` and store every episode's statistics (``stats``; docs/robot.md), verify, rename
        into place; returns ``destination``, ``steps``, ``episodes``, ``task`` (the task given, or
        None), ``stats`` (whether stored), ``verified``."""
        assert self.buf is not None
        try:
            if self.length:
                self.buf.set_episode_data_at(self.next_id, self._episode_row(self.ret, self.length))
                self.episodes += 1
            self.buf.mark_episode_end()
            if dataset_info is not None:
                from trajstore.metadata import set_dataset_info

                set_dataset_info(self.buf, **dataset_info)
            task = self._robot(stats, task)
            self.buf.close()
            self.buf = None
            self.bar.close()
            self.bar = None
            tmp = self.staged.pairs[0][0]
            verify_written(tmp)
            check = TrajectoryReplayBuffer.load_from(tmp, read_only=True)
            try:
                got_steps, got_eps = len(check), len(check.episodes()["episode_id"])
            finally:
                check.close()
            if (got_steps, got_eps) != (self.steps, self.episodes):
                raise DamagedStoreError(f"{self.what}: the written store holds {got_steps} steps in {got_eps} episodes; "
                                       f"expected {self.steps} in {self.episodes}")
            self.staged.commit(self.overwrite)
        except BaseException as e:
            self._discard()
            raise destination_full(e, self.out_path)  # e itself unless a full disk
        return {"destination": self.out_path, "steps": self.steps, "episodes": self.episodes, "task": task,
                "stats": bool(stats and self.episodes), "verified": True}

    def _robot(self, stats: bool, task: str | None) -> str | None:
        """Every episode's task and statistics, after the last step (the statistics of the
        committed rows, stored under the commit epoch the copy keeps).  A source's name that is no
        task string (empty, not printable, over 4096 characters) is left out; returns the task given."""
        assert self.buf is not None
        ids = self.buf.episodes()["episode_id"]
        if task is not None and len(ids):
            try:
                self.buf.assign_task(ids, task)
            except BadArgumentError:
                task = None  # the source's own text: not a task, but no reason to refuse the data
        if stats and len(ids):
            self.buf.save_stats()
        return task if len(ids) else None


# -- exports -----------------------------------------------------------------------------------------
class staged_path:
    """A destination file or folder written under a temporary name next to it
    (:func:`~trajstore.maintenance.staged.partial_path`): ``with staged_path(dst, overwrite) as tmp: ...`` puts ``tmp`` at ``dst``
    (:func:`~trajstore.storage.publish.publish`: ``dst`` is its old content or the new one at
    every instant) when the block ends without error, and removes it otherwise (a full disk:
    :class:`~trajstore.errors.StoreFullError` naming ``dst``)."""

    def __init__(self, dst: Any, what: str, overwrite: bool) -> None:
        if not isinstance(dst, (str, os.PathLike)):
            raise BadArgumentError(f"{what} must be a path (str or os.PathLike); got {type(dst).__name__}")
        p = os.fspath(dst)
        if "://" in p or "::" in p:
            raise BadOptionError(f"{what} {p!r}: exports write local files and folders")
        self.dst = os.path.abspath(p)
        self.overwrite = overwrite
        self.tmp = partial_path(self.dst)  # (completes a publish to dst a killed process left half done)
        if os.path.lexists(self.dst) and not overwrite:
            raise StoreExistsError(f"{self.dst}: something already exists there; pass overwrite=True (--overwrite) "
                                   "to replace it")

    def __enter__(self) -> str:
        os.makedirs(os.path.dirname(self.dst), exist_ok=True)
        return self.tmp

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is not None:
            remove_entry(self.tmp)
            err = destination_full(exc, self.dst)
            if err is not exc:
                raise err
            return
        try:
            publish([(self.tmp, self.dst)], overwrite=self.overwrite)
        except BaseException as e:
            remove_entry(self.tmp)
            raise destination_full(e, self.dst)  # e itself unless a full disk


def export_source(src: Any, what: str) -> tuple[TrajectoryReplayBuffer, bool]:
    """``(buffer, opened here)`` of an export's ``src``: a path opened read-only or a buffer."""
    return open_source(src, what)


def step_leaves(buf: TrajectoryReplayBuffer, what: str, *, box_only: tuple[str, ...] = ("obs", "next_obs"),
                allowed_extra: tuple[str, ...] = ()) -> dict[str, int]:
    """Leaf name -> leaf position of ``buf``'s step data, checked to be the recorders' schema:
    ``obs``, ``action``, ``reward``, ``terminated``, ``truncated`` required, ``next_obs`` and
    ``info/*`` allowed; the fields of ``box_only`` must be single arrays (not Dict or Tuple)."""
    if not isinstance(buf.step_space, gymnasium.spaces.Dict):
        raise UnsupportedSpaceError(f"{what}: the store's step space is {buf.step_space}; expected the recorders' "
                                    "Dict(obs, action, reward, terminated, truncated, next_obs?, info?)")
    names = {leaf.name: k for k, leaf in enumerate(buf.layout.step_plan.leaves)}
    missing = [f for f in ("obs", "action", "reward", "terminated", "truncated")
               if f not in names and not any(n.startswith(f + "/") for n in names)]
    if missing:
        raise UnknownFieldError(f"{what}: the store's step data has no {', '.join(missing)} (it has {sorted(names)}); "
                                "expected the recorders' schema obs, action, reward, terminated, truncated")
    extra = [n for n in names if n not in ("obs", "action", "reward", "terminated", "truncated", "next_obs")
             and not n.startswith("info/") and n.split("/")[0] not in allowed_extra]
    if extra:
        for f in box_only:
            if any(n.startswith(f + "/") for n in extra):
                raise UnsupportedSpaceError(f"{what}: step field {f!r} is a {type(buf.step_space[f]).__name__} "
                                            "space; this format holds one array per field (a Box or Discrete)")
        raise UnsupportedSpaceError(f"{what}: step fields {sorted(extra)} have no place in this format (it keeps obs, "
                                    "action, reward, terminated, truncated, next_obs and info/*)")
    return names


class StepBlocks:
    """The steps of a store in row order, a block of about :data:`BLOCK_BYTES` at a time, with an
    ``end`` flag per step: the last step of each run of equal episode ids except the store's very
    last step (the end of a file ends the last episode).  Refuses stores whose episodes interleave."""

    def __init__(self, buf: TrajectoryReplayBuffer, what: str) -> None:
        self.buf = buf
        rows = buf.row_source()
        _first, _lengths, run_ids = rows.runs()
        if len(np.unique(run_ids)) != len(run_ids):
            raise UnsupportedSpaceError(f"{what}: the store's episodes interleave (their steps alternate between "
                                        "episodes); this format keeps each episode's steps together. Write them "
                                        "episode by episode first (trajstore filter / combine copies keep the order)")
        self.episodes = len(run_ids)
        self.count = len(buf)

    def __iter__(self) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
        pending: tuple[list[np.ndarray], np.ndarray] | None = None
        for arrays, eids in step_blocks(self.buf, None):
            if pending is not None:
                parr, peids = pending
                yield parr, self._ends(peids, int(eids[0]))
            pending = (arrays, eids)
        if pending is not None:
            parr, peids = pending
            ends = self._ends(peids, None)
            yield parr, ends

    def _ends(self, eids: np.ndarray, next_id: int | None) -> np.ndarray:
        end = np.empty(len(eids), np.bool_)
        end[:-1] = eids[:-1] != eids[1:]
        end[-1] = False if next_id is None else bool(eids[-1] != next_id)
        return end


class Checksums:
    """SHA-256 per named array, fed block by block: what a writer wrote, compared with what a
    second pass reads back."""

    def __init__(self) -> None:
        self.h: dict[str, Any] = {}

    def add(self, name: str, block: np.ndarray) -> None:
        """Feed the bytes of ``block`` (C order) to the hash of ``name``."""
        self.h.setdefault(name, hashlib.sha256()).update(np.ascontiguousarray(block).tobytes())

    def digest(self) -> dict[str, str]:
        """Hex SHA-256 per name."""
        return {k: v.hexdigest() for k, v in self.h.items()}


def recorder_space(obs: gymnasium.Space, action: gymnasium.Space, *, next_obs: bool,
                   info: dict[str, gymnasium.Space] | None) -> Dict:
    """The recorders' step space (:func:`trajstore.recording.step_space`)."""
    return step_space(obs, action, next_obs=next_obs, info_spaces=info or None)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b": v}`` as nested dicts ``{"a": {"b": v}}`` (the leaf paths of a Dict space's values)."""
    out: dict[str, Any] = {}
    for path, v in flat.items():
        *parents, last = path.split("/")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = v
    return out
