"""Values checked and converted to the stored leaves' dtypes (:class:`ValuePlan`), and back."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import gymnasium
import numpy as np
from gymnasium.spaces import Box, Dict, Discrete, MultiBinary, MultiDiscrete, Tuple

from trajstore._optional import is_tensor
from trajstore.errors import BadValueError, SpaceMismatchError
from trajstore.spaces.leaves import Leaf, LeafPath, at_path, leaves


def _to_numpy(x: Any, path: LeafPath) -> np.ndarray:
    """numpy array / torch tensor (detected without importing torch) / scalar / nested list → ndarray."""
    if type(x) is np.ndarray:
        return x
    if isinstance(x, (np.generic, int, float)):
        return np.asarray(x)
    if is_tensor(x):
        try:
            return x.detach().cpu().numpy()
        except (TypeError, RuntimeError) as e:  # e.g. bfloat16 has no numpy dtype
            raise BadValueError(f"{at_path('value', path)}: cannot convert torch tensor of dtype {x.dtype} ({e})") from None
    if isinstance(x, Mapping):
        raise SpaceMismatchError(f"{at_path('value', path)}: expected an array for a leaf, got a {type(x).__name__}")
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:  # ragged nested lists
        raise BadValueError(f"{at_path('value', path)} is not array-like: {e}") from None


def _bad_value(arr: np.ndarray, bad: np.ndarray, path: LeafPath, batched: bool, expected: str,
               row0: int = 0) -> BadValueError:
    """The error for the elements of ``arr`` flagged in ``bad`` (same shape): the first one by row
    (when ``batched``; rows counted from ``row0``) and element, its value and what was expected,
    then how many more there are."""
    pos = tuple(int(i) for i in np.argwhere(bad)[0])
    where = [f"row {row0 + pos[0]}"] if batched else []
    if pos[int(batched):]:
        where.append(f"element {list(pos[int(batched):])}")
    text = f"{at_path('value', path)}{' ' + ', '.join(where) if where else ''} is {arr[pos].item()!r}; expected {expected}"
    n_bad = int(np.count_nonzero(bad))
    if n_bad > 1:
        rows = f" in {int(np.count_nonzero(bad.reshape(len(bad), -1).any(axis=1)))} of {len(bad)} rows" if batched else ""
        seen = list(dict.fromkeys(arr[bad][:256].tolist()))  # distinct, in order of appearance
        text += f" ({n_bad} bad values{rows}: {', '.join(map(repr, seen[:5]))}{', ...' if len(seen) > 5 else ''})"
    return BadValueError(text)


def _cast(arr: np.ndarray, dst: np.dtype, path: LeafPath, batched: bool = False) -> np.ndarray:
    """Apply the casting rule documented in :meth:`ValuePlan.to_arrays` (``batched``: axis 0 is rows,
    for the error message)."""
    src = arr.dtype
    if src == dst:  # hot path: no copy, no scan
        return arr
    if np.can_cast(src, dst, "safe") or (src.kind in "biuf" and dst.kind == "f"):
        return arr.astype(dst)
    if src.kind in "biuf" and dst.kind in "iu":
        if arr.size:  # only here are values scanned: int width/signedness differ, or floats into ints
            info = np.iinfo(dst)
            if src.kind == "f" and arr.size <= 64:  # small: Python floats beat a handful of 0-d ufuncs
                vals = arr.reshape(-1).tolist()
                if all(v.is_integer() for v in vals) and info.min <= min(vals) and max(vals) < float(info.max) + 1:
                    return arr.astype(dst)
            if src.kind == "f":
                # Whole floats are accepted (1.0 for a Discrete: torch policies, SB3's float action
                # arrays); 0.5 would be truncated silently, NaN has no integer.
                frac = arr != np.trunc(arr)
                if frac.any():
                    raise _bad_value(arr, frac, path, batched, f"a whole number for an integer field of dtype {dst} "
                                     f"(got {src} with a fractional part)")
                lo, hi = float(info.min), float(info.max) + 1  # both exact floats for every width: 2**63, 2**64
                if not (arr.min() >= lo and arr.max() < hi):
                    raise _bad_value(arr, (arr < lo) | (arr >= hi), path, batched,
                                     f"a value within the range of {dst} [{info.min}, {info.max}] (got {src})")
            elif int(arr.min()) < info.min or int(arr.max()) > info.max:
                raise _bad_value(arr, (arr < info.min) | (arr > info.max), path, batched,
                                 f"a value within the range of {dst} [{info.min}, {info.max}] (got {src})")
        return arr.astype(dst)
    raise BadValueError(f"{at_path('value', path)} has dtype {src}; expected {dst} or a dtype that casts to it safely")


def _braces(space: gymnasium.Space[Any]) -> str:
    """A one-line ``str(space)`` for messages, safe inside a ``str.format`` template."""
    if type(space) is MultiDiscrete:  # numpy's repr of a 2-D nvec spans lines
        start = f", start={space.start.tolist()}" if space.start.any() else ""
        text = f"MultiDiscrete({space.nvec.tolist()}{start})"
    else:
        text = str(space)
    text = text if len(text) <= 200 else text[:197] + "..."
    return text.replace("{", "{{").replace("}", "}}")


class _Allowed:
    """What a leaf's space allows, checked on values already of the leaf's dtype.

    Discrete, MultiDiscrete and MultiBinary always; Box only with ``check_bounds`` (its bounds, as
    ``Box.contains``: NaN is outside every bound, +-inf inside an infinite one).  ``ok`` is the
    per-call hot path: numpy reductions cost microseconds each, so small integer rows (a Discrete
    action, a MultiBinary) are compared as Python numbers.
    """

    __slots__ = ("expected", "hi", "hi_list", "lo", "lo_list", "py", "row_size", "uniform")

    def __init__(self, lo: np.ndarray, hi: np.ndarray, dtype: np.dtype, expected: str) -> None:
        self.lo, self.hi = lo, hi  # arrays of the leaf's row shape
        flat_lo, flat_hi = lo.reshape(-1), hi.reshape(-1)
        self.uniform = bool(flat_lo.size) and bool((flat_lo == flat_lo[0]).all() and (flat_hi == flat_hi[0]).all())
        self.lo_list, self.hi_list = flat_lo.tolist(), flat_hi.tolist()
        self.row_size = flat_lo.size
        self.py = dtype.kind in "biu"  # no NaN: Python's min/max are exact
        self.expected = expected

    @classmethod
    def of(cls, space: gymnasium.Space[Any], check_bounds: bool) -> _Allowed | None:
        """The check for a leaf space, or None when no value of its dtype can be outside it.

        ``expected`` is a template of the message: ``{lo}``, ``{hi}`` are the bad element's bounds,
        ``{at}`` says they are that element's own when they differ between elements.
        """
        dt = np.dtype(space.dtype)
        assert space.shape is not None  # a leaf
        shape = tuple(space.shape)
        if type(space) is Discrete:
            lo, hi = int(space.start), int(space.start) + int(space.n) - 1
            return cls(np.full(shape, lo, dt), np.full(shape, hi, dt), dt,
                       f"an integer in [{{lo}}, {{hi}}] ({_braces(space)})")
        if type(space) is MultiDiscrete:
            return cls(np.asarray(space.start, dt), np.asarray(space.start + space.nvec - 1, dt), dt,
                       f"an integer in [{{lo}}, {{hi}}]{{at}} ({_braces(space)})")
        if type(space) is MultiBinary:
            return cls(np.zeros(shape, dt), np.ones(shape, dt), dt, f"0 or 1 ({_braces(space)})")
        if not check_bounds or dt.kind == "b":
            return None
        box = cast(Box, space)  # the one leaf type left
        lo_a, hi_a = np.asarray(box.low, dt), np.asarray(box.high, dt)
        if dt.kind in "iu" and (lo_a == np.iinfo(dt).min).all() and (hi_a == np.iinfo(dt).max).all():
            return None  # the bounds span the dtype; the cast already checked that range
        return cls(lo_a, hi_a, dt, "a value in [{lo}, {hi}]{at} (the Box's bounds: check_bounds=True, "
                                   "which also refuses NaN)")

    def ok(self, a: np.ndarray) -> bool:
        """Whether every value of ``a`` (one row, or rows of the leaf's shape) is allowed."""
        if a.size == 0:
            return True
        if a.size == 1 and self.uniform:  # one value (NaN fails both comparisons)
            return self.lo_list[0] <= a.item() <= self.hi_list[0]
        if self.py and a.size <= 64:
            vals = a.reshape(-1).tolist()
            if self.uniform:
                return self.lo_list[0] <= min(vals) and max(vals) <= self.hi_list[0]
            if a.size == self.row_size:
                return all(lo <= v <= hi for lo, v, hi in zip(self.lo_list, vals, self.hi_list))
        if self.uniform:  # min/max propagate NaN, and NaN fails both comparisons
            return bool(self.lo_list[0] <= a.min() and a.max() <= self.hi_list[0])
        return bool(((a >= self.lo) & (a <= self.hi)).all())

    def error(self, a: np.ndarray, path: LeafPath, batched: bool, row0: int = 0) -> BadValueError:
        """The error for a value that failed :meth:`ok` (rows counted from ``row0``)."""
        bad = ~((a >= self.lo) & (a <= self.hi))
        elem = tuple(int(i) for i in np.argwhere(bad)[0])[int(batched):]
        expected = self.expected.format(lo=self.lo[elem].item(), hi=self.hi[elem].item(),
                                        at="" if self.uniform else " at that element")
        return _bad_value(a, bad, path, batched, expected, row0)


def _nest(node: tuple[Any, ...], it: Iterator[Any]) -> Any:
    """The value of ``node`` built from the next leaves of ``it`` (see ``ValuePlan.from_arrays``).

    A module function, not a closure: a self-recursive closure is a reference cycle, which would
    keep every batch it nested alive until the garbage collector ran.  Freshly gathered batches
    are megabytes; freed late, their pages go back to the OS and the next batch faults in new,
    zeroed ones (image ``sample`` was 5-10x slower than the gather itself).
    """
    if node[0] == "dict":
        return {k: _nest(c, it) for k, c in zip(node[2], node[4])}
    return next(it) if node[0] == "leaf" else tuple(_nest(c, it) for c in node[2])


class ValuePlan:
    """Precompiled validator/converter for one space (built once per buffer, used every step).

    Attributes
    ----------
    leaves : list of Leaf
        Storage/flatten order; every per-leaf list in this class uses it.
    flat_dim : int
        Width of a flattened row.
    flat_dtype : numpy.dtype
        dtype of ``gymnasium.spaces.flatten``: ``np.result_type`` of the children at every
        Dict/Tuple level, as gymnasium's nested ``np.concatenate`` gives (numpy promotion is not
        associative, so this can differ from the result type of all leaves at once).
    check_bounds : bool
        Whether writes also check Box values against ``low``/``high`` (see :meth:`to_arrays`).
    """

    def __init__(self, space: gymnasium.Space[Any], *, check_bounds: bool = False) -> None:
        self.space = space
        self.check_bounds = bool(check_bounds)
        self.leaves: list[Leaf] = leaves(space)
        self.flat_dim: int = sum(leaf.flat_dim for leaf in self.leaves)
        self.flat_dtype: np.dtype = self._flat_dtype(space)
        self._one_row = [(1, *leaf.shape) for leaf in self.leaves]
        self._cols = np.cumsum([0] + [leaf.flat_dim for leaf in self.leaves]).tolist()
        self._tree = self._compile(space, ())
        # Keys of a Dict whose values are all leaves: write_row's fast path.
        self._flat_keys = (tuple(space.spaces) if type(space) is Dict and all(len(leaf.path) == 1 for leaf in self.leaves)
                           else None)
        self._onehot = [self._onehot_tables(leaf.space) for leaf in self.leaves]
        # What each leaf allows beyond its dtype (None: nothing to check), and the leaves that have
        # a check: the only values scanned on a write whose dtypes already match.
        self._allowed = [_Allowed.of(leaf.space, self.check_bounds) for leaf in self.leaves]
        self._checked = [(i, a) for i, a in enumerate(self._allowed) if a is not None]
        # Root Discrete leaf, or Dict keys of Discrete leaves: a Python int is checked and stored
        # without becoming an array first (the usual ``append({"obs": ..., "action": 3})``).
        self._int_leaf = [type(leaf.space) is Discrete for leaf in self.leaves]

    def _compile(self, sp: gymnasium.Space[Any], path: LeafPath) -> tuple[Any, ...]:
        # Nodes: ("leaf",) | ("dict", path, keys, keyset, children) | ("tuple", path, children)
        if type(sp) is Dict:
            keys = tuple(sp.spaces)
            return ("dict", path, keys, frozenset(keys), [self._compile(sp.spaces[k], path + (k,)) for k in keys])
        if type(sp) is Tuple:
            return ("tuple", path, [self._compile(s, path + (i,)) for i, s in enumerate(sp.spaces)])
        return ("leaf",)

    def _flat_dtype(self, sp: gymnasium.Space[Any]) -> np.dtype:
        subs = sp.spaces.values() if type(sp) is Dict else sp.spaces if type(sp) is Tuple else None
        return np.dtype(sp.dtype) if subs is None else np.result_type(*(self._flat_dtype(s) for s in subs))

    @staticmethod
    def _onehot_tables(sp: gymnasium.Space[Any]) -> tuple[np.ndarray, ...] | None:
        """(nvec, start, first column of each category, column index within its category) or None."""
        if type(sp) is not Discrete and type(sp) is not MultiDiscrete:
            return None
        nvec = np.asarray(sp.nvec if type(sp) is MultiDiscrete else [cast(Discrete, sp).n], dtype=np.int64).reshape(-1)
        offsets = np.concatenate(([0], np.cumsum(nvec)[:-1])).astype(np.int64)
        local = np.arange(int(nvec.sum())) - np.repeat(offsets, nvec)
        return nvec, np.asarray(sp.start, dtype=np.int64).reshape(-1), offsets, local

    def _gather(self, node: tuple[Any, ...], value: Any, out: list[Any]) -> None:
        """Check ``value``'s structure against ``node`` and append its leaf values to ``out``."""
        if node[0] == "dict":
            _, path, keys, keyset, children = node
            if not isinstance(value, Mapping):
                raise SpaceMismatchError(f"{at_path('value', path)}: expected a Mapping with keys {list(keys)} for a Dict "
                                         f"space, got {type(value).__name__}")
            if value.keys() != keyset:
                missing, extra = [k for k in keys if k not in value], [k for k in value if k not in keyset]
                raise SpaceMismatchError(f"{at_path('value', path)}: expected keys {list(keys)}, got missing {missing} "
                                         f"and unexpected {extra}")
            items = zip(children, (value[k] for k in keys))
        elif node[0] == "tuple":
            _, path, children = node
            if not isinstance(value, (tuple, list)):
                raise SpaceMismatchError(f"{at_path('value', path)}: expected a tuple or list of length {len(children)} "
                                         f"for a Tuple space, got {type(value).__name__}")
            if len(value) != len(children):
                raise SpaceMismatchError(f"{at_path('value', path)}: expected a tuple or list of length {len(children)}, "
                                         f"got length {len(value)}")
            items = zip(children, value)
        else:
            out.append(value)
            return
        for child, item in items:
            if child[0] == "leaf":  # inlined common case: saves a call per leaf
                out.append(item)
            else:
                self._gather(child, item, out)

    def to_arrays(self, value: Any, *, batched: bool, check: bool = True) -> tuple[list[np.ndarray], int]:
        """Validate ``value`` against the space and convert it to one array per leaf.

        Parameters
        ----------
        value : Mapping (Dict) / tuple or list (Tuple), nested; at leaves numpy arrays, torch
            tensors, numpy or Python scalars or nested lists.
        batched : bool
            True: every leaf has a leading batch axis of one length B; False: one row, B = 1.
        check : bool
            Check values against the space (default).  ``False`` only converts (dtype and shape
            rules still apply): for reads such as :meth:`flatten`, which must not fail on rows a
            store already holds.

        Returns
        -------
        arrays : list of numpy.ndarray
            ``arrays[i]`` has shape ``(B, *leaves[i].shape)`` and dtype ``leaves[i].dtype``; it may
            be a view of the input (callers copy it into storage).
        B : int

        Notes
        -----
        Casting is allowed when ``np.can_cast(src, dst, "safe")``; also bool/int/float → any float
        (float64 data or Python ints into a float32 Box are normal), bool/int → int of another
        width or signedness when every value fits ``dst``, and float → int when every value is a
        whole number that fits ``dst`` (``1.0`` for a Discrete, as torch policies and SB3's float
        action arrays give; ``0.5`` and NaN are refused).  Only these casts scan values.
        complex → real and non-bool → bool are refused.  Python scalars arrive as int64/float64.

        Then values are checked against the space (after the cast, so what is checked is what
        would be stored): Discrete in ``[start, start + n - 1]``, MultiDiscrete in
        ``[start, start + nvec - 1]`` element-wise, MultiBinary 0 or 1.  Box bounds only with
        ``check_bounds=True`` (as ``Box.contains``: NaN is refused, +-inf only where the bound is
        infinite).  Each check is one vectorized pass; leaves that no value can violate (float
        Boxes without ``check_bounds``, integer Boxes whose bounds span the dtype) cost nothing.

        Raises
        ------
        SpaceMismatchError
            The structure differs from the space (Dict keys, Tuple length, Mapping at a leaf).
        BadValueError
            Wrong shape, differing batch sizes, a dtype that cannot be cast, a value that does not
            fit the field's dtype, or a value outside the space; the message names the field, the
            first bad row (batched) and element, the value, and what the space allows.
        """
        raw: list[Any] = []
        self._gather(self._tree, value, raw)
        out: list[np.ndarray] = []
        batch = -1
        for i, leaf in enumerate(self.leaves):
            path, shape = leaf.path, leaf.shape
            arr = _to_numpy(raw[i], path)
            allowed = self._allowed[i] if check else None
            if not batched:
                if arr.shape != shape:
                    raise BadValueError(f"{at_path('value', path)} has shape {arr.shape}; expected {shape}")
                arr = _cast(arr, leaf.dtype, path)
                if allowed is not None and not allowed.ok(arr):
                    raise allowed.error(arr, path, False)
                out.append(arr.reshape(self._one_row[i]))
                continue
            if arr.ndim != len(shape) + 1 or arr.shape[1:] != shape:
                want = f"(B, {', '.join(map(str, shape))})".replace("(B, )", "(B,)")
                with_b = f" = {(arr.shape[0], *shape)}" if arr.ndim else ""
                raise BadValueError(f"{at_path('value', path)} has shape {arr.shape}; expected {want}{with_b}")
            elif batch < 0:
                batch, first = arr.shape[0], path
            elif arr.shape[0] != batch:
                raise BadValueError(f"{at_path('value', path)} has batch size {arr.shape[0]}; expected {batch} "
                                    f"(the batch size of {at_path('value', first)})")
            arr = _cast(arr, leaf.dtype, path, True)
            if allowed is not None and not allowed.ok(arr):
                raise allowed.error(arr, path, True)
            out.append(arr)
        return out, (batch if batched else 1)

    def check(self, arrays: Sequence[np.ndarray], *, first_row: int = 0) -> None:
        """Check per-leaf arrays ``(B, *leaf.shape)`` already of the leaf dtypes (rows read from
        another store, for instance) against the space, as :meth:`to_arrays` does; rows in the
        message are counted from ``first_row``."""
        for i, allowed in self._checked:
            a = arrays[i]
            if not allowed.ok(a):
                raise allowed.error(a, self.leaves[i].path, True, first_row)

    def write_row(self, value: Any, out: Sequence[np.ndarray], j: int) -> None:
        """Validate one row and copy it into ``out[i][j]`` for every leaf ``i``.

        The per-step hot path of ``append``.  A flat Dict (every value a leaf) whose values
        already have the exact shape and dtype is copied without conversion; anything else goes
        through the rules of :meth:`to_arrays` (same errors and value checks).  On error, ``out``
        is untouched.
        """
        keys = self._flat_keys
        raw: list[Any] | None = None
        if keys is not None and type(value) is dict and len(value) == len(keys):
            try:
                raw = [value[k] for k in keys]
            except KeyError:
                raw = None  # the general path names the missing key
        if raw is None:
            raw = []
            self._gather(self._tree, value, raw)
        # Every leaf is converted and checked before any is copied: a bad leaf leaves row j as it was.
        arrs: list[np.ndarray] = []
        for i, leaf in enumerate(self.leaves):
            x = raw[i]
            allowed = self._allowed[i]
            if self._int_leaf[i] and isinstance(x, (int, float, np.integer, np.floating)) and type(x) is not bool:
                # A scalar for a Discrete: compared as a Python number, no array (ufuncs on 0-d
                # arrays cost microseconds each); a whole float is stored as its int.
                v = x if type(x) is int else x.item() if isinstance(x, np.generic) else x
                if type(v) is float and v.is_integer():
                    v = int(v)
                if type(v) is int and allowed.lo_list[0] <= v <= allowed.hi_list[0]:  # type: ignore[union-attr]
                    arrs.append(v)  # type: ignore[arg-type]  # the assignment below stores it as the leaf dtype
                    continue  # anything else takes the general path, which raises the right error
            if type(x) is np.ndarray and x.dtype == leaf.dtype and x.shape == leaf.shape:
                arr = x
            else:
                arr = _to_numpy(x, leaf.path)
                if arr.shape != leaf.shape:
                    raise BadValueError(f"{at_path('value', leaf.path)} has shape {arr.shape}; expected {leaf.shape}")
                arr = _cast(arr, leaf.dtype, leaf.path)
            if allowed is not None and not allowed.ok(arr):
                raise allowed.error(arr, leaf.path, False)
            arrs.append(arr)
        for i, arr in enumerate(arrs):
            out[i][j] = arr

    def from_arrays(self, arrays: Sequence[Any]) -> Any:
        """Nest per-leaf arrays (numpy, torch, ...; not converted) like the space.

        Returns a dict for a Dict (key order kept), a tuple for a Tuple, ``arrays[0]`` for a root leaf.
        """
        if len(arrays) != len(self.leaves):
            raise SpaceMismatchError(f"expected {len(self.leaves)} arrays (one per leaf), got {len(arrays)}")
        if self._tree[0] == "leaf":
            return arrays[0]
        return _nest(self._tree, iter(arrays))

    def flatten(self, arrays: Sequence[Any]) -> np.ndarray:
        """Per-leaf arrays ``(B, *leaf.shape)`` → ``(B, flat_dim)`` array of ``flat_dtype``.

        Row ``b`` equals ``gymnasium.spaces.flatten(space, from_arrays(row b))``, dtype included:
        Box/MultiBinary are raveled, Discrete/MultiDiscrete one-hot encoded at ``value - start``.
        Inputs follow the :meth:`to_arrays` rules.

        Raises
        ------
        BadValueError
            Bad shapes or dtypes, or a Discrete/MultiDiscrete value outside ``[start, start + n)``
            (it has no one-hot encoding).
        """
        arrs, batch = self.to_arrays(self.from_arrays(arrays), batched=True, check=False)
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
            if bad.any():
                b, j = (int(v[0]) for v in np.nonzero(bad))
                raise BadValueError(f"{at_path('value', leaf.path)} row {b} has {vals[b, j]}; expected a value in "
                                    f"[{start[j]}, {start[j] + nvec[j]}) to one-hot encode")
            out[rows, col + offsets + idx] = 1
        return out

    def unflatten(self, flat: Any) -> list[np.ndarray]:
        """``(B, flat_dim)`` → per-leaf arrays ``(B, *leaf.shape)`` of the leaf dtypes.

        Equals ``gymnasium.spaces.unflatten`` row by row for every value the space holds; in
        one-hot segments the first non-zero entry wins.  Unlike gymnasium, which casts unsafely,
        Box/MultiBinary columns follow the :meth:`to_arrays` casting rule and value checks (this
        is the write path of the flattened layout: 300.0 for a uint8 field or 0.5 for a
        MultiBinary is refused, not wrapped or truncated), except that a bool field takes the
        values 0 and 1 of any dtype, as a flattened row of mixed leaves is never bool.

        Raises
        ------
        BadValueError
            ``flat`` is not 2-D, has the wrong width or a non-numeric dtype, a row has an
            all-zero Discrete/MultiDiscrete segment, or a Box/MultiBinary value is refused.
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
        for i, (leaf, col, tables) in enumerate(zip(self.leaves, self._cols, self._onehot)):
            seg = flat[:, col:col + leaf.flat_dim]
            if tables is None or tables[0].size == 0:  # MultiDiscrete([]) decodes to an empty array
                seg = seg.reshape(batch, *leaf.shape)
                if leaf.dtype.kind == "b" and seg.dtype.kind != "b":
                    bad = (seg != 0) & (seg != 1)
                    if bad.any():
                        raise _bad_value(seg, bad, leaf.path, True, "0 or 1 for a bool field")
                    out.append(seg != 0)
                    continue
                seg = _cast(seg, leaf.dtype, leaf.path, True)
                allowed = self._allowed[i]
                if allowed is not None and not allowed.ok(seg):
                    raise allowed.error(seg, leaf.path, True)
                out.append(seg)  # may view ``flat``: callers copy into storage, as with to_arrays
                continue
            nvec, start, offsets, local = tables
            # first non-zero column within each category, like gymnasium's np.nonzero; flat_dim means none
            first = np.minimum.reduceat(np.where(seg != 0, local, leaf.flat_dim), offsets, axis=1)
            if (first == leaf.flat_dim).any():
                b = int(np.nonzero((first == leaf.flat_dim).any(axis=1))[0][0])
                raise BadValueError(f"row {b} of the flattened value has no non-zero entry in the one-hot segment "
                                    f"of {at_path('leaf', leaf.path)}; expected a one-hot encoding")
            out.append((first + start).astype(leaf.dtype).reshape(batch, *leaf.shape))
        return out
