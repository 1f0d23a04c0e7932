"""Dask arrays over trajstore columns: ``to_dask(buffer.get_column("obs"))``.

The array holds the committed rows of the column when it is made; its chunks follow the
store's chunks (one dask chunk never spans two stored chunks), so a task reads each stored
chunk once.  Tasks carry only the store path, options and row range: every worker process
opens the store read-only itself (once per process), so the array computes on a
``dask.distributed`` cluster as long as the workers can reach the path (shared filesystem or
object storage with ``storage_options``).  Secrets in ``storage_options`` (``key``,
``secret``, ``token``...) are not put in the graph: a worker process takes credentials from its
own environment (``AWS_*`` variables, an AWS ``profile`` named in the options, an instance role);
the process that made the array keeps using the options it was given.  The arrays are built by
:mod:`trajstore.sampling.dask_arrays` over the buffer's row source.
"""

from __future__ import annotations

from typing import Any

from trajstore.buffers.views import BatchBase

__all__ = ["to_dask"]


def to_dask(view: BatchBase) -> Any:
    """A dask array of the committed rows of a single-leaf column view (or buffer); a view of a
    Dict/Tuple sub-space gives the same nesting of dask arrays.

    Parameters
    ----------
    view : ReplayBuffer, TrajectoryReplayBuffer, EpisodeView, ShardedDataset or ColumnView
        A buffer, or a column view of one (``get_column``, possibly nested).  Slices are refused:
        take the rows you need from the dask array instead (``arr[lo:hi]``).  A sharded dataset
        (:func:`~trajstore.shards.open_sharded`) or a column of one gives one dask array per
        field across every shard: each shard's arrays, concatenated in shard name order.  An
        episode view (``select_episodes``) gives its parent's arrays at the selected rows.

    Returns
    -------
    dask.array.Array, or a dict / tuple of them (the view's space nesting)
        Shape ``(rows, *leaf.shape)``, the leaf's dtype; chunks along axis 0 aligned with the
        store's chunk rows (a ring's wrap point included), the other axes one chunk.  A writer's
        rows not yet committed are not included.  Computing a block whose rows a ring has
        evicted (also while the block reads them), or that were rewritten since (``set_at``,
        ``remove_at``, ``clear``), raises :class:`~trajstore.errors.ConcurrentWriteError`: the
        array describes the rows of one commit; make it again for the rows there now.
    """
    return view.to_dask()  # a sharded dataset's arrays are its shards' (ShardedDataset.dask_leaves)
