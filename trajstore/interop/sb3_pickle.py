"""stable-baselines3 replay-buffer pickles: :func:`import_sb3_replay_buffer`.

``model.save_replay_buffer(path)`` pickles SB3's ``ReplayBuffer`` or ``DictReplayBuffer``: arrays of
``(buffer_size, n_envs, ...)`` filled as a ring (``pos``, ``full``).  Unpickling runs code named in
the file, so this is the one place trajstore unpickles, and only when the caller passes
``trust=True``.  Unlike the other imports, the pickle is loaded whole into memory (that is how
pickles load); the store is then written in bounded blocks.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
from gymnasium.spaces import Dict

from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import BadOptionError, NotATrajstoreError, UnsupportedSpaceError
from trajstore.interop._common import (
    ImportWriter,
    block_rows,
    box_for,
    check_destination,
    recorder_space,
    source_file,
)
from trajstore.interop.foreign_gate import open_file

__all__ = ["import_sb3_replay_buffer", "sb3_replay_buffer_to_store"]

_KINDS = ("ReplayBuffer", "DictReplayBuffer")


def _check_trust(trust: Any, src: Any) -> None:
    """Refuse (:class:`BadOptionError`, before ``src`` is opened) unless ``trust is True``: a
    truthy string such as ``"no"`` or ``"false"`` must never unpickle."""
    if trust is True:
        return
    if trust is False or trust is None:
        raise BadOptionError(f"import_sb3_replay_buffer: {src} is a pickle, and unpickling runs code named in the "
                             "file; pass trust=True (--trust) only for a file you wrote or trust as you would a "
                             "program. Nothing was read.")
    raise BadOptionError(f"import_sb3_replay_buffer: trust must be True or False; got {trust!r} "
                         f"({type(trust).__name__}). Nothing was read.")


def _load(src: str, trust: bool) -> Any:
    _check_trust(trust, src)
    # Opened through the foreign gate, once: a FIFO, a device or another special file is refused
    # before any read (a plain open of a FIFO blocks until some writer appears).
    with open_file(src, "import_sb3_replay_buffer") as raw:
        head = raw.read(2)
        if len(head) < 2 or head[0] != 0x80:
            raise NotATrajstoreError(f"import_sb3_replay_buffer: {src} is not a pickle (it starts with {head!r}; "
                                     "model.save_replay_buffer writes pickle protocol >= 2, starting with b'\\x80')")
        try:
            from stable_baselines3.common.buffers import DictReplayBuffer, ReplayBuffer
        except ImportError:
            from trajstore._optional import missing

            raise missing("stable_baselines3", "import_sb3_replay_buffer") from None
        import pickle

        raw.seek(0)
        try:
            obj = pickle.load(io.BufferedReader(raw, 1 << 20))  # noqa: S301  # only with trust=True, as documented
        except Exception as e:  # noqa: BLE001  # a truncated or foreign pickle fails in many ways
            raise NotATrajstoreError(f"import_sb3_replay_buffer: {src} cannot be unpickled ({type(e).__name__}: "
                                     f"{e}); expected a file written by model.save_replay_buffer") from None
    if not isinstance(obj, (ReplayBuffer, DictReplayBuffer)) or type(obj).__name__ not in _KINDS:
        raise UnsupportedSpaceError(f"import_sb3_replay_buffer: {src} holds a {type(obj).__module__}."
                                    f"{type(obj).__qualname__}; expected SB3's ReplayBuffer or DictReplayBuffer "
                                    "(HerReplayBuffer and rollout buffers are not supported)")
    return obj


def _order(buf: Any) -> np.ndarray:
    """Ring slots oldest first."""
    size, pos = int(buf.buffer_size), int(buf.pos)
    if buf.full:
        return np.concatenate([np.arange(pos, size), np.arange(0, pos)])
    return np.arange(pos)


def sb3_replay_buffer_to_store(path: Any, cache_path: Any, *, trust: bool = False, tqdm: bool | None = None,
                               overwrite: bool = False, stats: bool = False,
                               **create_kwargs: Any) -> dict[str, Any]:
    """Write the SB3 replay-buffer pickle ``path`` to a new store at ``cache_path`` (see
    :func:`import_sb3_replay_buffer`).

    Parameters
    ----------
    path : path
        A file written by ``model.save_replay_buffer``.
    cache_path : path
        Destination: a local folder that does not exist yet (or is empty).
    trust : bool
        Unpickle the file (runs code named in it); refused (BadOptionError, before the file is
        opened) unless it is ``True`` itself: False or None, and anything else (``"no"``, 1, ...).
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
    _check_trust(trust, path)
    src = source_file(path, "import_sb3_replay_buffer: path")
    if os.path.isdir(src):
        raise NotATrajstoreError(f"import_sb3_replay_buffer: {src} is a folder; expected the .pkl file written by "
                                 "model.save_replay_buffer")
    check_destination(cache_path, overwrite, create_kwargs, "import_sb3_replay_buffer")  # before a long unpickle
    rb = _load(src, trust)
    order = _order(rb)
    n_envs = int(rb.n_envs)
    dict_obs = isinstance(rb.observations, dict)
    obs_arrays: dict[str, np.ndarray] = rb.observations if dict_obs else {"": rb.observations}
    nxt_arrays: dict[str, np.ndarray] | None = None
    if not rb.optimize_memory_usage:
        nxt_arrays = rb.next_observations if dict_obs else {"": rb.next_observations}

    def space_of(arrays: dict[str, np.ndarray]) -> Any:
        boxes: dict[str, Any] = {k: box_for(a.dtype, tuple(a.shape[2:]), f"{src}: observations {k}".rstrip()) for k, a in arrays.items()}
        return Dict(boxes) if dict_obs else boxes[""]

    obs_space = space_of(obs_arrays)
    act = box_for(rb.actions.dtype, tuple(rb.actions.shape[2:]), f"{src}: actions")
    space = recorder_space(obs_space, act, next_obs=nxt_arrays is not None, info=None)
    row_bytes = (sum(a[0, 0].nbytes for a in obs_arrays.values()) * 2 + rb.actions[0, 0].nbytes + 16)
    step = block_rows(row_bytes)
    timeouts = rb.timeouts if rb.handle_timeout_termination else np.zeros_like(rb.dones)
    info = {"imported_from": {"format": "sb3_replay_buffer", "path": src, "class": type(rb).__name__,
                              "buffer_size": int(rb.buffer_size), "n_envs": n_envs, "pos": int(rb.pos),
                              "full": bool(rb.full), "optimize_memory_usage": bool(rb.optimize_memory_usage),
                              "handle_timeout_termination": bool(rb.handle_timeout_termination),
                              "observation_space": str(rb.observation_space),
                              "action_space": str(rb.action_space)}}
    n = len(order)

    def pick(arrays: dict[str, np.ndarray], rows: np.ndarray, env: int) -> Any:
        got = {k: np.asarray(a[rows, env]) for k, a in arrays.items()}
        return got if dict_obs else got[""]

    with ImportWriter(cache_path, space, what="import_sb3_replay_buffer", create_kwargs=create_kwargs,
                      total=n * n_envs, tqdm=tqdm, overwrite=overwrite) as w:
        for env in range(n_envs):  # each env's steps together: its episodes stay contiguous
            for lo in range(0, n, step):
                rows = order[lo : lo + step]
                done = np.asarray(rb.dones[rows, env]) != 0
                tout = np.asarray(timeouts[rows, env]) != 0
                block: dict[str, Any] = {"obs": pick(obs_arrays, rows, env), "action": np.asarray(rb.actions[rows, env]),
                                         "reward": np.asarray(rb.rewards[rows, env], np.float64),
                                         "terminated": done & ~tout, "truncated": done & tout}
                if nxt_arrays is not None:
                    block["next_obs"] = pick(nxt_arrays, rows, env)
                ends = done.copy()
                if lo + step >= n:
                    ends[-1] = True  # the env's stream ends here: its unfinished episode is kept as one
                w.write(block, ends)
        out = w.finish(info, stats=stats)
    return {"source": src, **out}


def import_sb3_replay_buffer(path: Any, cache_path: Any, *, trust: bool = False, tqdm: bool | None = None,
                             overwrite: bool = False, stats: bool = False,
                             **create_kwargs: Any) -> TrajectoryReplayBuffer:
    """Import a replay buffer saved by stable-baselines3's ``model.save_replay_buffer`` into a new
    trajectory store with the recorders' schema.

    Refused unless ``trust=True``: the file is a pickle, and unpickling runs code named in it.
    ``ReplayBuffer`` and ``DictReplayBuffer`` are read; the rows of each env, oldest first (a full
    ring from ``pos``), are written one env after the other so episodes stay contiguous:
    ``observations`` -> ``obs`` (Dict for a DictReplayBuffer), ``next_observations`` ->
    ``next_obs`` (absent with ``optimize_memory_usage``: SB3 keeps the next observation only as
    the following row), ``actions`` -> ``action`` (as SB3 stores them: Discrete actions as (1,)
    ints), ``rewards`` -> ``reward`` (float64), ``dones & ~timeouts`` -> ``terminated``, ``dones &
    timeouts`` -> ``truncated``.  Episodes end at ``dones``; each env's last, unfinished episode
    (and, in a full ring, its first, cut one) is kept.  The buffer's settings and spaces are in the
    dataset description.  The pickle is loaded whole (as pickles are); the store is written in
    blocks of about 8 MiB under a temporary name, verified, renamed.

    Parameters
    ----------
    path : path
        The ``.pkl`` file written by ``model.save_replay_buffer``.
    cache_path : path
        Destination: a local folder that does not exist yet (or is empty).
    trust : bool
        Unpickle the file.  Refused (BadOptionError, nothing read) unless it is ``True`` itself
        (a string such as ``"no"``, or 1, is refused too).
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
    BadOptionError
        ``trust`` is not ``True`` (checked before the file is opened).
    NotATrajstoreError
        The file is not a pickle, or cannot be unpickled.
    UnsupportedSpaceError
        It holds something other than SB3's ReplayBuffer or DictReplayBuffer.
    MissingDependencyError
        stable-baselines3 is not installed (the pickle names its classes).
    """
    out = sb3_replay_buffer_to_store(path, cache_path, trust=trust, tqdm=tqdm, overwrite=overwrite, stats=stats, **create_kwargs)
    return TrajectoryReplayBuffer.load_from(out["destination"])
