"""The sequence part of prioritized replay
(:meth:`~trajstore.sampling.prioritized.PrioritizedSampler.sample_sequences`): which windows a
``seq_len`` or ``offsets`` describes, which anchors have their whole window inside one episode,
and drawing anchors by priority until enough of them do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from trajstore.errors import BadArgumentError, BadOptionError
from trajstore.sampling.field_windows import seq_len_or_offsets
from trajstore.sampling.source import EpisodeSource

__all__ = ["ACCEPT_ROUNDS", "window_offsets", "inside_one_run", "draw_accepted"]

#: Rounds of draws ``sample_sequences(within_episode=True)`` makes before it gives up.
ACCEPT_ROUNDS = 64


def _span(offsets: Any) -> tuple[int, int]:
    """``(lo, hi)``: the smallest and largest frame offset, 0 (the anchor) included, of one list of
    offsets or a mapping of field -> offsets (checked by ``get_sequences`` itself)."""
    every = [np.asarray(list(v) if isinstance(v, range) else v).reshape(-1)
             for v in (offsets.values() if isinstance(offsets, Mapping) else [offsets])]
    try:
        flat = np.concatenate(every + [np.zeros(1, np.int64)]).astype(np.int64)
    except (TypeError, ValueError):
        raise BadArgumentError(f"sample_sequences: offsets must be integers; got {offsets!r}") from None
    return int(flat.min()), int(flat.max())


def window_offsets(seq_len: Any, offsets: Any) -> tuple[Any, int, int]:
    """``(offsets, lo, hi)``: the frames of every window (``range(seq_len)`` when ``seq_len`` is
    given) and their smallest and largest offset, the anchor's 0 included.

    Raises
    ------
    BadArgumentError
        Both or neither of ``seq_len`` and ``offsets``; offsets that are not integers.
    BadOptionError
        ``seq_len`` is not an int > 0.
    """
    seq_len_or_offsets(seq_len, offsets)
    if offsets is None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len <= 0:
            raise BadOptionError(f"sample_sequences: seq_len must be an int > 0; got {seq_len!r}")
        offsets = np.arange(int(seq_len))
    lo, hi = _span(offsets)
    return offsets, lo, hi


def inside_one_run(src: EpisodeSource, lo: int, hi: int) -> Callable[[np.ndarray], np.ndarray]:
    """A test of anchors: (B,) logical rows in, (B,) bool out, True where the anchor's window
    (frames ``anchor + lo .. anchor + hi``) lies in one run of equal episode ids of ``src``."""

    def inside(idx: np.ndarray) -> np.ndarray:
        first = idx + lo
        ok = (first >= 0) & (idx + hi < src.count)
        ok[ok] = src.one_run(first[ok], hi - lo)
        return ok

    return inside


def draw_accepted(draw: Callable[[int], np.ndarray], logical: Callable[[np.ndarray], np.ndarray], k: int,
                  accept: Callable[[np.ndarray], np.ndarray], what: str) -> np.ndarray:
    """``k`` slots from ``draw(n)`` (n slots drawn by priority) whose logical rows ``accept``
    approves, drawn again in rounds (at least twice the number still needed) up to
    :data:`ACCEPT_ROUNDS`.  Kept in draw order, so the accepted ones are iid from ``P``
    renormalized over accepted rows.

    Raises
    ------
    BadOptionError
        After :data:`ACCEPT_ROUNDS` rounds, fewer than ``k`` slots were accepted.
    """
    got: list[np.ndarray] = []
    need = k
    for _ in range(ACCEPT_ROUNDS):
        s = draw(max(2 * need, 16))
        s = s[accept(logical(s))][:need]
        got.append(s)
        need -= len(s)
        if need == 0:
            return np.concatenate(got)
    raise BadOptionError(f"{what}: within_episode=True, but after {ACCEPT_ROUNDS} rounds of draws only "
                         f"{k - need} of {k} anchors had their window inside one episode (windows longer than "
                         "most episodes, or the priority on anchors near episode ends)")
