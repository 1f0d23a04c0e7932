"""``ReplayBuffer``: a disk-backed ring (or growing list) of gymnasium-space values.

Layout: ``<cache_path>/step_data/<leaf path>``, one zarr array per leaf of the space, in
one table (see :mod:`trajstore.store`).  Ring rules follow UniEnv: logical row ``i`` is
physical row ``(offset + i) % capacity``; an extend past capacity advances ``offset`` by
the overflow; a batch of ``B >= capacity`` rows keeps its last ``capacity`` rows.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import gymnasium
import numpy as np

from trajstore._optional import to_numpy
from trajstore.buffers.backend import Backend
from trajstore.buffers.base import StoredBuffer
from trajstore.buffers.views import BatchBase
from trajstore.core.progress import progress_bar
from trajstore.core.ring import IndexLike, normalize_index
from trajstore.core.stager import RowStager
from trajstore.core.store import Store, TableSpec
from trajstore.errors import BadArgumentError, BadOptionError, SpaceMismatchError
from trajstore.spaces import ValuePlan, flatdim, space_to_json
from trajstore.storage.fields.layout import check_compressor_keys, make_field_spec
from trajstore.storage.fields.spec import refuse_video

__all__ = ["ReplayBuffer", "ZarrStorage", "copy_steps", "check_storage_cls", "is_remote"]

TABLE = "step_data"

#: ``extend_from`` copies about this many bytes of row data per step: the per-step cost (a read,
#: a table write, a commit check) is then amortized (100,000 rows of (17,) float32 in memory:
#: 8 rows per step took 1.1 s, 4,096 rows 0.03 s) while memory stays bounded for image rows.
COPY_STEP_BYTES = 8 << 20
#: ``extend_from(..., tqdm=None)`` shows a progress bar (on a terminal, when tqdm is installed) for
#: copies of at least this many bytes of row data: about half a second and more on this machine.
COPY_BAR_BYTES = 64 << 20


def copy_steps(n: int, row_bytes: int, chunk_size: int | None, tqdm: bool | None) -> tuple[int, Any]:
    """Rows per step and the progress bar of an ``extend_from`` of ``n`` rows of ``row_bytes``."""
    if chunk_size is None:
        step = max(1, COPY_STEP_BYTES // max(row_bytes, 1))
    elif isinstance(chunk_size, (int, np.integer)) and not isinstance(chunk_size, bool) and chunk_size >= 1:
        step = int(chunk_size)
    else:
        raise BadArgumentError(f"extend_from: chunk_size must be a positive int, or None to size steps by bytes "
                               f"(about {COPY_STEP_BYTES >> 20} MiB of rows each); got {chunk_size!r}")
    enabled = (None if n * row_bytes >= COPY_BAR_BYTES else False) if tqdm is None else bool(tqdm)
    return step, progress_bar(n, "extend_from", enabled, unit="row")


class ZarrStorage:
    """The storage class: chunked zarr v3 arrays (the only one; it takes these options).

    Options (``**storage_kwargs`` of ``create``/``load_from``)
    ---------------------------------------------------------
    chunk_rows : int, optional
        Rows per chunk for every field.  Default: ~1 MiB per uncompressed chunk, ~1 MiB of data
        per compressed chunk.  Uncompressed chunks are always rounded up to whole memory pages
        (e.g. a multiple of 1024 rows for (17,) float32) so they can be mapped side by side.
    compressor : None, "lz4", "zstd", an image codec, zarr codec, numcodecs codec, or a dict of those
        Default None (raw) on local folders and in memory: raw chunks are memory-mapped and
        sample at numpy-memmap speed (docs/benchmarks.md); "lz4" on remote stores.  Image codecs
        (``"jpeg:90"``, ``"png"``, ``"webp-lossless"``, ``"avif:80"``, ``"jpegxl:90"``,
        ``"jpeg2k"``... or an ``ImageCodec``) encode each frame alone (docs/format.md, "Image
        fields"); a dict gives each leaf its own (``{"obs": "jpeg:90"}``, ``"*"``: the others).
    fsync : bool
        Make every commit durable against power loss (default False: SIGKILL-safe only).
    commit_interval : float
        Seconds between automatic commits while writing (default 1.0).
    """

    CREATE_OPTIONS = ("chunk_rows", "compressor", "fsync", "commit_interval")
    OPEN_OPTIONS = ("fsync", "commit_interval")

    @classmethod
    def check_options(cls, kwargs: dict[str, Any], allowed: Sequence[str]) -> dict[str, Any]:
        """A copy of ``kwargs``, checked to hold only options of ``allowed``.

        Parameters
        ----------
        kwargs : dict
            Storage options as given (``**storage_kwargs``).
        allowed : sequence of str
            The options that call takes (``CREATE_OPTIONS`` or ``OPEN_OPTIONS``).

        Raises
        ------
        BadArgumentError
            An option not in ``allowed``.
        BadOptionError
            ``chunk_rows`` is given and is not a positive int.
        """
        bad = sorted(set(kwargs) - set(allowed))
        if bad:
            raise BadArgumentError(f"unexpected storage option(s) {bad}; allowed: {list(allowed)}")
        if "chunk_rows" in kwargs and kwargs["chunk_rows"] is not None:
            if not isinstance(kwargs["chunk_rows"], (int, np.integer)) or kwargs["chunk_rows"] < 1:
                raise BadOptionError(f"chunk_rows must be a positive int; got {kwargs['chunk_rows']!r}")
        return dict(kwargs)


def check_storage_cls(storage_cls: Any) -> None:
    """Refuse a ``storage_cls`` argument of ``create`` other than None or :class:`ZarrStorage`
    (a path given there by mistake is named as one)."""
    if isinstance(storage_cls, (str, os.PathLike)):  # the usual slip: create(space, "runs/x")
        raise BadArgumentError(f"got the path {os.fspath(storage_cls)!r} as the storage class: the second positional "
                               "argument of create() is storage_cls (step_data_storage_cls for a "
                               f"TrajectoryReplayBuffer); pass the path as cache_path={os.fspath(storage_cls)!r}")
    if storage_cls not in (None, ZarrStorage):
        raise BadArgumentError(f"storage_cls must be None or trajstore.ZarrStorage; got {storage_cls!r}")


def is_remote(cache_path: Any) -> bool:
    """Whether ``cache_path`` names a remote store (a URL other than ``file://`` / ``memory://``)."""
    return cache_path is not None and "://" in os.fspath(cache_path) and not os.fspath(cache_path).startswith(
        ("file://", "memory://")
    )


class ReplayBuffer(StoredBuffer):
    """A disk-backed replay buffer; open one with :meth:`create` or :meth:`load_from`.

    Rows are values of ``single_space``: nested dicts (Dict), tuples (Tuple) of arrays of
    each leaf's shape and dtype.  Batched reads add a leading axis B.  Reads return copies
    in the chosen backend (numpy arrays, or torch tensors on ``device``).

    Every write checks its values before anything is written (a bad row anywhere in a batch
    writes nothing of it): they must fit the field's dtype (float64 into float32 and whole
    floats such as ``1.0`` into integer fields are fine; 300 into uint8, 2**40 into int32 or 0.5
    into a Discrete are not), Discrete/MultiDiscrete values must lie in ``[start, start + n - 1]``,
    MultiBinary values be 0 or 1.  Box bounds are checked only with ``check_bounds=True``.  A
    refused value raises :class:`~trajstore.errors.BadValueError` naming the field, the first bad
    row and element, the value and what the space allows.
    """

    def __init__(self, store: Store, space: gymnasium.Space, backend: Backend, *, open_args: dict[str, Any]):
        super().__init__(store, backend, open_args)
        self.single_space = space
        self._plan = ValuePlan(space, check_bounds=open_args.get("check_bounds", False))
        self._table = store.tables[TABLE]
        self._stager = RowStager(self._table, [(leaf.shape, leaf.dtype) for leaf in self._plan.leaves])
        self._stagers = [self._stager]
        self._leaf_ids = list(range(len(self._plan.leaves)))

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        single_instance_space: gymnasium.Space,
        storage_cls: Any = None,
        *,
        cache_path: str | os.PathLike[str] | None = None,
        capacity: int | None = None,
        multiprocessing: bool = False,
        backend: str = "numpy",
        device: Any = None,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        check_bounds: bool = False,
        **storage_kwargs: Any,
    ) -> "ReplayBuffer":
        """Create an empty buffer.

        Parameters
        ----------
        single_instance_space : gymnasium.Space
            Space of one row (Box, Discrete, MultiDiscrete, MultiBinary, Dict, Tuple, nested).
        storage_cls : None or ZarrStorage
        cache_path : str or path-like, optional
            Local folder or fsspec URL; ``None`` keeps the store in memory.  (A ``.zip`` is written
            once by ``dumps("x.zip")`` from a store built elsewhere, then read with
            ``load_from(..., read_only=True)``.)
        capacity : int, optional
            Ring size; ``None`` grows without bound.
        multiprocessing : bool
            Allow several processes to write (serialized by a lock); the buffer pickles as a handle.
        backend, device
            What reads return: ``"numpy"``, or ``"torch"`` tensors on ``device``.
        storage_options : dict, optional
            fsspec options for URLs (credentials, endpoint...).
        overwrite : bool
            Replace an existing store at ``cache_path``.
        check_bounds : bool
            Also refuse Box values outside ``low``/``high`` (``BadValueError``), as
            ``Box.contains`` judges them: NaN is refused (it lies in no interval), +-inf only where
            the bound is finite.  Off by default: observations often leave their nominal bounds
            and a float Box costs nothing unchecked.  A setting of this handle, not of the store
            (it is not saved in the store's metadata): a check on writes is the writer's policy,
            a store is data that any reader opens the same way, and the format stays v1.  So pass
            it again to ``load_from`` to keep checking; handles pickled for other processes
            (``multiprocessing=True``) keep it.
        **storage_kwargs
            :class:`ZarrStorage` options: ``chunk_rows``, ``compressor``, ``fsync``, ``commit_interval``.
        """
        check_storage_cls(storage_cls)
        opts = ZarrStorage.check_options(storage_kwargs, ZarrStorage.CREATE_OPTIONS)
        if capacity is not None and (not isinstance(capacity, (int, np.integer)) or capacity < 1):
            raise BadOptionError(f"capacity must be a positive int or None; got {capacity!r}")
        bk = Backend(backend, device)
        plan = ValuePlan(single_instance_space)  # refuses unsupported spaces before touching disk
        compressor = opts.pop("compressor", "lz4" if is_remote(cache_path) else None)
        spec = _table_spec(TABLE, plan, capacity, compressor, opts.pop("chunk_rows", None))
        store = Store.create(
            cache_path, "ReplayBuffer", [spec], {"spaces": {TABLE: space_to_json(single_instance_space)}},
            storage_options=storage_options, overwrite=overwrite, multiprocessing=multiprocessing, options=opts,
        )
        return cls(store, single_instance_space, bk, open_args=dict(
            cache_path=cache_path, multiprocessing=multiprocessing, backend=backend, device=device,
            storage_options=storage_options, options=opts, check_bounds=bool(check_bounds)))

    @classmethod
    def load_from(
        cls,
        path: str | os.PathLike[str],
        *,
        backend: str = "numpy",
        device: Any = None,
        read_only: bool = False,
        multiprocessing: bool = False,
        storage_options: dict[str, Any] | None = None,
        single_instance_space: gymnasium.Space | None = None,
        check_bounds: bool = False,
        **storage_kwargs: Any,
    ) -> "ReplayBuffer":
        """Open an existing buffer: reads metadata and the commit record only, whatever the size.

        ``read_only=True`` never writes a byte (no lock file, no temp file); any number of
        readers may open a store while one writer appends.  A given ``single_instance_space``
        must equal the stored one.  ``check_bounds=True``: this handle's writes refuse Box values
        outside the bounds (see :meth:`create`; it is not stored, so give it on every open).

        ``storage_options`` are fsspec's options for a URL (credentials, endpoint...), plus two of
        trajstore's own for remote stores read many times: ``trajstore_chunk_cache`` (a local
        folder) and ``trajstore_chunk_cache_bytes`` (its bound, default 8 GiB).  Chunks read once
        are kept there and reused by later opens and other processes; entries are tied to the
        store's commit record, so a new commit never reads stale ones.
        """
        opts = ZarrStorage.check_options(storage_kwargs, ZarrStorage.OPEN_OPTIONS)

        def build(store: Store, bk: Backend, open_args: dict[str, Any]) -> "ReplayBuffer":
            space = store.space(TABLE)
            if single_instance_space is not None and single_instance_space != space:
                raise SpaceMismatchError(f"{path}: stored space {space} differs from the given {single_instance_space}")
            return cls(store, space, bk, open_args=open_args | {"check_bounds": bool(check_bounds)})

        return cls._open_store("ReplayBuffer", path, build, backend=backend, device=device,  # type: ignore[return-value]
                               read_only=read_only, multiprocessing=multiprocessing,
                               storage_options=storage_options, options=opts)

    # -- reads -----------------------------------------------------------------------------
    def _read_rows(self, idx: int | np.ndarray, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        if isinstance(idx, int):
            return self._table.read_row(idx, leaf_ids)
        return self._table.gather(idx, leaf_ids)

    def _read_slice(self, s: slice, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        self._sync()
        lo, hi, step = s.indices(self._table.count)
        if step == 1:
            return self._table.read_contiguous(lo, max(lo, hi), leaf_ids)
        return self._table.gather(np.arange(lo, hi, step, dtype=np.int64), leaf_ids)

    # -- writes ----------------------------------------------------------------------------
    def row_stager(self) -> RowStager | None:
        """Where single-row appends are staged, for a writer that fills staged rows itself.

        ``ZarrReplayBuffer.add`` stages its frames here directly instead of building a row for
        :meth:`append`.  Such a writer follows :class:`~trajstore.core.stager.RowStager`'s
        protocol: ``room()``, write row ``n`` of ``bufs`` (one array per leaf of the space, in
        its order; values are not checked: assignment casts or broadcasts), then ``added()``,
        which hands the block to the store when it is full (and on the store's commit timer
        unless ``commit_timer=False``).  This buffer drains the stager before every read and
        commit, as for its own appends.

        Returns
        -------
        RowStager or None
            None when rows are not staged: the store is shared by several writer processes
            (each append commits under the lock), read-only or closed; :meth:`append` then
            writes through (or raises) as usual.
        """
        if self._store.multiprocessing or not self._store.writable or self._store.closed:
            return None
        return self._stager

    def append(self, value: Any) -> None:
        """Add one row (a value of ``single_space``)."""
        st = self.row_stager()
        if st is None:
            arrays, n = self._plan.to_arrays(value, batched=False)
            with self._store.write_op():
                self._table.extend(arrays, n)
            return
        st.room()
        self._plan.write_row(value, st.bufs, st.n)
        st.added()

    def append_leaves(self, arrays: Sequence[np.ndarray]) -> None:
        """:meth:`append` of one row given as one array per leaf, in the order of the space's
        leaves, each already of its leaf's shape and dtype (not checked: assignment would cast or
        broadcast).  For integrations that build rows themselves (the SB3 buffers): they skip the
        walk and checks of a nested value on every step."""
        st = self.row_stager()
        if st is None:
            self.append(self._plan.from_arrays(list(arrays)))  # the checked path, as it takes a lock anyway
            return
        st.room()
        j = st.n
        for b, a in zip(st.bufs, arrays):
            b[j] = a
        st.added()

    def extend(self, value: Any) -> None:
        """Add a batch of rows (leading axis B on every leaf)."""
        arrays, n = self._plan.to_arrays(value, batched=True)
        with self._store.write_op():
            self._stager.drain()
            self._table.extend(arrays, n)

    def append_flattened(self, value: Any) -> None:
        """Add one row given in gymnasium's flattened layout, shape (flatdim,)."""
        flat = to_numpy(value)
        if flat.ndim != 1:
            from trajstore.errors import BadValueError

            raise BadValueError(f"append_flattened expects shape ({flatdim(self.single_space)},); got {flat.shape}")
        self.extend_flattened(flat[None])

    def extend_flattened(self, value: Any) -> None:
        """Add rows given in gymnasium's flattened layout, shape (B, flatdim)."""
        flat = to_numpy(value)
        arrays = self._plan.unflatten(flat)
        with self._store.write_op():
            self._stager.drain()
            self._table.extend(arrays, len(flat))

    def set_at(self, idx: IndexLike, value: Any) -> None:
        """Overwrite rows ``idx`` (crash-atomic: the store holds all old or all new rows)."""
        self._sync()
        i = normalize_index(idx, self._table.count)
        single = isinstance(i, int)
        arrays, n = self._plan.to_arrays(value, batched=not single)
        rows = np.atleast_1d(np.asarray(i, dtype=np.int64))
        if not single and n != len(rows):
            from trajstore.errors import BadValueError

            raise BadValueError(f"set_at got {n} rows for {len(rows)} indices")
        with self._store.write_op():
            self._store.rewrite(self._table.rewrite_plan_set(rows, arrays, self._leaf_ids), lambda: None)

    def remove_at(self, idx: IndexLike) -> None:
        """Delete rows ``idx``; later rows move up and ``len`` shrinks.  Crash-atomic."""
        self._sync()
        rows = np.unique(np.atleast_1d(np.asarray(normalize_index(idx, self._table.count), dtype=np.int64)))
        if rows.size == 0:
            return
        t = self._table

        def shrink() -> None:
            t.state.end -= int(rows.size)

        with self._store.write_op():
            self._store.rewrite(t.rewrite_plan_remove(rows), shrink)

    def clear(self) -> None:
        """Remove every row (committed at once; the arrays keep their size)."""
        op = self._store.write_op()  # refuses a read-only or closed buffer before anything is dropped
        self._stager.discard()
        with op:
            t = self._table
            t.state.start = t.state.end = 0
            head = self._store.current_head()
            head.epoch += 1
            self._store.write_record(head)

    def extend_from(self, other: BatchBase, chunk_size: int | None = None, tqdm: bool | None = None) -> None:
        """Append every row of ``other`` (any buffer or view of an equal space).

        Parameters
        ----------
        other : BatchBase
            A buffer or view whose ``single_space`` equals this one's.
        chunk_size : int, optional
            Rows copied per step.  ``None`` (default) sizes steps by bytes: about 8 MiB of row
            data each (e.g. 123,361 rows of (17,) float32, 297 rows of (84,84,4) uint8).
        tqdm : bool, optional
            Progress bar: ``True`` always (needs tqdm), ``False`` never, ``None`` (default) on a
            terminal for copies of at least 64 MiB of row data, when tqdm is installed.

        Rows are checked against this buffer's space (and bounds, with ``check_bounds``) a step at
        a time, like ``extend``: a refused row stops the copy, with the steps before it appended.
        """
        if other.single_space != self.single_space:
            raise SpaceMismatchError(f"extend_from: spaces differ: {other.single_space} vs {self.single_space}")
        n = len(other)
        self._stager.drain()
        step, bar = copy_steps(n, self._table.row_bytes, chunk_size, tqdm)
        try:
            for lo in range(0, n, step):
                hi = min(lo + step, n)
                arrays = other.leaf_arrays(slice(lo, hi))
                self._plan.check(arrays, first_row=lo)  # rows of a store written without these checks
                with self._store.write_op():
                    self._table.extend(arrays, hi - lo)
                bar.update(hi - lo)
        finally:
            bar.close()


def _table_spec(name: str, plan: ValuePlan, capacity: int | None, compressor: Any, chunk_rows: int | None) -> TableSpec:
    """One field per leaf of ``plan`` under ``name/``; ``compressor`` may be a dict by leaf name."""
    paths = [f"{name}/{leaf.name}" if leaf.name else name for leaf in plan.leaves]
    check_compressor_keys(compressor, paths)
    fields = [make_field_spec(p, leaf.shape, leaf.dtype, capacity=capacity, compressor=compressor, chunk_rows=chunk_rows)
              for p, leaf in zip(paths, plan.leaves)]
    refuse_video(fields, "a ReplayBuffer")
    return TableSpec(name, capacity, fields)
