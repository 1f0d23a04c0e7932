"""Each array's ``zarr.json`` and the root group's, read from a store and checked against the
schema (:mod:`trajstore.storage.schema`) before any of it is used: shapes, chunk grids, key
encodings, data types and codecs a tampered store could make trajstore trust.

- :func:`check_array_meta`: one array's parsed metadata against its field;
- :func:`read_root`: the root ``zarr.json`` (a zarr v3 group with ``trajstore`` attributes);
- :func:`array_rows` / :func:`read_array_rows`: the rows every array records, its metadata checked.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from trajstore.errors import DamagedStoreError, NotATrajstoreError
from trajstore.storage.published import FileIdentity, file_identity
from trajstore.storage.schema import (
    DTYPE_NAMES,
    FieldSchema,
    TableSchema,
    as_dict,
    as_list,
    check_allocation,
    check_int,
    load_json,
    name_value,
)

__all__ = ["check_array_meta", "read_root", "consolidated", "array_rows", "read_array_rows"]


# -- array metadata -------------------------------------------------------------------------------
def check_array_meta(meta: Any, f: FieldSchema, where: str, key: str) -> int:
    """Check an array's zarr metadata (parsed ``zarr.json``) against its field; returns the rows
    its shape records.

    Checked: a zarr v3 array node, shape ``(rows, *row shape)`` with plausible ``rows``, a regular
    chunk grid of ``(chunk_rows, *row shape)``, the default chunk key encoding with ``/``, the
    field's data type, codecs (``bytes`` little-endian first; the raw layout has nothing else) and
    ``dimension_names`` when present (one name, a string or null, per axis).

    Raises
    ------
    DamagedStoreError
        Naming ``key`` and what differs.
    """
    meta = as_dict(meta, key, where)
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        raise DamagedStoreError(f"{where}: {key} is not zarr v3 array metadata (zarr_format "
                                f"{name_value(meta.get('zarr_format'))}, node_type {name_value(meta.get('node_type'))})")
    rows = _check_shape(meta, f, where, key)
    for check in _ARRAY_CHECKS:
        check(meta, f, where, key)
    return rows


def _check_shape(meta: dict[str, Any], f: FieldSchema, where: str, key: str) -> int:
    """Shape ``(rows, *row shape)`` with a plausible ``rows``; returns ``rows``."""
    shape = as_list(meta.get("shape"), f"{key} shape", where, 32)
    if len(shape) != 1 + len(f.shape) or tuple(shape[1:]) != f.shape:
        raise DamagedStoreError(f"{where}: {key} shape is {name_value(shape)}; expected [rows, {', '.join(map(str, f.shape))}]"
                                .replace(", ]", "]"))
    rows = check_int(shape[0], f"{key} shape[0]", where)
    check_allocation(f, rows, where, what="records")
    return rows


def _check_chunk_grid(meta: dict[str, Any], f: FieldSchema, where: str, key: str) -> None:
    """A regular chunk grid of ``(chunk_rows, *row shape)``."""
    grid = meta.get("chunk_grid")
    chunks = grid.get("configuration", {}).get("chunk_shape") if isinstance(grid, dict) and isinstance(
        grid.get("configuration"), dict) else None
    if not isinstance(grid, dict) or grid.get("name") != "regular" or chunks != [f.chunk_rows, *f.shape]:
        raise DamagedStoreError(f"{where}: {key} chunk grid is {name_value(grid)}; expected regular chunks of "
                                f"{[f.chunk_rows, *f.shape]}")


def _check_key_encoding(meta: dict[str, Any], f: FieldSchema, where: str, key: str) -> None:
    """The default chunk key encoding with ``/``."""
    enc = meta.get("chunk_key_encoding")
    sep = enc.get("configuration", {}).get("separator", "/") if isinstance(enc, dict) and isinstance(
        enc.get("configuration", {}), dict) else None
    if not isinstance(enc, dict) or enc.get("name") != "default" or sep != "/":
        raise DamagedStoreError(f"{where}: {key} chunk key encoding is {name_value(enc)}; expected the default "
                                "encoding with '/'")


def _check_data_type(meta: dict[str, Any], f: FieldSchema, where: str, key: str) -> None:
    """The field's data type."""
    dt = meta.get("data_type")
    if not isinstance(dt, str) or DTYPE_NAMES.get(dt) != f.dtype:
        raise DamagedStoreError(f"{where}: {key} data type is {name_value(dt)}; the schema says {f.dtype.name}")


def _check_codecs(meta: dict[str, Any], f: FieldSchema, where: str, key: str) -> None:
    """An image field's sharding codec (:func:`_check_image_codecs`); any other field's ``bytes``
    (little-endian) first, then compressors zarr knows (the raw layout: nothing else)."""
    codecs = as_list(meta.get("codecs"), f"{key} codecs", where, 16)
    if f.layout == "image":
        _check_image_codecs(codecs, f, where, key)
        return
    names: list[Any] = [c.get("name") if isinstance(c, dict) else None for c in codecs]
    first = codecs[0] if codecs else None
    endian = (first.get("configuration") or {}).get("endian", "little") if isinstance(first, dict) and isinstance(
        first.get("configuration", {}), dict) else None
    if (not names or names[0] != "bytes" or endian != "little" or any(not isinstance(n, str) for n in names)
            or (f.layout == "raw" and len(names) != 1)):
        raise DamagedStoreError(f"{where}: {key} codecs are {name_value(names)}; expected 'bytes' (little-endian)"
                                + (" alone (raw layout)" if f.layout == "raw" else " then compressors"))
    unknown = [n for n in names[1:] if not _known_codec(n)]
    if unknown:
        raise DamagedStoreError(f"{where}: {key} names codec(s) {name_value(unknown)} that zarr does not know")


def _check_dimension_names(meta: dict[str, Any], f: FieldSchema, where: str, key: str) -> None:
    """``dimension_names``, when present: one name (a string or null) per axis."""
    dims = meta.get("dimension_names")
    ndim = 1 + len(f.shape)  # the shape was checked first
    if dims is not None and (not isinstance(dims, list) or len(dims) != ndim or any(
            not (d is None or (isinstance(d, str) and len(d) <= 1024)) for d in dims)):
        raise DamagedStoreError(f"{where}: {key} dimension_names is {name_value(dims)}; expected null or a list of "
                                f"{ndim} names (strings or null)")


def _check_rest(meta: dict[str, Any], f: FieldSchema, where: str, key: str) -> None:
    """No storage transformers, and a fill value that is a number (or a short string naming one)."""
    if meta.get("storage_transformers") not in (None, []):
        raise DamagedStoreError(f"{where}: {key} has storage transformers; trajstore stores none")
    fill = meta.get("fill_value")
    if not (type(fill) in (int, float, bool) or (isinstance(fill, str) and len(fill) <= 32)):
        raise DamagedStoreError(f"{where}: {key} fill_value is {name_value(fill)}; expected a number")


#: What :func:`check_array_meta` checks after the node type and the shape, in order (each raises
#: :class:`DamagedStoreError` naming the key and what differs).
_ARRAY_CHECKS: tuple[Callable[[dict[str, Any], FieldSchema, str, str], None], ...] = (
    _check_chunk_grid, _check_key_encoding, _check_data_type, _check_codecs, _check_dimension_names, _check_rest)


def _check_image_codecs(codecs: list[Any], f: FieldSchema, where: str, key: str) -> None:
    """An image field's codecs: one ``sharding_indexed`` of ``(1, *row shape)`` inner chunks, each
    encoded by a ``trajstore.image`` codec this version knows for the field's frames, its index
    ``bytes`` (little-endian) then ``crc32c``, at the end.  Nothing is imported: the formats are a
    fixed table (:data:`trajstore.storage.fields.image_codecs.FORMATS`)."""
    from trajstore.storage.fields.image_codecs import codec_from_config

    expect = (f"one sharding_indexed codec of [1, {', '.join(map(str, f.shape))}] inner chunks encoded by a "
              "trajstore.image codec, its index 'bytes' (little-endian) then 'crc32c' at the end")
    shard = codecs[0] if len(codecs) == 1 and isinstance(codecs[0], dict) else {}
    cfg = shard.get("configuration")
    if shard.get("name") != "sharding_indexed" or not isinstance(cfg, dict):
        raise DamagedStoreError(f"{where}: {key} codecs are {name_value(codecs)}; expected {expect}")
    index = cfg.get("index_codecs")
    inner = cfg.get("codecs")
    if cfg.get("chunk_shape") != [1, *f.shape] or cfg.get("index_location", "end") != "end" or not (
            isinstance(index, list) and len(index) == 2 and isinstance(index[0], dict) and isinstance(index[1], dict)
            and index[0].get("name") == "bytes" and (index[0].get("configuration") or {}).get("endian") == "little"
            and index[1].get("name") == "crc32c") or not (isinstance(inner, list) and len(inner) == 1):
        raise DamagedStoreError(f"{where}: {key} sharding configuration is {name_value(cfg)}; expected {expect}")
    try:
        codec = codec_from_config(inner[0])
        codec.check(f.shape, f.dtype)
    except (ValueError, TypeError) as e:  # (BadOptionError is a ValueError)
        raise DamagedStoreError(f"{where}: {key} image codec {name_value(inner[0])} is not one this version of "
                                f"trajstore reads ({e})") from None


def _known_codec(name: str) -> bool:
    """A codec zarr can instantiate (checked so that a misspelt or foreign codec is reported as
    such, not as zarr's error while opening the group)."""
    from zarr.registry import get_codec_class

    try:
        get_codec_class(name)
    except Exception:  # KeyError, or an entry point that fails to load
        return False
    return True


# -- reading a store's metadata -----------------------------------------------------------------
def read_root(loc: Any) -> dict[str, Any] | None:
    """The root ``zarr.json`` of ``loc``, parsed and checked to be a zarr v3 group carrying
    ``trajstore`` attributes; ``None`` when there is no root ``zarr.json``.

    Raises
    ------
    NotATrajstoreError
        JSON without trajstore attributes (another zarr hierarchy, or something else).
    DamagedStoreError
        Unreadable, not a regular file, too large, too deeply nested, or a trajstore root that is
        not a zarr v3 group.
    """
    where = str(loc.url)
    raw = loc.get("zarr.json")
    if raw is None:
        return None
    obj = load_json(raw, where, "zarr.json")
    attrs = obj.get("attributes") if isinstance(obj, dict) else None
    if not isinstance(attrs, dict) or "trajstore" not in attrs:
        raise NotATrajstoreError(f"{where}: not a trajstore store (zarr.json has no 'trajstore' attributes)")
    if obj.get("zarr_format") != 3 or obj.get("node_type") != "group":
        raise DamagedStoreError(f"{where}: zarr.json is not zarr v3 group metadata (zarr_format "
                                f"{name_value(obj.get('zarr_format'))}, node_type {name_value(obj.get('node_type'))})")
    return obj


def consolidated(root: dict[str, Any], where: str) -> dict[str, Any] | None:
    """The consolidated metadata entries of a parsed root ``zarr.json`` (path -> array metadata),
    or None when it has none."""
    cons = root.get("consolidated_metadata")
    if cons is None:
        return None
    entries = as_dict(cons, "zarr.json consolidated_metadata", where).get("metadata")
    return as_dict(entries, "zarr.json consolidated_metadata.metadata", where)


def array_rows(loc: Any, tables: Mapping[str, TableSchema], root: dict[str, Any], *, fresh: bool,
               seen: dict[str, tuple[dict[str, Any], FileIdentity]] | None = None) -> dict[str, int]:
    """Rows each field's array records, after checking its metadata (:func:`check_array_meta`).

    The consolidated entries in ``root`` are always checked (zarr readers use them); each array's
    own ``zarr.json`` is read and checked too when ``fresh`` or when there are no consolidated
    entries (then its rows count: a writer publishes it before the consolidated copy).  Group
    ``zarr.json`` files on the way to the arrays are checked to be group metadata (zarr reads
    them when it consolidates).  ``seen`` (fresh reads only) receives each array's parsed
    ``zarr.json`` with the file's identity taken before it was read (``Publisher.seed``).
    """
    where = str(loc.url)
    entries = consolidated(root, where)
    out: dict[str, int] = {}
    groups: set[str] = set()
    for t in tables.values():
        for f in t.fields:
            parts = f.path.split("/")
            groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
            if entries is not None:
                if f.path not in entries:
                    raise DamagedStoreError(f"{where}: zarr.json's consolidated metadata has no entry for {f.path}")
                out[f.path] = check_array_meta(entries[f.path], f, where, f"zarr.json (consolidated entry {f.path})")
            if fresh or entries is None:
                out[f.path] = read_array_rows(loc, f, seen)
    if fresh:
        for g in sorted(groups):
            raw = loc.get(f"{g}/zarr.json")
            if raw is None:
                continue
            meta = load_json(raw, where, f"{g}/zarr.json")
            if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "group":
                raise DamagedStoreError(f"{where}: {g}/zarr.json is not zarr v3 group metadata")
    return out


def read_array_rows(loc: Any, f: FieldSchema, seen: dict[str, tuple[dict[str, Any], FileIdentity]] | None = None) -> int:
    """Rows recorded by the field's own ``zarr.json`` (read now, checked); ``seen``: see :func:`array_rows`."""
    where = str(loc.url)
    key = f"{f.path}/zarr.json"
    ident = file_identity(loc, key) if seen is not None else None
    raw = loc.get(key)
    if raw is None:
        raise DamagedStoreError(f"{where}: {key} is missing (or not a file): the array of field {f.path} has no metadata")
    meta = load_json(raw, where, key)
    rows = check_array_meta(meta, f, where, key)
    if seen is not None:
        seen[f.path] = (meta, ident)
    return rows
