"""The leaves of a gymnasium space: one stored array each, in ``gymnasium.spaces.flatten`` order.

Every leaf (Box, Discrete, MultiDiscrete, MultiBinary) becomes one stored array of shape
``(rows, *leaf.shape)`` and dtype ``leaf.dtype``; Dict and Tuple only give structure.  Leaves
are ordered depth-first exactly as ``gymnasium.spaces.flatten`` visits them (Dict: the Dict's own
key order; Tuple: positional), so a flattened row is the concatenation of its leaves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium
import numpy as np
from gymnasium.spaces import Box, Dict, Discrete, MultiBinary, MultiDiscrete, Tuple

from trajstore.errors import SpaceMismatchError, UnsupportedSpaceError

LeafPath = tuple[str | int, ...]
_LEAF_TYPES = (Box, Discrete, MultiDiscrete, MultiBinary)
SUPPORTED_SPACES = "trajstore stores Box, Discrete, MultiDiscrete, MultiBinary, Dict and Tuple"
SPECIAL_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


@dataclass(frozen=True)
class Leaf:
    """One stored array of a space: shape ``(rows, *shape)``, dtype ``dtype``.

    ``path`` holds Dict keys (str) and Tuple positions (int) from the root (``()`` for a root
    leaf); ``name`` is ``"/".join(map(str, path))`` (``""`` for a root leaf); ``shape`` is the
    per-row shape (Discrete: ``()``); ``dtype`` the space's dtype (MultiBinary: int8);
    ``flat_dim`` is ``gymnasium.spaces.flatdim(space)``.
    """

    path: LeafPath
    name: str
    space: gymnasium.Space[Any]
    shape: tuple[int, ...]
    dtype: np.dtype
    flat_dim: int


def path_name(path: LeafPath) -> str:
    """A leaf path as the name errors use: its keys and indices joined by ``/``."""
    return "/".join(map(str, path))


def at_path(kind: str, path: LeafPath) -> str:
    """``"value at 'obs/2'"``, or plain ``"value"`` for the root."""
    return f"{kind} at '{path_name(path)}'" if path else kind


def check_dict_key(key: Any, path: LeafPath) -> None:
    """Refuse a Dict key at ``path`` that cannot be a zarr node name (UnsupportedSpaceError)."""
    # Keys become zarr node names: "/" nests, and "." / "__" prefixes are reserved.
    problem = (f"is not a str ({type(key).__name__})" if not isinstance(key, str) else "is empty" if not key
               else "contains '/'" if "/" in key else "starts with '__' or '.'" if key.startswith(("__", ".")) else "")
    if problem:
        raise UnsupportedSpaceError(f"Dict key {key!r} in {at_path('space', path)} {problem}; trajstore needs non-empty "
                                    "str keys without '/' that do not start with '__' or '.'")


def child_spaces(space: gymnasium.Space[Any], path: LeafPath) -> list[tuple[str | int, gymnasium.Space[Any]]] | None:
    """Validated (key, subspace) pairs of a Dict/Tuple; ``None`` for a supported leaf."""
    kind = type(space)  # exact types: a subclass could not round-trip through JSON
    if kind in _LEAF_TYPES:
        return None
    if type(space) is Dict:  # (== kind, written so a type checker narrows space)
        items: list[tuple[str | int, gymnasium.Space[Any]]] = list(space.spaces.items())
        for key, _ in items:
            check_dict_key(key, path)
    elif type(space) is Tuple:
        items = list(enumerate(space.spaces))
    else:
        raise UnsupportedSpaceError(f"{at_path('space', path)} is {kind.__name__}; {SUPPORTED_SPACES}")
    if not items:  # no leaf would carry a row count, and gymnasium cannot flatten it either
        raise UnsupportedSpaceError(f"{at_path('space', path)} is an empty {kind.__name__}; {SUPPORTED_SPACES} with leaves")
    return items


def leaves(space: gymnasium.Space[Any]) -> list[Leaf]:
    """Leaves of ``space``, depth-first in ``gymnasium.spaces.flatten`` order.

    Raises ``UnsupportedSpaceError`` naming the path of an unsupported subspace or of a Dict key
    that is not a valid zarr node name (non-str, empty, containing "/", starting "__" or ".").
    """
    out: list[Leaf] = []

    def walk(sp: gymnasium.Space[Any], path: LeafPath) -> None:
        items = child_spaces(sp, path)
        if items is None:
            assert sp.shape is not None  # every supported leaf has one
            shape = tuple(int(d) for d in sp.shape)
            out.append(Leaf(path, path_name(path), sp, shape, np.dtype(sp.dtype), int(gymnasium.spaces.flatdim(sp))))
        else:
            for key, sub in items:
                walk(sub, path + (key,))

    walk(space, ())
    return out


def flatdim(space: gymnasium.Space[Any]) -> int:
    """Width of ``gymnasium.spaces.flatten(space, x)``, after checking the space is supported."""
    return sum(leaf.flat_dim for leaf in leaves(space))


def subspace(space: gymnasium.Space[Any], keys: Sequence[str | int] | str) -> gymnasium.Space[Any]:
    """Follow Dict keys / Tuple indices from ``space``; raise ``SpaceMismatchError`` naming a bad key.

    ``keys`` may also be a leaf name such as ``"obs/2"`` (split on ``"/"``; ``""`` is the root),
    so Tuple positions given as digit strings are accepted.
    """
    path: LeafPath = ()
    for key in (keys.split("/") if keys else []) if isinstance(keys, str) else keys:
        if type(space) is Dict:
            if not isinstance(key, str) or key not in space.spaces:
                raise SpaceMismatchError(f"{at_path('space', path)} has no key {key!r}; available keys: {list(space.spaces)}")
            space = space.spaces[key]
        elif type(space) is Tuple:
            n, idx = len(space.spaces), int(key) if isinstance(key, str) and key.isdigit() else key
            if isinstance(idx, bool) or not isinstance(idx, (int, np.integer)) or not 0 <= idx < n:
                raise SpaceMismatchError(f"{at_path('space', path)} has no index {key!r}; available indices: {list(range(n))}")
            key = int(idx)
            space = space.spaces[key]
        else:
            raise SpaceMismatchError(f"{at_path('space', path)} is {type(space).__name__}, which has no key {key!r}")
        path += (key,)
    return space


