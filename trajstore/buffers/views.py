"""``BatchBase``, the indexing/reading surface every buffer and view shares, and the lazy
views ``get_slice`` and ``get_column`` return.

Reads go through one method, :meth:`BatchBase._read`, which takes indices already
resolved against the current length and a list of leaf numbers; views translate both
and pass them to their parent, so a chain of views costs one read of the base buffer
when indexed, and nothing before.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import gymnasium
import numpy as np

from trajstore._optional import to_numpy
from trajstore.buffers.backend import Backend
from trajstore.core.ring import IndexLike, normalize_index
from trajstore.errors import BadArgumentError, IndexOutOfRangeError, ReadOnlyError
from trajstore.spaces import ValuePlan, subspace

__all__ = ["BatchBase", "SliceView", "ColumnView"]

_T = TypeVar("_T")


class BatchBase:
    """A sequence of rows of ``single_space`` values, indexed like numpy along axis 0.

    An int index gives one unbatched value; a slice, an int array, a bool mask of length
    ``len(self)`` or ``...`` give a batch with leading dimension B.  Values are nested dicts
    (tuples for Tuple spaces) of numpy arrays or torch tensors, always fresh copies.
    """

    single_space: gymnasium.Space
    _plan: ValuePlan
    _backend: Backend

    # -- to implement ----------------------------------------------------------------------
    def __len__(self) -> int:
        raise NotImplementedError  # abstract: every concrete batch defines its length

    def _read(self, idx: int | np.ndarray, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        """Arrays of leaves ``leaf_ids`` at resolved rows ``idx`` (int: unbatched)."""
        raise NotImplementedError  # abstract

    def _read_slice(self, s: slice, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        return self._read(normalize_index(s, len(self)), leaf_ids)

    def _consistent(self, read: Callable[[], _T]) -> _T:
        """Run ``read`` (which resolves indices against the current length, then reads) so that
        its result is the rows of one commit record.  Buffers that other processes commit into
        override this to retry; views hand it to the buffer they look at."""
        return read()

    # -- common properties ------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """What reads return: ``"numpy"`` arrays or ``"torch"`` tensors."""
        return self._backend.name

    @property
    def device(self) -> Any:
        """The ``torch.device`` of returned tensors (CPU unless given); ``None`` for numpy."""
        return self._backend.device

    @property
    def _all_leaves(self) -> list[int]:
        return list(range(len(self._plan.leaves)))

    # -- reads ------------------------------------------------------------------------------
    def _raw(self, idx: IndexLike) -> tuple[list[np.ndarray], bool]:
        return self._consistent(lambda: self._raw_once(idx))

    def _raw_once(self, idx: IndexLike) -> tuple[list[np.ndarray], bool]:
        if isinstance(idx, slice):
            return self._read_slice(idx, self._all_leaves), True
        i = normalize_index(idx, len(self))
        return self._read(i, self._all_leaves), not isinstance(i, int)

    def leaf_arrays(self, idx: IndexLike) -> list[np.ndarray]:
        """The numpy array of every leaf (in ``single_space``'s leaf order) at ``idx``, as of one
        commit record: what copies between batches (``extend_from``) read."""
        return self._raw(idx)[0]

    def read_values(self, rows: Callable[[], np.ndarray]) -> Any:
        """The rows that ``rows()`` (B,) int64 names, every leaf, as a batch of ``single_space``
        values in this batch's backend.  ``rows`` is called inside the read of one commit record:
        rows found under an older record may name other rows once a ring has evicted."""
        arrays = self._consistent(lambda: self._read(rows(), self._all_leaves))
        return self._plan.from_arrays([self._backend.out(a) for a in arrays])

    def get_at(self, idx: IndexLike) -> Any:
        """Value(s) at ``idx``: one unbatched value for an int, a batch otherwise."""
        arrays, _ = self._raw(idx)
        return self._plan.from_arrays([self._backend.out(a) for a in arrays])

    def __getitem__(self, idx: IndexLike) -> Any:
        return self.get_at(idx)

    def get_flattened_at(self, idx: IndexLike) -> Any:
        """Rows in gymnasium's flattened layout: (flatdim,) for an int, (B, flatdim) otherwise.

        Equals ``gymnasium.spaces.flatten(single_space, get_at(i))`` row by row.
        """
        arrays, batched = self._raw(idx)
        if not batched:
            arrays = [a[None] for a in arrays]
        flat = self._plan.flatten(arrays)
        return self._backend.out(flat if batched else flat[0])

    def to_numpy(self) -> Any:
        """Every row, as numpy (whatever the backend)."""
        return self._plan.from_arrays(self._consistent(lambda: self._read(np.arange(len(self)), self._all_leaves)))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if len(self._plan.leaves) != 1 or self._plan.leaves[0].path:
            raise TypeError(
                f"np.asarray needs a single-array view; this one has leaves "
                f"{[leaf.name for leaf in self._plan.leaves]}: use get_column([...]) or to_numpy()"
            )
        arr = self._consistent(lambda: self._read(np.arange(len(self)), [0]))[0]
        return arr if dtype is None else arr.astype(dtype)

    def __iter__(self) -> Any:
        """Rows ``0 .. len(self) - 1``, one :meth:`get_at` each, every row read under the commit
        record current when it is read.  Over a ring that a writer is turning, the numbering moves
        between rows (a row can come twice or be skipped; each is whole): ``self[:]`` reads every
        row of one record at once."""
        for i in range(len(self)):
            yield self.get_at(i)

    # -- lazy views -------------------------------------------------------------------------
    def get_slice(self, idx: IndexLike) -> "SliceView":
        """A lazy view of rows ``idx``, resolved against this batch's length at read time."""
        return SliceView(self, idx)

    def to_dask(self) -> Any:
        """The committed rows of this column view as a dask array (nested dict of them for a Dict
        column), chunked like the store; see :func:`trajstore.dask.to_dask`."""
        node, leaves = self, list(range(len(self._plan.leaves)))
        while isinstance(node, ColumnView):
            leaves = [node._leaf_map[j] for j in leaves]
            node = node.parent
        return ValuePlan(self.single_space).from_arrays(node.dask_leaves(leaves))

    def dask_leaves(self, leaves: Sequence[int]) -> list[Any]:
        """One dask array per leaf in ``leaves`` (leaf numbers of ``single_space``): this
        buffer's committed rows (:func:`~trajstore.sampling.dask_arrays.dask_arrays` over its row
        source).  Batches whose rows are numbered otherwise (an episode view, a sharded dataset)
        override it.

        Raises
        ------
        BadArgumentError
            The batch is no buffer (a slice view: take the rows you need from the dask array).
        """
        from trajstore.sampling.dask_arrays import dask_arrays

        row_source = getattr(self, "row_source", None)
        if row_source is None:
            raise BadArgumentError(f"to_dask needs a buffer or a column view of one (possibly nested); got "
                                   f"{type(self).__name__} in the chain (take the rows you need from the dask "
                                   "array instead: arr[lo:hi])")
        return dask_arrays(row_source(), leaves)

    def get_column(self, nested_keys: Sequence[str | int] | str) -> "ColumnView":
        """A lazy read-only view of the sub-space at ``nested_keys`` (e.g. ``["obs", "pos"]`` or ``"obs/pos"``)."""
        if isinstance(nested_keys, str):
            nested_keys = nested_keys.split("/")
        elif isinstance(nested_keys, int):
            nested_keys = [nested_keys]
        return ColumnView(self, list(nested_keys))

    # -- writes (buffers override; views refuse or forward) ----------------------------------
    def _refuse(self, what: str) -> None:
        raise ReadOnlyError(f"{type(self).__name__} does not support {what}")

    def set_at(self, idx: IndexLike, value: Any) -> None:
        """Overwrite rows ``idx`` with ``value``.

        Buffers overwrite their rows crash-atomically; a :class:`SliceView` writes through to its
        parent's rows; other batches refuse.

        Parameters
        ----------
        idx : int, slice, ``...``, (B,) int array or (len,) bool mask
            Rows to overwrite, resolved against the current length.
        value : value of ``single_space``
            One unbatched value for an int index, else a batch with leading axis B equal to the
            number of rows ``idx`` selects.

        Raises
        ------
        ReadOnlyError
            This batch cannot be written (this base implementation always raises it; buffers
            raise it when open read-only).
        ClosedError
            The buffer was closed.
        IndexOutOfRangeError, BadIndexError
            ``idx`` is out of range or not an index.
        BadValueError, SpaceMismatchError
            ``value`` does not fit ``single_space``, or B differs from the rows selected.
        """
        self._refuse("set_at")

    def __setitem__(self, idx: IndexLike, value: Any) -> None:
        self.set_at(idx, value)

    def set_flattened_at(self, idx: IndexLike, value: Any) -> None:
        """Set rows from gymnasium-flattened values (``(flatdim,)`` for an int index)."""
        flat = to_numpy(value)
        single = not isinstance(normalize_index(idx, len(self)), np.ndarray) if not isinstance(idx, slice) else False
        arrays = self._plan.unflatten(flat[None] if single else flat)
        self.set_at(idx, self._plan.from_arrays([a[0] for a in arrays] if single else arrays))

    def remove_at(self, idx: IndexLike) -> None:
        """Delete rows ``idx``: later rows move up and ``len`` shrinks by the rows removed.

        Parameters
        ----------
        idx : int, slice, ``...``, (B,) int array or (len,) bool mask
            Rows to delete (duplicates count once).

        Raises
        ------
        ReadOnlyError
            This batch cannot be written (always, for views and this base implementation).
        IndexOutOfRangeError, BadIndexError
            ``idx`` is out of range or not an index.
        """
        self._refuse("remove_at")

    def __delitem__(self, idx: IndexLike) -> None:
        self.remove_at(idx)

    def extend(self, value: Any) -> None:
        """Add a batch of rows at the end.

        Parameters
        ----------
        value : batch of ``single_space``
            Every leaf with a leading axis B (the rows added), e.g. ``(B, *shape)`` of a Box.

        Raises
        ------
        ReadOnlyError
            This batch cannot grow (always, for views and this base implementation).
        BadValueError, SpaceMismatchError
            ``value`` does not fit ``single_space``; nothing of it is written.
        """
        self._refuse("extend")

    def append(self, value: Any) -> None:
        """Add one row at the end.

        Parameters
        ----------
        value : value of ``single_space``
            One unbatched value.

        Raises
        ------
        ReadOnlyError
            This batch cannot grow (always, for views and this base implementation).
        BadValueError, SpaceMismatchError
            ``value`` does not fit ``single_space``.
        """
        self._refuse("append")

    def extend_flattened(self, value: Any) -> None:
        """Add rows given in gymnasium's flattened layout of ``single_space``.

        Parameters
        ----------
        value : (B, flatdim) array
            One flattened row per row added (numpy or torch).

        Raises
        ------
        ReadOnlyError
            This batch cannot grow (always, for views and this base implementation).
        BadValueError
            Wrong shape or width, a non-numeric dtype, or a segment that decodes to no value of
            its leaf (a one-hot segment without a 1, a value out of range).
        """
        self._refuse("extend_flattened")

    def append_flattened(self, value: Any) -> None:
        """Add one row given in gymnasium's flattened layout of ``single_space``.

        Parameters
        ----------
        value : (flatdim,) array
            The flattened row (numpy or torch).

        Raises
        ------
        ReadOnlyError
            This batch cannot grow (always, for views and this base implementation).
        BadValueError
            ``value`` is not 1-D, or as :meth:`extend_flattened`.
        """
        self._refuse("append_flattened")


class _View(BatchBase):
    """A view of ``parent``: its reads are the parent's reads, retried as the parent's are."""

    parent: BatchBase

    def _consistent(self, read: Callable[[], _T]) -> _T:
        return self.parent._consistent(read)


class SliceView(_View):
    """Rows ``idx`` of ``parent``: a slice re-resolves against the parent's current length
    on every read; an int array or mask is fixed at creation (the logical rows it named then,
    read under the record current when it is read).  Writes through it go to the parent's rows
    (``set_at``); it cannot grow.  Reading fixed rows that the parent no longer has (it shrank:
    ``remove_at``, ``clear``) raises :class:`~trajstore.errors.IndexOutOfRangeError`."""

    def __init__(self, parent: BatchBase, idx: IndexLike) -> None:
        self.parent = parent
        self.single_space = parent.single_space
        self._plan = parent._plan
        self._backend = parent._backend
        if not isinstance(idx, slice) and idx is not Ellipsis:
            resolved = normalize_index(idx, len(parent))
            idx = np.array([resolved]) if isinstance(resolved, int) else resolved
        self._idx = idx

    def _rows(self) -> np.ndarray:
        """The parent's logical rows this view names, against the parent's length now."""
        n = len(self.parent)
        if isinstance(self._idx, np.ndarray):
            # Rows fixed at creation are checked at every read: past the parent's end they are slots
            # no record counts (rows removed or cleared, or ones a writer is filling).
            if self._idx.size and int(self._idx.max()) >= n:
                gone = self._idx[self._idx >= n]
                raise IndexOutOfRangeError(f"row(s) {gone[:5].tolist()} of this view are no longer in the buffer "
                                           f"({n} rows; it shrank since the view was made): make the view again")
            return self._idx
        return normalize_index(self._idx, n)  # type: ignore[return-value]

    def __len__(self) -> int:
        if isinstance(self._idx, slice):
            return len(range(*self._idx.indices(len(self.parent))))
        if isinstance(self._idx, np.ndarray):
            return len(self._idx)  # the rows it names, even ones the parent no longer has
        return len(self.parent)  # ``...``: every row

    def _read(self, idx: int | np.ndarray, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        rows = self._rows()
        return self.parent._read(int(rows[idx]) if isinstance(idx, int) else rows[idx], leaf_ids)

    def set_at(self, idx: IndexLike, value: Any) -> None:
        """Overwrite rows ``idx`` of this view, i.e. the parent's rows they map to (see
        :meth:`BatchBase.set_at`; ``idx`` is resolved against the view's length)."""
        rows = self._rows()
        i = normalize_index(idx, len(rows))
        self.parent.set_at(int(rows[i]) if isinstance(i, int) else rows[i], value)

    def __repr__(self) -> str:
        return f"SliceView({self._idx!r}, len={len(self)}) of {self.parent!r}"


class ColumnView(_View):
    """The sub-space at ``keys`` of every row of ``parent``; read-only."""

    def __init__(self, parent: BatchBase, keys: list[str | int]) -> None:
        self.parent = parent
        self.keys = keys
        self.single_space = subspace(parent.single_space, keys)
        self._plan = ValuePlan(self.single_space)
        self._backend = parent._backend
        prefix = tuple(keys)
        self._leaf_map = [j for j, leaf in enumerate(parent._plan.leaves) if leaf.path[: len(prefix)] == prefix]

    def __len__(self) -> int:
        return len(self.parent)

    def _read(self, idx: int | np.ndarray, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        return self.parent._read(idx, [self._leaf_map[j] for j in leaf_ids])

    def _read_slice(self, s: slice, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        return self.parent._read_slice(s, [self._leaf_map[j] for j in leaf_ids])

    def set_at(self, idx: IndexLike, value: Any) -> None:
        """Always raises :class:`~trajstore.errors.ReadOnlyError`: a column is written through its buffer."""
        raise ReadOnlyError(f"column view {self.keys!r} is read-only; write through the buffer instead")

    def __repr__(self) -> str:
        return f"ColumnView({self.keys!r}, len={len(self)}) of {self.parent!r}"
