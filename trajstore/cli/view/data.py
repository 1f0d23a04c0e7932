"""What ``trajstore view`` shows, as JSON-ready dicts and decoded frames: one store opened read-only.

A :class:`StorePart` is one store (a plain store, one store of a stable-baselines3 buffer folder,
one shard of a sharded dataset).  It opens the store read-only with the CLI's
:func:`~trajstore.maintenance.summary.open_store` (nothing is ever written: no lock file, no temp
file) and answers the page's questions: the overview (:func:`~trajstore.maintenance.summary.store_info`,
what ``trajstore info --json`` prints), the episode table (:func:`~trajstore.maintenance.summary.episode_table`,
plus every scalar episode-data column of a trajectory store) filtered with ``trajstore filter
--where``'s language (:mod:`trajstore.maintenance.where`), one episode's scalar and small vector
fields, and single frames of its image fields.

Every name in a request (episode id, field path, step, sort column) is checked against what the
store holds before anything is read; nothing in a request becomes a file path.  Before each
answer the store adopts the newest commit record (a ``stat`` for a local store), so a page over a
store a writer is filling sees new rows, and a ring's evicted episodes disappear.  Reads of one
store are serialised by a lock: a reader handle is not shared by threads mid-read.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from trajstore.cli.view.robot import check_where_tasks, stats_answer, task_dictionary, time_axis
from trajstore.core.store import Store
from trajstore.core.table import Table
from trajstore.errors import (
    BadOptionError,
    ConcurrentWriteError,
    IndexOutOfRangeError,
    NoEpisodesError,
    UnknownEpisodeError,
    UnknownFieldError,
)
from trajstore.maintenance.summary import STEP_IDS, STEPS, episode_table, open_store, store_info
from trajstore.maintenance.where import MAX_WHERE_CHARS, compile_where
from trajstore.storage.robot_files import RobotInfo, load_robot

__all__ = ["StorePart", "MAX_PAGE", "MAX_SERIES_STEPS", "MAX_SERIES_VALUES", "MAX_SERIES_WIDTH", "is_image_shape"]

#: Most episodes one page of the table holds.
MAX_PAGE = 500
#: Most steps of one episode sent as series; a longer episode is sent every k-th step.
MAX_SERIES_STEPS = 20_000
#: Most numbers one episode's answer holds (steps x plotted numbers per step); more: a larger stride.
MAX_SERIES_VALUES = 1_000_000
#: A field with at most this many numbers per step is plotted (one line per element).
MAX_SERIES_WIDTH = 16
#: Episodes whose step rows are kept (an LRU of the last few opened).
_ROW_CACHE = 8
#: Reads redone when a writer turned the ring under them, before the episode is reported gone.
_TRIES = 3


def is_image_shape(shape: tuple[int, ...], dtype: np.dtype, layout: str) -> bool:
    """Whether rows of ``shape`` and ``dtype`` are shown as frames: image and video fields, and uint8
    rows of shape (H, W) or (H, W, C) with C in 1, 3, 4 and H, W >= 8 (raw Atari or camera frames)."""
    if layout in ("image", "video"):
        return True
    if dtype != np.uint8 or len(shape) not in (2, 3) or min(shape[:2]) < 8:
        return False
    return len(shape) == 2 or shape[2] in (1, 3, 4)


def _json_value(v: Any) -> Any:
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return str(v)
    return v


class StorePart:
    """One store of what ``trajstore view`` was given, opened read-only on first use.

    Parameters
    ----------
    name : str
        Its name on the page ("" for a lone store, ``shards/00003``, ``transitions``...).
    url : str
        Its path or URL, as the CLI opens it.
    storage_options : dict or None
        fsspec options for a URL (``--storage-options``).
    """

    def __init__(self, name: str, url: str, storage_options: dict[str, Any] | None) -> None:
        self.name, self.url, self.storage_options = name, url, storage_options
        self.lock = threading.Lock()
        self._store: Store | None = None
        self._buf: Any = None  # a read-only TrajectoryReplayBuffer, for episode-data columns
        self._cache: dict[str, tuple[int, Any]] = {}  # what -> (generation, value)
        self._rows: dict[int, np.ndarray] = {}  # episode id -> logical step rows (this generation)
        self._rows_gen = -1
        self._tasks: tuple[dict[str, np.ndarray], RobotInfo, np.ndarray] | None = None  # the last task column
        self._stats: dict[str, Any] = {}  # the last statistics answer (trajstore.cli.view.robot.stats_answer)

    # -- opening and refreshing ------------------------------------------------------------------
    def store(self) -> Store:
        """The open store, at its newest commit record (opened on first use; a store that cannot
        be opened raises the error the CLI reports, each time it is asked for)."""
        if self._store is None:
            self._store = open_store(self.url, self.storage_options)
        else:
            self._store.refresh()
        return self._store

    def close(self) -> None:
        """Close the store (and the episode-data reader) if open."""
        for h in (self._buf, self._store):
            if h is not None:
                h.close()
        self._store = self._buf = None

    def _cached(self, what: str, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per commit record."""
        gen = self.store().committed.generation
        hit = self._cache.get(what)
        if hit is not None and hit[0] == gen:
            return hit[1]
        value = make()
        self._cache[what] = (gen, value)
        return value

    # -- questions ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What changes while a writer fills the store: ``generation``, rows per table and the
        episode count (None for a store without episode boundaries)."""
        store = self.store()
        eps = self._episodes_or_none()
        return {"generation": store.committed.generation,
                "rows": {n: t.count for n, t in store.tables.items()},
                "episodes": None if eps is None else len(eps["episode_id"])}

    def overview(self) -> dict[str, Any]:
        """``trajstore info --json`` of the store (its text rendering of the spaces included; its
        ``robot`` entry says the frame rate and whether statistics are stored) and
        ``task_dictionary`` (:func:`~trajstore.cli.view.robot.task_dictionary`; None without tasks)."""
        store = self.store()
        info: dict[str, Any] = self._cached("overview", lambda: store_info(self.url, storage_options=self.storage_options))
        robot = load_robot(store.loc)
        eps = self._episodes_or_none() if robot.tasks else None
        tasks = None if eps is None else task_dictionary(robot, eps["episode_id"])
        return {**info, "task_dictionary": tasks}

    def stats(self) -> dict[str, Any]:
        """The stored statistics aggregated over the episodes they are current for
        (:func:`~trajstore.cli.view.robot.stats_answer`); ``stored`` False for a store without them."""
        buf = self.trajectory()
        if buf is None:
            return {"stored": False, "episodes": 0, "of": 0, "fields": []}
        return stats_answer(buf, self._stats)

    def _episodes_or_none(self) -> dict[str, np.ndarray] | None:
        try:
            return self.episode_columns()
        except NoEpisodesError:
            return None

    def episode_columns(self) -> dict[str, np.ndarray]:
        """The episode table as columns: ``episode_id, start, length, live``, ``return`` (when the
        store has a reward field), ``terminated``/``truncated`` (when recorded), and every scalar
        episode-data column of a trajectory store (``task``, ``info/success``...).  Raises
        NoEpisodesError for a replay buffer without done flags."""
        cols: dict[str, np.ndarray] = self._cached("episodes", lambda: self._consistent(self._read_episodes))
        return cols

    def _read_episodes(self) -> dict[str, np.ndarray]:
        store = self.store()
        eps = episode_table(store)
        cols = {k: np.asarray(v) for k, v in eps.items() if isinstance(v, np.ndarray)}
        if "episode_data" in store.tables and store.tables["episode_data"].count and self.trajectory() is not None:
            cols.update(self._episode_data(cols["episode_id"]))
        return cols

    def trajectory(self) -> Any:
        """The store as a read-only TrajectoryReplayBuffer (opened on first use), or None for
        another kind of store (its robot metadata, episode data and statistics are a trajectory
        store's)."""
        from trajstore.buffers.trajectory import TrajectoryReplayBuffer

        if self._buf is None:
            if self.store().attrs.get("kind") != TrajectoryReplayBuffer.__name__:
                return None
            self._buf = TrajectoryReplayBuffer.load_from(self.url, read_only=True, storage_options=self.storage_options)
        return self._buf

    def table_columns(self) -> dict[str, np.ndarray]:
        """:meth:`episode_columns` and, when the store has a task dictionary (and no episode-data
        field ``task``), ``task``: each episode's task string ("" for none), the column ``trajstore
        filter --where`` compares quoted strings with.  The task file is read at each call (an edit
        of the tasks commits nothing, so the commit generation does not say it changed)."""
        cols = self.episode_columns()
        info = load_robot(self.store().loc)
        if not info.tasks or "task" in cols:
            return cols
        hit = self._tasks
        if hit is None or hit[0] is not cols or hit[1] != info:
            hit = self._tasks = (cols, info, info.task_of(cols["episode_id"]).astype(str))
        return {**cols, "task": hit[2]}

    def _episode_data(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Scalar episode-data columns aligned with ``ids`` (read through the buffer's
        :func:`~trajstore.buffers.episode_edit.episode_columns`, the columns ``filter --where`` sees)."""
        from trajstore.buffers.episode_edit import TABLE_COLUMNS, episode_columns

        data = episode_columns(self.trajectory())
        # The buffer may have read a newer record than the table: align its rows on the ids.
        sorter = np.argsort(data["episode_id"], kind="stable")
        sorted_ids = data["episode_id"][sorter]
        pos = np.minimum(np.searchsorted(sorted_ids, ids), max(len(sorted_ids) - 1, 0))
        found = sorted_ids[pos] == ids if len(sorted_ids) else np.zeros(len(ids), bool)
        src = sorter[pos] if len(sorted_ids) else pos
        out: dict[str, np.ndarray] = {}
        for k, v in data.items():
            if k in ("episode_id", "start", "length", "live") or np.ndim(v) != 1 or v.dtype.kind not in "biuf":
                continue
            col = np.where(found, v[src], np.zeros((), v.dtype)) if len(v) else np.zeros(len(ids), v.dtype)
            out[k if k not in TABLE_COLUMNS or k == "has_data" else f"data.{k}"] = col
        return out

    def episodes(self, where: str = "", sort: str = "", desc: bool = False, offset: int = 0,
                 limit: int = 100) -> dict[str, Any]:
        """One page of the episode table.

        Parameters
        ----------
        where : str
            An expression of ``trajstore filter --where`` over the columns ("" keeps all).
        sort : str
            A column to order by ("": by first step); ties keep first-step order.
        desc : bool
            Largest first.
        offset, limit : int
            The page: rows ``[offset, offset + limit)`` of the ordered, filtered table
            (``limit`` <= :data:`MAX_PAGE`).

        Returns
        -------
        dict
            ``columns`` (names), ``total`` (episodes), ``matched`` (after ``where``), ``offset``,
            ``rows`` (lists of values, in ``columns`` order).

        Raises
        ------
        BadOptionError
            A bad ``where``, ``sort``, ``offset`` or ``limit``.
        UnknownFieldError
            ``where`` names no column.
        """
        if not 1 <= limit <= MAX_PAGE or offset < 0:
            raise BadOptionError(f"limit must be 1..{MAX_PAGE} and offset >= 0; got limit={limit}, offset={offset}")
        if len(where) > MAX_WHERE_CHARS:
            raise BadOptionError(f"where: {len(where)} characters; at most {MAX_WHERE_CHARS}")
        cols = self.table_columns()
        names = list(cols)
        n = len(cols["episode_id"])
        keep = np.arange(n)
        if where.strip():
            evaluate = compile_where(where, cols)  # unknown fields and bad syntax first
            check_where_tasks(self.trajectory() if "task" in cols else None, where)
            keep = np.flatnonzero(evaluate(cols))
        if sort:
            if sort not in cols:
                raise BadOptionError(f"sort: no column {sort!r}; the columns are {names}")
            keep = keep[_order(cols[sort][keep], desc)]
        page = keep[offset:offset + limit]
        rows = [[_json_value(cols[c][i]) for c in names] for i in page.tolist()]
        return {"columns": names, "total": n, "matched": int(len(keep)), "offset": offset, "rows": rows}

    # -- one episode ------------------------------------------------------------------------------
    def _episode(self, eid: int) -> tuple[int, int]:
        """(first step row, length) of episode ``eid``; UnknownEpisodeError when it has no steps."""
        cols = self.episode_columns()
        k = np.flatnonzero(cols["episode_id"] == eid)
        if k.size == 0:
            raise UnknownEpisodeError(f"episode {eid} has no steps in the store ({len(cols['episode_id'])} "
                                      "episode(s); a ring may have evicted it)")
        return int(cols["start"][k[0]]), int(cols["length"][k[0]])

    def episode_rows(self, eid: int) -> np.ndarray:
        """Logical step rows of episode ``eid``, (length,) int64, in step order."""
        store = self.store()
        gen = store.committed.generation
        if gen != self._rows_gen:
            self._rows, self._rows_gen = {}, gen
        hit = self._rows.get(eid)
        if hit is not None:
            return hit
        start, length = self._episode(eid)
        rows = np.arange(start, start + length, dtype=np.int64)
        t = store.tables[STEPS]
        j = _field_index(t, STEP_IDS)
        if j is not None:  # a trajectory store: its steps are contiguous unless episodes interleave
            ids = t.read_contiguous(start, start + length, [j])[0].reshape(-1)
            if not np.all(ids == eid):
                rows = np.flatnonzero(t.read_contiguous(0, t.count, [j])[0].reshape(-1) == eid).astype(np.int64)
        if len(self._rows) >= _ROW_CACHE:
            self._rows.pop(next(iter(self._rows)))
        self._rows[eid] = rows
        return rows

    def fields(self) -> list[dict[str, Any]]:
        """The step table's fields: ``path``, ``shape``, ``dtype``, ``kind`` ("series": plotted,
        "image": frames, "other": listed only)."""
        t = self.store().tables[STEPS]
        out = []
        for f in t.fields:
            s = f.spec
            if s.array_path == f"{STEPS}/{STEP_IDS}" or s.array_path == STEP_IDS:
                continue
            width = int(np.prod(s.row_shape, dtype=np.int64))
            kind = ("image" if is_image_shape(s.row_shape, s.dtype, s.layout)
                    else "series" if width <= MAX_SERIES_WIDTH and s.dtype.kind in "biuf" else "other")
            out.append({"path": s.array_path, "shape": list(s.row_shape), "dtype": str(s.dtype), "kind": kind})
        return out

    def _consistent(self, read: Callable[[], Any]) -> Any:
        """``read()`` with every row it read still stored under the newest record: a writer that
        turned a ring meanwhile may have put other steps in those slots, so the read is redone
        (rows found again) at most :data:`_TRIES` times, then ConcurrentWriteError says to ask again."""
        for _ in range(_TRIES):
            store = self.store()
            before = store.committed
            out = read()
            store.refresh()
            if store.rows_intact(before):
                return out
        raise ConcurrentWriteError(f"{self.url}: a writer turned the ring {_TRIES} times while its rows were read; "
                                   "ask again")

    def episode(self, eid: int) -> dict[str, Any]:
        """Episode ``eid`` as :meth:`_episode_now` reads it, from one commit record's rows."""
        out: dict[str, Any] = self._consistent(lambda: self._episode_now(eid))
        return out

    def _episode_now(self, eid: int) -> dict[str, Any]:
        """Episode ``eid``: ``id, length, rows`` (first and last step row), ``stride`` (every k-th
        step is in the series), ``steps`` (the step numbers sent), ``fields`` (as :meth:`fields`)
        ``series``: field path -> list of per-element lists (one per number of the row) and ``time``:
        the steps' times in seconds when the store has a time (:func:`~trajstore.cli.view.robot.time_axis`)."""
        rows = self.episode_rows(eid)
        t = self.store().tables[STEPS]
        fields = self.fields()
        plotted = [f for f in fields if f["kind"] == "series"]
        width = sum(max(1, int(np.prod(f["shape"], dtype=np.int64))) for f in plotted)
        stride = max(1, -(-len(rows) // MAX_SERIES_STEPS), -(-len(rows) * width // MAX_SERIES_VALUES))
        steps = np.arange(0, len(rows), stride)
        which = [_field_index(t, f["path"]) for f in plotted]
        arrays = t.gather(rows[steps], [j for j in which if j is not None]) if len(rows) and plotted else []
        series = {}
        for f, a in zip(plotted, arrays):
            flat = np.asarray(a).reshape(len(steps), -1).astype(np.float64)
            series[f["path"]] = [[_json_value(x) for x in flat[:, k].tolist()] for k in range(flat.shape[1])]
        return {"id": eid, "length": int(len(rows)), "rows": [int(rows[0]), int(rows[-1])] if len(rows) else [],
                "stride": stride, "steps": steps.tolist(), "fields": fields, "series": series,
                "time": time_axis(self.store().loc, series, steps)}

    def frame(self, eid: int, field: str, step: int) -> np.ndarray:
        """Frame ``step`` of image field ``field`` in episode ``eid``, decoded: (H, W) or (H, W, C)
        uint8.  Read through the field's own read path (:meth:`Table.read_contiguous`), so any
        field engine that decodes rows (per-frame codecs, video) serves frames the same way.

        Raises
        ------
        UnknownFieldError
            ``field`` is no image field of the store.
        UnknownEpisodeError, IndexOutOfRangeError
            No such episode, or ``step`` outside ``[0, length)``.
        """
        images = [f["path"] for f in self.fields() if f["kind"] == "image"]
        if field not in images:
            raise UnknownFieldError(f"no image field {field!r}; the image fields are {images}")
        t = self.store().tables[STEPS]
        j = _field_index(t, field)
        assert j is not None  # listed by fields()

        def read() -> np.ndarray:
            rows = self.episode_rows(eid)  # of the newest record: a ring may have dropped steps since
            if not 0 <= step < len(rows):
                raise IndexOutOfRangeError(f"step {step} is outside episode {eid} (steps 0..{len(rows) - 1})")
            r = int(rows[step])
            return np.asarray(t.read_contiguous(r, r + 1, [j])[0][0])

        frame: np.ndarray = self._consistent(read)
        return frame


def _order(col: np.ndarray, desc: bool) -> np.ndarray:
    """Positions sorting ``col`` stably (ties keep first-step order): numbers as numbers (bools and
    unsigned ints negate as numbers), text by its rank in code-point order."""
    key = np.unique(col, return_inverse=True)[1].astype(np.float64) if col.dtype.kind in "USO" else col.astype(np.float64)
    return np.argsort(-key if desc else key, kind="stable")


def _field_index(t: Table, path: str) -> int | None:
    """Index of the field of ``t`` whose array path is ``path`` (or ``step_data/path``), or None."""
    for j, f in enumerate(t.fields):
        if f.spec.array_path in (path, f"{STEPS}/{path}"):
            return j
    return None
