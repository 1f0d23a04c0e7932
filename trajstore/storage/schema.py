"""Checking what a store says about itself before any of it is used (docs/design.md 3, invariant 7).

A store on disk is input.  Its root attributes (the schema), each array's ``zarr.json`` and the
commit record name paths, shapes, dtypes, chunk sizes and row counts; trajstore turns those into
file names, address-space reservations and loops.  This module checks them, against each other
and against plausible bounds, so that a tampered or damaged store raises a
:mod:`trajstore.errors` type (naming the store, the key and the problem) instead of touching a
file outside the store, allocating without bound, or failing deep inside numpy or zarr:

- :func:`load_json`: a metadata file's bytes as JSON (bounded nesting, strict numbers);
- :func:`check_schema`: the ``trajstore`` root attributes, down to every field, checked against
  the spaces they were derived from;
- (:mod:`trajstore.storage.array_meta`: each array's zarr metadata against its field;)
- :func:`check_head_tables` / :func:`check_pending`: a commit record against the schema.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from trajstore.errors import DamagedStoreError, FormatVersionError, NotATrajstoreError
from trajstore.storage.keys import FORMAT_VERSION, HEAD_KEY

__all__ = [
    "MAX_INT", "MAX_ROW_ELEMENTS", "MAX_CHUNK_BYTES", "MAX_CHUNKS", "MAX_ARRAY_BYTES", "MAX_FIELDS", "MAX_DEPTH",
    "FieldSchema", "TableSchema", "load_json", "check_schema", "check_head_tables", "check_pending", "check_int",
    "check_allocation", "as_dict", "as_list", "name_value", "ALLOWED_DTYPES", "DTYPE_NAMES",
]

# -- plausibility bounds ------------------------------------------------------------------------
#: Any count, row number or generation (JSON allows arbitrarily large integers).
MAX_INT = 1 << 62
#: Elements of one row of one field (1080p RGB frames are 6.2 M); bounds what decoding a Box's
#: bounds allocates, too.
MAX_ROW_ELEMENTS = 1 << 23
#: Bytes of one chunk (the default chunk is 1 MiB); a chunk is decoded whole into RAM.
MAX_CHUNK_BYTES = 1 << 29
#: Chunks of one array (the bitmap of mapped chunks and verify's work grow with it).
MAX_CHUNKS = 1 << 22
#: Bytes of one array (its allocated rows): the address range a raw field reserves.
MAX_ARRAY_BYTES = 1 << 46
#: Fields (arrays) of one store.
MAX_FIELDS = 4096
#: Nesting of JSON objects and lists in any metadata file.
MAX_DEPTH = 64

#: The plain numeric and boolean dtypes a field may have (as the schema and zarr spell them).
ALLOWED_DTYPES = {np.dtype(t) for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                        "uint64", "float16", "float32", "float64")}
DTYPE_NAMES = {n: d for d in ALLOWED_DTYPES for n in (d.name, d.str.lstrip("<>|="), d.str)}

_KINDS = {"ReplayBuffer": ("step_data",), "TrajectoryReplayBuffer": ("step_data", "episode_data")}
_STAGING_PREFIX = re.compile(r"\.trajstore-staging/([0-9]{1,19})\Z")
_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")


def name_value(v: Any) -> str:
    """``repr(v)`` cut to 80 characters, for messages quoting what a store holds."""
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(v: Any) -> str:
    return "null" if v is None else {bool: "bool", int: "int", float: "float", str: "str", list: "list",
                                     dict: "object"}.get(type(v), type(v).__name__)


def check_int(v: Any, what: str, where: str, lo: int = 0, hi: int = MAX_INT) -> int:
    """``v`` as an int in ``[lo, hi)``; a bool, float or string is refused (JSON says what it is)."""
    if type(v) is not int:
        raise DamagedStoreError(f"{where}: {what} is {name_value(v)} ({_type_name(v)}); expected an integer")
    if not lo <= v < hi:
        raise DamagedStoreError(f"{where}: {what} is {name_value(v)}; expected an integer in [{lo}, {hi})")
    return v


def as_dict(v: Any, what: str, where: str) -> dict[str, Any]:
    """``v``, checked to be a JSON object (DamagedStoreError naming ``what`` at ``where``)."""
    if not isinstance(v, dict):
        raise DamagedStoreError(f"{where}: {what} is {name_value(v)} ({_type_name(v)}); expected a JSON object")
    return v


def as_list(v: Any, what: str, where: str, max_len: int) -> list[Any]:
    """``v``, checked to be a JSON list of at most ``max_len`` entries."""
    if not isinstance(v, list):
        raise DamagedStoreError(f"{where}: {what} is {name_value(v)} ({_type_name(v)}); expected a JSON list")
    if len(v) > max_len:
        raise DamagedStoreError(f"{where}: {what} has {len(v)} entries; at most {max_len} are plausible")
    return v


def _depth_exceeds(obj: Any, limit: int) -> bool:
    """Whether ``obj`` nests lists/objects deeper than ``limit`` (level by level: no recursion;
    one comprehension per level, 4x faster than a stack of (value, depth) pairs on a root
    ``zarr.json`` with consolidated metadata)."""
    level = [obj] if type(obj) is dict or type(obj) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [v for o in level for v in (o.values() if type(o) is dict else o)
                 if type(v) is dict or type(v) is list]
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def load_json(raw: bytes, where: str, key: str, *, strict_numbers: bool = False) -> Any:
    """Parse a metadata file: refuse invalid UTF-8/JSON, nesting deeper than :data:`MAX_DEPTH`
    (never a ``RecursionError``) and, with ``strict_numbers``, ``NaN``/``Infinity``.

    Raises
    ------
    DamagedStoreError
        Naming ``where`` (the store), ``key`` and the problem.
    """
    try:
        obj = json.loads(raw, parse_constant=_no_constant if strict_numbers else None)
    except RecursionError:
        raise DamagedStoreError(f"{where}: {key} nests JSON deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DamagedStoreError(f"{where}: {key} is not valid JSON ({type(e).__name__}: {e})") from None
    # Nesting is at most the number of '[' and '{' (more where strings hold some): counting them
    # in C spares metadata files of ordinary depth the walk, which costs twice the parse.
    brackets = raw.count(b"[") + raw.count(b"{") if isinstance(raw, bytes) else MAX_DEPTH + 1
    if brackets > MAX_DEPTH and _depth_exceeds(obj, MAX_DEPTH):
        raise DamagedStoreError(f"{where}: {key} nests JSON deeper than {MAX_DEPTH} levels")
    return obj


# -- the schema -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FieldSchema:
    """One field of a table, checked: ``path`` inside its table's folder, a plausible shape."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_rows: int
    layout: str

    @property
    def row_bytes(self) -> int:
        """Uncompressed bytes of one row (``shape`` is the row shape)."""
        return math.prod(self.shape) * self.dtype.itemsize

    def chunk_count(self, rows: int) -> int:
        """Chunks that ``rows`` rows from row 0 span: ``ceil(rows / chunk_rows)``."""
        return -(-rows // self.chunk_rows)


@dataclass(frozen=True)
class TableSchema:
    """One table of the schema, checked: its ``name``, ring ``capacity`` (None: unbounded) and
    ``fields`` in stored order."""

    name: str
    capacity: int | None
    fields: tuple[FieldSchema, ...]


def check_dtype(v: Any, what: str, where: str) -> np.dtype:
    """The numpy dtype named ``v`` (``"float32"``, ``"<f4"``...), one of :data:`ALLOWED_DTYPES`.

    Raises
    ------
    DamagedStoreError
        ``v`` names no allowed dtype; the message names ``where`` and ``what``.
    """
    if not isinstance(v, str) or v not in DTYPE_NAMES:
        raise DamagedStoreError(f"{where}: {what} is {name_value(v)}; expected one of the plain dtypes "
                                f"{sorted(d.name for d in ALLOWED_DTYPES)}")
    return DTYPE_NAMES[v]


def check_shape(v: Any, what: str, where: str) -> tuple[int, ...]:
    """A row shape: a list of at most 31 non-negative ints whose product is plausible."""
    dims = tuple(check_int(d, f"{what}[{i}]", where) for i, d in enumerate(as_list(v, what, where, 31)))
    n = 1
    for d in dims:
        n *= d
        if n > MAX_ROW_ELEMENTS:
            raise DamagedStoreError(f"{where}: {what} {list(dims)} has more than {MAX_ROW_ELEMENTS} elements per row; "
                                    "not a plausible row shape")
    return dims


def check_field_path(path: Any, table: str, kind: str, where: str) -> str:
    """A field's array path: inside the table's own folder, no empty/``.``/``..`` parts, no hidden or
    reserved names (``.``/``__`` prefixes, ``zarr.json``), no control characters."""
    if not isinstance(path, str) or not path or len(path) > 1024:
        raise DamagedStoreError(f"{where}: field path {name_value(path)} of table {table!r} is not a non-empty string")
    parts = path.split("/")
    bad = [p for p in parts if not p or p in (".", "..") or p.startswith((".", "__")) or p == "zarr.json"
           or _BAD_CHARS.search(p) or len(p) > 255]
    own = path == table or path.startswith(table + "/") or (
        kind == "TrajectoryReplayBuffer" and table == "step_data" and path == "step_episode_ids")
    if bad or path.startswith("/") or not own:
        raise DamagedStoreError(f"{where}: field path {path!r} of table {table!r} is not a valid array path inside the "
                                f"table's folder (expected '{table}' or '{table}/<leaf path>', no empty, '.', '..', "
                                "hidden or reserved parts)")
    return path


def _check_field(fj: Any, table: str, kind: str, capacity: int | None, where: str, i: int) -> FieldSchema:
    what = f"table {table!r} field {i}"
    fj = as_dict(fj, what, where)
    for k in ("path", "shape", "dtype", "chunk_rows", "layout"):
        if k not in fj:
            raise DamagedStoreError(f"{where}: {what} has no {k!r}")
    path = check_field_path(fj["path"], table, kind, where)
    what = f"field {path!r}"
    shape = check_shape(fj["shape"], f"{what} shape", where)
    dtype = check_dtype(fj["dtype"], f"{what} dtype", where)
    chunk_rows = check_int(fj["chunk_rows"], f"{what} chunk_rows", where, 1)
    layout = fj["layout"]
    if layout not in ("raw", "compressed", "image", "video"):
        raise DamagedStoreError(f"{where}: {what} layout is {name_value(layout)}; expected 'raw', 'compressed', "
                                "'image' or 'video'")
    f = FieldSchema(path, shape, dtype, chunk_rows, layout)
    if chunk_rows * max(f.row_bytes, 1) > MAX_CHUNK_BYTES:
        raise DamagedStoreError(f"{where}: {what} chunks of {chunk_rows} rows x {f.row_bytes} bytes exceed "
                                f"{MAX_CHUNK_BYTES} bytes; not a plausible chunk size")
    if capacity is not None:
        check_allocation(f, capacity, where)
    return f


def check_allocation(f: FieldSchema, rows: int, where: str, what: str = "allocates") -> None:
    """``rows`` allocated rows of ``f`` fit the plausibility bounds (chunk count, bytes)."""
    if f.chunk_count(rows) > MAX_CHUNKS or rows * f.row_bytes > MAX_ARRAY_BYTES:
        raise DamagedStoreError(f"{where}: {f.path} {what} {rows} rows of {f.chunk_rows} per chunk and {f.row_bytes} "
                                f"bytes each: more than {MAX_CHUNKS} chunks or {MAX_ARRAY_BYTES} bytes; not plausible")


def _check_version(attrs: dict[str, Any], where: str) -> None:

    if "format_version" not in attrs:
        raise DamagedStoreError(f"{where}: the trajstore attributes have no format_version")
    version = attrs["format_version"]
    if type(version) is not int:
        raise DamagedStoreError(f"{where}: format_version is {name_value(version)} ({_type_name(version)}); "
                                "expected an integer")
    if version > FORMAT_VERSION:
        raise FormatVersionError(f"{where}: format version {version} is newer than this trajstore reads "
                                 f"({FORMAT_VERSION}); upgrade trajstore")
    if version < 1:
        raise DamagedStoreError(f"{where}: format_version is {version}; expected 1 to {FORMAT_VERSION}")


def check_schema(attrs: Any, where: str) -> dict[str, TableSchema]:
    """Check the ``trajstore`` root attributes and return the tables they describe.

    Checked: ``format_version`` (an int, 1 to the newest known), ``kind``, the table names the kind
    allows, every field (:func:`check_field_path`, shape, dtype, chunk rows, layout, plausible
    sizes), that field paths are unique and none lies inside another, and that the fields are
    exactly the leaves of the stored ``spaces`` (paths, shapes and dtypes, in order), so that a
    buffer reads and writes each leaf into an array of the right shape.

    Raises
    ------
    NotATrajstoreError
        ``attrs`` is not an object (a zarr group without trajstore attributes).
    FormatVersionError
        A newer format than this trajstore reads.
    DamagedStoreError
        Anything malformed, inconsistent or implausible (the message names the value).
    """
    if not isinstance(attrs, dict):
        raise NotATrajstoreError(f"{where}: a zarr group, but not a trajstore store (no 'trajstore' attribute)")
    _check_version(attrs, where)
    if _depth_exceeds(attrs, MAX_DEPTH):
        raise DamagedStoreError(f"{where}: the trajstore attributes nest deeper than {MAX_DEPTH} levels")
    kind = attrs.get("kind")
    if not isinstance(kind, str) or kind not in _KINDS:
        raise DamagedStoreError(f"{where}: kind is {name_value(kind)}; expected one of {', '.join(_KINDS)}")
    tables_j = as_dict(attrs.get("tables"), "tables", where)
    if "step_data" not in tables_j or any(t not in _KINDS[kind] for t in tables_j):
        raise DamagedStoreError(f"{where}: a {kind} has tables {' and '.join(_KINDS[kind])} (step_data required); "
                                f"the schema names {sorted(map(str, tables_j))}")
    tables: dict[str, TableSchema] = {}
    n_fields = 0
    for name, tj in tables_j.items():
        tj = as_dict(tj, f"table {name!r}", where)
        if "capacity" not in tj or "fields" not in tj:
            raise DamagedStoreError(f"{where}: table {name!r} needs 'capacity' and 'fields'")
        cap = tj["capacity"]
        capacity = None if cap is None else check_int(cap, f"table {name!r} capacity", where, 1)
        fields_j = as_list(tj["fields"], f"table {name!r} fields", where, MAX_FIELDS)
        if not fields_j:
            raise DamagedStoreError(f"{where}: table {name!r} has no fields")
        n_fields += len(fields_j)
        if n_fields > MAX_FIELDS:
            raise DamagedStoreError(f"{where}: more than {MAX_FIELDS} fields; not plausible")
        fields = tuple(_check_field(fj, name, kind, capacity, where, i) for i, fj in enumerate(fields_j))
        tables[name] = TableSchema(name, capacity, fields)
    paths = sorted(f.path for t in tables.values() for f in t.fields)
    for a, b in zip(paths, paths[1:]):
        if b == a or b.startswith(a + "/"):
            raise DamagedStoreError(f"{where}: field paths {a!r} and {b!r} collide (one array inside another)")
    _check_spaces(attrs, kind, tables, where)
    return tables


# -- spaces against fields ------------------------------------------------------------------------
def _space_dtype(o: dict[str, Any], kinds: str, what: str, where: str, default: str | None = None) -> np.dtype:
    """A leaf space's dtype (byte order dropped: arrays are little-endian), one of the plain ones."""
    name = o.get("dtype", default)
    try:
        dt = np.dtype(name) if isinstance(name, str) and len(name) <= 16 else None
    except TypeError:
        dt = None
    plain = None if dt is None or dt.kind not in kinds else DTYPE_NAMES.get(dt.str.lstrip("<>|="))
    if plain is None:
        raise DamagedStoreError(f"{where}: {what} dtype is {name_value(name)}; expected a plain dtype of kind {kinds!r}")
    return plain


def _positive_ints(v: Any, what: str, where: str) -> None:
    """Every number in ``v`` (a number or nested lists of them) is an int >= 1 (gymnasium asserts it)."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(x)
        elif type(x) is not int or x < 1:
            raise DamagedStoreError(f"{where}: {what} holds {name_value(x)}; expected integers >= 1")


def _space_leaves(space: Any, where: str) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """``(leaf name, row shape, dtype)`` of every leaf of a space JSON (``space_to_json``), in
    ``trajstore.spaces.leaves`` order, read from the JSON alone: no bounds array is built, and
    nesting is walked without recursion.  Parameters gymnasium asserts on are checked too."""
    out: list[tuple[str, tuple[int, ...], np.dtype]] = []
    stack: list[tuple[Any, str]] = [(space, "")]
    while stack:
        o, name = stack.pop()
        what = f"space {'at ' + repr(name) if name else '(root)'}"
        if not isinstance(o, dict) or not isinstance(o.get("type"), str):
            raise DamagedStoreError(f"{where}: {what} is {name_value(o)}; expected an object with a string 'type'")
        t = o["type"]
        if t in ("Dict", "Tuple"):
            subs = o.get("spaces")
            if t == "Dict" and isinstance(subs, dict):
                subs = list(subs.items())
            subs = as_list(subs, f"{what} spaces", where, MAX_FIELDS)
            if not subs:
                raise DamagedStoreError(f"{where}: {what} is an empty {t}")
            children = []
            for i, sub in enumerate(subs):
                if t == "Dict":
                    if not (isinstance(sub, (list, tuple)) and len(sub) == 2):
                        raise DamagedStoreError(f"{where}: {what} entries must be [key, space] pairs; got {name_value(sub)}")
                    key, sub = sub
                    if not isinstance(key, str) or not key or "/" in key or key.startswith(("__", ".")) \
                            or _BAD_CHARS.search(key) or key == "zarr.json":
                        raise DamagedStoreError(f"{where}: {what} has Dict key {name_value(key)}; keys are non-empty "
                                                "strings without '/' that do not start with '__' or '.'")
                else:
                    key = str(i)
                children.append((sub, f"{name}/{key}" if name else key))
            stack.extend(reversed(children))  # depth-first, in order
        elif t == "Box":
            out.append((name, check_shape(o.get("shape"), f"{what} shape", where), _space_dtype(o, "biuf", what, where)))
        elif t == "Discrete":
            check_int(o.get("n"), f"{what} n", where, 1)
            check_int(o.get("start", 0), f"{what} start", where, -MAX_INT)
            out.append((name, (), _space_dtype(o, "iu", what, where, "int64")))
        elif t == "MultiDiscrete":
            shape = check_shape(o.get("shape"), f"{what} shape", where)
            _positive_ints(o.get("nvec"), f"{what} nvec", where)
            out.append((name, shape, _space_dtype(o, "iu", what, where)))
        elif t == "MultiBinary":
            n = o.get("n")
            shape = check_shape([n] if type(n) is int else n, f"{what} n", where)
            _positive_ints(list(shape), f"{what} n", where)
            out.append((name, shape, np.dtype(np.int8)))
        else:
            raise DamagedStoreError(f"{where}: {what} has type {name_value(t)}; trajstore stores Box, Discrete, "
                                    "MultiDiscrete, MultiBinary, Dict and Tuple")
    return out


def _expected_fields(kind: str, table: str, space: Any, where: str) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(path, shape, dtype) of each field a buffer of ``kind`` stores for ``space`` in ``table``
    (as replay_buffer._table_spec and trajectory._field_paths / _specs lay them out)."""
    out = []
    root_leaf = "value" if table == "episode_data" else None
    for name, shape, dtype in _space_leaves(space, where):
        path = f"{table}/{name}" if name else (f"{table}/{root_leaf}" if root_leaf else table)
        out.append((path, shape, dtype))
    if kind == "TrajectoryReplayBuffer":
        ids = "step_episode_ids" if table == "step_data" else "episode_data/_episode_id"
        out.append((ids, (), np.dtype(np.int64)))
    return out


def _check_spaces(attrs: dict[str, Any], kind: str, tables: dict[str, TableSchema], where: str) -> None:
    """The stored spaces are well formed and their leaves are exactly the tables' fields.  (The
    buffer decodes the spaces itself, bounds included: ``trajstore.spaces.space_from_json``.)"""
    spaces = as_dict(attrs.get("spaces"), "spaces", where)
    if set(spaces) != set(tables):
        raise DamagedStoreError(f"{where}: spaces are given for {sorted(map(str, spaces))}; the tables are "
                                f"{sorted(tables)}")
    for name, t in tables.items():
        want = _expected_fields(kind, name, spaces[name], where)
        have = [(f.path, f.shape, f.dtype) for f in t.fields]
        if have != want:
            diff = next(((h, w) for h, w in zip(have, want) if h != w), (have[len(want):] or None, want[len(have):] or None))
            raise DamagedStoreError(f"{where}: the fields of table {name!r} do not match its space: stored "
                                    f"{_fmt_field(diff[0])}, the space gives {_fmt_field(diff[1])}")


def _fmt_field(f: Any) -> str:
    if isinstance(f, tuple) and len(f) == 3 and isinstance(f[0], str):
        return f"{f[0]} {list(f[1])} {np.dtype(f[2]).name}"
    return "nothing" if not f else ", ".join(_fmt_field(x) for x in f)


# -- commit record against the schema --------------------------------------------------------------
def check_head_tables(head: Any, tables: Mapping[str, TableSchema], where: str) -> None:
    """The commit record ``head`` (a parsed :class:`trajstore.storage.head.Head`) covers every table, each
    with a plausible allocation (a ring: exactly its capacity; unbounded: rows start at 0) and a
    pending rewrite that names only fields and chunks of this store (:func:`check_pending`)."""

    for name, t in tables.items():
        st = head.tables.get(name)
        if st is None:
            raise DamagedStoreError(f"{where}: the commit record {HEAD_KEY} has no entry for table {name!r}")
        if t.capacity is not None and st.allocated != t.capacity:
            raise DamagedStoreError(f"{where}: {HEAD_KEY} allocates {st.allocated} rows to table {name!r}, a ring of "
                                    f"capacity {t.capacity}")
        if t.capacity is None and st.end > st.allocated:
            raise DamagedStoreError(f"{where}: {HEAD_KEY} commits rows up to {st.end} of table {name!r} but allocates "
                                    f"only {st.allocated}")
        for f in t.fields:
            check_allocation(f, st.allocated, where)
    check_pending(head.pending, tables, {n: st.allocated for n, st in head.tables.items()}, where)


def check_pending(pending: Any, tables: Mapping[str, TableSchema], allocated: Mapping[str, int], where: str) -> None:
    """A pending rewrite names ``.trajstore-staging/<int>`` and, per field path of this store, a
    list of distinct chunk numbers below the field's allocation (``allocated`` rows per table)."""

    if pending is None:
        return
    what = f"{HEAD_KEY} pending"
    pending = as_dict(pending, what, where)
    prefix = pending.get("prefix")
    if not isinstance(prefix, str) or not _STAGING_PREFIX.match(prefix):
        raise DamagedStoreError(f"{where}: {what} prefix is {name_value(prefix)}; expected '.trajstore-staging/<int>'")
    chunks = as_dict(pending.get("chunks"), f"{what} chunks", where)
    fields = {f.path: (t, f) for t in tables.values() for f in t.fields}
    for path, ks in chunks.items():
        if path not in fields:
            raise DamagedStoreError(f"{where}: {what} names {name_value(path)}, which is not a field of this store")
        t, f = fields[path]
        n = f.chunk_count(allocated.get(t.name, 0))
        ks = as_list(ks, f"{what} chunks of {path!r}", where, n)
        for k in ks:
            check_int(k, f"{what} chunk number of {path!r}", where, 0, n)
        if len(set(ks)) != len(ks):
            raise DamagedStoreError(f"{where}: {what} lists a chunk of {path!r} twice")
