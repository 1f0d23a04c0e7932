"""A LeRobot dataset folder read and checked: :func:`read_layout` (v3.0 and v2.1).

LeRobot (huggingface/lerobot ``docs/source/lerobot-dataset-v3.mdx``, ``datasets/utils.py``) keeps:

- ``meta/info.json``: ``codebase_version``, ``fps``, ``features`` (name -> ``dtype``, ``shape``,
  ``names``; ``dtype: "video"`` for cameras), ``data_path`` / ``video_path`` templates,
  ``chunks_size``, totals;
- v3.0: ``meta/tasks.parquet`` (``task_index`` and the task string, pandas' index ``task``),
  ``meta/episodes/chunk-*/file-*.parquet`` (``episode_index``, ``tasks``, ``length``,
  ``data/chunk_index``, ``data/file_index``, ``dataset_from_index``, ``dataset_to_index``,
  ``videos/<key>/{chunk_index,file_index,from_timestamp,to_timestamp}``), data Parquet files of
  many episodes and MP4 shards of many episodes per camera;
- v2.1: ``meta/tasks.jsonl``, ``meta/episodes.jsonl``, one Parquet and one MP4 (per camera) per
  episode, at ``episode_chunk = episode_index // chunks_size``.

Everything is input: JSON through :func:`~trajstore.interop.foreign_gate.parse_json`, files opened
below the dataset folder only (:func:`~trajstore.interop.foreign_gate.open_below`: no links),
path templates parsed (only LeRobot's placeholders, integer formats; a rendered path with ``..``,
an absolute path or a backslash is refused), Parquet sizes bounded before a value is read.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajstore.errors import BadValueError, ForeignFileError, NotATrajstoreError, StoreNotFoundError
from trajstore.interop.foreign_gate import check_declared, parse_json
from trajstore.interop.lerobot_source import Source
from trajstore.storage.confined import MAX_META_BYTES
from trajstore.storage.schema import MAX_ARRAY_BYTES

__all__ = ["Feature", "Episode", "LeRobotLayout", "read_layout", "episode_starts", "read_parquet", "column_array", "pyarrow_module",
           "DEFAULT_COLUMNS", "render"]

#: Columns every LeRobot data file carries besides the features (kept as the store's structure).
DEFAULT_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
_PLACEHOLDERS = {"chunk_index", "file_index", "video_key", "episode_chunk", "episode_index"}
_INT_SPEC = re.compile(r"^0?[0-9]{0,2}d?$")
#: Bytes of a v2.1 JSON-lines metadata file read at most.
MAX_JSONL_BYTES = 256 << 20
_DTYPES = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "bool"}


def pyarrow_module(what: str) -> Any:
    """``pyarrow.parquet``, or MissingDependencyError naming the ``interop`` extra."""
    try:
        import pyarrow.parquet as pq  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        from trajstore._optional import missing

        raise missing("pyarrow", what) from None
    return pq


@dataclass
class Feature:
    """One feature of ``info.json``: ``name``, numpy ``dtype`` (uint8 for video), per-row
    ``shape`` (video: (H, W, 3)) and ``video`` (whether it lives in MP4 files)."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    video: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """One episode of ``meta/episodes``: ``index``, ``length``, ``tasks``, where its rows are
    (``data`` (chunk, file), ``rows`` (from, to) global indices) and, per camera, ``videos[key] =
    (chunk, file, from_timestamp, to_timestamp)``."""

    index: int
    length: int
    tasks: list[str]
    data: tuple[int, int]
    rows: tuple[int, int]
    videos: dict[str, tuple[int, int, float, float]] = field(default_factory=dict)


@dataclass
class LeRobotLayout:
    """A checked LeRobot dataset: its folder, ``version`` ("v3.0" or "v2.1"), ``fps``, features
    (tabular ones in the data files, video ones in MP4s), task dictionary, episodes (by index)
    and ``info`` / ``stats`` (info.json and stats.json as parsed)."""

    source: Source
    version: str
    fps: float
    features: dict[str, Feature]
    tasks: list[str]
    episodes: list[Episode]
    info: dict[str, Any]
    stats: dict[str, Any] | None
    data_path: str
    video_path: str

    @property
    def videos(self) -> list[str]:
        """Camera feature names (in info.json's order)."""
        return [k for k, f in self.features.items() if f.video]

    @property
    def tabular(self) -> list[str]:
        """Non-video features stored in the data files (in info.json's order)."""
        return [k for k, f in self.features.items() if not f.video]

    def data_key(self, ep: Episode) -> str:
        """Path (below the root) of the data file holding ``ep``."""
        chunk, file = ep.data
        return render(self.data_path, "data_path", self.source.where("meta/info.json"), chunk_index=chunk,
                      file_index=file, episode_chunk=chunk, episode_index=ep.index)

    def video_key(self, key: str, ep: Episode) -> str:
        """Path (below the root) of camera ``key``'s MP4 holding ``ep``."""
        chunk, file, _a, _b = ep.videos[key]
        return render(self.video_path, "video_path", self.source.where("meta/info.json"), video_key=key,
                      chunk_index=chunk, file_index=file, episode_chunk=chunk, episode_index=ep.index)

    @property
    def root(self) -> str:
        """The dataset folder (a path or URL)."""
        return self.source.root

    def open(self, key: str) -> Any:
        """The file ``key`` below the root, opened for reading (no link followed)."""
        return self.source.open(key)

    def where(self, key: str) -> str:
        """``key``'s full path, for messages."""
        return self.source.where(key)


def _check_template(template: Any, name: str, where: str) -> str:
    if not isinstance(template, str) or not 0 < len(template) <= 512:
        raise ForeignFileError(f"{where}: {name} must be a path template string; got {template!r}")
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ForeignFileError(f"{where}: {name} {template!r} is not a format string ({e})") from None
    for _lit, fname, spec, conv in parts:
        if fname is None:
            continue
        if fname not in _PLACEHOLDERS or conv or (fname != "video_key" and not _INT_SPEC.match(spec or "")) or \
                (fname == "video_key" and spec):
            raise ForeignFileError(f"{where}: {name} {template!r}: placeholder {{{fname}{':' + spec if spec else ''}}} "
                                   f"is not one of LeRobot's ({sorted(_PLACEHOLDERS)}, integer formats)")
    # the literal parts are checked here, naming info.json; render checks each path again with its values
    render(template, name, where, chunk_index=0, file_index=0, video_key="key", episode_chunk=0, episode_index=0)
    return template


def render(template: str, name: str, where: str = "LeRobot", **values: Any) -> str:
    """``template`` with ``values``, refused unless the path stays below the dataset folder
    (``where``: the info.json it came from, for the message)."""
    path = template.format(**values)
    parts = path.split("/")
    if path.startswith("/") or "\\" in path or "\x00" in path or any(p in ("", ".", "..") for p in parts):
        raise ForeignFileError(f"{where}: {name} {template!r} gives {path!r}: a path outside the dataset folder "
                               "(absolute, '..' or empty parts) is refused")
    return path


def _read_small(src: Source, key: str) -> bytes:
    with src.open(key) as f:
        data = f.read(MAX_META_BYTES + 1)
    if len(data) > MAX_META_BYTES:
        raise ForeignFileError(f"{src.where(key)}: more than {MAX_META_BYTES} bytes; not read")
    return bytes(data)


def _feature(name: str, spec: Any, where: str) -> Feature:
    if not isinstance(spec, dict) or "dtype" not in spec or "shape" not in spec:
        raise ForeignFileError(f"{where}: feature {name!r} must be an object with dtype and shape; got {spec!r:.200}")
    shape = spec["shape"]
    if not isinstance(shape, list) or not 0 < len(shape) <= 4 or \
            not all(type(s) is int and 0 < s <= 1 << 20 for s in shape):
        raise ForeignFileError(f"{where}: feature {name!r} shape {shape!r:.100} is not 1 to 4 positive ints")
    if "/" in name or "\\" in name or name in (".", "..") or not 0 < len(name) <= 128:
        raise ForeignFileError(f"{where}: feature name {name!r:.140} (LeRobot refuses '/' in names; '.' and '..' "
                               "would lead out of the videos folder)")
    if spec["dtype"] == "video":
        names = spec.get("names") or ["height", "width", "channels"]
        hwc = tuple(shape) if list(names)[:1] != ["channels"] else (shape[1], shape[2], shape[0])
        if len(hwc) != 3 or hwc[2] != 3:
            raise ForeignFileError(f"{where}: video feature {name!r} shape {shape} is not RGB (H, W, 3)")
        info: dict[str, Any] = spec["info"] if isinstance(spec.get("info"), dict) else {}
        return Feature(name, np.dtype(np.uint8), hwc, True, info)
    if spec["dtype"] not in _DTYPES:
        raise ForeignFileError(f"{where}: feature {name!r} has dtype {spec['dtype']!r:.40}; trajstore reads numbers, "
                               "bools and video (images stored in Parquet and strings are not supported)")
    return Feature(name, np.dtype(spec["dtype"]), tuple(shape), False)


def _info(src: Source) -> dict[str, Any]:
    key = "meta/info.json"
    try:
        raw = _read_small(src, key)
    except StoreNotFoundError:
        raise NotATrajstoreError(f"{src.where(key)}: no such file; a LeRobot dataset has meta/info.json") from None
    info = parse_json(raw, src.where(key), "info")
    if not isinstance(info, dict):
        raise ForeignFileError(f"{src.where(key)}: not a JSON object")
    return info


def read_layout(path: Any, storage_options: dict[str, Any] | None = None) -> LeRobotLayout:
    """The LeRobot dataset in the folder ``path`` (local, or an fsspec URL with
    ``storage_options``), checked (the data and video files are opened later, when read).

    Raises
    ------
    NotATrajstoreError
        No ``meta/info.json``.
    ForeignFileError
        A link or special file in the folder, malformed metadata, a version other than v2.x / v3.x,
        a hostile path template, episodes that contradict each other (naming the file).
    """
    src = Source(path, storage_options)
    src.check()
    info = _info(src)
    where = src.where("meta/info.json")
    version = str(info.get("codebase_version", ""))
    if not re.fullmatch(r"v[23]\.[0-9]+", version):
        raise ForeignFileError(f"{where}: codebase_version {version!r:.40}; trajstore reads LeRobot v2.x and v3.x")
    fps = info.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < 1e6:
        raise ForeignFileError(f"{where}: fps {fps!r:.40} is not a positive number")
    feats = info.get("features")
    if not isinstance(feats, dict) or not feats:
        raise ForeignFileError(f"{where}: features must be a non-empty object")
    features = {k: _feature(k, v, where) for k, v in feats.items() if k not in DEFAULT_COLUMNS}
    data_path = _check_template(info.get("data_path"), "data_path", where)
    video_path = _check_template(info.get("video_path") or "videos/{video_key}.mp4", "video_path", where)
    if version.startswith("v3"):
        tasks = _tasks_v3(src)
        episodes = _episodes_v3(src, [k for k, f in features.items() if f.video])
    else:
        tasks, episodes = _meta_v2(src, info, features)
    stats = None
    try:
        stats = parse_json(_read_small(src, "meta/stats.json"), src.where("meta/stats.json"), "stats")
    except StoreNotFoundError:
        pass
    _check_episodes(episodes, tasks, src.where("meta/episodes"))
    return LeRobotLayout(src, version, float(fps), features, tasks, episodes, info, stats, data_path, video_path)


def _check_episodes(episodes: list[Episode], tasks: list[str], where: str) -> None:
    known = set(tasks)
    seen: set[int] = set()
    for ep in episodes:
        if ep.index in seen:
            raise ForeignFileError(f"{where}: episode {ep.index} is listed twice")
        seen.add(ep.index)
        if ep.length < 1 or ep.rows[1] - ep.rows[0] != ep.length:
            raise ForeignFileError(f"{where}: episode {ep.index} has length {ep.length} but rows {ep.rows}")
        for t in ep.tasks:
            if t not in known:
                raise ForeignFileError(f"{where}: episode {ep.index} has task {t!r:.80}, which meta/tasks does not list")
        for key, (_c, _f, t0, t1) in ep.videos.items():
            if not (np.isfinite(t0) and np.isfinite(t1) and 0 <= t0 < t1):
                raise ForeignFileError(f"{where}: episode {ep.index} camera {key}: time range [{t0}, {t1}) is not one")
    episodes.sort(key=lambda e: e.index)


# -- Parquet ---------------------------------------------------------------------------------------
#: A Parquet file's values decode on pyarrow's threads only above this many bytes: starting them costs
#: more than a LeRobot data file of a few MB takes to decode (measured: 4-8 ms against 20-85 ms).
THREADED_PARQUET_BYTES = 32 << 20


def read_parquet(src: Source, key: str, columns: list[str] | None = None) -> Any:
    """The Parquet file ``key`` of ``src`` as a pyarrow Table (``columns`` only),
    its size bounded from its footer before any value is read.

    Raises
    ------
    StoreNotFoundError
        No such file.
    ForeignFileError
        Not Parquet, larger than trajstore reads, or a listed column missing (naming the file).
    """
    where = src.where(key)
    pq = pyarrow_module(where)
    with src.open(key) as f:
        try:
            pf = pq.ParquetFile(f)
            md = pf.metadata
            size = sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
            if size > MAX_ARRAY_BYTES or md.num_rows > MAX_ARRAY_BYTES // 8:
                raise ForeignFileError(f"{where}: {md.num_rows} rows of {size} bytes; more than trajstore reads")
            names = pf.schema_arrow.names
            missing = [c for c in columns or [] if c not in names]
            if missing:
                raise ForeignFileError(f"{where}: no column {missing[0]!r} (it has {names[:20]}); info.json or "
                                       "meta/episodes names it")
            return pf.read(columns=columns, use_threads=size > THREADED_PARQUET_BYTES)
        except ForeignFileError:
            raise
        except Exception as e:  # noqa: BLE001  # the file is input: whatever pyarrow says about it
            raise ForeignFileError(f"{where}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _numbers(col: Any, pa: Any) -> np.ndarray:
    """The values of the null-free pyarrow Array ``col`` as (len,) numpy: integers and floats viewed
    in place (pyarrow's ``to_numpy`` imports pandas, about half a second the first time), anything
    else through ``to_numpy`` (dtype object for what is not a number)."""
    t = col.type
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        kind = "f" if pa.types.is_floating(t) else ("i" if pa.types.is_signed_integer(t) else "u")
        dt = np.dtype(f"{kind}{t.bit_width // 8}")
        return np.frombuffer(col.buffers()[1], dt, count=len(col), offset=col.offset * dt.itemsize)
    return np.asarray(col.to_numpy(zero_copy_only=False))


def column_array(table: Any, name: str, dtype: np.dtype[Any], shape: tuple[int, ...], where: str) -> np.ndarray:
    """Column ``name`` of ``table`` as (rows, *shape) ``dtype``: a scalar column when ``shape`` is
    (1,) or (), else (nested) lists of exactly ``prod(shape)`` values per row.

    Raises
    ------
    ForeignFileError
        Nulls, lists of another length, values that are not numbers (naming the file and column).
    """
    import pyarrow as pa  # type: ignore[import-untyped,import-not-found,unused-ignore]

    col = table.column(name).combine_chunks()
    n = len(col)
    check_declared((n, *shape), dtype, None, f"{where}: column {name}")
    try:
        if col.null_count:
            raise ValueError("it holds nulls")
        while pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type):
            if col.null_count:
                raise ValueError("it holds nulls")
            flat = col.flatten()
            col = flat
        values = _numbers(col, pa)
        if values.dtype == object or values.dtype.kind not in "biuf":
            raise ValueError(f"its values are {col.type}, not numbers")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if len(values) != n * count:
            raise ValueError(f"{len(values)} values for {n} rows of shape {list(shape)}")
        if values.dtype.kind == "f" and dtype.kind in "biu" and not np.array_equal(values, np.trunc(values)):
            # info.json and the file disagree: a cast would silently truncate the fractions
            raise ValueError(f"it holds {values.dtype} fractions; info.json declares {dtype}")
        return values.astype(dtype, copy=False).reshape((n, *shape))
    except ValueError as e:
        raise ForeignFileError(f"{where}: column {name!r}: {e}") from None


def episode_starts(ids: np.ndarray, episodes: list[Episode], where: str) -> list[int]:
    """The first row of each of ``episodes`` in a data file whose ``episode_index`` column is
    ``ids``: each episode's rows must be contiguous and ``length`` many (one sort, not a scan per
    episode).

    Raises
    ------
    ForeignFileError
        An episode with another row count here, or rows not together (naming the file).
    """
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    want = np.array([ep.index for ep in episodes], np.int64)
    lo = np.searchsorted(sorted_ids, want, side="left")
    hi = np.searchsorted(sorted_ids, want, side="right")
    out = []
    for ep, a, b in zip(episodes, lo.tolist(), hi.tolist()):
        first = int(order[a]) if b > a else 0
        if b - a != ep.length or int(order[b - 1]) - first != ep.length - 1:
            raise ForeignFileError(f"{where}: episode {ep.index} has {b - a} rows here"
                                   f"{' (not contiguous)' if b - a == ep.length else ''}; meta/episodes gives it "
                                   f"{ep.length}")
        out.append(first)
    return out


def _task_column(table: Any, where: str) -> list[str]:
    name = "task" if "task" in table.column_names else "__index_level_0__"
    if name not in table.column_names or "task_index" not in table.column_names:
        raise ForeignFileError(f"{where}: expected columns task_index and task; it has {table.column_names[:10]}")
    idx = column_array(table, "task_index", np.dtype(np.int64), (), where)
    texts = table.column(name).to_pylist()
    if not all(isinstance(t, str) for t in texts) or sorted(idx.tolist()) != list(range(len(idx))):
        raise ForeignFileError(f"{where}: tasks must be strings with task_index 0..{len(idx) - 1}")
    out = [""] * len(idx)
    for i, t in zip(idx.tolist(), texts):
        out[i] = t
    return out


def _tasks_v3(src: Source) -> list[str]:
    return _task_column(read_parquet(src, "meta/tasks.parquet"), src.where("meta/tasks.parquet"))


def _episode_files(src: Source) -> list[str]:
    chunks, _files = src.listdir("meta/episodes")
    if not chunks:
        raise ForeignFileError(f"{src.where('meta/episodes')}: no chunk folders; a LeRobot v3 dataset lists its "
                               "episodes there")
    return [f"meta/episodes/{c}/{f}" for c in chunks for f in src.listdir(f"meta/episodes/{c}")[1]
            if f.endswith(".parquet")]


def _episodes_v3(src: Source, videos: list[str]) -> list[Episode]:
    out: list[Episode] = []
    for key in _episode_files(src):
        where = src.where(key)
        cols = ["episode_index", "tasks", "length", "data/chunk_index", "data/file_index", "dataset_from_index",
                "dataset_to_index"]
        vcols = [f"videos/{v}/{c}" for v in videos for c in ("chunk_index", "file_index", "from_timestamp",
                                                             "to_timestamp")]
        t = read_parquet(src, key, cols + vcols)
        ints = {c: column_array(t, c, np.dtype(np.int64), (), where) for c in cols if c != "tasks"}
        floats = {c: column_array(t, c, np.dtype(np.float64), (), where) for c in vcols}
        tasks = t.column("tasks").to_pylist()
        for i in range(len(t)):
            if not isinstance(tasks[i], list) or not all(isinstance(x, str) for x in tasks[i]):
                raise ForeignFileError(f"{where}: row {i}: tasks must be a list of strings")
            vids = {v: (int(floats[f"videos/{v}/chunk_index"][i]), int(floats[f"videos/{v}/file_index"][i]),
                        float(floats[f"videos/{v}/from_timestamp"][i]), float(floats[f"videos/{v}/to_timestamp"][i]))
                    for v in videos}
            out.append(Episode(int(ints["episode_index"][i]), int(ints["length"][i]), tasks[i],
                               (int(ints["data/chunk_index"][i]), int(ints["data/file_index"][i])),
                               (int(ints["dataset_from_index"][i]), int(ints["dataset_to_index"][i])), vids))
    return out


def _jsonl(src: Source, key: str) -> list[dict[str, Any]]:
    where = src.where(key)
    with src.open(key) as f:
        raw = f.read(MAX_JSONL_BYTES + 1)
    if len(raw) > MAX_JSONL_BYTES:
        raise ForeignFileError(f"{where}: more than {MAX_JSONL_BYTES} bytes; not read")
    out = []
    for n, line in enumerate(bytes(raw).splitlines()):
        if line.strip():
            obj = parse_json(line, where, f"line {n + 1}")
            if not isinstance(obj, dict):
                raise ForeignFileError(f"{where}: line {n + 1} is not a JSON object")
            out.append(obj)
    return out


def _meta_v2(src: Source, info: dict[str, Any], features: dict[str, Feature]) -> tuple[list[str], list[Episode]]:
    where = src.where("meta")
    chunks = info.get("chunks_size", 1000)
    if type(chunks) is not int or chunks < 1:
        raise ForeignFileError(f"{where}/info.json: chunks_size {chunks!r:.40} is not a positive int")
    tasks_rows = _jsonl(src, "meta/tasks.jsonl")
    try:
        pairs = sorted((int(r["task_index"]), str(r["task"])) for r in tasks_rows)
        eps = [(int(r["episode_index"]), int(r["length"]), [str(t) for t in r.get("tasks", [])])
               for r in _jsonl(src, "meta/episodes.jsonl")]
    except (KeyError, TypeError, ValueError) as e:
        raise ForeignFileError(f"{where}: tasks.jsonl / episodes.jsonl rows lack a field or hold a wrong type ({e})") \
            from None
    if [i for i, _ in pairs] != list(range(len(pairs))):
        raise ForeignFileError(f"{where}/tasks.jsonl: task_index must run 0..{len(pairs) - 1}")
    out, start = [], 0
    videos = [k for k, f in features.items() if f.video]
    for index, length, tasks in sorted(eps):
        if not 0 <= index < 1 << 40:
            raise BadValueError(f"{where}/episodes.jsonl: episode_index {index} out of range")
        c = index // chunks
        out.append(Episode(index, length, tasks, (c, index), (start, start + length),
                           {v: (c, index, 0.0, length / float(info["fps"])) for v in videos}))
        start += length
    return [t for _, t in pairs], out
