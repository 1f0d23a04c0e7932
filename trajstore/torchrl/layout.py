"""TorchRL layouts and trajstore spaces: one from the other, and the check that they agree.

A TensorDict row (or a TorchRL ``Composite`` spec) maps onto a gymnasium ``Dict`` space key by key:
a nested key ``("next", "observation")`` is the leaf ``next/observation`` of nested ``Dict`` spaces;
a leaf's shape is its per-row shape (without the batch dimension) and its dtype the tensor's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from trajstore.errors import SpaceMismatchError, UnsupportedSpaceError

__all__ = ["Leaves", "space_leaves", "space_from_spec", "space_from_leaves", "tensordict_leaves", "spec_leaves",
           "check_leaves", "numpy_dtype"]

#: ``{key tuple: (per-row shape, numpy dtype)}``: what a layout is compared by.
Leaves = dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch dtype (``UnsupportedSpaceError`` for one numpy lacks, e.g. bfloat16)."""
    try:
        return np.dtype(torch.empty((), dtype=dtype).numpy().dtype)
    except TypeError:
        raise UnsupportedSpaceError(f"torch dtype {dtype} has no numpy dtype; a trajstore field cannot hold it"
                                    ) from None


def space_leaves(space: gym.Space, prefix: tuple[str, ...] = ()) -> Leaves:
    """The leaves of a store's space (``Dict`` nests; a ``Tuple`` has no TensorDict key and is refused)."""
    if isinstance(space, gym.spaces.Dict):
        out: Leaves = {}
        for k, sub in space.spaces.items():
            out.update(space_leaves(sub, prefix + (str(k),)))
        return out
    if isinstance(space, gym.spaces.Tuple):
        raise UnsupportedSpaceError(f"field {'/'.join(prefix) or '<root>'} is a Tuple space: a TensorDict has "
                                    "string keys only; open the store with trajstore.torch instead")
    if not prefix:
        raise UnsupportedSpaceError(f"the store's space is a bare {type(space).__name__}: a TorchRL storage "
                                    "needs a Dict space (one key per field)")
    shape = () if space.shape is None else tuple(int(s) for s in space.shape)
    return {prefix: (shape, np.dtype(space.dtype))}


def _leaf_space(shape: tuple[int, ...], dtype: np.dtype, low: Any = None, high: Any = None) -> gym.Space:
    if low is None:
        if dtype == np.bool_:
            low, high = 0, 1
        elif np.issubdtype(dtype, np.integer):
            low, high = np.iinfo(dtype).min, np.iinfo(dtype).max
        else:
            low, high = -np.inf, np.inf
    return gym.spaces.Box(low, high, shape, dtype)


def space_from_leaves(leaves: Leaves) -> gym.spaces.Dict:
    """A nested ``Dict`` space of unbounded ``Box`` leaves (bool: {0, 1}; ints: their dtype's range)."""
    tree: dict[str, Any] = {}
    for key, (shape, dtype) in leaves.items():
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = _leaf_space(shape, dtype)
    return _as_dict(tree)


def _as_dict(tree: Mapping[str, Any]) -> gym.spaces.Dict:
    return gym.spaces.Dict({k: _as_dict(v) if isinstance(v, dict) else v for k, v in tree.items()})


def _key(key: Any) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


def tensordict_leaves(td: Any, batch_dims: int = 1) -> Leaves:
    """The per-row layout of a (batched) TensorDict."""
    return {_key(k): (tuple(int(s) for s in v.shape[batch_dims:]), numpy_dtype(v.dtype))
            for k, v in td.items(include_nested=True, leaves_only=True)}


def spec_leaves(spec: Any) -> Leaves:
    """The per-row layout of a TorchRL ``Composite`` spec (its own batch shape is not part of a row)."""
    nb = len(spec.shape)
    return {_key(k): (tuple(int(s) for s in leaf.shape[nb:]), numpy_dtype(leaf.dtype))
            for k, leaf in spec.items(include_nested=True, leaves_only=True)}


def space_from_spec(spec: Any) -> gym.spaces.Dict:
    """The store space for a TorchRL ``Composite`` spec.

    ``Bounded`` leaves keep their bounds, a scalar ``Categorical`` becomes ``Discrete(n)``, every
    other leaf an unbounded ``Box`` of its shape and dtype (ints: the dtype's range).
    """
    from torchrl.data import Bounded, Categorical

    nb = len(spec.shape)
    tree: dict[str, Any] = {}
    for k, leaf in spec.items(include_nested=True, leaves_only=True):
        key, shape, dtype = _key(k), tuple(int(s) for s in leaf.shape[nb:]), numpy_dtype(leaf.dtype)
        if isinstance(leaf, Categorical) and shape == () and leaf.n is not None and leaf.n > 0:
            space: gym.Space = gym.spaces.Discrete(int(leaf.n), dtype=dtype)
        elif isinstance(leaf, Bounded):
            low = leaf.space.low.reshape(leaf.shape)[(0,) * nb].cpu().numpy().astype(dtype)
            high = leaf.space.high.reshape(leaf.shape)[(0,) * nb].cpu().numpy().astype(dtype)
            space = _leaf_space(shape, dtype, low, high)
        else:
            space = _leaf_space(shape, dtype)
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = space
    return _as_dict(tree)


def _name(key: tuple[str, ...]) -> str:
    return repr(key[0]) if len(key) == 1 else repr(key)


def check_leaves(expected: Leaves, got: Leaves, what: str, *, exact_dtype: bool = False) -> None:
    """Raise ``SpaceMismatchError`` naming every key that is missing, extra, or of another shape
    or dtype (``exact_dtype=False``: a dtype that casts safely to the field's is accepted)."""
    problems = []
    missing = [_name(k) for k in expected if k not in got]
    extra = [_name(k) for k in got if k not in expected]
    if missing:
        problems.append(f"missing keys {', '.join(missing)}")
    if extra:
        problems.append(f"keys the store has no field for: {', '.join(extra)}")
    for k, (shape, dtype) in expected.items():
        if k not in got:
            continue
        gshape, gdtype = got[k]
        if gshape != shape:
            problems.append(f"{_name(k)} has per-row shape {gshape}, the store's field {shape}")
        ok = gdtype == dtype if exact_dtype else np.can_cast(gdtype, dtype, "safe")
        if not ok:
            problems.append(f"{_name(k)} is {gdtype}, the store's field is {dtype}")
    if problems:
        raise SpaceMismatchError(f"{what} does not match the store's spaces: " + "; ".join(problems))
