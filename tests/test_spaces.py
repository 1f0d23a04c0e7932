"""Tests for trajstore.spaces: JSON round trips, leaves, value conversion, flatten."""

from __future__ import annotations

import json
from collections import OrderedDict

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium.spaces import Box, Dict, Discrete, Graph, MultiBinary, MultiDiscrete, OneOf, Sequence, Text, Tuple

from trajstore.errors import BadValueError, SpaceMismatchError, UnsupportedSpaceError
from trajstore.spaces import Leaf, ValuePlan, flatdim, leaves, space_from_json, space_to_json, subspace

INF = np.inf


def _nested() -> Dict:
    # Deliberately unsorted keys given as a list: the Dict keeps this order.
    return Dict([
        ("pos", Box(-1.0, 1.0, (2, 3), np.float32)),
        ("act", Discrete(4, start=-2)),
        ("md", MultiDiscrete(np.array([[2, 3], [4, 5]]), start=np.array([[0, -1], [3, 0]]))),
        ("mb", MultiBinary((2, 2))),
        ("inner", Tuple((Box(0, 255, (3,), np.uint8), Dict([("z", Discrete(2, start=1)), ("a", Box(-INF, INF, (), np.float64))])))),
    ])


ZOO = {
    "box_f32": Box(-1.0, 1.0, (3,), np.float32),
    "box_inf": Box(-INF, INF, (2, 2), np.float32),
    "box_mixed_f64": Box(np.array([-INF, -0.0, 1e-300, 0.1]), np.array([INF, 0.0, 1e300, 0.30000000000000004]), dtype=np.float64),
    "box_f16": Box(np.array([-1.5, -INF, 0.0009765625], np.float16), np.array([65504.0, 2.0, INF], np.float16), dtype=np.float16),
    "box_half_bounded": Box(np.array([0.0, -INF], np.float32), np.array([INF, 1.0], np.float32), dtype=np.float32),
    "box_u8_img": Box(0, 255, (4, 4, 3), np.uint8),
    "box_i64_inf": Box(-INF, INF, (2,), np.int64),
    "box_i32_half_inf": Box(np.array([-INF, 0.0]), np.array([5.0, INF]), dtype=np.int32),
    "box_i32_arr": Box(np.array([[-5, 0], [1, 2]]), np.array([[5, 9], [7, 3]]), dtype=np.int32),
    "box_bool": Box(0, 1, (3,), np.bool_),
    "box_scalar": Box(-2.0, 3.0, (), np.float64),
    "discrete": Discrete(5),
    "discrete_start": Discrete(4, start=-3),
    "discrete_i32": Discrete(7, start=2, dtype=np.int32),
    "discrete_u8": Discrete(3, dtype=np.uint8),
    "multidiscrete": MultiDiscrete([3, 4, 5]),
    "multidiscrete_2d_start": MultiDiscrete(np.array([[2, 3], [4, 5]]), start=np.array([[-1, 0], [2, -5]])),
    "multidiscrete_i8": MultiDiscrete([100, 100, 100], dtype=np.int8),
    "multibinary": MultiBinary(4),
    "multibinary_2d": MultiBinary((2, 3)),
    "tuple": Tuple((Discrete(3), Box(0.0, 1.0, (2,), np.float32))),
    "nested": _nested(),
    # numpy promotion is not associative: flatten must mirror gymnasium's nesting
    "promo_dict": Dict([("a", Box(-1, 1, (2,), np.int8)), ("b", Tuple((Box(0, 9, (1,), np.uint8), Box(-1, 1, (2,), np.float16))))]),
    "promo_tuple": Tuple((Tuple((Box(-1, 1, (2,), np.int8), Box(0, 9, (1,), np.uint8))), Box(-1, 1, (2,), np.float16))),
    "dict_discrete_mb": Dict([("b", MultiBinary(3)), ("a", Discrete(2, dtype=np.int16))]),
}
JSON_ONLY = {
    "box_u64": Box(0, 2**64 - 1, (2,), np.uint64),
    # one bound per side (decoded from scalars): an int Box unbounded below only, a -0.0 bound
    "box_i64_low_inf": Box(-INF, 5, (3,), np.int64),
    "box_f32_neg_zero": Box(-0.0, 1.0, (2,), np.float32),
    "box_empty": Box(0.0, 1.0, (0, 3), np.float32),
    "multibinary_tuple1": MultiBinary((5,)),
    "box_bigendian": Box(-1.0, 1.0, (2,), np.dtype(">f4")),
}


def assert_same_space(a: gymnasium.Space, b: gymnasium.Space) -> None:
    """Bit-exact comparison (gymnasium's == uses allclose for Box bounds)."""
    assert type(a) is type(b) and a == b
    if isinstance(a, Dict):
        assert list(a.spaces) == list(b.spaces)
        for k in a.spaces:
            assert_same_space(a.spaces[k], b.spaces[k])
    elif isinstance(a, Tuple):
        for x, y in zip(a.spaces, b.spaces, strict=True):
            assert_same_space(x, y)
    elif isinstance(a, Box):
        assert a.dtype == b.dtype and a.shape == b.shape
        for x, y in ((a.low, b.low), (a.high, b.high)):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()  # also -0.0 vs 0.0
        assert np.array_equal(a.bounded_below, b.bounded_below) and np.array_equal(a.bounded_above, b.bounded_above)
    elif isinstance(a, Discrete):
        assert a.dtype == b.dtype and a.n == b.n and a.start == b.start and type(a.start) is type(b.start)
    elif isinstance(a, MultiDiscrete):
        assert a.dtype == b.dtype and np.array_equal(a.nvec, b.nvec) and np.array_equal(a.start, b.start)
        assert a.nvec.dtype == b.nvec.dtype and a.start.dtype == b.start.dtype
    elif isinstance(a, MultiBinary):
        assert a.n == b.n and type(a.n) is type(b.n)


@pytest.mark.parametrize("name", list(ZOO) + list(JSON_ONLY))
def test_json_round_trip_exact(name: str) -> None:
    space = {**ZOO, **JSON_ONLY}[name]
    text = json.dumps(space_to_json(space), allow_nan=False)
    assert "NaN" not in text and "Infinity" not in text
    assert_same_space(space_from_json(json.loads(text)), space)


def test_json_shapes() -> None:
    enc = space_to_json(ZOO["box_f32"])
    assert enc == {"type": "Box", "dtype": "float32", "shape": [3], "low": -1.0, "high": 1.0}
    assert space_to_json(ZOO["box_inf"])["low"] == "-inf"
    assert space_to_json(ZOO["box_mixed_f64"])["low"] == ["-inf", -0.0, 1e-300, 0.1]
    assert [k for k, _ in space_to_json(ZOO["nested"])["spaces"]] == ["pos", "act", "md", "mb", "inner"]


@pytest.mark.parametrize("obj, match", [
    ({"type": "Text", "max_length": 3}, "unknown type 'Text'"),
    ({"type": "Tuple", "spaces": [{"type": "Discrete", "n": 2, "start": 0, "dtype": "int64"}, {"type": "os.system"}]}, "'1'"),
    ({"type": "Box", "dtype": "object", "shape": [1], "low": 0, "high": 1}, "dtype"),
    ({"type": "Box", "dtype": "float32", "shape": [2], "low": [0.0], "high": 1.0}, "shape"),
    ({"type": "Box", "dtype": "float32", "shape": [1], "low": "__import__('os')", "high": 1.0}, "bad number"),
    ({"type": "Discrete", "dtype": "int64", "n": 2.5, "start": 0}, "integers"),
    ({"type": "Dict", "spaces": [["a/b", {"type": "MultiBinary", "n": 2}]]}, "contains '/'"),
    ({"type": "MultiBinary"}, "malformed"),
    ([1, 2], "malformed"),
])
def test_json_bad_input(obj: object, match: str) -> None:
    with pytest.raises(UnsupportedSpaceError, match=match):
        space_from_json(obj)  # type: ignore[arg-type]


@pytest.mark.parametrize("leaves, peak_mib", [
    ([{"type": "Box", "dtype": "uint8", "shape": [10**12], "low": 0, "high": 255}], 1),  # one bound, broadcast
    ([{"type": "Box", "dtype": "int64", "shape": [100_000, 100_000, 3], "low": 0, "high": 1}], 1),
    ([{"type": "MultiDiscrete", "dtype": "int64", "shape": [2**40], "nvec": 2, "start": 0}], 1),
    # each leaf under the bound, together past it: the first is built (its bounds, flags and
    # gymnasium's copies of them: a few bytes per element), the second refused
    ([{"type": "Box", "dtype": "uint8", "shape": [2**26 + 1], "low": 0, "high": 1}] * 2, 8 * 2**26 >> 20),
])
def test_json_space_past_the_element_bound_is_refused_before_allocating(leaves: list, peak_mib: int) -> None:
    """A stored space is input: a shape it claims never sizes an allocation past
    MAX_SPACE_ELEMENTS (gymnasium would hold full bound arrays: 931 GiB for the first case)."""
    import tracemalloc

    obj = {"type": "Tuple", "spaces": leaves}
    tracemalloc.start()
    try:
        with pytest.raises(UnsupportedSpaceError, match="elements in all"):
            space_from_json(obj)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < peak_mib << 20, peak


@pytest.mark.parametrize("space, match", [
    (Text(5), r"^space is Text; trajstore stores Box"),
    (Dict(obs=Tuple((Discrete(2), Box(0, 1), Dict(text=Text(3))))), r"space at 'obs/2/text' is Text"),
    (Tuple((Discrete(2), Sequence(Discrete(2)))), r"space at '1' is Sequence"),
    (Dict(g=Graph(Box(0, 1, (2,)), Discrete(2))), r"space at 'g' is Graph"),
    (Dict(o=OneOf((Discrete(2), Discrete(3)))), r"space at 'o' is OneOf"),
    (Dict(a=Dict()), r"space at 'a' is an empty Dict"),
    (Dict({"a/b": Discrete(2)}), r"Dict key 'a/b' in space contains '/'"),
    (Dict(x=Dict({"": Discrete(2)})), r"Dict key '' in space at 'x' is empty"),
    (Dict({"__meta": Discrete(2)}), r"starts with '__' or '.'"),
    (Dict({".zattrs": Discrete(2)}), r"starts with '__' or '.'"),
    (Dict({3: Discrete(2)}), r"Dict key 3 in space is not a str"),
])
def test_unsupported_spaces(space: gymnasium.Space, match: str) -> None:
    for fn in (leaves, space_to_json, flatdim, ValuePlan):
        with pytest.raises(UnsupportedSpaceError, match=match):
            fn(space)


def test_leaves() -> None:
    ls = leaves(ZOO["nested"])
    assert [leaf.name for leaf in ls] == ["pos", "act", "md", "mb", "inner/0", "inner/1/z", "inner/1/a"]
    assert [leaf.path for leaf in ls][4:6] == [("inner", 0), ("inner", 1, "z")]
    assert [leaf.shape for leaf in ls] == [(2, 3), (), (2, 2), (2, 2), (3,), (), ()]
    assert [leaf.dtype for leaf in ls] == [np.dtype(t) for t in ("float32", "int64", "int64", "int8", "uint8", "int64", "float64")]
    assert [leaf.flat_dim for leaf in ls] == [6, 4, 14, 4, 3, 2, 1]
    assert flatdim(ZOO["nested"]) == gymnasium.spaces.flatdim(ZOO["nested"]) == 34
    root = leaves(ZOO["discrete"])
    assert root == [Leaf((), "", ZOO["discrete"], (), np.dtype(np.int64), 5)]


def test_subspace() -> None:
    s = ZOO["nested"]
    assert subspace(s, ["inner", 1, "z"]) == Discrete(2, start=1)
    assert subspace(s, "inner/1/z") == Discrete(2, start=1)
    assert subspace(s, []) is s and subspace(s, "") is s
    with pytest.raises(SpaceMismatchError, match=r"space at 'inner/1' has no key 'q'; available keys: \['z', 'a'\]"):
        subspace(s, ["inner", 1, "q"])
    with pytest.raises(SpaceMismatchError, match=r"has no index 2; available indices: \[0, 1\]"):
        subspace(s, ["inner", 2])
    with pytest.raises(SpaceMismatchError, match=r"space at 'pos' is Box, which has no key 'x'"):
        subspace(s, ["pos", "x"])


# ---------------------------------------------------------------- to_arrays


def test_to_arrays_unbatched_mixed_inputs() -> None:
    plan = ValuePlan(ZOO["nested"])
    value = {
        "pos": torch.ones(2, 3, dtype=torch.float64, requires_grad=True),  # float64 → float32 allowed
        "act": 1,  # Python int (Discrete(4, start=-2))
        "md": [[1, 1], [3, 4]],  # nested list
        "mb": np.array([[True, False], [False, True]]),  # bool → int8 is safe
        "inner": [np.array([1, 2, 3], np.int64), OrderedDict(a=np.float32(0.5), z=np.int8(1))],  # key order irrelevant
    }
    arrays, b = plan.to_arrays(value, batched=False)
    assert b == 1
    for leaf, arr in zip(plan.leaves, arrays, strict=True):
        assert arr.shape == (1, *leaf.shape) and arr.dtype == leaf.dtype
    assert arrays[0].sum() == 6 and arrays[1][0] == 1 and arrays[4].tolist() == [[1, 2, 3]]
    back = plan.from_arrays(arrays)
    assert list(back) == ["pos", "act", "md", "mb", "inner"] and isinstance(back["inner"], tuple)
    assert list(back["inner"][1]) == ["z", "a"]


def test_to_arrays_batched_and_views() -> None:
    plan = ValuePlan(ZOO["tuple"])
    disc = np.array([0, 1, 2, 1])
    box = np.zeros((4, 2), np.float32)
    arrays, b = plan.to_arrays((disc, box), batched=True)
    assert b == 4 and arrays[0] is disc and arrays[1] is box  # same dtype: no copy
    arrays, b = plan.to_arrays([torch.tensor([1, 2]), torch.zeros(2, 2)], batched=True)
    assert b == 2 and arrays[0].dtype == np.int64 and arrays[1].dtype == np.float32
    arrays, b = plan.to_arrays((disc[:0], box[:0]), batched=True)
    assert b == 0 and arrays[1].shape == (0, 2)


def test_root_leaf_values() -> None:
    plan = ValuePlan(Box(0, 255, (2,), np.uint8))
    arrays, _ = plan.to_arrays([3, 200], batched=False)  # int64 values that fit
    assert arrays[0].dtype == np.uint8 and arrays[0].tolist() == [[3, 200]]
    assert plan.from_arrays(arrays) is arrays[0]
    plan = ValuePlan(Discrete(5))
    assert plan.to_arrays(np.int32(4), batched=False)[0][0].tolist() == [4]
    assert plan.to_arrays(4, batched=False)[0][0].tolist() == [4]
    with pytest.raises(BadValueError, match=r"^value is 9; expected an integer in \[0, 4\] \(Discrete\(5\)\)$"):
        plan.to_arrays(9, batched=False)  # ranges are checked (tests/test_value_checks.py)
    t = torch.tensor([1, 2, 3])
    assert plan.from_arrays([t]) is t


@pytest.mark.parametrize("space, value, batched, err, match", [
    (_nested(), {"pos": 0}, False, SpaceMismatchError, r"value: expected keys \['pos', 'act', 'md', 'mb', 'inner'\], got missing \['act', 'md', 'mb', 'inner'\]"),
    (Dict(a=Discrete(2)), {"a": 1, "b": 2}, False, SpaceMismatchError, r"unexpected \['b'\]"),
    (Dict(a=Discrete(2)), [1], False, SpaceMismatchError, r"expected a Mapping with keys \['a'\] for a Dict space, got list"),
    (Dict(a=Tuple((Discrete(2), Discrete(2)))), {"a": (1,)}, False, SpaceMismatchError, r"value at 'a': expected a tuple or list of length 2, got length 1"),
    (Dict(a=Tuple((Discrete(2),))), {"a": np.array([1])}, False, SpaceMismatchError, r"got ndarray"),
    (Dict(a=Discrete(2)), {"a": {"x": 1}}, False, SpaceMismatchError, r"value at 'a': expected an array for a leaf, got a dict"),
    (Dict(obs=Box(0, 1, (17,))), {"obs": np.zeros((3, 16))}, True, BadValueError, r"value at 'obs' has shape \(3, 16\); expected \(B, 17\) = \(3, 17\)"),
    (Dict(obs=Box(0, 1, (17,))), {"obs": np.zeros(17)}, True, BadValueError, r"has shape \(17,\); expected \(B, 17\) = \(17, 17\)"),
    (Dict(obs=Box(0, 1, (17,))), {"obs": np.zeros((1, 17))}, False, BadValueError, r"value at 'obs' has shape \(1, 17\); expected \(17,\)"),
    (Discrete(3), 1, True, BadValueError, r"^value has shape \(\); expected \(B,\)$"),
    (Tuple((Discrete(3), Box(0, 1, (2,)))), ([0, 1], np.zeros((3, 2))), True, BadValueError, r"value at '1' has batch size 3; expected 2 \(the batch size of value at '0'\)"),
    (Box(0, 255, (1,), np.uint8), [300], False, BadValueError, r"^value element \[0\] is 300; expected a value within the range of uint8 \[0, 255\] \(got int64\)$"),
    (Box(0, 255, (1,), np.uint8), [-1], False, BadValueError, r"range of uint8"),
    (Discrete(3), 1.5, False, BadValueError, r"^value is 1.5; expected a whole number for an integer field of dtype int64"),
    (Box(0, 1, (1,)), np.array([1j]), False, BadValueError, r"complex128; expected float32"),
    (Box(0, 1, (1,), np.bool_), [1], False, BadValueError, r"int64; expected bool"),
    (Box(0, 1, (2,)), ["a", "b"], False, BadValueError, r"<U1"),
    (Box(0, 1, (2,)), [[1.0], [1.0, 2.0]], False, BadValueError, r"not array-like"),
    (Box(0, 1, (2,)), torch.zeros(2, dtype=torch.bfloat16), False, BadValueError, r"torch.bfloat16"),
])
def test_to_arrays_errors(space, value, batched, err, match) -> None:
    with pytest.raises(err, match=match):
        ValuePlan(space).to_arrays(value, batched=batched)


def test_casting_rule() -> None:
    plan = ValuePlan(Box(-100, 100, (2,), np.int8))
    assert plan.to_arrays(np.array([-100, 100], np.int64), batched=False)[0][0].dtype == np.int8
    assert plan.to_arrays(np.array([True, False]), batched=False)[0][0].tolist() == [[1, 0]]
    assert plan.to_arrays(np.array([0.0, 1.0], np.float32), batched=False)[0][0].tolist() == [[0, 1]]  # whole floats
    with pytest.raises(BadValueError):
        plan.to_arrays(np.array([0.0, 1.5], np.float32), batched=False)
    plan = ValuePlan(Box(0, 1, (2,), np.float16))
    assert plan.to_arrays(np.array([0.5, 1.0]), batched=False)[0][0].dtype == np.float16
    assert plan.to_arrays(np.array([1, 2], np.int64), batched=False)[0][0].dtype == np.float16  # int→float allowed
    assert ValuePlan(Box(0, 1, (2,))).to_arrays([0, 1], batched=False)[0][0].dtype == np.float32


# ---------------------------------------------------------------- flatten / unflatten


def _samples(space: gymnasium.Space, n: int = 6) -> list:
    space.seed(123)
    return [space.sample() for _ in range(n)]


@pytest.mark.parametrize("name", list(ZOO))
def test_flatten_matches_gymnasium(name: str) -> None:
    space = ZOO[name]
    plan = ValuePlan(space)
    samples = _samples(space)
    rows = [plan.to_arrays(s, batched=False)[0] for s in samples]
    arrays = [np.concatenate(parts) for parts in zip(*rows, strict=True)]
    flat = plan.flatten(arrays)
    expected = np.stack([gymnasium.spaces.flatten(space, s) for s in samples])
    assert flat.dtype == expected.dtype == plan.flat_dtype
    assert flat.shape == (len(samples), gymnasium.spaces.flatdim(space))
    assert np.array_equal(flat, expected)

    back = plan.unflatten(flat)
    for leaf, arr, orig in zip(plan.leaves, back, arrays, strict=True):
        assert arr.dtype == leaf.dtype and arr.shape == orig.shape
        assert np.array_equal(arr, orig)
    for b, row in enumerate(expected):
        ref = plan.to_arrays(gymnasium.spaces.unflatten(space, row), batched=False)[0]
        assert all(np.array_equal(r[0], a[b]) for r, a in zip(ref, back, strict=True))
    # torch inputs work too
    assert np.array_equal(plan.flatten([torch.from_numpy(a) for a in arrays]), expected)
    assert np.array_equal(plan.unflatten(torch.from_numpy(flat)).pop(), back[-1])


def test_flatten_dtypes() -> None:
    # one Discrete (int64 one-hot) turns a float32 observation into float64
    assert ValuePlan(Dict(a=Box(0, 1, (2,)), b=Discrete(2))).flat_dtype == np.float64
    assert ValuePlan(Tuple((Box(0, 255, (2,), np.uint8), MultiBinary(2)))).flat_dtype == np.int16
    assert ValuePlan(ZOO["promo_dict"]).flat_dtype == np.float16
    assert ValuePlan(ZOO["promo_tuple"]).flat_dtype == np.float32


def test_flatten_errors() -> None:
    plan = ValuePlan(Dict(a=Discrete(3, start=1), b=Box(0, 1, (2,))))
    with pytest.raises(BadValueError, match=r"value at 'a' row 1 has 0; expected a value in \[1, 4\) to one-hot encode"):
        plan.flatten([np.array([1, 0]), np.zeros((2, 2))])
    with pytest.raises(SpaceMismatchError, match="expected 2 arrays"):
        plan.flatten([np.array([1])])
    with pytest.raises(BadValueError, match="batch size"):
        plan.flatten([np.array([1]), np.zeros((2, 2))])


def test_unflatten_errors() -> None:
    plan = ValuePlan(Dict(a=Discrete(3), b=Box(0, 1, (2,))))
    assert plan.flat_dim == 5
    with pytest.raises(BadValueError, match="expected flattened width 5, got 4"):
        plan.unflatten(np.zeros((2, 4)))
    with pytest.raises(BadValueError, match=r"has shape \(5,\); expected \(B, 5\)"):
        plan.unflatten(np.zeros(5))
    with pytest.raises(BadValueError, match="dtype <U1"):
        plan.unflatten(np.full((1, 5), "x"))
    with pytest.raises(BadValueError, match="row 1 .* segment of leaf at 'a'"):
        plan.unflatten(np.array([[0, 1, 0, 0.5, 0.5], [0, 0, 0, 0.5, 0.5]]))


def test_to_arrays_is_cheap() -> None:
    import time

    plan = ValuePlan(ZOO["nested"])
    value = _samples(ZOO["nested"], 1)[0]
    plan.to_arrays(value, batched=False)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        plan.to_arrays(value, batched=False)
    per_leaf = (time.perf_counter() - t0) / n / len(plan.leaves)
    assert per_leaf < 20e-6  # generous bound; typically ~1-2 µs per leaf
