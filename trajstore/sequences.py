"""Sequences within episodes: which rows a window of frames reads, which frames are valid,
and how invalid frames are padded.  Pure numpy on absolute row numbers, so the cost of a
batch is O(B x T) whatever the store's size.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["window_rows", "pad_sources", "PADS"]

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
