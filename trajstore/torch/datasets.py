"""Map-style PyTorch datasets over a trajstore store: single transitions and fixed-length sequences.

Both read a whole DataLoader batch with one gather per field (``__getitems__``), so every chunk
a batch touches is read once per batch, not once per sample.  Only the store's path and options
are pickled: each worker process opens the store read-only on first use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate, default_collate_fn_map

from trajstore.core.episodes import (
    all_done,
    done_at,
    done_field_names,
    done_fields,
    episode_numbers,
)
from trajstore.errors import BadArgumentError, BadOptionError, IndexOutOfRangeError, NoEpisodesError
from trajstore.sampling import field_windows as _fw
from trajstore.sampling.sequences import PADS, pad_sources, window_rows
from trajstore.sampling.source import read_consistent
from trajstore.storage.fields.out import returned_rows
from trajstore.torch._source import FieldSelection, ShardedSource, make_source
from trajstore.torch._transfer import in_worker, pack_read
from trajstore.torch.normalize import Normalizer

__all__ = ["BaseDataset", "SampleBatch", "SequenceDataset", "TransitionDataset", "collate_batch"]

_OUTPUTS = ("torch", "numpy")


def _take(value: Any, k: int) -> Any:
    if isinstance(value, Mapping):
        return {key: _take(v, k) for key, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_take(v, k) for v in value)
    return value[k]


class _Item(dict):
    """One sample taken out of a :class:`SampleBatch` (its own type, so ``default_collate`` can
    recognise a whole SampleBatch by its first element, see :func:`_collate_items`)."""


class SampleBatch(Sequence):
    """What ``__getitems__`` returns: a batch already stacked (``.data``) that also behaves as the
    list of its samples.  Both :func:`collate_batch` and torch's ``default_collate`` return ``.data``
    as it is, without splitting and restacking; in a DataLoader worker ``.data`` holds every array
    of the batch in one buffer, which is what crosses to the main process (``_transfer``)."""

    def __init__(self, data: dict[str, Any], n: int) -> None:
        self.data = data
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self._n))]
        if not -self._n <= k < self._n:
            raise IndexOutOfRangeError(f"index {k} is out of range for {self._n} items")
        return _Item(_take(self.data, k % self._n))


def collate_batch(items: Any) -> Any:
    """``collate_fn`` for DataLoaders over trajstore datasets: a :class:`SampleBatch` is returned
    as its stacked data (no per-sample copies); anything else goes to ``default_collate``."""
    if isinstance(items, SampleBatch):
        return items.data
    return default_collate(items)


def _collate_items(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """``default_collate`` of a sequence whose first element is an :class:`_Item`: a SampleBatch
    is returned as its stacked data; a list of items is collated key by key as any mapping."""
    if isinstance(batch, SampleBatch):
        return batch.data
    from torch.utils.data._utils.collate import collate

    return {key: collate([d[key] for d in batch], collate_fn_map=collate_fn_map) for key in batch[0]}


# torch documents extending default_collate by adding entries to this registry; the key is a
# type of our own, so no other collation changes.
default_collate_fn_map[_Item] = _collate_items


class BaseDataset(Dataset):
    """What every dataset here shares: the lazily opened source, the field selection, batch reads
    (``__getitems__``), the output type and optional normalization.  Subclasses define ``__len__``
    and ``_read(indices, out)``."""

    def __init__(self, source: Any, fields: Sequence[str] | str | None, output: str,
                 storage_options: dict[str, Any] | None) -> None:
        if output not in _OUTPUTS:
            raise BadOptionError(f"output must be one of {_OUTPUTS}; got {output!r}")
        self.output = output
        # A sharded dataset (its root path, or open_sharded's view) reads every shard as one store.
        self._src = make_source(source, storage_options)
        buf: Any = self._src.buffer
        self._sel = FieldSelection(buf, fields)
        self.fields = list(self._sel.names)

    if TYPE_CHECKING:  # each dataset defines its length
        def __len__(self) -> int: ...

    @property
    def buffer(self) -> Any:
        """This process's read-only buffer (opened lazily in each worker)."""
        return self._src.buffer

    @staticmethod
    def _torch(a: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a))

    @staticmethod
    def _numpy(a: np.ndarray) -> Any:
        return a

    def _indices(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices.numpy() if isinstance(indices, torch.Tensor) else indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if not idx.size:
            return idx
        lo = idx.min()
        if lo < -n or idx.max() >= n:
            raise IndexOutOfRangeError(f"index out of range for a dataset of {n} items")
        return np.where(idx < 0, idx + n, idx) if lo < 0 else idx

    def read_batch(self, indices: Any) -> dict[str, Any]:
        """Items ``indices`` (non-negative) as one stacked batch ``{field: (B, ...)}``."""
        return self._normed(self._read(indices, self._torch if self.output == "torch" else self._numpy))

    def normalize(self, modes: Mapping[str, str], *, episodes: Any = None) -> Any:
        """Normalize fields by the store's statistics from now on (``{"state": "mean_std", "action":
        "min_max"}``; modes of :data:`trajstore.torch.normalize.MODES`); returns the dataset.  The
        statistics are taken now (stored ones where current, docs/robot.md) and pickled with it."""
        self._norm: Normalizer | None = Normalizer(self.buffer, modes, episodes)
        return self

    def _normed(self, batch: dict[str, Any]) -> dict[str, Any]:
        norm = getattr(self, "_norm", None)
        return batch if norm is None else norm(batch)

    def _read(self, indices: Any, out: Any) -> dict[str, Any]:
        raise NotImplementedError  # abstract

    def __getitems__(self, indices: Any) -> SampleBatch:
        """The items ``indices`` as one batch (what a DataLoader calls with a whole batch of indices).

        In a DataLoader worker with ``output="torch"`` every array of the batch is laid out in one
        buffer, so the batch crosses to the main process as one object (see ``_transfer``)."""
        idx = self._indices(indices)
        if in_worker() and self.output == "torch":
            # The step rows decode straight into the shared memory the batch crosses in.
            return SampleBatch(pack_read(lambda: self._normed(self._read(idx, self._numpy)), id(self)), len(idx))
        return SampleBatch(self.read_batch(idx), len(idx))

    def __getitem__(self, i: int) -> dict[str, Any]:
        in_worker()  # (in a worker: its share of the decode threads)
        return _take(self.read_batch(self._indices([i])), 0)

    def close(self) -> None:
        """Close this process's buffer (if the dataset opened it)."""
        self._src.close()


class TransitionDataset(BaseDataset):
    """One item per stored step (row): ``{field: value}``.

    Parameters
    ----------
    source : str, os.PathLike, ReplayBuffer, TrajectoryReplayBuffer or ShardedDataset
        A store path / URL (opened read-only) or a buffer; or a sharded dataset (its root path or
        :func:`~trajstore.shards.open_sharded`'s view), read as one store over every shard.
    fields : list of str, optional
        ``/``-paths relative to the step space (``"obs"``, ``"obs/pos"``); for trajectory stores
        also ``"episode_data/<path>"`` (the value of the step's episode).  Default: every
        top-level step field.
    output : "torch" or "numpy"
    episode_ids : bool
        Add ``"episode_id"`` (int64) of each step (trajectory stores).
    storage_options : dict, optional
        fsspec options for a URL.

    ``len`` is the number of rows when the dataset was created (datasets are meant for stores
    that are no longer being written; rows are read from the latest commit).
    """

    def __init__(self, source: Any, fields: Sequence[str] | str | None = None, *, output: str = "torch",
                 episode_ids: bool = False, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(source, fields, output, storage_options)
        if episode_ids and not self._src.is_trajectory:
            raise BadOptionError("episode_ids=True needs a TrajectoryReplayBuffer store")
        self.episode_ids = episode_ids
        self._n = len(self._src.buffer)

    def __len__(self) -> int:
        return self._n

    def _read(self, indices: Any, out: Any) -> dict[str, Any]:
        rows = self._src.buffer.row_source()
        # A reader of a live store retries until no writer evicted or rewrote the rows meanwhile.
        return read_consistent(rows, lambda: self._read_once(rows, np.asarray(indices, dtype=np.int64), out))

    def _read_once(self, rows: Any, idx: np.ndarray, out: Any) -> dict[str, Any]:
        rows.sync()
        if idx.size and idx.max() >= rows.count:
            raise IndexOutOfRangeError(f"row {int(idx.max())} is no longer in the store ({rows.count} rows)")
        s, e = self._sel.step_leaves, self._sel.episode_leaves
        with returned_rows():  # (in a worker: into the batch's shared memory, see _transfer.pack_read)
            steps = rows.read_rows(idx, s) if s else []
        eps = rows.read_rows(idx, e) if e else []
        batch = self._sel.assemble(steps, eps, out)
        if self.episode_ids:
            batch["episode_id"] = out(rows.step_ids(idx))
        return batch


class SequenceDataset(BaseDataset):
    """One item per window of ``seq_len`` consecutive steps: ``{field: (T, ...), "mask": (T,) bool}``,
    or with per-field ``offsets``: ``{key: (len(offsets[key]), ...), "mask": {key: (len(offsets[key]),) bool}}``.

    Frame ``t`` of item ``i`` is row ``anchor_i + t``; it is valid when that row exists and belongs
    to the anchor's episode (as :meth:`TrajectoryReplayBuffer.get_sequences`).  Invalid frames are
    filled by ``pad`` (``"edge"`` repeats the nearest valid frame, ``"zero"`` fills zeros).

    Episodes are those ``trajstore episodes`` lists: a TrajectoryReplayBuffer store's episode ids;
    in a ReplayBuffer store an episode ends after a row flagged by a done-like field
    (``terminated``, ``truncated``, ``done``...: any set); the rows before a ring's first flag are
    a (partial) episode.  A ReplayBuffer store without such fields is one long episode, and
    ``within_episode=True`` is refused on it.

    Per-field windows (TrajectoryReplayBuffer stores): ``offsets`` maps step fields to their own
    offsets around an anchor row (every ``stride``-th row), e.g. ``{"obs": [-1, 0], "action":
    range(16)}``, read and padded as :meth:`TrajectoryReplayBuffer.get_sequences` with a mapping
    (``pad`` may map fields to modes); ``fields`` then only adds ``"episode_data/<path>"`` fields.

    Parameters
    ----------
    seq_len : int, optional
        Exactly one of ``seq_len`` and ``offsets``.
    fields : list of str, optional
        As :class:`TransitionDataset`; ``"episode_data/<path>"`` fields hold the anchor's episode
        value (no time axis).
    offsets : mapping of str to ints, optional
        Per-field offsets (keys as :meth:`TrajectoryReplayBuffer.get_sequences` takes them).
    pad : "edge" or "zero" (or, with ``offsets``, a mapping of keys to modes)
    within_episode : bool
        Only windows lying wholly inside one episode (then every mask is all True); with
        ``offsets``: anchors whose window of all fields together (smallest to largest offset,
        anchor included) lies inside one episode.
    stride : int
        Anchors every ``stride`` rows.
    mask_key : str
        Key of the valid mask in each item.

    Raises
    ------
    NoEpisodesError
        ``within_episode=True`` on a ReplayBuffer store without done-like fields.
    BadArgumentError
        Both or neither of ``seq_len`` and ``offsets``; ``offsets`` on a ReplayBuffer store; bad
        ``offsets`` as :meth:`TrajectoryReplayBuffer.get_sequences` raises; a sharded dataset of
        ReplayBuffer shards (windows need episode ids).
    """

    seq_len: int | None  # None with offsets
    pad: str | Mapping[str, str]

    def __init__(self, source: Any, seq_len: int | None = None, fields: Sequence[str] | str | None = None, *,
                 offsets: Mapping[str, Any] | None = None, pad: str | Mapping[str, str] = "edge",
                 within_episode: bool = False, stride: int = 1, output: str = "torch", mask_key: str = "mask",
                 storage_options: dict[str, Any] | None = None) -> None:
        _fw.seq_len_or_offsets(seq_len, offsets)
        if offsets is not None:
            self._init_fields(source, fields, offsets, pad, within_episode, stride, output, mask_key, storage_options)
            return
        assert seq_len is not None
        self._field_offsets: Mapping[str, Any] | None = None
        if seq_len < 1 or stride < 1:
            raise BadOptionError(f"seq_len and stride must be >= 1; got {seq_len}, {stride}")
        if not isinstance(pad, str) or pad not in PADS:
            raise BadOptionError(f"pad must be one of {PADS}; got {pad!r}")
        super().__init__(source, fields, output, storage_options)
        if mask_key in self.fields:
            raise BadOptionError(f"mask_key {mask_key!r} collides with a field name")
        self.seq_len, self.pad, self.within_episode, self.stride, self.mask_key = seq_len, pad, within_episode, stride, mask_key
        buf = self._src.buffer
        rows = buf.row_source()
        if isinstance(self._src, ShardedSource) and not self._src.is_trajectory:
            raise BadArgumentError(f"{self._src.path}: SequenceDataset over a sharded dataset needs trajectory shards "
                                   "(episode ids); its shards are ReplayBuffer stores: use TransitionDataset")
        # Done-like fields of a ReplayBuffer store (None: no episode boundaries, or a trajectory store).
        self._done = None if self._src.is_trajectory else done_fields(rows.table)
        if within_episode and not self._src.is_trajectory and self._done is None:
            raise NoEpisodesError(
                f"{self._src.path or 'in-memory buffer'}: within_episode=True needs episode boundaries, but this ReplayBuffer store "
                f"has no done-like field (looked for a scalar step field named {done_field_names()}; it has "
                f"{_top_fields(buf)}). Record one of those fields, use a "
                "TrajectoryReplayBuffer (episode ids), or pass within_episode=False (windows then run across "
                "episode ends, as one long episode)")
        # Row count and ids from one commit record (a writer may be appending or evicting).
        n, ids = read_consistent(rows, lambda: (rows.count, self._all_ids(rows) if within_episode else None))
        anchors = np.arange(0, n, stride, dtype=np.int64)
        if within_episode:
            assert ids is not None  # read with within_episode
            # run_end[i]: first row after the run of equal ids that contains row i.
            change = np.flatnonzero(ids[1:] != ids[:-1]) + 1
            ends = np.append(change, n)
            run_end = ends[np.searchsorted(ends, np.arange(n), side="right")] if n else ends
            anchors = anchors[anchors + seq_len <= run_end[anchors]]
        self._anchors = anchors
        self._offsets = np.arange(seq_len, dtype=np.int64)

    def _init_fields(self, source: Any, fields: Sequence[str] | str | None, offsets: Mapping[str, Any],
                     pad: str | Mapping[str, str], within_episode: bool, stride: int, output: str, mask_key: str,
                     storage_options: dict[str, Any] | None) -> None:
        """``__init__`` with per-field ``offsets``: anchors every ``stride`` rows (``within_episode``:
        those whose span of all fields lies in one run of equal episode ids)."""
        if stride < 1:
            raise BadOptionError(f"stride must be >= 1; got {stride}")
        ep_fields = [fields] if isinstance(fields, str) else list(fields or [])
        steps = [f for f in ep_fields if f.split("/")[0] != "episode_data"]
        if steps:
            raise BadOptionError(f"with offsets=, the step fields are the offsets keys; fields= may only add "
                                 f"'episode_data' or 'episode_data/<path>' fields; got {steps}")
        super().__init__(source, ep_fields, output, storage_options)
        if not self._src.is_trajectory:
            raise BadArgumentError(f"{self._src.path or 'in-memory buffer'}: offsets= (per-field windows) needs a "
                                   "TrajectoryReplayBuffer store; a ReplayBuffer store takes seq_len")
        buf: Any = self._src.buffer
        rows = buf.row_source()
        fw = _fw.resolve_fields(buf.step_space, rows.step_leaves, offsets, pad)  # checks every key and offset
        if mask_key in offsets or mask_key in self.fields:
            raise BadOptionError(f"mask_key {mask_key!r} collides with a field name")
        self.fields = [*offsets, *self.fields]
        self.seq_len, self.pad, self.within_episode, self.stride = None, pad, within_episode, stride
        self.mask_key, self._field_offsets = mask_key, offsets
        self._done = None
        n, ids = read_consistent(rows, lambda: (rows.count, self._all_ids(rows) if within_episode else None))
        anchors = np.arange(0, n, stride, dtype=np.int64)
        if within_episode and n:
            assert ids is not None
            lo, hi = _fw.span_of(fw)
            change = np.flatnonzero(ids[1:] != ids[:-1]) + 1
            starts, ends = np.concatenate([[0], change]), np.append(change, n)
            run = np.searchsorted(ends, anchors, side="right")  # the run of equal ids holding each anchor
            anchors = anchors[(anchors + lo >= starts[run]) & (anchors + hi < ends[run])]
        self._anchors = anchors

    def _all_ids(self, rows: Any) -> np.ndarray:
        """An episode id of every row: stored ids (from the run index), or episode numbers from done flags."""
        if self._src.is_trajectory:
            _first, lengths, ids = rows.runs()  # runs of equal ids cover every row, in order
            return np.repeat(ids, lengths)
        if self._done is None:
            return np.zeros(rows.count, np.int64)
        return episode_numbers(all_done(rows.table, self._done))

    def __len__(self) -> int:
        return len(self._anchors)

    @property
    def anchors(self) -> np.ndarray:
        """Logical row of the first frame of every item (with ``offsets``: the anchor row, offset 0)."""
        return self._anchors

    def _read(self, indices: Any, out: Any) -> dict[str, Any]:
        rows = self._src.buffer.row_source()
        if self._field_offsets is not None:
            return self._read_fields(rows, np.asarray(indices, dtype=np.int64), out)
        # One commit record for the mask and the data: a reader of a live store retries until
        # no writer evicted or rewrote the rows meanwhile (as TrajectoryReplayBuffer.get_sequences).
        return read_consistent(rows, lambda: self._read_once(rows, np.asarray(indices, dtype=np.int64), out))

    def _read_once(self, rows: Any, indices: np.ndarray, out: Any) -> dict[str, Any]:
        anchors = self._anchors[indices]
        rows.sync()
        n = rows.count
        if anchors.size and anchors.max() >= n:
            raise IndexOutOfRangeError(f"row {int(anchors.max())} is no longer in the store ({n} rows)")
        if self._src.is_trajectory:
            frames, valid = window_rows(anchors, self._offsets, 0, n, rows.step_ids)
        else:
            frames, valid = window_rows(anchors, self._offsets, 0, n, lambda r: np.zeros(np.shape(r), np.int64))
            if self._done is not None:
                # Frames (consecutive rows from the anchor, frame 0) after a flagged frame belong
                # to a later episode; clipped frames past the last row are invalid already.
                valid &= episode_numbers(done_at(rows.table, self._done, frames), axis=1) == 0
        src = pad_sources(frames, valid, self._offsets, anchors) if self.pad == "edge" else frames
        B, T = frames.shape
        steps = []
        if self._sel.step_leaves:
            with returned_rows():  # (in a worker: into the batch's shared memory, see _transfer.pack_read)
                got = rows.read_rows(src.ravel(), self._sel.step_leaves)
            for a in got:
                a = a.reshape(B, T, *a.shape[1:])
                if self.pad == "zero":
                    a[~valid] = 0
                steps.append(a)
        eps = rows.read_rows(anchors, self._sel.episode_leaves) if self._sel.episode_leaves else []
        batch = self._sel.assemble(steps, eps, out)
        batch[self.mask_key] = out(valid)
        return batch


    def _read_fields(self, rows: Any, indices: np.ndarray, out: Any) -> dict[str, Any]:
        """Items with per-field offsets: ``{key: (B, T_key, ...), episode fields: (B, ...),
        mask_key: {key: (B, T_key) bool}}``, from one consistent read."""
        assert self._field_offsets is not None
        buf: Any = self._src.buffer
        w = _fw.get_field_windows(rows, buf.step_space, self._anchors[indices], self._field_offsets, self.pad)
        where = {j: k for k, j in enumerate(rows.episode_leaves)}
        eps = [w.episodes[where[j]] for j in self._sel.episode_leaves]
        batch = {**w.by_key(out), **self._sel.assemble([], eps, out)}
        batch[self.mask_key] = {k: out(v) for k, v in w.valid.items()}
        return batch


def _top_fields(buf: Any) -> str:
    """The top-level step fields of a ReplayBuffer, for messages."""
    import gymnasium

    space = buf.single_space
    if not isinstance(space, gymnasium.spaces.Dict):
        return f"one unnamed {type(space).__name__} value per row"
    return ", ".join(repr(k) for k in space.spaces)
