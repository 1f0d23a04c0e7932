"""What plain zarr readers see of a store: each array's ``shape`` and ``dimension_names``.

trajstore itself reads a store through its commit record (the rows each table holds, what its
arrays have allocated); the ``zarr.json`` files are for everyone else (zarr-python, xarray, any
zarr v3 reader).  So a writer *publishes* the committed rows into them:

- every array carries ``dimension_names`` (:func:`dimension_names`), so
  ``xarray.open_zarr(path, group="step_data")`` gives a Dataset;
- an unbounded table's arrays record exactly its committed rows (``shape[0] == end``); a ring's
  record its capacity (plain readers see physical slots; docs/format.md says how to read them in
  order);
- the consolidated entries in the root ``zarr.json`` say the same as the arrays' own files.

Order (:meth:`Publisher.publish` is called around each commit record, see
:meth:`trajstore.core.commit.StoreCommits.write_record`): a shape grows only after the record that
commits the rows, and shrinks (``clear``, ``remove_at``) before the record that drops them, so at
every instant a recorded shape names committed rows only, whose chunks are whole.  A kill between
the record and the metadata leaves a shape that lags (plain readers see fewer rows, never rows that
are not there); the next commit of any writer publishes again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Any, Mapping

from trajstore.errors import DamagedStoreError, TrajstoreError
from trajstore.storage.confined import pwrite
from trajstore.storage.location import Location
from trajstore.storage.schema import TableSchema, load_json

__all__ = ["ROW_AXIS", "DATASET_ATTR", "dimension_names", "Publisher", "FileIdentity", "file_identity", "set_root_attribute", "root_attribute",
           "add_dimension_names"]

#: Name of axis 0 (rows) of each table's arrays.  One name per table, so every array of a table
#: shares it (xarray aligns them); different names per table, because their row counts differ.
ROW_AXIS = {"step_data": "row", "episode_data": "episode"}
#: Root group attribute mirroring the dataset description (``trajstore.dataset.json``).
DATASET_ATTR = "dataset"


def _table_of(path: str) -> str:
    return "episode_data" if path == "episode_data" or path.startswith("episode_data/") else "step_data"


def dimension_names(path: str, row_ndim: int) -> list[str]:
    """Zarr ``dimension_names`` of the array at ``path`` whose rows have ``row_ndim`` axes.

    Axis 0 is the table's row axis (:data:`ROW_AXIS`); trailing axis ``i`` is named
    ``<leaf>_<i>``, where ``<leaf>`` is the array's path inside its table's folder with ``/``
    replaced by ``.`` (the table's own name for an array that is the whole table): unequal leaf
    sizes never share a name.

    Examples
    --------
    >>> dimension_names("step_data/obs/image", 3)
    ['row', 'obs.image_0', 'obs.image_1', 'obs.image_2']
    >>> dimension_names("step_data", 1), dimension_names("episode_data/_episode_id", 0)
    (['row', 'step_data_0'], ['episode'])
    """
    table = _table_of(path)
    leaf = path[len(table) + 1:] if path.startswith(table + "/") else path
    leaf = leaf.replace("/", ".")
    return [ROW_AXIS[table], *(f"{leaf}_{i}" for i in range(row_ndim))]


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")  # no indent: C encoder (indent is 10x slower)


#: Writes of one key per session replaced the plain way (:class:`_Replacer`).
_PLAIN_WRITES = 3


class _Replacer:
    """Replaces small metadata files of a local store by rename, as :meth:`Location.put` does,
    without freeing the replaced file: it is kept (hard-linked under a temp name in
    ``.trajstore-tmp``) and its blocks take the next version of the same key.

    Why: a file whose blocks are freed costs a discard on filesystems mounted with ``discard``
    (2.5-5 ms per replaced ``zarr.json`` on this machine's ext4, against 0.13 ms this way), and a
    commit that adds rows replaces every array's ``zarr.json`` and the root's.  Readers see the
    old file or the new one (a reader that opened a version and reads it only after the next
    publish sees that one: every version names committed rows only).  The kept files are removed
    by :meth:`close` (or, after a kill, with the writer's other temp files by the next writer);
    a key's first :data:`_PLAIN_WRITES` writes of a session keep nothing, so that opening a store
    (which may roll a rewrite forward and commit) leaves no temp file.  Elsewhere, and with ``fsync``, :meth:`Location.put`.
    """

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self._pid = os.getpid()
        self._spares: dict[str, tuple[Path, Path]] = {}  # key -> (next version's file, name the replaced one keeps)
        self._writes: dict[str, int] = {}  # key -> times written in this session

    def put(self, key: str, data: bytes, *, fsync: bool = False) -> None:
        if self.loc.local_root is None or fsync:
            self.loc.put(key, data, fsync=fsync)
            return
        if os.getpid() != self._pid:  # a forked writer: the parent's kept files are the parent's
            self._pid, self._spares, self._writes = os.getpid(), {}, {}
        n = self._writes[key] = self._writes.get(key, 0) + 1
        if n <= _PLAIN_WRITES:  # what a writer's open writes (a rewrite rolled forward) keeps nothing
            self.loc.put(key, data)
            return
        pair = self._spares.pop(key, None)
        spare, keep = pair if pair is not None else (self.loc.new_tmp_path(), self.loc.new_tmp_path())
        try:
            fd = os.open(spare, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                # Pad with JSON whitespace to the kept file's size: nothing of its old bytes remains.
                buf = data + b" " * max(os.fstat(fd).st_size - len(data), 0)
                if pwrite(fd, buf, 0) != len(buf):
                    raise OSError(errno.EIO, f"short write of {spare}")
            finally:
                os.close(fd)
            dest = self.loc.path(key)
            try:
                os.link(dest, keep, follow_symlinks=False)
                kept = True
            except FileNotFoundError:
                kept = False
            os.replace(spare, dest)
        except OSError:
            for path in (spare, keep):  # (keep: a link made before the rename failed)
                with contextlib.suppress(OSError):
                    os.unlink(path)
            self.loc.put(key, data)  # the plain way (it raises what a full disk raises)
            return
        if kept:
            self._spares[key] = (keep, spare)

    def close(self) -> None:
        """Remove the kept files (this process's: a forked child leaves its parent's alone)."""
        if os.getpid() != self._pid:
            return
        for pair in self._spares.values():
            for path in pair:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self._spares, self._writes = {}, {}


def _read_obj(loc: Location, key: str) -> dict[str, Any]:
    raw = loc.get(key)
    if raw is None:
        raise DamagedStoreError(f"{loc.url}: {key} is missing")
    obj = load_json(raw, str(loc.url), key)
    if not isinstance(obj, dict):
        raise DamagedStoreError(f"{loc.url}: {key} holds {type(obj).__name__}; expected a JSON object")
    return obj


def root_attribute(loc: Location, name: str) -> Any:
    """Attribute ``name`` of the root group of the store at ``loc`` (None when it has none)."""
    attrs = _read_obj(loc, "zarr.json").get("attributes")
    return attrs.get(name) if isinstance(attrs, dict) else None


def set_root_attribute(loc: Location, name: str, value: Any, *, fsync: bool = False) -> None:
    """Set (``value`` not None) or remove attribute ``name`` of the root group, in place of its
    ``zarr.json`` (atomically; every other attribute and the consolidated metadata are kept)."""
    root = _read_obj(loc, "zarr.json")
    attrs = root.setdefault("attributes", {})
    if value is None:
        attrs.pop(name, None)
    else:
        attrs[name] = value
    loc.put("zarr.json", _dumps(root), fsync=fsync)


def add_dimension_names(loc: Location) -> None:
    """Give every array of the store at ``loc`` that has none its :func:`dimension_names` (its own
    ``zarr.json``; consolidate afterwards).  Field paths come from the root's ``trajstore``
    attributes; a store without them is left alone."""
    attrs = _read_obj(loc, "zarr.json").get("attributes", {}).get("trajstore")
    tables = attrs.get("tables") if isinstance(attrs, dict) else None
    for t in (tables or {}).values():
        for fj in t.get("fields", ()):
            key = f"{fj['path']}/zarr.json"
            meta = _read_obj(loc, key)
            if meta.get("dimension_names") is None:
                meta["dimension_names"] = dimension_names(fj["path"], len(meta["shape"]) - 1)
                loc.put(key, _dumps(meta))


#: (inode, mtime, ctime, size) of a local file; None elsewhere or when it cannot be read.
FileIdentity = tuple[int, int, int, int] | None


def file_identity(loc: Location, key: str) -> FileIdentity:
    """The identity of the local file ``key`` (the link itself, never followed): a metadata file
    replaced by rename has a new inode, one rewritten in place a new mtime and ctime.  None on
    a remote store (nothing is cached there: it is read every time) or when there is no file."""
    if loc.local_root is None:
        return None
    try:
        # (A stat opens nothing: the joined path needs none of Location.path's folder checks,
        # which cost 20 us a key; the files are read through the confinement.)
        st = os.stat(os.path.join(loc.local_root, key), follow_symlinks=False)
    except (OSError, ValueError):
        return None
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size


class Publisher:
    """Keeps the arrays' ``zarr.json`` (and the consolidated copies) of one open store in step
    with its commit records.

    It remembers what it last wrote, so a commit that changes no table's rows writes nothing;
    :meth:`forget` makes it read the files again (another process may have written them).
    """

    def __init__(self, loc: Location, schema: Mapping[str, TableSchema]):
        self.loc = loc
        self.schema = schema
        self._meta: dict[str, dict[str, Any]] | None = None  # array path -> its zarr.json as on disk
        self._root_ok = False  # the consolidated entries match self._meta
        self._root: dict[str, Any] | None = None  # the root zarr.json as last written, and its file's identity
        self._root_id: FileIdentity = None
        self._seeded: tuple[dict[str, Any], dict[str, tuple[dict[str, Any], FileIdentity]], FileIdentity] | None = None
        self._files = _Replacer(loc)

    def close(self) -> None:
        """Remove the temp files kept for the next publish (:class:`_Replacer`)."""
        self._files.close()

    def forget(self) -> None:
        """Read the metadata files again before the next publish."""
        self._meta = None
        self._root_ok = False
        self._root = None
        self._seeded = None

    def seed(self, root: dict[str, Any], arrays: Mapping[str, tuple[dict[str, Any], FileIdentity]],
             root_id: FileIdentity) -> None:
        """Adopt the metadata a writer's open just read and checked (the root ``zarr.json`` and each
        array's own), with each file's identity taken before it was read: the first publish
        then reads nothing as long as every identity still holds (:meth:`_load`).  The open reads
        before it takes the writer's lock, so a writer that published in between changed an
        identity, and the files are read again."""
        self._seeded = (root, dict(arrays), root_id)

    def _load(self) -> dict[str, dict[str, Any]]:
        if self._meta is None:
            seeded, self._seeded = self._seeded, None
            if seeded is not None:
                root, arrays, root_id = seeded
                paths = [f.path for t in self.schema.values() for f in t.fields]
                if all(p in arrays and arrays[p][1] is not None
                       and file_identity(self.loc, f"{p}/zarr.json") == arrays[p][1] for p in paths):
                    self._meta = {p: arrays[p][0] for p in paths}
                if root_id is not None and self._root_identity() == root_id:
                    self._root, self._root_id = root, root_id
        if self._meta is None:
            self._meta = {f.path: _read_obj(self.loc, f"{f.path}/zarr.json")
                          for t in self.schema.values() for f in t.fields}
        return self._meta

    def publish(self, rows: Mapping[str, int], *, lower_only: bool = False, fsync: bool = False) -> bool:
        """Record ``rows[table]`` rows in the arrays of each table named (and dimension names in
        every array of those tables); with ``lower_only``, only shapes that record more rows are
        changed.  Returns whether a file was written.

        Arrays first, then the root's consolidated entries: zarr readers that use either see a
        shape that names committed rows only (see the module docstring for the order around the
        commit record).
        """
        meta = self._load()
        changed = False
        for name, n in rows.items():
            for f in self.schema[name].fields:
                m = meta[f.path]
                dims = dimension_names(f.path, len(f.shape))
                shape = m.get("shape")
                old = shape[0] if isinstance(shape, list) and shape else None
                new = min(old, n) if lower_only and isinstance(old, int) else n
                if old == new and m.get("dimension_names") == dims:
                    continue
                m = dict(m)  # shape and names are replaced below, never changed in place
                m["shape"] = [new, *f.shape]
                m["dimension_names"] = dims
                self._files.put(f"{f.path}/zarr.json", _dumps(m), fsync=fsync)
                meta[f.path] = m
                changed = True
        if changed or not self._root_ok:
            self._root_ok = False
            self._consolidate(fsync)
            self._root_ok = True
        return changed

    def _rows(self, head: Any) -> dict[str, int]:
        """Rows plain readers may see under commit record ``head``: an unbounded table's ``end``, or,
        while a rewrite is pending, only its rows before the first chunk being moved into place
        (until then those chunks are partly old, partly new); a ring's capacity."""
        out = {}
        for n, st in head.tables.items():
            t = self.schema.get(n)
            if t is None:
                continue
            rows = st.end if t.capacity is None else st.allocated
            if t.capacity is None and head.pending:
                staged = head.pending.get("chunks") or {}
                for f in t.fields:
                    ks = staged.get(f.path)
                    if ks:
                        rows = min(rows, min(ks) * f.chunk_rows)
            out[n] = rows
        return out

    def before_commit(self, old: Any, new: Any, *, fsync: bool = False) -> None:
        """Before commit record ``new`` replaces ``old`` (:class:`trajstore.storage.head.Head`
        objects): lower every unbounded table's shapes that would name rows ``new`` drops, or
        rows a rewrite it names is about to replace."""
        before, after = self._rows(old), self._rows(new)
        self.publish({n: min(before.get(n, r), r) for n, r in after.items() if self.schema[n].capacity is None},
                     lower_only=True, fsync=fsync)

    def after_commit(self, new: Any) -> None:
        """After commit record ``new`` is in place: record its rows (:meth:`_rows`).  Not part of
        the commit: a failure (a full disk) leaves the shapes lagging and is not raised; the next
        commit publishes again."""
        try:
            self.publish(self._rows(new))
        except (OSError, TrajstoreError):
            self.forget()

    def _consolidate(self, fsync: bool) -> None:
        """Copy every array's shape and dimension names into the root's consolidated entries
        (written only when one differs)."""
        assert self._meta is not None
        # The root as this publisher last wrote it, unless the file changed since (set_dataset_info
        # replaces it): parsing and checking a large root on every commit costs milliseconds.
        root = self._root if self._root is not None and self._root_id == self._root_identity() else None
        if root is None:
            root = self._root = _read_obj(self.loc, "zarr.json")
        cons = root.get("consolidated_metadata")
        entries = cons.get("metadata") if isinstance(cons, dict) else None
        if not isinstance(entries, dict):
            return  # no consolidated metadata: readers use the arrays' own files
        dirty = False
        for path, m in self._meta.items():
            e = entries.get(path)
            if not isinstance(e, dict):
                continue
            for k in ("shape", "dimension_names"):
                if e.get(k) != m.get(k):
                    e[k] = m.get(k)
                    dirty = True
        if dirty:
            self._root = None  # (if the write fails half-way, read it again next time)
            self._files.put("zarr.json", _dumps(root), fsync=fsync)
            self._root, self._root_id = root, self._root_identity()

    def _root_identity(self) -> FileIdentity:
        return file_identity(self.loc, "zarr.json")
