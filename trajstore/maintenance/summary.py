"""What a store holds, as plain data: the numbers behind ``trajstore info``, ``ls``,
``episodes``, ``head`` and ``stats``.

Every function opens the store read-only (nothing is written, not even a lock file) and
reads committed rows only.  Reads go through the store's tables a block of rows at a time,
so memory stays bounded by a block whatever the store's size.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterator

import gymnasium
import numpy as np

from trajstore.core.episodes import all_done, done_fields, episode_numbers, scalar_field
from trajstore.core.ring import contiguous_runs
from trajstore.core.store import Store
from trajstore.core.table import Table
from trajstore.errors import DamagedStoreError, NoEpisodesError, UnknownEpisodeError, UnknownFieldError
from trajstore.storage.keys import DATASET_KEY
from trajstore.storage.robot_files import robot_summary
from trajstore.storage.schema import load_json

__all__ = [
    "store_info", "space_tree", "open_store", "array_list", "select_fields", "episode_table", "head_rows",
    "summarize_value", "episode_counts",
]

#: Rows a block read may hold (bytes), so stats/episodes stay in bounded memory.
BLOCK_BYTES = 64 << 20
#: Leaves with more elements than this are summarized (shape, dtype, min, max) by ``head``.
HEAD_MAX_ELEMENTS = 16

STEPS, EPISODES, STEP_IDS = "step_data", "episode_data", "step_episode_ids"
_REWARD_NAMES = ("reward", "rewards", "rew")


def space_tree(space: gymnasium.Space, indent: str = "") -> str:
    """A readable multi-line rendering of a (nested) space."""
    if not isinstance(space, (gymnasium.spaces.Dict, gymnasium.spaces.Tuple)):
        return f"{indent}{space}"
    items = space.spaces.items() if isinstance(space, gymnasium.spaces.Dict) else enumerate(space.spaces)
    lines = []
    for key, sub in items:
        if isinstance(sub, (gymnasium.spaces.Dict, gymnasium.spaces.Tuple)):
            lines += [f"{indent}{key}: {type(sub).__name__}", space_tree(sub, indent + "  ")]
        else:
            lines.append(f"{indent}{key}: {sub}")
    return "\n".join(lines)


def open_store(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Store:
    """Open the store at ``path`` read-only (any kind)."""
    return Store.open(path, None, read_only=True, multiprocessing=False, storage_options=storage_options, options={})


def _codec_label(z: Any) -> str:
    from trajstore.storage.fields.video_codec import VIDEO_ATTR, codec_from_attrs

    if VIDEO_ATTR in z.attrs:  # a video field: its settings ("h264:crf=23:g=10:...")
        try:
            return "video " + codec_from_attrs(z.attrs[VIDEO_ATTR]).label
        except ValueError:
            return "video (unreadable settings)"
    names = []
    for c in z.metadata.codecs:
        d = c.to_dict()
        if d["name"] == "bytes":
            continue
        cname = (d.get("configuration") or {}).get("cname")
        inner: Any = getattr(c, "codecs", ())  # an image field's shard: name its frames' codec ("jpeg:90")
        if len(inner) == 1 and hasattr(inner[0], "label"):
            names.append(inner[0].label)
            continue
        names.append(f"{d['name']}:{cname}" if cname else d["name"])
    return "+".join(names) or "none"


def _array_sizes(store: Store, present: dict[str, set[int]] | None = None) -> dict[str, tuple[int, int]]:
    """Array path -> (bytes stored, chunk objects stored); ``present`` (if given) gets, per array
    path, the row-chunk numbers of its chunk keys."""
    sizes: dict[str, tuple[int, int]] = {}
    for key, n in store.loc.iter_sizes(""):
        if "/video/" in key:  # a video field's segments, index and packs: its stored bytes, each segment a "chunk"
            top = key.partition("/video/")[0]
            b, c = sizes.get(top, (0, 0))
            sizes[top] = (b + n, c + (not key.endswith("/index") and "/video/pack/" not in key))
        elif "/c/" in key or key.startswith("c/"):
            top, _, rest = key.rpartition("/c/") if "/c/" in key else ("", "", key[2:])
            b, c = sizes.get(top, (0, 0))
            sizes[top] = (b + n, c + 1)
            if present is not None and rest.split("/", 1)[0].isdigit():
                present.setdefault(top, set()).add(int(rest.split("/", 1)[0]))
    return sizes


def _check_committed_chunks(store: Store, present: dict[str, set[int]]) -> None:
    """Raise DamagedStoreError naming the first field whose committed rows lie in a chunk that has
    no key (deleted, or a commit record naming rows never written): reads would give zeros."""
    for table in store.tables.values():
        for f in table.fields:
            if f.spec.layout == "video":  # no chunks: its segments are checked by `trajstore verify`
                continue
            have = present.get(f.spec.array_path, set())
            for lo, _off, m in contiguous_runs(table.state.start, table.state.end, table.capacity):
                missing = sorted(set(range(lo // f.C, (lo + m - 1) // f.C + 1)) - have)
                if missing:
                    k = missing[0]
                    raise DamagedStoreError(
                        f"{store.loc.url}: {f.spec.array_path}: rows {max(lo, k * f.C)}..{min(lo + m, (k + 1) * f.C) - 1} "
                        f"(physical) are committed, but their chunk {k} is missing ({len(missing)} chunk(s) missing); "
                        "run `trajstore verify`")


def array_list(store: Store, *, check: bool = False) -> list[dict[str, Any]]:
    """One entry per stored array: path, table, shape, committed rows, dtype, chunk shape, codec,
    stored bytes and chunks, logical bytes (committed rows x row size) and ``ratio``: logical /
    stored bytes for compressed arrays, ``None`` for raw ones (their chunk files hold blocks a
    bounded step ahead of the rows, so the quotient says how full they are, not how well they compress).

    ``check``: raise DamagedStoreError when a chunk holding committed rows has no key (the listing
    is made anyway, so this costs a set per array)."""
    present: dict[str, set[int]] = {}
    sizes = _array_sizes(store, present if check else None)
    if check:
        _check_committed_chunks(store, present)
    out = []
    for name, table in store.tables.items():
        for f in table.fields:
            z: Any = store.group[f.spec.array_path]  # a zarr array (a field's)
            stored, nchunks = sizes.get(f.spec.array_path, (0, 0))
            logical = table.count * f.spec.row_bytes
            codec = _codec_label(z)
            out.append({
                "path": f.spec.array_path, "table": name, "shape": [int(s) for s in z.shape],
                "committed_rows": table.count, "dtype": str(f.spec.dtype), "chunk_rows": f.spec.chunk_rows,
                "chunks": [int(c) for c in z.chunks], "layout": f.spec.layout, "codec": codec,
                "stored_bytes": stored, "stored_chunks": nchunks, "logical_bytes": logical,
                "ratio": float(logical / stored) if stored and codec != "none" else None,
            })
    return out


def store_info(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Summary of the store at ``path`` (opened read-only; nothing is written).

    Returns
    -------
    dict
        ``path, kind, format_version, created_by, created_at, generation, tables`` (rows,
        capacity, offset per table), ``spaces`` (JSON), ``spaces_text`` (rendered), ``arrays``
        (as :func:`array_list`), ``episodes`` (as :func:`episode_counts`), ``stored_bytes``
        (every key, temp files included; of a zip store, the zip file), ``logical_bytes``
        (committed rows x row size),
        ``compression_ratio`` (logical / stored bytes of the compressed arrays; ``None`` when
        every array is raw), ``compressed_arrays`` and ``raw_arrays`` (counts).
    """
    store = open_store(path, storage_options)
    try:
        arrays = array_list(store, check=True)
        logical = sum(a["logical_bytes"] for a in arrays)
        stored_total = sum(n for _k, n in store.loc.iter_sizes(""))
        if store.loc.url is not None and str(store.loc.url).endswith(".zip") and os.path.isfile(store.loc.url):
            stored_total = os.path.getsize(store.loc.url)  # the file, not its members unpacked
        packed = [a for a in arrays if a["ratio"] is not None or (a["codec"] != "none" and not a["stored_bytes"])]
        stored_packed = sum(a["stored_bytes"] for a in packed)
        spaces = store.attrs.get("spaces", {})
        return {
            "path": store.loc.url,
            "kind": store.attrs.get("kind"),
            "format_version": store.attrs.get("format_version"),
            "created_by": store.attrs.get("created_by"),
            "created_at": store.attrs.get("created_at"),
            "generation": store.committed.generation,
            "tables": {n: {"rows": t.count, "capacity": t.capacity, "offset": t.offset} for n, t in store.tables.items()},
            "spaces": spaces,
            "spaces_text": {n: space_tree(store.space(n)) for n in spaces},
            "arrays": arrays,
            "episodes": episode_counts(store),
            "stored_bytes": stored_total,
            "logical_bytes": logical,
            "compression_ratio": (float(sum(a["logical_bytes"] for a in packed) / stored_packed) if stored_packed
                                  else None),
            "compressed_arrays": len(packed),
            "raw_arrays": len(arrays) - len(packed),
            "state": store.committed.state,
            "dataset": _dataset_info(store),
            "robot": robot_summary(store.loc, store.committed.epoch),
        }
    finally:
        store.close()


def episode_counts(store: Store) -> dict[str, Any] | None:
    """How many episodes the store holds, as a user counts them.

    Returns
    -------
    dict or None
        ``finished`` (ended episodes with steps in the store), ``in_progress`` (1 when the
        episode being recorded has steps, else 0), ``present`` (``finished + in_progress``) and
        ``source``.  Trajectory stores add ``finished_total`` (episodes ended since the store was
        created, evicted ones included), ``total`` (episode ids ever given: the current one too,
        even without steps), ``current_id`` and ``with_data`` (episode-data rows).  Replay
        buffers with terminated/truncated/done fields count from those flags (and add
        ``complete``, the same as ``finished``); other replay buffers give None.
    """
    if store.attrs.get("kind") == "TrajectoryReplayBuffer":
        t = store.tables[STEPS]
        ids = np.unique(_read_column(t, _field_index(t, STEP_IDS)))
        state = store.committed.state
        cur = int(state.get("current_episode_id", 0))
        total = int(state.get("next_episode_id", cur + 1))
        open_ = int(bool(np.isin(cur, ids)))
        et = store.tables.get(EPISODES)
        return {"present": int(ids.size), "finished": int(ids.size) - open_, "in_progress": open_,
                "finished_total": max(total - 1, int(ids.size) - open_), "total": total, "current_id": cur,
                "with_data": 0 if et is None else et.count, "source": "episode ids"}
    flags = done_fields(store.tables[STEPS])
    if flags is None:
        return None
    done = all_done(store.tables[STEPS], flags)
    n = int(done.sum())
    open_tail = int(bool(len(done) and not done[-1]))
    return {"present": n + open_tail, "finished": n, "in_progress": open_tail, "complete": n,
            "source": "terminated/truncated flags"}


# -- fields ----------------------------------------------------------------------------------
def _field_index(t: Table, path: str) -> int:
    return next(j for j, f in enumerate(t.fields) if f.spec.array_path == path)


def select_fields(store: Store, field: str | None, *, default_table: str = STEPS) -> list[tuple[Table, int]]:
    """Fields whose array path is ``field`` or lies under it (``obs`` also matches
    ``step_data/obs``); all fields of ``default_table`` when ``field`` is None.

    Raises
    ------
    KeyError
        Nothing matches (the message lists the array paths).
    """
    if field is None:
        t = store.tables[default_table]
        return [(t, j) for j in range(len(t.fields))]
    want = field.strip("/")
    out: list[tuple[Table, int]] = []
    for cand in (want, f"{STEPS}/{want}"):
        for t in store.tables.values():
            for j, f in enumerate(t.fields):
                p = f.spec.array_path
                if p == cand or p.startswith(cand + "/"):
                    out.append((t, j))
        if out:
            return out
    paths = [f.spec.array_path for t in store.tables.values() for f in t.fields]
    raise UnknownFieldError(f"no array matches field {field!r}; arrays: {', '.join(paths)}")


def _block_rows(t: Table, which: list[int]) -> int:
    row = sum(max(t.fields[j].spec.row_bytes, 1) for j in which) or 1
    C = max(t.fields[j].spec.chunk_rows for j in which) if which else 1
    rows = max(1, BLOCK_BYTES // row)
    return max(1, rows // C * C) if rows >= C else rows


def iter_blocks(t: Table, which: list[int], lo: int = 0, hi: int | None = None) -> Iterator[tuple[int, list[np.ndarray]]]:
    """``(first logical row, arrays)`` of committed rows ``[lo, hi)`` a bounded block at a time."""
    hi = t.count if hi is None else hi
    step = _block_rows(t, which)
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        yield a, t.read_contiguous(a, b, which)


def _read_column(t: Table, j: int) -> np.ndarray:
    """A whole committed column (used for small per-row columns: ids, rewards, flags)."""
    return t.read_contiguous(0, t.count, [j])[0]


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(len(a))


# -- episodes ----------------------------------------------------------------------------------
def episode_table(store: Store, reward_field: str | None = None) -> dict[str, Any]:
    """One entry per episode with steps present, ordered by first step.

    Trajectory stores group rows by their episode id (as ``TrajectoryReplayBuffer.episodes()``);
    replay buffers with ``terminated``/``truncated`` (or ``done``) fields split rows after every
    flagged row, numbering episodes from 0 (a ring's first episode may have lost its start).

    Returns
    -------
    dict
        ``episode_id, start, length, live`` arrays; ``return`` (float64 sums of the reward field:
        ``reward_field`` if given, else a scalar leaf named ``reward``/``rewards``, else absent);
        ``terminated``/``truncated`` (flag of each episode's last step) when those fields exist;
        ``reward_field`` (the leaf used or None) and ``source``.

    Raises
    ------
    ValueError
        A replay buffer without terminated/truncated/done fields (no episode boundaries).
    KeyError
        ``reward_field`` names no scalar step leaf.
    """
    t = store.tables[STEPS]
    flags = done_fields(t)
    n = t.count
    if store.attrs.get("kind") == "TrajectoryReplayBuffer":
        ids = _read_column(t, _field_index(t, STEP_IDS))
        uniq, first, inverse, counts = np.unique(ids, return_index=True, return_inverse=True, return_counts=True)
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        ep_of_row = rank[inverse.reshape(-1)]
        eids = uniq[order].astype(np.int64)
        cur = int(store.committed.state.get("current_episode_id", 0))
        live = eids == cur
        starts, lengths = first[order].astype(np.int64), counts[order].astype(np.int64)
        source = "episode ids"
    else:
        if flags is None:
            raise NoEpisodesError("this ReplayBuffer has no terminated/truncated (or done) fields, so it has no episode "
                             "boundaries; episodes are listed for TrajectoryReplayBuffer stores and for replay "
                             "buffers that record those flags")
        done = all_done(t, flags)
        ep_of_row = episode_numbers(done)
        n_eps = int(ep_of_row[-1]) + 1 if n else 0
        counts = np.bincount(ep_of_row, minlength=n_eps)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if n_eps else np.zeros(0, np.int64)
        lengths = counts.astype(np.int64)
        eids = np.arange(n_eps, dtype=np.int64)
        live = np.zeros(n_eps, bool)
        if n_eps and not done[-1]:
            live[-1] = True
        source = "terminated/truncated flags"
    n_eps = len(eids)
    out: dict[str, Any] = {
        "episode_id": eids,
        "start": starts,
        "length": lengths,
        "live": live,
        "reward_field": None,
        "source": source,
    }
    # Last row of each episode (for flags): the row where the episode's rank last appears.
    last = np.zeros(n_eps, np.int64)
    if n:
        last[ep_of_row] = np.arange(n)  # later rows overwrite earlier ones
    if reward_field is not None:
        sel = [(tt, j) for tt, j in select_fields(store, reward_field) if tt is t]
        if len(sel) != 1 or int(np.prod(t.fields[sel[0][1]].spec.row_shape, dtype=np.int64)) != 1:
            raise UnknownFieldError(f"--reward-field {reward_field!r} must name one scalar step field")
        rj: int | None = sel[0][1]
    else:
        rj = scalar_field(t, _REWARD_NAMES)
    if rj is not None:
        rew = _flat(_read_column(t, rj)).astype(np.float64)
        out["return"] = np.bincount(ep_of_row, weights=rew, minlength=n_eps) if n else np.zeros(0)
        out["reward_field"] = t.fields[rj].spec.array_path
    for key in ("terminated", "truncated"):
        if flags is not None and key in flags:
            col = _flat(_read_column(t, flags[key])).astype(bool)
            out[key] = col[last] if n else np.zeros(0, bool)
    return out


def episode_rows(store: Store, episode_id: int) -> np.ndarray:
    """Logical step rows of episode ``episode_id`` (KeyError when it has none)."""
    eps = episode_table(store)
    k = np.flatnonzero(eps["episode_id"] == episode_id)
    if k.size == 0:
        raise UnknownEpisodeError(f"episode {episode_id} has no steps in the store")
    if store.attrs.get("kind") == "TrajectoryReplayBuffer":
        t = store.tables[STEPS]
        return np.flatnonzero(_read_column(t, _field_index(t, STEP_IDS)) == episode_id)
    s, n = int(eps["start"][k[0]]), int(eps["length"][k[0]])
    return np.arange(s, s + n)


# -- head -----------------------------------------------------------------------------------------
def summarize_value(a: np.ndarray, max_elements: int = HEAD_MAX_ELEMENTS) -> Any:
    """A small array as a (nested) list; a large one as ``{shape, dtype, min, max}``."""
    a = np.asarray(a)
    if a.size <= max_elements:
        v = a.tolist()
        return _clean(v)
    finite = a[np.isfinite(a)] if a.dtype.kind == "f" else a
    mn = finite.min().item() if finite.size else None
    mx = finite.max().item() if finite.size else None
    return {"shape": list(a.shape), "dtype": str(a.dtype), "min": _clean(mn), "max": _clean(mx)}


def _clean(v: Any) -> Any:
    """JSON-safe scalars: NaN/inf become strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def head_rows(store: Store, n: int = 5, field: str | None = None, episode: int | None = None) -> dict[str, Any]:
    """The first ``n`` committed rows (of episode ``episode`` if given) of the selected fields.

    Returns ``{"table", "rows": [logical row numbers], "fields": [array paths], "values":
    [{array path: value or summary}, ...]}`` (see :func:`summarize_value`).
    """
    fields = select_fields(store, field)
    tables = {t.name for t, _ in fields}
    if len(tables) != 1:
        raise UnknownFieldError(f"--field {field!r} matches arrays of several tables ({', '.join(sorted(tables))}); pick one")
    t = fields[0][0]
    which = [j for _t, j in fields]
    if episode is not None:
        if t.name != STEPS:
            raise UnknownFieldError("--episode selects step rows; --field must name step data")
        rows = episode_rows(store, episode)[: max(n, 0)]
    else:
        rows = np.arange(min(max(n, 0), t.count))
    arrays = t.gather(rows.astype(np.int64), which) if len(rows) else [np.zeros((0,) + t.fields[j].spec.row_shape) for j in which]
    names = [t.fields[j].spec.array_path for j in which]
    values = [{name: summarize_value(a[i]) for name, a in zip(names, arrays)} for i in range(len(rows))]
    return {"table": t.name, "rows": rows.tolist(), "fields": names, "values": values}


def _dataset_info(store: Store) -> dict[str, Any] | None:
    """The store's dataset description (trajstore.metadata), if one was set."""

    raw = store.loc.get(DATASET_KEY)
    return None if raw is None else load_json(raw, str(store.loc.url), DATASET_KEY)
