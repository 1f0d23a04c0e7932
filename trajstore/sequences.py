"""Sequences within episodes: which rows a window of frames reads, which frames are valid,
and how invalid frames are padded.  Pure numpy on absolute row numbers, so the cost of a
batch is O(B x T) whatever the store's size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .ring import normalize_index

if TYPE_CHECKING:
    from .trajectory import TrajectoryReplayBuffer

__all__ = ["window_rows", "pad_sources", "get_sequences", "sample_sequences", "episode_table", "episode_rows", "PADS"]

PADS = ("edge", "zero")


def window_rows(
    anchors: np.ndarray, offsets: np.ndarray, start: int, end: int, ids_at: Callable[[np.ndarray], np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of every frame and whether it is valid.

    Parameters
    ----------
    anchors : (B,) int64
        Absolute row numbers of the anchor rows (each in ``[start, end)``).
    offsets : (T,) int64
        Frame ``t`` of anchor ``b`` is row ``anchors[b] + offsets[t]``.
    start, end : int
        Absolute rows present in the buffer.
    ids_at : callable
        Episode ids of absolute rows (any shape in, same shape out).

    Returns
    -------
    rows : (B, T) int64
        Absolute rows, clipped into ``[start, end)`` (so they can always be read).
    valid : (B, T) bool
        The frame's row exists and belongs to the anchor's episode.
    """
    rows = anchors[:, None] + offsets[None, :]
    inside = (rows >= start) & (rows < end)
    clipped = np.clip(rows, start, max(end - 1, start))
    ids = ids_at(np.concatenate([anchors, clipped.ravel()]))
    anchor_ids, frame_ids = ids[: len(anchors)], ids[len(anchors) :].reshape(rows.shape)
    return clipped, inside & (frame_ids == anchor_ids[:, None])


def pad_sources(rows: np.ndarray, valid: np.ndarray, offsets: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """Rows to read for ``pad="edge"``: an invalid frame before the anchor (negative offset) repeats
    the earliest valid frame, one at or after it the latest valid frame; a window with no valid
    frame at all repeats the anchor row.

    Returns
    -------
    (B, T) int64
        Absolute rows whose data fills each frame.
    """
    any_valid = valid.any(axis=1)
    first = np.argmax(valid, axis=1)
    last = valid.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)
    b = np.arange(len(rows))
    earliest = np.where(any_valid, rows[b, first], anchors)
    latest = np.where(any_valid, rows[b, last], anchors)
    fill = np.where(offsets[None, :] < 0, earliest[:, None], latest[:, None])
    return np.where(valid, rows, fill)


def get_sequences(buf: "TrajectoryReplayBuffer", idx: Any, offsets: Any, pad: str = "edge") -> tuple[Any, Any]:
    """Frames ``idx[b] + offsets[t]`` of a trajectory buffer; see
    :meth:`TrajectoryReplayBuffer.get_sequences`."""
    if pad not in PADS:
        raise ValueError(f"pad must be one of {PADS}; got {pad!r}")
    buf._sync()
    t = buf._table
    anchors = normalize_index(idx, t.count)
    anchors = np.atleast_1d(np.asarray(anchors, dtype=np.int64))
    offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
    return _read_windows(buf, anchors, offs, pad)


def _read_windows(buf: "TrajectoryReplayBuffer", anchors: np.ndarray, offs: np.ndarray, pad: str) -> tuple[Any, Any]:
    """Read windows for logical ``anchors``: step data (B, T, ...), episode data of each anchor's
    episode (B, ...), valid mask (B, T)."""
    t = buf._table
    start = t.state.start
    ids_of = lambda absolute: buf._step_ids(absolute - start)  # noqa: E731
    rows, valid = window_rows(anchors + start, offs, start, t.state.end, ids_of)
    src = pad_sources(rows, valid, offs, anchors + start) if pad == "edge" else rows
    step_leaves = [j for j, s in enumerate(buf._src) if s[0] == "s"]
    flat = buf._read_rows((src - start).ravel(), step_leaves)
    B, T = rows.shape
    steps = []
    for a in flat:
        a = a.reshape(B, T, *a.shape[1:])
        if pad == "zero":
            a[~valid] = 0
        steps.append(a)
    ep = None
    if buf._ep_plan is not None:
        ep_leaves = [j for j, s in enumerate(buf._src) if s[0] == "e"]
        ep = buf._read_rows(anchors, ep_leaves)
    out = buf._backend.out
    step_data = buf._step_plan.from_arrays([out(a) for a in steps])
    episode_data = buf._ep_plan.from_arrays([out(a) for a in ep]) if ep is not None else None
    return {"step_data": step_data, "episode_data": episode_data}, out(valid)


def sample_sequences(buf: "TrajectoryReplayBuffer", batch_size: int, seq_len: int, rng: np.random.Generator,
                     pad: str, within_episode: bool) -> tuple[Any, Any]:
    """Windows of ``seq_len`` consecutive rows starting at uniformly drawn rows.

    ``within_episode=True`` draws only windows lying wholly inside one episode, by rejection:
    each round reads the ids of the candidate windows only (B x T ids), so the cost depends on
    the share of valid windows, never on the number of rows or episodes stored.
    """
    if pad not in PADS:
        raise ValueError(f"pad must be one of {PADS}; got {pad!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1; got {seq_len}")
    buf._sync()
    t = buf._table
    n = t.count
    if n == 0:
        raise ValueError("cannot sample from an empty buffer")
    offs = np.arange(seq_len, dtype=np.int64)
    anchors = rng.integers(0, n, size=batch_size)
    if within_episode:
        start = t.state.start
        ids_of = lambda absolute: buf._step_ids(absolute - start)  # noqa: E731
        todo = np.ones(batch_size, bool)
        for _ in range(1000):
            _rows, valid = window_rows(anchors[todo] + start, offs, start, t.state.end, ids_of)
            ok = valid.all(axis=1)
            idx = np.flatnonzero(todo)
            todo[idx[ok]] = False
            if not todo.any():
                break
            anchors[todo] = rng.integers(0, n, size=int(todo.sum()))
        else:
            raise ValueError(f"no window of {seq_len} steps lies inside one episode (or almost none do): "
                             "use a shorter seq_len or within_episode=False")
    return _read_windows(buf, anchors, offs, pad)


def episode_table(buf: "TrajectoryReplayBuffer") -> dict[str, np.ndarray]:
    """``{"episode_id", "start", "length", "live"}`` arrays, one entry per episode with steps
    present, ordered by first step.  ``start`` is the logical row of its first step, ``length``
    its number of steps, ``live`` whether it is the episode being recorded."""
    buf._sync()
    t = buf._table
    ids = t.read_contiguous(0, t.count, [buf._id_field])[0]
    uniq, first, counts = np.unique(ids, return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    eids = uniq[order]
    return {"episode_id": eids, "start": first[order].astype(np.int64), "length": counts[order].astype(np.int64),
            "live": eids == buf.current_episode_id}


def episode_rows(buf: "TrajectoryReplayBuffer", episode_id: int) -> np.ndarray:
    """Logical rows of the steps of ``episode_id`` (KeyError when it has none)."""
    buf._sync()
    t = buf._table
    rows = np.flatnonzero(t.read_contiguous(0, t.count, [buf._id_field])[0] == episode_id)
    if rows.size == 0:
        raise KeyError(f"episode {episode_id} has no steps in the buffer")
    return rows
