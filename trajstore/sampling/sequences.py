"""Sequences within episodes over an :class:`~trajstore.sampling.source.EpisodeSource`: which
rows a window of frames reads, which frames are valid, and how invalid frames are padded.  Pure numpy on row numbers, so the cost of a batch is
O(B x T) whatever the store's size.  Windows of consecutive frames containing the anchor
(every sampled sequence, frame stacks) are read as blocks of rows, one copy per window.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from trajstore.core.ring import normalize_index
from trajstore.errors import BadOptionError, UnknownEpisodeError
from trajstore.sampling.source import EpisodeSource, put_rows, read_consistent, sample_consistent

__all__ = ["PADS", "Windows", "block_frames", "episode_rows", "episode_table", "get_sequences", "pad_sources",
           "sample_sequences", "window_rows"]

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


def block_frames(anchors: np.ndarray, first: np.ndarray, offsets: np.ndarray, count: int,
                 ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Frames of windows read as blocks of consecutive rows (contiguous offsets containing 0).

    Parameters
    ----------
    anchors : (B,) int64
        Logical anchor rows.
    first : (B,) int64
        First logical row of each block: ``anchors + offsets[0]`` clipped into ``[0, count - T]``,
        so the block holds every frame's clipped row and the anchor.
    offsets : (T,) int64
        Consecutive, ``offsets[0] <= 0 <= offsets[-1]``.
    count : int
        Rows in the buffer.
    ids : (B, T) int64
        Episode ids of the block rows ``first[b] + t``.

    Returns
    -------
    pos : (B, T) int64
        Index within the block of the row each frame reads (clipped into the buffer).
    valid : (B, T) bool
        The frame's row exists and belongs to the anchor's episode.
    """
    rows = anchors[:, None] + offsets[None, :]
    inside = (rows >= 0) & (rows < count)
    pos = np.clip(rows, 0, count - 1) - first[:, None]
    anchor_ids = ids[np.arange(len(anchors)), anchors - first]
    # Unclipped blocks hold frame t at position t: only clipped ones need re-indexing.
    frame_ids = ids if inside.all() else np.take_along_axis(ids, pos, axis=1)
    return pos, inside & (frame_ids == anchor_ids[:, None])


def pad_sources(rows: np.ndarray, valid: np.ndarray, offsets: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """Where each frame's data comes from for ``pad="edge"``: an invalid frame before the anchor
    (negative offset) repeats the earliest valid frame, one at or after it the latest valid frame;
    a window with no valid frame at all repeats the anchor row.

    ``rows`` (B, T) and ``anchors`` (B,) are in one coordinate system: absolute or logical rows,
    or positions within blocks.

    Returns
    -------
    (B, T) int64
        The row (position) whose data fills each frame.
    """
    any_valid = valid.any(axis=1)
    first = np.argmax(valid, axis=1)
    last = valid.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)
    b = np.arange(len(rows))
    earliest = np.where(any_valid, rows[b, first], anchors)
    latest = np.where(any_valid, rows[b, last], anchors)
    fill = np.where(offsets[None, :] < 0, earliest[:, None], latest[:, None])
    return np.where(valid, rows, fill)


class Windows(NamedTuple):
    """Windows of frames as numpy, before a buffer gives them its structure and backend."""

    steps: list[np.ndarray]  # one (B, T, *leaf.shape) array per step leaf (src.step_leaves order)
    episodes: list[np.ndarray]  # one (B, *leaf.shape) array per episode leaf, of each anchor's episode
    valid: np.ndarray  # (B, T) bool


def get_sequences(src: EpisodeSource, idx: Any, offsets: Any, pad: str = "edge") -> Windows:
    """Frames ``idx[b] + offsets[t]`` (logical rows); see
    :meth:`TrajectoryReplayBuffer.get_sequences <trajstore.TrajectoryReplayBuffer.get_sequences>`."""
    if pad not in PADS:
        raise BadOptionError(f"pad must be one of {PADS}; got {pad!r}")
    src.sync()
    offs = np.asarray(offsets, dtype=np.int64).reshape(-1)

    def read() -> Windows:
        anchors = np.atleast_1d(np.asarray(normalize_index(idx, src.count), dtype=np.int64))
        return _read_windows(src, anchors, offs, pad)

    return read_consistent(src, read)  # a reader retries until no commit happened while it read


def _is_block(offs: np.ndarray, count: int) -> bool:
    """Whether windows of these offsets are blocks of consecutive rows containing the anchor."""
    T = len(offs)
    return 0 < T <= count and offs[0] <= 0 <= offs[-1] and bool((np.diff(offs) == 1).all())


class _Frames(NamedTuple):
    """Which rows the frames of a batch of windows read, and which frames are valid."""

    first: np.ndarray | None  # (B,) first logical row of each block read, or None: rows gathered one by one
    check: np.ndarray  # (K,) blocks that are clipped or cross episodes (all of them when first is None)
    rows: np.ndarray  # (K, T) positions within those blocks, or logical rows when first is None
    valid: np.ndarray  # (B, T) bool


def block_ok(src: EpisodeSource, anchors: np.ndarray, offs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First logical row of each anchor's block (clipped into the source), and whether the block
    holds exactly its frames (unclipped) within one run of equal episode ids: wholly valid."""
    T = len(offs)
    lo = anchors + offs[0]
    first = np.clip(lo, 0, src.count - T)
    return first, (first == lo) & src.one_run(first, T - 1)


def span_frames(src: EpisodeSource, anchors: np.ndarray, offs: np.ndarray, block: bool) -> _Frames:
    """Frames of logical ``anchors``.

    ``block`` (see :func:`_is_block`): each window is a block of consecutive rows; blocks inside
    the source and inside one run of equal ids (the run index answers without reading ids) are
    wholly valid, and only the others read their ids.  Otherwise frames are resolved row by row.
    """
    B, T = len(anchors), len(offs)
    if not block:
        rows, valid = window_rows(anchors, offs, 0, src.count, src.step_ids)
        return _Frames(None, np.arange(B), rows, valid)
    first, ok = block_ok(src, anchors, offs)
    check = np.flatnonzero(~ok)
    valid = np.ones((B, T), bool)
    pos = np.zeros((0, T), np.int64)
    if check.size:
        ids = src.window_ids(first[check], T)
        pos, valid[check] = block_frames(anchors[check], first[check], offs, src.count, ids)
    return _Frames(first, check, pos, valid)


def _read_windows(src: EpisodeSource, anchors: np.ndarray, offs: np.ndarray, pad: str,
                  all_valid: bool = False) -> Windows:
    """Read windows for logical ``anchors``.  ``all_valid``: the caller knows every window is a
    block wholly inside one episode (``within_episode`` sampling checked it)."""
    if all_valid:
        B, T = len(anchors), len(offs)
        f = _Frames(anchors + offs[0], np.zeros(0, np.int64), np.zeros((0, T), np.int64), np.ones((B, T), bool))
    else:
        f = span_frames(src, anchors, offs, _is_block(offs, src.count))
    B, T = f.valid.shape
    if f.first is None:
        rows = pad_sources(f.rows, f.valid, offs, anchors) if pad == "edge" else f.rows
        steps = [a.reshape(B, T, *a.shape[1:]) for a in src.read_rows(rows.ravel(), src.step_leaves)]
    else:
        steps = src.gather_windows(f.first, T, src.step_leaves)
        c = f.check
        if c.size:  # clipped or padded blocks: re-index their frames within the block
            pos = pad_sources(f.rows, f.valid[c], offs, anchors[c] - f.first[c]) if pad == "edge" else f.rows
            for a in steps:
                a[c] = a[c[:, None], pos]
    if pad == "zero" and f.check.size:
        for a in steps:
            a[~f.valid] = 0
    episodes = src.read_episode_rows(anchors, src.episode_leaves) if src.episode_leaves else []
    return Windows(steps, episodes, f.valid)


def sample_sequences(src: EpisodeSource, batch_size: int, seq_len: int, rng: np.random.Generator,
                     pad: str, within_episode: bool) -> Windows:
    """Windows of ``seq_len`` consecutive rows starting at uniformly drawn rows.

    ``within_episode=True`` draws only windows lying wholly inside one episode, by rejection:
    each round asks the run index about the candidate windows only (no id is read), so the cost
    depends on the share of valid windows, never on the number of rows or episodes stored.
    """
    if pad not in PADS:
        raise BadOptionError(f"pad must be one of {PADS}; got {pad!r}")
    if seq_len < 1:
        raise BadOptionError(f"seq_len must be >= 1; got {seq_len}")
    offs = np.arange(seq_len, dtype=np.int64)
    # A reader re-checks the commit record after reading: windows whose first row was evicted
    # meanwhile (it may have been overwritten) are drawn again, everything after a rewrite.
    return sample_consistent(
        src,
        lambda k: draw_anchors(src, k, offs, rng, within_episode),
        lambda anchors: _read_windows(src, anchors, offs, pad, all_valid=within_episode and _is_block(offs, src.count)),
        batch_size, _put_windows)


def _put_windows(out: Windows, positions: np.ndarray, part: Windows) -> None:
    """The ``put`` of :func:`~trajstore.sampling.source.sample_consistent` for :class:`Windows`:
    ``part``'s windows into rows ``positions`` of ``out``."""
    put_rows(out.steps, positions, part.steps)
    put_rows(out.episodes, positions, part.episodes)
    out.valid[positions] = part.valid


def draw_anchors(src: EpisodeSource, batch_size: int, offs: np.ndarray, rng: np.random.Generator,
                  within_episode: bool) -> np.ndarray:
    """First rows of ``batch_size`` windows drawn uniformly (``within_episode``: uniformly among
    the windows wholly inside one episode), (B,) int64 logical rows."""
    n = src.count
    if not within_episode or batch_size == 0:
        return rng.integers(0, n, size=batch_size)
    # Rejection sampling, keeping accepted candidates in draw order (so anchors stay iid uniform
    # over valid windows); each round draws enough candidates for the acceptance rate seen so
    # far, so a batch usually takes one round.
    block = _is_block(offs, n)
    kept: list[np.ndarray] = []
    need, draw, tried, accepted = batch_size, batch_size + batch_size // 4 + 8, 0, 0
    for _ in range(1000):
        if not accepted and tried >= 1000 * batch_size:
            break  # none in a thousand batches' worth of windows: give up
        cand = rng.integers(0, n, size=draw)
        ok = block_ok(src, cand, offs)[1] if block else span_frames(src, cand, offs, False).valid.all(axis=1)
        good = cand[ok][:need]
        kept.append(good)
        need -= len(good)
        tried, accepted = tried + draw, accepted + int(ok.sum())
        if not need:
            break
        draw = min(int(need * tried / max(accepted, 1) * 1.25) + 8, 64 * batch_size + 64)
    if need:
        raise BadOptionError(f"no window of {len(offs)} steps lies inside one episode (or almost none do): "
                             "use a shorter seq_len or within_episode=False")
    return np.concatenate(kept)


def episode_table(src: EpisodeSource) -> dict[str, np.ndarray]:
    """``{"episode_id", "start", "length", "live"}`` arrays, one entry per episode with steps
    present, ordered by first step.  ``start`` is the logical row of its first step, ``length``
    its number of steps, ``live`` whether it is the episode being recorded.  Built from the run
    index: O(runs), not O(rows)."""
    src.sync()
    first, lengths, ids = src.runs()
    eids, at, inv = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first[at], kind="stable")
    eids, starts = eids[order], first[at][order]
    counts = np.bincount(inv, weights=lengths, minlength=len(at)).astype(np.int64)[order]
    return {"episode_id": eids, "start": starts, "length": counts, "live": eids == src.current_episode_id}


def episode_rows(src: EpisodeSource, episode_id: int) -> np.ndarray:
    """Logical rows of the steps of ``episode_id`` (UnknownEpisodeError when it has none)."""
    src.sync()
    first, lengths, ids = src.runs()
    mine = np.flatnonzero(ids == episode_id)
    if mine.size == 0:
        raise UnknownEpisodeError(f"episode {episode_id} has no steps in the buffer")
    return np.concatenate([np.arange(first[k], first[k] + lengths[k]) for k in mine.tolist()])
