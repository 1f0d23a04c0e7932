"""Gymnasium spaces as stored arrays: JSON encoding, leaves, and value conversion.

Every leaf of a space (Box, Discrete, MultiDiscrete, MultiBinary) becomes one stored
array of shape ``(rows, *leaf.shape)`` and dtype ``leaf.dtype``; Dict and Tuple only
give structure.  Leaves are ordered depth-first exactly as
``gymnasium.spaces.flatten`` visits them (Dict: the Dict's own key order; Tuple:
positional), so the flattened layout of a row is the concatenation of its leaves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium
import numpy as np
from gymnasium.spaces import Box, Dict, Discrete, MultiBinary, MultiDiscrete, Tuple

from trajstore.errors import BadValueError, SpaceMismatchError, UnsupportedSpaceError

__all__ = ["Leaf", "ValuePlan", "flatdim", "leaves", "space_from_json", "space_to_json", "subspace"]

_Path = tuple[str | int, ...]
_LEAF_TYPES = (Box, Discrete, MultiDiscrete, MultiBinary)
_SUPPORTED = "trajstore stores Box, Discrete, MultiDiscrete, MultiBinary, Dict and Tuple"
_SPECIAL_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_IS_INF = np.frompyfunc(lambda v: isinstance(v, float) and math.isinf(v), 1, 1)
_IS_NEG = np.frompyfunc(lambda v: v < 0, 1, 1)


@dataclass(frozen=True)
class Leaf:
    """One stored array of a space: shape ``(rows, *shape)``, dtype ``dtype``.

    ``path`` holds Dict keys (str) and Tuple positions (int) from the root (``()`` for a
    root leaf); ``name`` is ``"/".join(map(str, path))`` (``""`` for a root leaf);
    ``shape`` is the per-row shape (Discrete: ``()``); ``dtype`` the space's dtype
    (MultiBinary: int8); ``flat_dim`` is ``gymnasium.spaces.flatdim(space)``.
    """

    path: _Path
    name: str
    space: gymnasium.Space
    shape: tuple[int, ...]
    dtype: np.dtype
    flat_dim: int


def _name(path: _Path) -> str:
    return "/".join(map(str, path))


def _at(kind: str, path: _Path) -> str:
    """``"value at 'obs/2'"`` or plain ``"value"`` for the root."""
    return f"{kind} at '{_name(path)}'" if path else kind


def _check_key(key: Any, path: _Path) -> None:
    # Keys become zarr node names: "/" nests, "." and "__" prefixes are reserved.
    if not isinstance(key, str):
        problem = f"is not a str ({type(key).__name__})"
    elif not key:
        problem = "is empty"
    elif "/" in key:
        problem = "contains '/'"
    elif key.startswith(("__", ".")):
        problem = "starts with '__' or '.'"
    else:
        return
    raise UnsupportedSpaceError(
        f"Dict key {key!r} in {_at('space', path)} {problem}; trajstore needs non-empty str keys "
        "without '/' that do not start with '__' or '.'"
    )


def _children(space: gymnasium.Space, path: _Path) -> list[tuple[str | int, gymnasium.Space]] | None:
    """Validated (key, subspace) pairs of a Dict/Tuple, ``None`` for a supported leaf."""
    kind = type(space)  # exact types: a subclass could not round-trip through JSON
    if kind in _LEAF_TYPES:
        return None
    if kind is Dict:
        items: list[tuple[str | int, gymnasium.Space]] = list(space.spaces.items())
        for key, _ in items:
            _check_key(key, path)
    elif kind is Tuple:
        items = list(enumerate(space.spaces))
    else:
        raise UnsupportedSpaceError(f"{_at('space', path)} is {kind.__name__}; {_SUPPORTED}")
    if not items:  # no leaf would carry a row count, and gymnasium cannot flatten it either
        raise UnsupportedSpaceError(f"{_at('space', path)} is an empty {kind.__name__}; {_SUPPORTED} with at least one leaf")
    return items


def leaves(space: gymnasium.Space) -> list[Leaf]:
    """Return the leaves of ``space`` depth-first, in ``gymnasium.spaces.flatten`` order.

    Raises
    ------
    UnsupportedSpaceError
        If a subspace is not supported or a Dict key is not a valid node name.
    """
    out: list[Leaf] = []

    def walk(sp: gymnasium.Space, path: _Path) -> None:
        items = _children(sp, path)
        if items is None:
            dim = int(gymnasium.spaces.flatdim(sp))
            out.append(Leaf(path, _name(path), sp, tuple(int(d) for d in sp.shape), np.dtype(sp.dtype), dim))
            return
        for key, sub in items:
            walk(sub, path + (key,))

    walk(space, ())
    return out


def flatdim(space: gymnasium.Space) -> int:
    """Width of ``gymnasium.spaces.flatten(space, x)`` (after checking the space is supported)."""
    return sum(leaf.flat_dim for leaf in leaves(space))


def subspace(space: gymnasium.Space, keys: Sequence[str | int] | str) -> gymnasium.Space:
    """Follow Dict keys / Tuple indices from ``space``.

    ``keys`` may also be a leaf name such as ``"obs/2"`` (split on ``"/"``; ``""`` is the
    root); Tuple positions then arrive as digit strings and are accepted.

    Raises
    ------
    SpaceMismatchError
        Naming the bad key and the available keys.
    """
    if isinstance(keys, str):
        keys = keys.split("/") if keys else []
    path: _Path = ()
    for key in keys:
        if type(space) is Dict:
            if not isinstance(key, str) or key not in space.spaces:
                raise SpaceMismatchError(f"{_at('space', path)} has no key {key!r}; available keys: {list(space.spaces)}")
            space = space.spaces[key]
        elif type(space) is Tuple:
            n = len(space.spaces)
            idx = int(key) if isinstance(key, str) and key.isdigit() else key
            if isinstance(idx, bool) or not isinstance(idx, (int, np.integer)) or not 0 <= idx < n:
                raise SpaceMismatchError(f"{_at('space', path)} has no index {key!r}; available indices: {list(range(n))}")
            key = int(idx)
            space = space.spaces[key]
        else:
            raise SpaceMismatchError(f"{_at('space', path)} is {type(space).__name__}, which has no key {key!r}")
        path += (key,)
    return space


# ---------------------------------------------------------------- JSON


def _num_to_json(x: Any) -> Any:
    if isinstance(x, list):
        return [_num_to_json(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x  # Python float repr round-trips exactly; ints/bools are exact


def _num_from_json(x: Any, path: _Path) -> Any:
    if isinstance(x, list):
        return [_num_from_json(v, path) for v in x]
    if isinstance(x, str) and x in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[x]
    if isinstance(x, (int, float)):  # bool is an int: fine for bool Boxes
        return x
    raise UnsupportedSpaceError(f"malformed space JSON at '{_name(path)}': bad number {x!r}")


def _array_to_json(a: np.ndarray) -> Any:
    """A scalar when all elements are bit-identical (keeps -0.0 vs 0.0 apart), else nested lists."""
    flat = np.ascontiguousarray(a).reshape(-1)
    if flat.size and (flat.view(np.uint8).reshape(flat.size, -1) == flat[:1].view(np.uint8)).all():
        return _num_to_json(flat[0].item())
    return _num_to_json(a.tolist())


def _bound_to_json(a: np.ndarray, bounded: np.ndarray, inf: float) -> Any:
    # Int Boxes store +-inf bounds as the dtype's min/max plus a bounded_* flag (which
    # changes sampling); writing "inf" back keeps that flag through the round trip.
    if a.dtype.kind == "i" and not bounded.all():
        return _num_to_json(inf) if not bounded.any() else _num_to_json(np.where(bounded, a.astype(object), inf).tolist())
    return _array_to_json(a)


def _dtype_to_json(dtype: np.dtype) -> str:
    return dtype.name if dtype.isnative else dtype.str  # '>f4' keeps a foreign byte order


def space_to_json(space: gymnasium.Space) -> dict[str, Any]:
    """Encode a supported space as a JSON-safe dict (``json.dumps(..., allow_nan=False)`` works).

    Box bounds are a scalar when uniform, else nested lists; non-finite floats become the
    strings ``"inf"``, ``"-inf"``, ``"nan"``.  Dict entries are ``[key, space]`` pairs so
    the key order survives any JSON reader.

    Raises
    ------
    UnsupportedSpaceError
        If any subspace is unsupported (the message names its path).
    """

    def enc(sp: gymnasium.Space, path: _Path) -> dict[str, Any]:
        items = _children(sp, path)
        if type(sp) is Dict:
            return {"type": "Dict", "spaces": [[k, enc(s, path + (k,))] for k, s in items]}
        if type(sp) is Tuple:
            return {"type": "Tuple", "spaces": [enc(s, path + (i,)) for i, s in items]}
        if type(sp) is Box:
            return {"type": "Box", "dtype": _dtype_to_json(sp.dtype), "shape": list(sp.shape),
                    "low": _bound_to_json(sp.low, sp.bounded_below, -math.inf),
                    "high": _bound_to_json(sp.high, sp.bounded_above, math.inf)}
        if type(sp) is Discrete:
            return {"type": "Discrete", "dtype": _dtype_to_json(sp.dtype), "n": int(sp.n), "start": int(sp.start)}
        if type(sp) is MultiDiscrete:
            return {"type": "MultiDiscrete", "dtype": _dtype_to_json(sp.dtype), "shape": list(sp.shape),
                    "nvec": sp.nvec.tolist(), "start": sp.start.tolist()}
        n = sp.n  # MultiBinary: int and tuple n compare unequal in gymnasium, so keep which
        return {"type": "MultiBinary", "n": int(n) if isinstance(n, int) else [int(d) for d in n]}

    return enc(space, ())


def space_from_json(obj: Mapping[str, Any]) -> gymnasium.Space:
    """Decode :func:`space_to_json` output; bounds, nvec, start, n and dtype are bit-exact.

    Only plain data is interpreted (never eval/import/unpickle).

    Raises
    ------
    UnsupportedSpaceError
        For an unknown ``"type"`` or malformed JSON (the message names the path).
    """

    def bad(path: _Path, why: str) -> UnsupportedSpaceError:
        return UnsupportedSpaceError(f"malformed space JSON at '{_name(path)}': {why}")

    def dtype_of(o: Mapping[str, Any], path: _Path, kinds: str) -> np.dtype:
        try:
            dt = np.dtype(str(o["dtype"]))
        except (KeyError, TypeError, ValueError) as e:
            raise bad(path, f"bad dtype ({e})") from None
        if dt.kind not in kinds or dt.fields is not None or dt.shape != ():
            raise bad(path, f"dtype {dt} is not allowed here")
        return dt

    def shape_of(o: Mapping[str, Any], path: _Path) -> tuple[int, ...]:
        if not all(type(d) is int and d >= 0 for d in o["shape"]):
            raise bad(path, f"bad shape {o['shape']!r}")
        return tuple(o["shape"])

    def array(x: Any, dt: np.dtype, shape: tuple[int, ...], path: _Path) -> tuple[np.ndarray, np.ndarray]:
        """Exact array of ``dt`` and the mask of infinite entries (object arrays avoid float rounding)."""
        x = _num_from_json(x, path)
        obj = np.array(x, dtype=object) if isinstance(x, list) else np.full(shape, x, dtype=object)
        if obj.size != math.prod(shape):
            raise bad(path, f"array of shape {obj.shape}; expected {shape}")
        obj = obj.reshape(shape)  # reshape restores e.g. (0, 3) from []
        inf = np.asarray(_IS_INF(obj), dtype=bool)
        if inf.any() and dt.kind != "f":
            if dt.kind != "i":
                raise bad(path, f"infinite value for dtype {dt}")
            else:  # mirror gymnasium: -inf/inf become a signed int dtype's min/max
                neg = inf & np.asarray(_IS_NEG(obj), dtype=bool)
                obj[neg], obj[inf & ~neg] = np.iinfo(dt).min, np.iinfo(dt).max
        return obj.astype(dt), inf

    def dec(o: Any, path: _Path) -> gymnasium.Space:
        if not isinstance(o, Mapping) or not isinstance(o.get("type"), str):
            raise bad(path, "expected an object with a string 'type'")
        kind = o["type"]
        try:
            if kind == "Dict":
                pairs = list(o["spaces"].items() if isinstance(o["spaces"], Mapping) else o["spaces"])
                if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
                    raise bad(path, "Dict 'spaces' must be a list of [key, space] pairs")
                for k, _ in pairs:
                    _check_key(k, path)
                return Dict([(k, dec(v, path + (k,))) for k, v in pairs])  # a list keeps order (dict input is sorted)
            if kind == "Tuple":
                return Tuple([dec(v, path + (i,)) for i, v in enumerate(o["spaces"])])
            if kind == "Box":
                dt = dtype_of(o, path, "biuf")
                shape = shape_of(o, path)
                (low, low_inf), (high, high_inf) = array(o["low"], dt, shape, path), array(o["high"], dt, shape, path)
                box = Box(low, high, shape, dt)
                if dt.kind == "i":  # restore the unbounded flags gymnasium set from the original infinities
                    box.bounded_below, box.bounded_above = ~low_inf, ~high_inf
                return box
            if kind == "Discrete":
                dt = dtype_of(o, path, "iu")
                if not (type(o["n"]) is int and type(o["start"]) is int):
                    raise bad(path, "'n' and 'start' must be integers")
                return Discrete(o["n"], start=o["start"], dtype=dt)
            if kind == "MultiDiscrete":
                dt = dtype_of(o, path, "iu")
                shape = shape_of(o, path)
                nvec, start = array(o["nvec"], dt, shape, path)[0], array(o["start"], dt, shape, path)[0]
                return MultiDiscrete(nvec, dtype=dt, start=start)
            if kind == "MultiBinary":
                n = o["n"]
                return MultiBinary(n if type(n) is int else tuple(int(d) for d in n))
        except UnsupportedSpaceError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise bad(path, f"{type(e).__name__}: {e}") from None
        raise UnsupportedSpaceError(f"{_at('space', path)} has unknown type {kind!r}; {_SUPPORTED}")

    return dec(obj, ())


# ---------------------------------------------------------------- values


def _to_numpy(x: Any, path: _Path) -> np.ndarray:
    """numpy array / torch tensor (detected without importing torch) / array-like → ndarray."""
    if type(x) is np.ndarray:
        return x
    if isinstance(x, (np.generic, int, float)):
        return np.asarray(x)
    if type(x).__module__.split(".", 1)[0] == "torch" and hasattr(x, "detach"):
        try:
            return x.detach().cpu().numpy()
        except (TypeError, RuntimeError) as e:  # e.g. bfloat16 has no numpy dtype
            raise BadValueError(f"{_at('value', path)}: cannot convert torch tensor of dtype {x.dtype} to numpy ({e})") from None
    if isinstance(x, Mapping):
        raise SpaceMismatchError(f"{_at('value', path)}: expected an array for a leaf, got a {type(x).__name__}")
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:  # ragged nested lists
        raise BadValueError(f"{_at('value', path)} is not array-like: {e}") from None


def _cast(arr: np.ndarray, dst: np.dtype, path: _Path) -> np.ndarray:
    src = arr.dtype
    if src == dst:  # hot path: no copy, no scan
        return arr
    if np.can_cast(src, dst, "safe") or (src.kind in "biuf" and dst.kind == "f"):
        return arr.astype(dst)
    if src.kind in "biu" and dst.kind in "iu":
        if arr.size:  # only here do we scan values: int widths/signedness differ
            info, lo, hi = np.iinfo(dst), int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise BadValueError(f"{_at('value', path)} has {src} values in [{lo}, {hi}]; expected values within "
                                    f"the range of {dst} [{info.min}, {info.max}]")
        return arr.astype(dst)
    raise BadValueError(f"{_at('value', path)} has dtype {src}; expected {dst} or a dtype that casts to it safely")


class ValuePlan:
    """Precompiled validator/converter for one space (built once per buffer, used per step).

    Parameters
    ----------
    space : gymnasium.Space
        A supported space (see :func:`leaves`).

    Attributes
    ----------
    leaves : list of Leaf
        In storage/flatten order; every per-leaf list below uses this order.
    flat_dim : int
        Width of a flattened row.
    flat_dtype : numpy.dtype
        dtype of ``gymnasium.spaces.flatten`` output: ``np.result_type`` of the children at
        every Dict/Tuple level (nested, like gymnasium's nested ``np.concatenate``; numpy
        promotion is not associative, so this is not simply the result type of all leaves).
    """

    def __init__(self, space: gymnasium.Space) -> None:
        self.space = space
        self.leaves: list[Leaf] = leaves(space)
        self.flat_dim: int = sum(leaf.flat_dim for leaf in self.leaves)
        self._paths = [leaf.path for leaf in self.leaves]
        self._shapes = [leaf.shape for leaf in self.leaves]
        self._rows = [(1, *leaf.shape) for leaf in self.leaves]
        self._cols = np.cumsum([0] + [leaf.flat_dim for leaf in self.leaves]).tolist()
        self._tree = self._compile(space, ())
        # per leaf: None (Box/MultiBinary: copied) or one-hot tables (Discrete/MultiDiscrete)
        self._onehot = [self._onehot_tables(leaf.space) for leaf in self.leaves]
        self.flat_dtype: np.dtype = self._flat_dtype(space)

    def _compile(self, sp: gymnasium.Space, path: _Path) -> tuple[Any, ...]:
        # Nodes: ("leaf",) | ("dict", path, keys, keyset, children) | ("tuple", path, children)
        if type(sp) is Dict:
            keys = tuple(sp.spaces)
            return ("dict", path, keys, frozenset(keys), [self._compile(sp.spaces[k], path + (k,)) for k in keys])
        if type(sp) is Tuple:
            return ("tuple", path, [self._compile(s, path + (i,)) for i, s in enumerate(sp.spaces)])
        return ("leaf",)

    @staticmethod
    def _onehot_tables(sp: gymnasium.Space) -> tuple[np.ndarray, ...] | None:
        if type(sp) is not Discrete and type(sp) is not MultiDiscrete:
            return None
        nvec = np.asarray(sp.nvec if type(sp) is MultiDiscrete else [sp.n], dtype=np.int64).reshape(-1)
        start = np.asarray(sp.start, dtype=np.int64).reshape(-1)
        offsets = np.concatenate(([0], np.cumsum(nvec)[:-1])).astype(np.int64)  # first column of each category
        local = np.arange(int(nvec.sum())) - np.repeat(offsets, nvec)  # column's index within its category
        return nvec, start, offsets, local

    def _flat_dtype(self, sp: gymnasium.Space) -> np.dtype:
        if type(sp) is Dict:
            return np.result_type(*(self._flat_dtype(s) for s in sp.spaces.values()))
        if type(sp) is Tuple:
            return np.result_type(*(self._flat_dtype(s) for s in sp.spaces))
        return np.dtype(sp.dtype)

    def _gather(self, node: tuple[Any, ...], value: Any, out: list[Any]) -> None:
        kind = node[0]
        if kind == "leaf":
            out.append(value)
        elif kind == "dict":
            _, path, keys, keyset, children = node
            if not isinstance(value, Mapping):
                raise SpaceMismatchError(f"{_at('value', path)}: expected a Mapping with keys {list(keys)} for a Dict space, "
                                         f"got {type(value).__name__}")
            if value.keys() != keyset:
                missing = [k for k in keys if k not in value]
                extra = [k for k in value if k not in keyset]
                raise SpaceMismatchError(f"{_at('value', path)}: expected keys {list(keys)}, got missing {missing} and "
                                         f"unexpected {extra}")
            for key, child in zip(keys, children):
                if child[0] == "leaf":  # inline the common case: saves a call per leaf
                    out.append(value[key])
                else:
                    self._gather(child, value[key], out)
        else:
            _, path, children = node
            if not isinstance(value, (tuple, list)):
                raise SpaceMismatchError(f"{_at('value', path)}: expected a tuple or list of length {len(children)} for a "
                                         f"Tuple space, got {type(value).__name__}")
            if len(value) != len(children):
                raise SpaceMismatchError(f"{_at('value', path)}: expected a tuple or list of length {len(children)}, got "
                                         f"length {len(value)}")
            for child, item in zip(children, value):
                if child[0] == "leaf":
                    out.append(item)
                else:
                    self._gather(child, item, out)

    def to_arrays(self, value: Any, *, batched: bool) -> tuple[list[np.ndarray], int]:
        """Validate ``value`` against the space and convert it to one array per leaf.

        Parameters
        ----------
        value : nested Mapping / tuple / list with array-likes at leaves
            Leaves may be numpy arrays, torch tensors, numpy or Python scalars, nested lists.
        batched : bool
            If True every leaf has a leading batch axis of the same length B; if False
            ``value`` is a single row (B = 1).

        Returns
        -------
        arrays : list of numpy.ndarray
            ``arrays[i]`` has shape ``(B, *leaves[i].shape)`` and dtype ``leaves[i].dtype``;
            may be a view of the input (callers copy into storage).
        B : int

        Notes
        -----
        Casting rule: allowed when ``np.can_cast(src, dst, "safe")``; additionally any
        bool/int/float → float of lower precision (float64 data or Python ints into a
        float32 Box are normal), and bool/int → int of
        another width or signedness when every value fits the destination range (only
        then are min/max scanned).  float → int, complex → real and non-bool → bool are
        refused.  Python scalars arrive as int64/float64.  Values are NOT checked against
        Box bounds or Discrete ranges.

        Raises
        ------
        SpaceMismatchError
            Structure differs from the space (Dict keys, Tuple length, Mapping at a leaf).
        BadValueError
            Wrong shape, inconsistent batch sizes, or a dtype that cannot be cast.
        """
        raw: list[Any] = []
        self._gather(self._tree, value, raw)
        out: list[np.ndarray] = []
        batch = -1
        for i, x in enumerate(raw):
            path, shape = self._paths[i], self._shapes[i]
            arr = _to_numpy(x, path)
            if batched:
                if arr.shape[1:] != shape or arr.ndim != len(shape) + 1:
                    got_b = f" = {(arr.shape[0], *shape)}" if arr.ndim else ""
                    raise BadValueError(f"{_at('value', path)} has shape {arr.shape}; expected (B, "
                                        f"{', '.join(map(str, shape))}){got_b}".replace("(B, )", "(B,)"))
                if batch < 0:
                    batch, first = arr.shape[0], path
                elif arr.shape[0] != batch:
                    raise BadValueError(f"{_at('value', path)} has batch size {arr.shape[0]}; expected {batch} "
                                        f"(the batch size of {_at('value', first)})")
            else:
                if arr.shape != shape:
                    raise BadValueError(f"{_at('value', path)} has shape {arr.shape}; expected {shape}")
                arr = arr.reshape(self._rows[i])
            out.append(_cast(arr, self.leaves[i].dtype, path))
        return out, (batch if batched else 1)

    def from_arrays(self, arrays: Sequence[Any]) -> Any:
        """Nest per-leaf arrays (numpy, torch, anything; not converted) like the space.

        Returns a dict for Dict (key order preserved), a tuple for Tuple, and
        ``arrays[0]`` itself for a root leaf.
        """
        if len(arrays) != len(self.leaves):
            raise SpaceMismatchError(f"expected {len(self.leaves)} arrays (one per leaf), got {len(arrays)}")
        it = iter(arrays)

        def build(node: tuple[Any, ...]) -> Any:
            if node[0] == "leaf":
                return next(it)
            if node[0] == "dict":
                return {k: build(c) for k, c in zip(node[2], node[4])}
            return tuple(build(c) for c in node[2])

        return build(self._tree)

    def flatten(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """Per-leaf arrays ``(B, *leaf.shape)`` → ``(B, flat_dim)`` of ``flat_dtype``.

        Row ``b`` equals ``gymnasium.spaces.flatten(space, from_arrays(row b))`` including
        dtype: Box/MultiBinary are raveled, Discrete/MultiDiscrete one-hot encoded
        (``value - start``).  Inputs follow the :meth:`to_arrays` casting rule.

        Raises
        ------
        BadValueError
            Bad shapes/dtypes, or a Discrete/MultiDiscrete value outside
            ``[start, start + n)`` (it has no one-hot encoding).
        """
        arrs, batch = self.to_arrays(self.from_arrays(arrays), batched=True)
        out = np.zeros((batch, self.flat_dim), dtype=self.flat_dtype)
        rows = np.arange(batch)[:, None]
        for leaf, arr, col, tables in zip(self.leaves, arrs, self._cols, self._onehot):
            if tables is None:  # setitem casts leaf dtype → flat dtype exactly as np.concatenate does
                out[:, col:col + leaf.flat_dim] = arr.reshape(batch, leaf.flat_dim)
                continue
            nvec, start, offsets, _ = tables
            vals = arr.reshape(batch, nvec.size)
            idx = vals.astype(np.int64) - start
            bad = (idx < 0) | (idx >= nvec)
            if bad.any():  # such a value has no one-hot encoding (gymnasium would index out of range)
                b, j = (int(v[0]) for v in np.nonzero(bad))
                raise BadValueError(f"{_at('value', leaf.path)} row {b} has {vals[b, j]}; expected a value in "
                                    f"[{start[j]}, {start[j] + nvec[j]}) to one-hot encode")
            out[rows, col + offsets + idx] = 1
        return out

    def unflatten(self, flat: np.ndarray) -> list[np.ndarray]:
        """``(B, flat_dim)`` → per-leaf arrays ``(B, *leaf.shape)`` of leaf dtypes.

        Equals ``gymnasium.spaces.unflatten`` row by row: Box/MultiBinary slices are cast
        (unsafely, like gymnasium) to the leaf dtype; for one-hot segments the first
        non-zero entry wins.

        Raises
        ------
        BadValueError
            ``flat`` is not 2-D, has the wrong width, is not numeric, or a
            Discrete/MultiDiscrete segment of a row is all zeros.
        """
        flat = _to_numpy(flat, ())
        if flat.dtype.kind not in "biuf":
            raise BadValueError(f"flattened value has dtype {flat.dtype}; expected a bool, integer or float dtype")
        if flat.ndim != 2:
            raise BadValueError(f"flattened value has shape {flat.shape}; expected (B, {self.flat_dim})")
        if flat.shape[1] != self.flat_dim:
            raise BadValueError(f"expected flattened width {self.flat_dim}, got {flat.shape[1]}")
        batch = flat.shape[0]
        out: list[np.ndarray] = []
        for leaf, col, tables in zip(self.leaves, self._cols, self._onehot):
            seg = flat[:, col:col + leaf.flat_dim]
            if tables is None:  # unsafe cast, exactly like gymnasium's np.asarray(x, dtype=space.dtype)
                out.append(seg.astype(leaf.dtype).reshape(batch, *leaf.shape))
                continue
            nvec, start, offsets, local = tables
            if nvec.size == 0:  # MultiDiscrete([]): nothing to decode
                out.append(np.zeros((batch, *leaf.shape), dtype=leaf.dtype))
                continue
            # first non-zero column of each category (as gymnasium's np.nonzero(...)[0]); flat_dim = none
            first = np.minimum.reduceat(np.where(seg != 0, local, leaf.flat_dim), offsets, axis=1)
            missing = first == leaf.flat_dim
            if missing.any():
                b = int(np.nonzero(missing.any(axis=1))[0][0])
                raise BadValueError(f"row {b} of the flattened value has no non-zero entry in the one-hot segment of "
                                    f"{_at('leaf', leaf.path)}; expected a one-hot encoding")
            out.append((first + start).astype(leaf.dtype).reshape(batch, *leaf.shape))
        return out
