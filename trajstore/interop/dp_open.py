"""Diffusion Policy replay buffers opened in place: :func:`open_diffusion_policy`.

The store (``data/<key>`` arrays, ``meta/episode_ends``; zarr format 2 or 3; a folder or a
``.zarr.zip``) is read where it is, through zarr-python, as a read-only
:class:`~trajstore.TrajectoryReplayBuffer` (:class:`DiffusionPolicyBuffer`): nothing is copied.
Its arrays are checked as :func:`~trajstore.interop.import_diffusion_policy` checks them, and their
sizes against the limits of trajstore's own stores, before anything is read or allocated.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from gymnasium.spaces import Dict

from trajstore.buffers.in_place import InPlaceStore, InPlaceTrajectoryBuffer
from trajstore.interop._common import box_for, source_file
from trajstore.interop.diffusion_policy import read_layout
from trajstore.interop.foreign_gate import open_zarr
from trajstore.spaces import ValuePlan
from trajstore.storage.fields.base import Field
from trajstore.storage.fields.foreign import EpisodeIdField, ForeignField
from trajstore.storage.location import Location

__all__ = ["open_diffusion_policy", "DiffusionPolicyBuffer"]

_WHAT = "open_diffusion_policy"


class DiffusionPolicyBuffer(InPlaceTrajectoryBuffer):
    """A Diffusion Policy replay buffer opened in place: a read-only
    :class:`~trajstore.TrajectoryReplayBuffer` whose step space is ``Dict(<key>: Box)``, one Box
    per ``data/<key>`` array (its dtype and row shape, the dtype's widest bounds), whose episodes
    are ``meta/episode_ends``' (ids 0, 1, ...), without episode data.  Open it with
    :func:`open_diffusion_policy`; ``load_from`` (the same) is what pickling and DataLoader
    workers use to reopen it by path.
    """

    source_format = "Diffusion Policy"

    @classmethod
    def load_from(cls, path: str | os.PathLike[str], *, backend: str = "numpy", device: Any = None,
                  read_only: bool = True, multiprocessing: bool = False,
                  storage_options: dict[str, Any] | None = None, **kwargs: Any) -> "DiffusionPolicyBuffer":
        """:func:`open_diffusion_policy` (``read_only`` must stay True; other store options are
        accepted and ignored, as a read-only ``load_from`` ignores them)."""
        cls.check_open_args(_WHAT, read_only, multiprocessing, storage_options)
        return open_diffusion_policy(path, backend=backend, device=device)


def open_diffusion_policy(path: Any, *, backend: str = "numpy", device: Any = None) -> DiffusionPolicyBuffer:
    """Open a Diffusion Policy replay buffer read-only in place, without copying it.

    Parameters
    ----------
    path : str or os.PathLike
        A zarr folder or ``.zarr.zip`` file (zarr format 2 as zarr 2.x writes it, or 3):
        ``data/<key>`` arrays of N rows (``action`` among them) and ``meta/episode_ends`` (E,)
        integers, strictly increasing, ``ends[-1] == N``.
    backend : {"numpy", "torch"}
        What reads return.
    device : optional
        Torch device (backend ``"torch"``).

    Returns
    -------
    DiffusionPolicyBuffer
        A read-only :class:`~trajstore.TrajectoryReplayBuffer`: ``step_space`` is
        ``Dict(<key>: Box(dtype, row shape))`` for every ``data/<key>``; ``buf[i]["step_data"]
        ["img"]`` is row i of ``data/img``; episode ``e`` is rows ``ends[e-1]:ends[e]`` (id e);
        ``episode_data`` is None.  Writes raise :class:`~trajstore.errors.ReadOnlyError`; close it
        when done (it is a context manager).

    Raises
    ------
    StoreNotFoundError
        ``path`` does not exist.
    NotATrajstoreError
        ``path`` is not a zarr group, or lacks ``data/action`` or ``meta/episode_ends``.
    BadValueError
        ``episode_ends`` not 1-D integers increasing strictly from > 0, or data arrays whose
        length is not ``ends[-1]``.
    UnsupportedSpaceError
        A data array of a dtype trajstore does not read (strings, structured, complex).
    DamagedStoreError
        Array metadata zarr cannot parse, sizes beyond trajstore's limits, or (when read) a
        chunk that does not decode.
    """
    src = source_file(path, f"{_WHAT}: path")
    loc, root = open_zarr(src, _WHAT)
    try:
        space, fields, ends = _layout_in_place(loc, root, src)
        store = InPlaceStore(loc, fields, int(ends[-1]) if len(ends) else 0, len(ends), closer=loc.close)
    except BaseException:
        loc.close()
        raise
    try:
        return DiffusionPolicyBuffer(store, space, backend, device)
    except BaseException:
        store.close()
        raise


def _layout_in_place(loc: Location, root: Any, src: str) -> tuple[Dict, list[Field], np.ndarray]:
    """``(step space, fields in the space's leaf order with the id field last, episode ends)`` of
    the store at ``loc`` (root group ``root``), checked by
    :func:`~trajstore.interop.diffusion_policy.read_layout`."""
    lay = read_layout(root, src, _WHAT)
    specs = lay["specs"]
    space = Dict({key: box_for(s.dtype, s.row_shape, f"{src}: data/{key}") for key, s in specs.items()})
    order = [leaf.path[0] for leaf in ValuePlan(space).leaves]  # Dict sorts its keys: follow its order
    fields: list[Field] = [ForeignField(loc, specs[key], lay["arrays"][key]) for key in order]
    fields.append(EpisodeIdField(loc, "meta/episode_ends", lay["ends"], max(f.C for f in fields)))
    return space, fields, lay["ends"]
