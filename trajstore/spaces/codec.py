"""Gymnasium spaces to and from the JSON stored in a store's metadata (bounds, dtypes, nesting)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import gymnasium
import numpy as np
from gymnasium.spaces import Box, Dict, Discrete, MultiBinary, MultiDiscrete, Tuple

from trajstore.errors import UnsupportedSpaceError
from trajstore.spaces.leaves import (
    SPECIAL_FLOATS,
    SUPPORTED_SPACES,
    LeafPath,
    at_path,
    check_dict_key,
    child_spaces,
    path_name,
)


def _num_to_json(x: Any) -> Any:
    if isinstance(x, list):
        return [_num_to_json(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x  # a Python float's repr round-trips exactly (float16/32 widen exactly); ints/bools are exact


def _num_from_json(x: Any, path: LeafPath) -> Any:
    if isinstance(x, list):
        return [_num_from_json(v, path) for v in x]
    if isinstance(x, str) and x in SPECIAL_FLOATS:
        return SPECIAL_FLOATS[x]
    if isinstance(x, (int, float)):  # bool is an int: fine for bool Boxes
        return x
    raise UnsupportedSpaceError(f"malformed space JSON at '{path_name(path)}': bad number {x!r}")


def _bound_to_json(a: np.ndarray, bounded: np.ndarray, inf: float) -> Any:
    """A scalar when all elements are bit-identical (keeps -0.0 apart from 0.0), else nested lists."""
    if a.dtype.kind == "i" and not bounded.all():
        # Int Boxes store +-inf bounds as the dtype's min/max plus a bounded_* flag that changes
        # sampling; writing "inf" back keeps that flag through the round trip.
        return _num_to_json(inf if not bounded.any() else np.where(bounded, a.astype(object), inf).tolist())
    flat = np.ascontiguousarray(a).reshape(-1)
    if flat.size and (flat.view(np.uint8).reshape(flat.size, -1) == flat[:1].view(np.uint8)).all():
        return _num_to_json(flat[0].item())
    return _num_to_json(a.tolist())


def _dtype_to_json(dtype: np.dtype) -> str:
    return dtype.name if dtype.isnative else dtype.str  # '>f4' keeps a foreign byte order


def space_to_json(space: gymnasium.Space[Any]) -> dict[str, Any]:
    """Encode a supported space as a JSON-safe dict (``json.dumps(..., allow_nan=False)`` works).

    Box bounds are a scalar when uniform, else nested lists, with non-finite floats as the
    strings ``"inf"``/``"-inf"``; dtypes are numpy names (``"float32"``).  Dict entries are
    ``[key, space]`` pairs so the key order survives any JSON reader.  Raises
    ``UnsupportedSpaceError`` (naming the path) for an unsupported subspace.
    """

    def enc(sp: gymnasium.Space[Any], path: LeafPath) -> dict[str, Any]:
        items = child_spaces(sp, path)
        if type(sp) is Dict:
            assert items is not None
            return {"type": "Dict", "spaces": [[k, enc(s, path + (k,))] for k, s in items]}
        if type(sp) is Tuple:
            assert items is not None
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
        n = cast(MultiBinary, sp).n  # MultiBinary: gymnasium says MultiBinary(5) != MultiBinary((5,)), so keep which
        return {"type": "MultiBinary", "n": int(n) if isinstance(n, int) else [int(d) for d in n]}

    return enc(space, ())


#: Elements of all the shaped leaves (Box, MultiDiscrete) of one decoded space, at most: gymnasium
#: holds full bound arrays per leaf, so a stored space that claims more (a Box of 10**12 elements
#: with one bound) would allocate without bound; refused before anything is allocated.  2**27 is
#: about 5 RGB frames of 4K per row.
MAX_SPACE_ELEMENTS = 1 << 27


def space_from_json(obj: Mapping[str, Any]) -> gymnasium.Space[Any]:
    """Decode :func:`space_to_json` output; bounds, nvec, start, n and dtype come back bit-exact.

    Only plain data is interpreted: nothing is evaluated, imported or unpickled.  Raises
    ``UnsupportedSpaceError`` (naming the path) for an unknown ``"type"`` or malformed JSON.
    """

    def bad(path: LeafPath, why: str) -> UnsupportedSpaceError:
        return UnsupportedSpaceError(f"malformed space JSON at '{path_name(path)}': {why}")

    def dtype_of(o: Mapping[str, Any], path: LeafPath, kinds: str) -> np.dtype:
        try:
            dt = np.dtype(str(o["dtype"]))
        except (KeyError, TypeError, ValueError) as e:
            raise bad(path, f"bad dtype ({e})") from None
        if dt.kind not in kinds or dt.fields is not None or dt.shape != ():
            raise bad(path, f"dtype {dt} is not allowed here")
        return dt

    elements = [0]  # of the leaves decoded so far (MAX_SPACE_ELEMENTS)

    def shape_of(o: Mapping[str, Any], path: LeafPath) -> tuple[int, ...]:
        if not all(type(d) is int and d >= 0 for d in o["shape"]):
            raise bad(path, f"bad shape {o['shape']!r}")
        elements[0] += math.prod(o["shape"])
        if elements[0] > MAX_SPACE_ELEMENTS:
            raise bad(path, f"shape {o['shape']!r} takes the space past {MAX_SPACE_ELEMENTS:,} elements in all")
        return tuple(o["shape"])

    def array(x: Any, dt: np.dtype, shape: tuple[int, ...], path: LeafPath) -> tuple[np.ndarray, np.ndarray]:
        """Exact array of ``dt`` and its mask of infinite entries (object arrays: no float rounding)."""
        x = _num_from_json(x, path)
        if not isinstance(x, list):
            # One bound for every element (an image's 0..255): convert the scalar once and
            # broadcast; the object-array path costs ~0.2 s for a 480x640x3 frame's bounds.
            one, one_inf = array([x], dt, (1,), path)
            return np.full(shape, one[0], dtype=dt), np.full(shape, bool(one_inf[0]))
        obj = np.array(x, dtype=object)
        if obj.size != math.prod(shape):
            raise bad(path, f"array of shape {obj.shape}; expected {shape}")
        obj = obj.reshape(shape)  # also restores e.g. (0, 3) from []
        inf = np.asarray((obj == math.inf) | (obj == -math.inf), dtype=bool)
        if inf.any() and dt.kind != "f":
            if dt.kind != "i":
                raise bad(path, f"infinite value for dtype {dt}")
            neg = inf & np.asarray(obj < 0, dtype=bool)  # as gymnasium: +-inf → int dtype's max/min
            obj[neg], obj[inf & ~neg] = np.iinfo(dt).min, np.iinfo(dt).max
        return obj.astype(dt), inf

    def box_of(o: Mapping[str, Any], dt: np.dtype, shape: tuple[int, ...], path: LeafPath) -> Box:
        if dt.kind in "iuf" and all(shape) and not isinstance(o["low"], list) and not isinstance(o["high"], list):
            # One bound each (an image's 0..255): gymnasium checks two scalars, not every element
            # (a 480x640x3 Box built from full arrays took ~20 ms, from scalars ~0.5 ms); same Box.
            (low, low_inf), (high, high_inf) = array([o["low"]], dt, (1,), path), array([o["high"]], dt, (1,), path)
            box = Box(low[0], high[0], shape, dt)
            if dt.kind == "i":  # the "unbounded" flags gymnasium derived from the original infinities
                box.bounded_below, box.bounded_above = np.full(shape, not low_inf[0]), np.full(shape, not high_inf[0])
            return box
        (low, low_inf), (high, high_inf) = array(o["low"], dt, shape, path), array(o["high"], dt, shape, path)
        box = Box(low, high, shape, dt)
        if dt.kind == "i":  # restore the "unbounded" flags gymnasium derived from the original infinities
            box.bounded_below, box.bounded_above = ~low_inf, ~high_inf
        return box

    def dec(o: Any, path: LeafPath) -> gymnasium.Space[Any]:
        if not isinstance(o, Mapping) or not isinstance(o.get("type"), str):
            raise bad(path, "expected an object with a string 'type'")
        kind = o["type"]
        try:
            if kind == "Dict":
                pairs = list(o["spaces"].items() if isinstance(o["spaces"], Mapping) else o["spaces"])
                if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
                    raise bad(path, "Dict 'spaces' must be a list of [key, space] pairs")
                for k, _ in pairs:
                    check_dict_key(k, path)
                return Dict([(k, dec(v, path + (k,))) for k, v in pairs])  # a list keeps order (a dict is sorted)
            if kind == "Tuple":
                return Tuple([dec(v, path + (i,)) for i, v in enumerate(o["spaces"])])
            if kind == "Box":
                dt = dtype_of(o, path, "biuf")
                return box_of(o, dt, shape_of(o, path), path)
            if kind == "Discrete":
                if not (type(o["n"]) is int and type(o["start"]) is int):
                    raise bad(path, "'n' and 'start' must be integers")
                return Discrete(o["n"], start=o["start"], dtype=dtype_of(o, path, "iu"))
            if kind == "MultiDiscrete":
                dt, shape = dtype_of(o, path, "iu"), shape_of(o, path)
                nvec, start = array(o["nvec"], dt, shape, path)[0], array(o["start"], dt, shape, path)[0]
                return MultiDiscrete(nvec, dtype=dt, start=start)
            if kind == "MultiBinary":
                n = o["n"]
                return MultiBinary(n if type(n) is int else tuple(int(d) for d in n))
        except UnsupportedSpaceError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise bad(path, f"{type(e).__name__}: {e}") from None
        raise UnsupportedSpaceError(f"{at_path('space', path)} has unknown type {kind!r}; {SUPPORTED_SPACES}")

    return dec(obj, ())


