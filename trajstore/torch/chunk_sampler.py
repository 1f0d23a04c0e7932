"""``ChunkShuffleSampler``: epochs that read a store chunk by chunk, shuffled within a bounded pool.

A uniformly random batch of 256 rows touches about 256 chunks of every field it reads: on object
storage that is hundreds of requests per batch (docs/benchmarks.md, "S3 (moto)").  Streaming
datasets trade some randomness for locality: visit the chunks in a random order, take a few at a
time into a pool and draw the batches from the pool, shuffled.  Each chunk is then fetched once
per epoch (its decoded copy stays in the reading process's chunk cache while its pool is drawn),
so a batch costs a fraction of a chunk request.

With DataLoader workers a batch sampler runs in the main process and the DataLoader hands batch
``t`` to worker ``t % num_workers``; the sampler lays its batches out so that every chunk is read
by one worker only: the epoch's chunks are dealt to ``num_workers`` streams, each stream draws its
batches from its own pool, and the streams' batches alternate.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from trajstore.errors import BadArgumentError, BadOptionError, EmptyBufferError, ResumeStateError, TrajstoreError
from trajstore.shards.rows import ROW_STRIDE
from trajstore.torch._source import FieldSelection
from trajstore.torch.datasets import BaseDataset
from trajstore.torch.resume import ResumableOrder

__all__ = ["ChunkShuffleSampler"]


def _count(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise BadOptionError(f"{name} must be an int >= {minimum}; got {value!r}")
    return int(value)


class ChunkShuffleSampler(ResumableOrder, Sampler[list[int]]):
    """Batches of a whole epoch read chunk by chunk: for datasets on object storage.

    Each epoch visits the store's chunks in a random order (seeded by ``(seed, epoch)``), takes
    ``pool_chunks`` of them at a time into a pool, shuffles the pool's items and yields them in
    batches of ``batch_size``; the few items a pool leaves over (less than a batch) open the next
    pool's first batch.  Every item of the dataset comes exactly once per epoch (with
    ``drop_last=False``), each batch from the chunks of one pool (two for a pool's first batch,
    more only where pools hold fewer items than a batch): on a remote store a batch costs a
    fraction of a chunk request per field instead of a request per row
    (``scripts/bench_offline.py``).  The price is randomness: items of one batch come from a few
    chunks (neighbouring rows), as with any streaming dataset; a larger pool mixes more and holds
    more decoded chunks in memory.

    Use it as a DataLoader's ``batch_sampler`` over a :class:`~trajstore.torch.TransitionDataset`,
    :class:`~trajstore.torch.SequenceDataset` or :class:`~trajstore.torch.TimeWindowDataset`
    (an item belongs to the chunk of its first row: a window's anchor).  With DataLoader
    workers, pass the DataLoader's ``num_workers`` here too: the batches are laid out so that
    worker ``w`` gets the batches of its own chunks only (each chunk is read by one worker; a
    different ``num_workers`` still reads every item, at more requests).

    Parameters
    ----------
    data_source : BaseDataset
        A map-style dataset of :mod:`trajstore.torch` (local, remote or sharded store).
    batch_size : int
    pool_chunks : int
        Chunks shuffled together (default 4).
    num_workers : int
        The DataLoader's ``num_workers`` (0: batches are read in the main process).
    chunk_rows : int, optional
        Rows per chunk to group items by; default: the smallest ``chunk_rows`` of the store's
        per-row fields the dataset reads (each shard's own, for a sharded dataset).
    drop_last : bool
        Drop each worker stream's last, short batch (then the items in it are not read that epoch).
    seed : int, optional
        Batches depend only on ``(seed, epoch)``; ``None`` draws a fresh seed.

    Raises
    ------
    BadArgumentError
        ``data_source`` is not a dataset of :mod:`trajstore.torch` (a :class:`MixtureDataset` has
        its own :class:`MixtureSampler`).
    BadOptionError
        ``batch_size``, ``pool_chunks`` or ``chunk_rows`` not an int >= 1, ``num_workers`` not an
        int >= 0.
    EmptyBufferError
        The dataset has no items.

    Notes
    -----
    Epochs: call :meth:`set_epoch` every epoch (as with ``DistributedSampler``) for a new chunk
    order; ``iter()`` again without it repeats the epoch.  The items are counted when an epoch
    starts (``len(data_source)``): items that a store gains later (rows appended, read through a
    dataset made again over it) join at the next epoch, never the one in progress.

    ``state_dict(consumed=k)`` / ``load_state_dict`` resume an epoch after its ``k``-th batch in
    any process, with exactly the batches that were still to come (``trajstore.torch.resume``);
    the state records the epoch's items and chunks, and a sampler whose dataset has fewer items,
    or groups them into other chunks (another ``chunk_rows``, a ring that evicted rows), refuses
    it with ``ResumeStateError``.  One process group: with DistributedDataParallel use
    :class:`RandomBatchSampler`'s ``rank`` / ``num_replicas``.
    """

    #: One process group (ResumableOrder records rank and num_replicas).
    rank = 0
    num_replicas = 1

    def __init__(self, data_source: Any, batch_size: int, *, pool_chunks: int = 4, num_workers: int = 0,
                 chunk_rows: int | None = None, drop_last: bool = False, seed: int | None = None) -> None:
        if not isinstance(data_source, BaseDataset):
            raise BadArgumentError(f"ChunkShuffleSampler needs a dataset of trajstore.torch (TransitionDataset, "
                                   f"SequenceDataset, TimeWindowDataset); got {type(data_source).__name__} (a "
                                   "MixtureDataset takes a MixtureSampler)")
        self.batch_size = _count(batch_size, "batch_size", 1)
        self.pool_chunks = _count(pool_chunks, "pool_chunks", 1)
        self.num_workers = _count(num_workers, "num_workers", 0)
        self.chunk_rows = None if chunk_rows is None else _count(chunk_rows, "chunk_rows", 1)
        self.drop_last = bool(drop_last)
        if len(data_source) < 1:
            raise EmptyBufferError("cannot sample batches from an empty dataset")
        self.data_source = data_source
        self.seed = int(np.random.SeedSequence().entropy % (2**63)) if seed is None else int(seed)  # type: ignore[operator]
        self.epoch = 0
        self._resumed_n: tuple[int, int] | None = None  # (epoch, items) of a resumed epoch
        self._groups_of: tuple[int, list[np.ndarray]] | None = None  # (items, items of each chunk)
        self._batches_of: tuple[tuple[int, int], list[list[int]]] | None = None  # ((epoch, items), batches)

    def fingerprint(self) -> dict[str, Any]:
        """Batch size, pool, workers, chunk rows and ``drop_last`` (items and chunks are checked by
        :meth:`load_state_dict`)."""
        return {"batch_size": self.batch_size, "pool_chunks": self.pool_chunks, "num_workers": self.num_workers,
                "chunk_rows": self.chunk_rows, "drop_last": self.drop_last}

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The position (see ``trajstore.torch.resume``), the items and the chunks of the epoch in progress."""
        state = super().state_dict(consumed)
        state["rows"] = self._rows(self.epoch)
        state["chunks"] = len(self._groups(state["rows"]))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume ``state``'s epoch over its items (a dataset that grew adds items from the next epoch).

        Raises
        ------
        ResumeStateError
            A state of another sampler, seed or options; more items than this dataset has, or
            items grouped into another number of chunks.
        """
        rows = state.get("rows")
        n = len(self.data_source)
        if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= n:
            raise ResumeStateError(f"the saved sampler state is not this sampler's: rows: saved {rows!r}, this "
                                   f"dataset has {n} (a resumed epoch needs the items it had, or more)")
        chunks = len(self._groups(rows))
        if state.get("chunks") != chunks:
            raise ResumeStateError(f"the saved sampler state is not this sampler's: chunks: saved "
                                   f"{state.get('chunks')!r}, this dataset's first {rows} items lie in {chunks} "
                                   "(another chunk_rows, or a store whose rows moved)")
        super().load_state_dict(state)
        self._resumed_n = (self.epoch, rows)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: its chunk order and pools depend on ``(seed, epoch)``."""
        self.epoch = int(epoch)

    def _rows(self, epoch: int) -> int:
        if self._resumed_n is not None and self._resumed_n[0] == epoch:
            return self._resumed_n[1]
        return len(self.data_source)

    # -- layout ----------------------------------------------------------------------------------
    def _groups(self, rows: int) -> list[np.ndarray]:
        """Items ``0 .. rows - 1`` grouped by chunk (chunks in store order, items ascending)."""
        if self._groups_of is not None and self._groups_of[0] == rows:
            return self._groups_of[1]
        ds = self.data_source
        anchors = getattr(ds, "anchors", None)  # a window's chunk is its first row's
        first = np.asarray(anchors[:rows], np.int64) if anchors is not None else np.arange(rows, dtype=np.int64)
        keys = _chunk_keys(ds.buffer.row_source(), first, _read_leaves(ds), self.chunk_rows)
        order = np.argsort(keys, kind="stable")
        _keys, starts = np.unique(keys[order], return_index=True)
        groups = np.split(order, starts[1:])
        self._groups_of = (rows, groups)
        return groups

    def _batches(self, epoch: int, rows: int) -> list[list[int]]:
        if self._batches_of is not None and self._batches_of[0] == (epoch, rows):
            return self._batches_of[1]
        groups = self._groups(rows)
        rng = np.random.default_rng([self.seed, epoch])
        streams: list[list[np.ndarray]] = [[] for _ in range(max(1, self.num_workers))]
        load = np.zeros(len(streams), np.int64)
        for c in rng.permutation(len(groups)):  # deal the chunks to the streams, evening out their items
            w = int(np.argmin(load))
            streams[w].append(groups[c])
            load[w] += len(groups[c])
        per_stream = [self._pool_batches(rng, chunks) for chunks in streams]
        # Batch t goes to worker t % num_workers: the streams take turns (a stream that ran out
        # leaves the turns to the others, so the last batches of an epoch may cross workers).
        batches = [s[t] for t in range(max(map(len, per_stream))) for s in per_stream if t < len(s)]
        self._batches_of = ((epoch, rows), batches)
        return batches

    def _pool_batches(self, rng: np.random.Generator, chunks: Sequence[np.ndarray]) -> list[list[int]]:
        """One stream's batches: ``pool_chunks`` chunks at a time, shuffled, after what the pool
        before left over, cut into batches."""
        out: list[list[int]] = []
        left = np.zeros(0, np.int64)
        b = self.batch_size
        for g in range(0, len(chunks), self.pool_chunks):
            pool = np.concatenate(chunks[g : g + self.pool_chunks])
            rng.shuffle(pool)
            # The few items the pool before left go first: a batch then spans two pools at most,
            # and no item waits in the pool for more than one refill.
            pool = np.concatenate([left, pool])
            full = len(pool) - len(pool) % b
            out.extend(pool[i : i + b].tolist() for i in range(0, full, b))
            left = pool[full:]
        if len(left) and not self.drop_last:
            out.append(left.tolist())
        return out

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches(self.epoch, self._rows(self.epoch))
        start = self._take_start()
        for batch in batches[start:]:  # a resumed epoch skips the batches it already gave
            self._advance()
            yield batch

    def __len__(self) -> int:
        return len(self._batches(self.epoch, self._rows(self.epoch)))


def _read_leaves(ds: BaseDataset) -> list[int]:
    """Per-row leaves the dataset reads (empty when its field names do not say: every field counts)."""
    try:
        return FieldSelection(ds.buffer, ds.fields).step_leaves
    except (TrajstoreError, KeyError):  # e.g. "data" (a whole non-Dict space), per-field windows' keys
        return []


def _chunk_keys(src: Any, rows: np.ndarray, leaves: list[int], chunk_rows: int | None) -> np.ndarray:
    """A chunk number for each logical row of ``src``: physical row // chunk rows (a sharded
    source: the shard's position times ``ROW_STRIDE`` plus the chunk in that shard)."""
    sources, locate = getattr(src, "sources", None), getattr(src, "locate", None)
    if sources is None or locate is None:
        return _store_chunks(src, rows, leaves, chunk_rows)
    shard, local = locate(rows)
    keys = np.empty(len(rows), np.int64)
    for k in np.unique(shard).tolist():
        sel = shard == k
        keys[sel] = k * ROW_STRIDE + _store_chunks(sources[k], local[sel], leaves, chunk_rows)
    return keys


def _store_chunks(src: Any, rows: np.ndarray, leaves: list[int], chunk_rows: int | None) -> np.ndarray:
    phys = np.asarray(src.absolute_rows(rows), np.int64)
    if src.capacity:  # a ring: absolute row r lives in slot r % capacity
        phys %= src.capacity
    return phys // (chunk_rows or _chunk_rows(src, leaves))


def _chunk_rows(src: Any, leaves: list[int]) -> int:
    """The smallest chunk (in rows) of the fields holding ``leaves`` (every per-row field when none)."""
    fields = [f for f in (src.leaf_field(j) for j in leaves) if f is not None]
    if not fields:
        table = getattr(src, "table", None)
        fields = list(getattr(table, "fields", []))
    sizes = [int(f.C) for f in fields if isinstance(getattr(f, "C", None), (int, np.integer)) and f.C > 0]
    if not sizes:
        raise BadArgumentError(f"{src.name}: its fields do not say how many rows a chunk holds; pass chunk_rows=")
    return min(sizes)
