"""Mixtures of datasets: several stores (local or remote) read as one, sampled with weights.

:class:`MixtureDataset` puts datasets end to end (item ``i`` of the mixture is item ``i -
offsets[k]`` of dataset ``k``); :class:`MixtureSampler` draws batches of mixture indices with a
weight per dataset and, optionally, a weight per item (:func:`episode_item_weights` turns weights
per episode, e.g. by task or by return, into weights per item).  Every draw depends only on
``(seed, epoch, rank)``, so a run is reproducible and DataLoader workers, which only read the
indices they are given, change nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from trajstore.errors import (
    BadArgumentError,
    BadOptionError,
    BadWeightsError,
    EmptyBufferError,
    IndexOutOfRangeError,
    SpaceMismatchError,
    UnknownFieldError,
)
from trajstore.torch._transfer import in_worker, pack
from trajstore.torch.datasets import SampleBatch, TransitionDataset
from trajstore.torch.resume import ResumableOrder

__all__ = ["MixtureDataset", "MixtureSampler", "episode_item_weights"]

#: The mixture's own field: which dataset (its position in ``MixtureDataset.names``) each item came from.
DATASET_KEY = "dataset"


def _tree_cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], Mapping):
        return {k: _tree_cat([p[k] for p in parts]) for k in parts[0]}
    if isinstance(parts[0], tuple):
        return tuple(_tree_cat([p[i] for p in parts]) for i in range(len(parts[0])))
    return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts)


def _tree_take(value: Any, order: np.ndarray) -> Any:
    if isinstance(value, Mapping):
        return {k: _tree_take(v, order) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_tree_take(v, order) for v in value)
    return value[torch.from_numpy(order)] if isinstance(value, torch.Tensor) else value[order]


def _tree_numpy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _tree_numpy(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_tree_numpy(v) for v in value)
    return value.numpy() if isinstance(value, torch.Tensor) else value


def _layout(value: Any, prefix: str = "") -> dict[str, tuple[tuple[int, ...], str]]:
    """``{field path: (per-item shape, dtype)}`` of a one-item batch."""
    if isinstance(value, Mapping):
        return {k2: v2 for k, v in value.items() for k2, v2 in _layout(v, f"{prefix}{k}/").items()}
    if isinstance(value, tuple):
        return {k2: v2 for i, v in enumerate(value) for k2, v2 in _layout(v, f"{prefix}{i}/").items()}
    return {prefix.rstrip("/"): (tuple(value.shape[1:]), str(value.dtype))}


class MixtureDataset(Dataset):
    """Several trajstore datasets as one map-style dataset.

    Parameters
    ----------
    datasets : sequence or mapping of datasets or store paths / URLs
        Each a :class:`~trajstore.torch.TransitionDataset` / :class:`~trajstore.torch.SequenceDataset`
        (or any of their kind with ``read_batch`` and ``fields``), or a store path / URL opened as
        ``TransitionDataset(path, fields=fields, output=output, storage_options=...)``.  A mapping
        names them (default names: ``"0"``, ``"1"``, ...).
    fields : list of str, optional
        The fields every dataset shares (their shapes and dtypes must agree: ``SpaceMismatchError``
        names the dataset and field that differ).  With ``fields`` a batch may mix datasets and
        holds these fields plus ``"dataset"`` (int64, the dataset of each item); without, each
        dataset keeps its own fields and spaces, and a batch must come from one dataset
        (``MixtureSampler(per_batch=True)``).
    output : "torch" or "numpy"
        For datasets opened here from paths.
    storage_options : dict or mapping of dicts, optional
        fsspec options for URLs (one dict for all, or one per dataset name).
    """

    def __init__(self, datasets: Sequence[Any] | Mapping[str, Any], *, fields: Sequence[str] | None = None,
                 output: str = "torch", storage_options: Mapping[str, Any] | None = None) -> None:
        items = (list(datasets.items()) if isinstance(datasets, Mapping)
                 else [(str(i), d) for i, d in enumerate(datasets)])
        if not items:
            raise BadOptionError("a MixtureDataset needs at least one dataset; got none")
        self.names = [str(n) for n, _ in items]
        self.fields = None if fields is None else list(fields)
        self.datasets = [self._dataset(n, d, output, storage_options) for n, d in items]
        self.offsets = np.concatenate([[0], np.cumsum([len(d) for d in self.datasets])]).astype(np.int64)
        if self.fields is not None:
            self._check_common()

    def _dataset(self, name: str, d: Any, output: str, storage_options: Mapping[str, Any] | None) -> Any:
        if hasattr(d, "read_batch") and hasattr(d, "fields"):
            if self.fields is not None:
                missing = [f for f in self.fields if f not in d.fields]
                if missing:
                    raise UnknownFieldError(f"dataset {name!r} has no field {missing[0]!r}; it has {list(d.fields)}")
            return d
        so = storage_options
        if so is not None and name in so and isinstance(so[name], Mapping):
            so = so[name]
        return TransitionDataset(d, fields=self.fields, output=output,
                                 storage_options=dict(so) if so is not None else None)

    def _check_common(self) -> None:
        seen: dict[str, tuple[str, tuple[tuple[int, ...], str]]] = {}
        for name, d in zip(self.names, self.datasets):
            if not len(d):
                continue
            got = _layout(self._select(d.read_batch([0])))
            for field, want in got.items():
                first = seen.setdefault(field, (name, want))
                if first[1] != want:
                    raise SpaceMismatchError(f"field {field!r}: dataset {first[0]!r} has per-item shape and dtype "
                                             f"{first[1]}, dataset {name!r} has {want}")

    def _select(self, batch: dict[str, Any]) -> dict[str, Any]:
        return batch if self.fields is None else {f: batch[f] for f in self.fields}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """(dataset number, index in that dataset) of each mixture index (int64 arrays)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexOutOfRangeError(f"index out of range for a mixture of {n} items")
        k = np.searchsorted(self.offsets, idx, side="right") - 1
        return k, idx - self.offsets[k]

    def read_batch(self, indices: Any) -> dict[str, Any]:
        """Items ``indices`` as one batch, in order, with ``"dataset"`` (int64) per item."""
        k, local = self.locate(indices)
        present = np.unique(k)
        if len(present) > 1 and self.fields is None:
            mixed = [self.names[i] for i in present]
            raise BadArgumentError(f"a batch mixes datasets {mixed} whose fields may differ: "
                                   "declare the common fields (MixtureDataset(..., fields=[...])) or draw each batch "
                                   "from one dataset (MixtureSampler(..., per_batch=True))")
        parts, where = [], []
        for j in present:
            sel = np.flatnonzero(k == j)
            parts.append(self._select(self.datasets[j].read_batch(local[sel])))
            where.append(sel)
        order = np.argsort(np.concatenate(where), kind="stable")
        batch = _tree_take(_tree_cat(parts), order) if len(parts) > 1 else parts[0]
        first = next(iter(batch.values()))
        batch[DATASET_KEY] = torch.from_numpy(k) if isinstance(first, torch.Tensor) else k
        return batch

    def __getitems__(self, indices: Any) -> SampleBatch:
        batch = self.read_batch(indices)
        if in_worker() and isinstance(batch[DATASET_KEY], torch.Tensor):
            # one buffer crosses to the main process, as the datasets' own batches (``_transfer``)
            batch = pack(_tree_numpy(batch))
        return SampleBatch(batch, len(np.asarray(indices).reshape(-1)))

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v[0] for k, v in self.read_batch([i]).items()}


def _weights(values: Any, n: int, what: str, labels: Sequence[str] | None = None) -> np.ndarray:
    w = np.asarray(values, dtype=np.float64).reshape(-1)
    if w.shape != (n,):
        raise BadOptionError(f"{what}: {n} weights expected, got {w.size}")
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if bad.size:
        at = f"of dataset {labels[bad[0]]!r}" if labels is not None else f"at position {int(bad[0])}"
        raise BadWeightsError(f"{what}: weight {float(w[bad[0]])} {at} is not a finite number >= 0")
    if n and not w.sum() > 0:
        raise BadWeightsError(f"{what}: every weight is zero, nothing could be drawn")
    return w


class MixtureSampler(ResumableOrder, Sampler[list[int]]):
    """Batches of mixture indices: each item's dataset drawn with probability ``weights[k] /
    sum(weights)``, then an item of that dataset uniformly or with probability proportional to
    its ``item_weights``.

    Use it as a DataLoader's ``batch_sampler`` over a :class:`MixtureDataset`.

    Parameters
    ----------
    mixture : MixtureDataset
    batch_size : int
    weights : sequence or mapping of float, optional
        One per dataset (by position or name); default: by dataset size (every item equally likely).
    item_weights : mapping of name -> array, optional
        Per-item weights of some datasets (e.g. :func:`episode_item_weights`).
    num_batches : int, optional
        Batches per epoch; ``None``: endless.
    per_batch : bool
        False (default): each item draws its dataset (needs the mixture's common ``fields``);
        True: each batch draws one dataset and all its items come from it (datasets keep their own
        fields); the expected share of batches is the weights'.
    seed, rank, num_replicas
        As :class:`~trajstore.torch.RandomBatchSampler`: batches depend only on
        ``(seed, epoch, rank)`` (:meth:`set_epoch`); ``state_dict(consumed=k)`` /
        ``load_state_dict`` resume an epoch after its ``k``-th batch in any process (the
        datasets' sizes and the weights must be the saved ones: ``ResumeStateError`` otherwise).

    Raises
    ------
    BadWeightsError
        A weight that is negative, NaN or infinite, or weights that are all zero.
    EmptyBufferError
        A dataset with a positive weight has no items.
    """

    def __init__(self, mixture: MixtureDataset, batch_size: int,
                 weights: Sequence[float] | Mapping[str, float] | None = None,
                 *, item_weights: Mapping[str, Any] | None = None, num_batches: int | None = None,
                 per_batch: bool = False, seed: int | None = None, rank: int = 0, num_replicas: int = 1) -> None:
        if batch_size < 1 or (num_batches is not None and num_batches < 0):
            raise BadOptionError(f"batch_size must be >= 1 and num_batches >= 0; got {batch_size}, {num_batches}")
        if not 0 <= rank < num_replicas:
            raise BadOptionError(f"rank {rank} not in [0, {num_replicas})")
        names = mixture.names
        sizes = np.diff(mixture.offsets)
        given: Any = sizes.astype(np.float64) if weights is None else weights
        if isinstance(given, Mapping):
            unknown = [k for k in given if k not in names]
            if unknown:
                raise BadOptionError(f"weights for unknown datasets {unknown}; the mixture has {names}")
            given = [given.get(n, 0.0) for n in names]
        w = _weights(given, len(names), "dataset weights", names)
        empty = [n for n, s, x in zip(names, sizes, w) if s == 0 and x > 0]
        if empty:
            raise EmptyBufferError(f"dataset {empty[0]!r} has weight > 0 but no items")
        self.probs = w / w.sum()
        self._cum: dict[int, np.ndarray] = {}
        for name, iw in (item_weights or {}).items():
            if name not in names:
                raise BadOptionError(f"item_weights for unknown dataset {name!r}; the mixture has {names}")
            k = names.index(name)
            self._cum[k] = np.cumsum(_weights(iw, int(sizes[k]), f"item weights of dataset {name!r}"))
        if per_batch is False and mixture.fields is None and len(names) > 1:
            raise BadOptionError("per_batch=False mixes datasets in a batch: declare the mixture's common fields "
                                 "(MixtureDataset(..., fields=[...])) or pass per_batch=True")
        self.mixture, self.batch_size, self.num_batches = mixture, int(batch_size), num_batches
        self.per_batch = per_batch
        entropy: Any = np.random.SeedSequence().entropy
        self.seed = int(entropy % (2**63)) if seed is None else int(seed)
        self.rank, self.num_replicas, self.epoch = rank, num_replicas, 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: the batches that follow depend on ``(seed, epoch, rank)``."""
        self.epoch = int(epoch)

    def fingerprint(self) -> dict[str, Any]:
        """The datasets (names, sizes), the weights (a digest) and the batch shape of the draws."""
        digest = hashlib.sha256(self.probs.tobytes())
        for k in sorted(self._cum):
            digest.update(str(k).encode() + self._cum[k].tobytes())
        return {"datasets": list(self.mixture.names), "sizes": np.diff(self.mixture.offsets).tolist(),
                "weights": digest.hexdigest()[:16], "batch_size": self.batch_size, "num_batches": self.num_batches,
                "per_batch": self.per_batch}

    def _items(self, rng: np.random.Generator, k: int, n: int) -> np.ndarray:
        cum = self._cum.get(k)
        if cum is None:
            local = rng.integers(0, int(self.mixture.offsets[k + 1] - self.mixture.offsets[k]), size=n)
        else:
            # inverse CDF: item i is drawn with probability item_weights[i] / sum (zero-weight items never)
            local = np.searchsorted(cum, rng.random(n) * cum[-1], side="right")
        return self.mixture.offsets[k] + local

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        """One batch of mixture indices from ``rng``."""
        if self.per_batch:
            return self._items(rng, int(rng.choice(len(self.probs), p=self.probs)), self.batch_size)
        ks = rng.choice(len(self.probs), size=self.batch_size, p=self.probs)
        out = np.empty(self.batch_size, np.int64)
        for k in np.unique(ks):
            sel = ks == k
            out[sel] = self._items(rng, int(k), int(sel.sum()))
        return out

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch, self.rank])
        start, drawn = self._take_start(), 0
        while self.num_batches is None or drawn < self.num_batches:
            drawn += 1
            batch = self.draw(rng)
            if drawn > start:  # a resumed epoch draws (and drops) the batches it already gave
                self._advance()
                yield batch.tolist()

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("an endless MixtureSampler (num_batches=None) has no length")
        return self.num_batches


def episode_item_weights(dataset: Any, weight: Mapping[int, float] | Callable[[np.ndarray], Any], *,
                         per: str = "step") -> np.ndarray:
    """Per-item weights of ``dataset`` from weights per episode (a task, a return...).

    Parameters
    ----------
    dataset : TransitionDataset or SequenceDataset over a TrajectoryReplayBuffer store
    weight : mapping episode id -> float, or callable
        A callable gets the (E,) int64 array of episode ids and returns (E,) weights; episodes
        missing from a mapping weigh 0.
    per : "step" or "episode"
        ``"step"``: every item of an episode gets the episode's weight (longer episodes are drawn
        more, in proportion to their items); ``"episode"``: the episode's weight is shared by its
        items, so each episode as a whole is drawn in proportion to its weight.

    Returns
    -------
    numpy.ndarray
        (len(dataset),) float64, for ``MixtureSampler(item_weights={name: ...})``.
    """
    if per not in ("step", "episode"):
        raise BadOptionError(f"per must be 'step' or 'episode'; got {per!r}")
    rows = dataset.buffer.row_source()
    anchors = getattr(dataset, "anchors", None)
    ids = rows.step_ids(np.arange(len(dataset)) if anchors is None else np.asarray(anchors))
    episodes, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    if callable(weight):
        per_episode = np.asarray(weight(episodes), dtype=np.float64).reshape(-1)
    else:
        per_episode = np.array([float(weight.get(int(e), 0.0)) for e in episodes])
    w = _weights(per_episode, len(episodes), "episode weights")
    return w[inverse] / (counts[inverse] if per == "episode" else 1)
