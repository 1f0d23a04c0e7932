"""Windows of steps and the episode table of a ``TrajectoryReplayBuffer`` (mixed into it): sequences
around anchor rows, one list of offsets for every field or offsets per field, drawn or given, and
``episodes`` / ``get_episode``.  The work is the sampling layer's (:mod:`trajstore.sampling.sequences`,
:mod:`trajstore.sampling.field_windows`) over the buffer's row source; this gives it the buffer's
structure and backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from trajstore.buffers.base import as_generator
from trajstore.buffers.trajectory_layout import TrajectoryData, TrajectoryOutput, as_trajectory_data
from trajstore.buffers.views import BatchBase
from trajstore.core.ring import IndexLike
from trajstore.sampling import field_windows as _fw
from trajstore.sampling import sequences as _seq
from trajstore.sampling.source import EpisodeSource

if TYPE_CHECKING:
    from trajstore.buffers.trajectory import TrajectoryReplayBuffer

__all__ = ["EpisodeWindows", "read_episode"]


class EpisodeWindows:
    """Sequence windows and the episode table, mixed into ``TrajectoryReplayBuffer`` (and
    :class:`~trajstore.shards.dataset.ShardedTrajectories`), which set ``output``."""

    output: TrajectoryOutput

    def get_sequences(self, idx: IndexLike, offsets: Sequence[int] | np.ndarray | Mapping[str, Any], *,
                      pad: str | Mapping[str, str] = "edge") -> tuple[TrajectoryData, Any]:
        """Windows of frames around anchor rows.

        Frame ``t`` of anchor ``b`` is row ``idx[b] + offsets[t]``; it is valid when that row exists
        and belongs to the anchor's episode.  Invalid frames are filled by ``pad``: ``"edge"``
        repeats the nearest valid frame (before the anchor the earliest valid one, after it the
        latest), ``"zero"`` fills zeros.

        Per-field windows: ``offsets`` may map fields of a Dict step space (keys joined by ``"/"``,
        ``"obs/image"``; a Dict or Tuple node is read whole) to their own offsets, e.g.
        ``{"obs": [-1, 0], "action": range(16)}``, and ``pad`` may map fields to modes (unnamed:
        ``"edge"``).  Only the named fields are read, each once; ``"edge"`` then repeats the nearest
        row of the anchor's episode within the window of all fields together (its first step before
        the anchor, its last after it: Diffusion Policy's padding); see docs/offline.md.

        Returns
        -------
        data : TrajectoryData
            ``step_data`` leaves of shape (B, T, ...) (per field: only the named fields, nested as in
            the space, (B, len(offsets[key]), ...)); ``episode_data`` of each anchor's episode, (B, ...).
        valid_mask : (B, T) bool, or per field a dict key -> (B, len(offsets[key])) bool

        Raises
        ------
        BadOptionError, BadArgumentError, UnknownFieldError
            A bad pad mode; per field: offsets not 1-D integers, empty, overlapping or naming no
            field; a step space that is not a Dict.
        """
        buf = cast("TrajectoryReplayBuffer", self)
        if isinstance(offsets, Mapping):
            return self.output.field_windows(_fw.get_field_windows(buf.row_source(), buf.step_space, idx, offsets, pad))
        return self.output.windows(_seq.get_sequences(buf.row_source(), idx, offsets, pad))  # type: ignore[arg-type]

    def sample_sequences(self, batch_size: int, seq_len: int | None = None, *,
                         offsets: Mapping[str, Any] | None = None, rng: np.random.Generator | int | None = None,
                         pad: str | Mapping[str, str] = "edge", within_episode: bool = False, allow_pad: bool = False
                         ) -> tuple[TrajectoryData, Any]:
        """``batch_size`` windows of ``seq_len`` consecutive rows from uniformly drawn first rows
        (``within_episode=True``: only windows wholly inside one episode).  Returns
        ``(data with step_data (B, T, ...), valid_mask (B, T))`` as :meth:`get_sequences`.

        Or, instead of ``seq_len``, per-field ``offsets`` as :meth:`get_sequences` takes them,
        around uniformly drawn anchor rows (``within_episode=True``: anchors whose window of all
        fields together lies inside the anchor's episode), returning per-field data and masks.
        ``allow_pad=True`` with ``within_episode=True`` draws every row as an anchor and pads the
        frames outside its episode (Diffusion Policy's ``pad_before`` / ``pad_after``).

        Raises
        ------
        BadArgumentError
            Both or neither of ``seq_len`` and ``offsets``; bad ``offsets`` as :meth:`get_sequences`.
        BadOptionError
            A bad ``batch_size`` (not an int >= 0), ``seq_len`` or ``pad``; no window lies inside
            one episode with ``within_episode``.
        """
        buf = cast("TrajectoryReplayBuffer", self)
        _fw.seq_len_or_offsets(seq_len, offsets)
        g, within = as_generator(rng, buf.default_rng), within_episode and not allow_pad
        if offsets is not None:
            return self.output.field_windows(_fw.sample_field_windows(buf.row_source(), buf.step_space, batch_size,
                                                                     offsets, g, pad, within))
        return self.output.windows(_seq.sample_sequences(buf.row_source(), batch_size, cast(int, seq_len), g,
                                                        pad, within))  # type: ignore[arg-type]

    def episodes(self) -> dict[str, np.ndarray]:
        """One entry per episode with steps present: ``episode_id``, ``start`` (logical row of its
        first step), ``length`` (steps) and ``live`` (still being recorded), ordered by ``start``."""
        return _seq.episode_table(cast("TrajectoryReplayBuffer", self).row_source())

    def get_episode(self, episode_id: int) -> TrajectoryData:
        """Every step of episode ``episode_id`` in row order (KeyError when it has none)."""
        buf = cast("TrajectoryReplayBuffer", self)
        return read_episode(buf, buf.row_source(), episode_id)


def read_episode(batch: BatchBase, src: EpisodeSource, episode_id: int) -> TrajectoryData:
    """Every step of episode ``episode_id`` of ``batch`` (a buffer, an episode view, a sharded
    dataset), whose rows ``src`` numbers, in row order.

    The rows are found and read under one commit record (``batch.read_values``): rows found under
    an older record name other steps once a ring has evicted (a reader got another episode's steps,
    16 rows further on, after a turn of 16 rows in between).

    Raises
    ------
    UnknownEpisodeError
        The episode has no steps (a KeyError), also when a ring evicted them during the read.
    """
    eid = int(episode_id)
    return as_trajectory_data(batch.read_values(lambda: _seq.episode_rows(src, eid)))
