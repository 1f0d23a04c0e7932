"""Sharded dataset roots (:mod:`trajstore.shards`) in ``info``, ``episodes``, ``stats``, ``verify`` and ``copy``.

A root is recognised by its root record (``trajstore.shards.json``); the commands then run their
per-store code on every shard (``shards/<name>``, name order) and add the results up.  Global
rows and episode ids are those of :func:`~trajstore.shards.open_sharded`: shards in name order,
episode ``e`` of the ``k``-th shard is ``k * 2**40 + e``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any, Callable, Iterator

import numpy as np

from trajstore.cli._common import CLIError, fmt_bytes, print_spaces, print_table
from trajstore.errors import DamagedStoreError, FormatVersionError
from trajstore.maintenance.moments import field_stats, merge_stats
from trajstore.maintenance.staged import partial_path, verify_written
from trajstore.maintenance.summary import (
    STEP_IDS,
    STEPS,
    episode_table,
    iter_blocks,
    open_store,
    store_info,
)
from trajstore.maintenance.verify import Fault, VerifyReport, verify_store
from trajstore.shards.layout import (
    ROOT_KEY,
    RootRecord,
    is_sharded_root,
    list_shards,
    read_root_record,
    root_location,
    shard_ready,
    shard_url,
)
from trajstore.shards.rows import EPISODE_STRIDE
from trajstore.spaces import space_from_json
from trajstore.storage.publish import recover

__all__ = ["is_sharded_root", "sharded_info", "sharded_episodes", "sharded_stats", "verify_sharded", "merge_copy",
           "verify_copy"]

Options = dict[str, Any] | None


def _root(path: str, storage_options: Options) -> tuple[RootRecord, list[str], list[str]]:
    """The root record, the names of the shards in the dataset and of those still being created
    (no commit record yet; ``open_sharded`` leaves them out too)."""
    loc = root_location(path, read_only=True, storage_options=storage_options)
    try:
        root = read_root_record(loc)
        if root is None:  # removed between is_sharded_root and here
            raise DamagedStoreError(f"{loc.url}: {ROOT_KEY} is gone")
        names = list_shards(loc)
        ready = [n for n in names if shard_ready(loc, n)]
        return root, ready, [n for n in names if n not in ready]
    finally:
        loc.close()


# -- info ---------------------------------------------------------------------------------------
def sharded_info(path: str, storage_options: Options) -> dict[str, Any]:
    """``trajstore info`` of a sharded dataset: the root record and ``store_info`` of every shard.

    Returns
    -------
    dict
        ``path, sharded`` (True), ``kind`` (of the shards), ``spaces``, ``spaces_text``,
        ``options``, ``shards`` (one ``{name, rows, episodes, stored_bytes, logical_bytes}`` per
        shard, name order), ``creating`` (shards without a commit record yet), ``rows`` (step rows
        of every shard), ``episodes`` (``finished``, ``in_progress``: summed), ``stored_bytes``
        and ``logical_bytes`` (summed).
    """
    from trajstore.maintenance.summary import space_tree

    root, names, creating = _root(path, storage_options)
    shards = []
    for name in names:
        info = store_info(shard_url(path, name), storage_options=storage_options)
        shards.append({"name": name, "rows": info["tables"][STEPS]["rows"], "episodes": info["episodes"],
                       "stored_bytes": info["stored_bytes"], "logical_bytes": info["logical_bytes"]})
    eps = [s["episodes"] for s in shards if s["episodes"] is not None]
    return {
        "path": path, "sharded": True, "kind": root.kind, "spaces": root.spaces,
        "spaces_text": {k: space_tree(space_from_json(v)) for k, v in root.spaces.items()},
        "options": root.options, "shards": shards, "creating": creating,
        "rows": sum(s["rows"] for s in shards),
        "episodes": {"finished": sum(e["finished"] for e in eps), "in_progress": sum(bool(e["in_progress"]) for e in eps)},
        "stored_bytes": sum(s["stored_bytes"] for s in shards), "logical_bytes": sum(s["logical_bytes"] for s in shards),
    }


def print_sharded_info(info: dict[str, Any]) -> None:
    """Print what ``trajstore info`` shows of a sharded dataset (from :func:`sharded_info`)."""
    eps = info["episodes"]
    print(f"sharded dataset {info['path']}")
    print(f"kind           {info['kind']} shards")
    print(f"shards         {len(info['shards'])}" + (f" (+{len(info['creating'])} being created)" if info["creating"] else ""))
    print(f"rows           {info['rows']} steps in all")
    print(f"episodes       {eps['finished']} finished" + (f" (+{eps['in_progress']} in progress)" if eps["in_progress"] else ""))
    print(f"size on disk   {fmt_bytes(info['stored_bytes'])}: {fmt_bytes(info['logical_bytes'])} of committed data")
    if info["options"]:
        print("options        " + ", ".join(f"{k}={v}" for k, v in sorted(info["options"].items())))
    print_spaces(info["spaces_text"])
    print("shards")
    print_table(["shard", "rows", "episodes", "stored"],
                [[s["name"], s["rows"], "-" if s["episodes"] is None else s["episodes"]["finished"],
                  fmt_bytes(s["stored_bytes"])] for s in info["shards"]], right=("rows", "episodes", "stored"), indent="  ")


# -- episodes -------------------------------------------------------------------------------------
def sharded_episodes(path: str, storage_options: Options, reward_field: str | None) -> dict[str, Any]:
    """``episode_table`` of every shard, concatenated in shard order, as one table: ``episode_id``
    (global), ``shard``, ``shard_episode_id``, ``start`` (global row) and the per-store columns."""
    _root_rec, names, _creating = _root(path, storage_options)
    parts: list[dict[str, Any]] = []
    first = 0
    for k, name in enumerate(names):
        store = open_store(shard_url(path, name), storage_options)
        try:
            t = episode_table(store, reward_field)
            rows = store.tables[STEPS].count
        finally:
            store.close()
        t["shard"] = np.full(len(t["episode_id"]), name, dtype=object)
        t["shard_episode_id"] = t["episode_id"]
        t["episode_id"] = t["episode_id"] + k * EPISODE_STRIDE
        t["start"] = t["start"] + first
        first += rows
        parts.append(t)
    if not parts:
        return {"episode_id": np.zeros(0, np.int64), "shard": np.zeros(0, object), "shard_episode_id": np.zeros(0, np.int64),
                "start": np.zeros(0, np.int64), "length": np.zeros(0, np.int64), "live": np.zeros(0, bool),
                "source": "no shard yet", "reward_field": reward_field}
    out: dict[str, Any] = {k: np.concatenate([p[k] for p in parts]) for k, v in parts[0].items() if isinstance(v, np.ndarray)}
    out["source"], out["reward_field"] = parts[0]["source"], parts[0]["reward_field"]
    return out


# -- stats ------------------------------------------------------------------------------------------
def sharded_stats(path: str, storage_options: Options, field: str | None,
                  progress: Callable[[int, str], Any]) -> list[dict[str, Any]]:
    """``field_stats`` of every shard, one shard open at a time (memory bounded by a block of rows),
    merged per array; ``progress(total_rows, description)`` makes a bar per shard."""
    _root_rec, names, _creating = _root(path, storage_options)
    merged: dict[str, dict[str, Any]] = {}
    for name in names:
        store = open_store(shard_url(path, name), storage_options)
        try:
            bar = progress(sum(t.count for t in store.tables.values()), f"stats {name}")
            try:
                stats = field_stats(store, field, progress=bar.update)
            finally:
                bar.close()
        finally:
            store.close()
        for s in stats:
            merged[s["path"]] = merge_stats(merged[s["path"]], s) if s["path"] in merged else s
    return list(merged.values())


# -- verify -----------------------------------------------------------------------------------------
def verify_sharded(path: str, storage_options: Options, deep: bool,
                   progress: Callable[[int, str], Any] | None) -> dict[str, Any]:
    """``verify_store`` of every shard, plus the root record, the shard names and each shard's
    spaces against the root's.

    Returns
    -------
    dict
        ``path, sharded`` (True), ``ok``, ``root`` (``{"faults": [...], "notes": [...]}``) and
        ``shards`` (``{name: VerifyReport.to_json()}``); the reports themselves under
        ``_reports`` (dropped from JSON output).
    """
    root_faults: list[Fault] = []
    notes: list[str] = []
    reports: dict[str, VerifyReport] = {}
    root: RootRecord | None = None
    names: list[str] = []
    creating: list[str] = []
    loc = root_location(path, read_only=True, storage_options=storage_options)
    try:  # a damaged record or shard folder is a fault; the shards are still checked where they can be listed
        try:
            root = read_root_record(loc)
        except (DamagedStoreError, FormatVersionError) as e:
            root_faults.append(Fault("record", ROOT_KEY, " ".join(str(e).split())))
        try:
            listed = list_shards(loc)
            names = [n for n in listed if shard_ready(loc, n)]
            creating = [n for n in listed if n not in names]
        except DamagedStoreError as e:
            root_faults.append(Fault("shards", "shards", " ".join(str(e).split())))
    finally:
        loc.close()
    notes += [f"shard {n} has no commit record (being created, or its writer died first); readers leave it out"
              for n in creating]
    for name in names:
        url = shard_url(path, name)
        rep = verify_store(url, storage_options=storage_options, deep=deep, progress=progress)
        if rep.ok and root is not None:
            store = open_store(url, storage_options)
            try:
                spaces = store.attrs.get("spaces")
            finally:
                store.close()
            if spaces != root.spaces:
                rep.faults.append(Fault("spaces", "zarr.json", f"the shard's spaces differ from those {ROOT_KEY} "
                                                               "records; readers of the dataset refuse it"))
        reports[name] = rep
    ok = not root_faults and all(r.ok for r in reports.values())
    return {"path": path, "sharded": True, "ok": ok,
            "root": {"faults": [f.to_json() for f in root_faults], "notes": notes},
            "shards": {n: r.to_json() for n, r in reports.items()}, "_reports": reports, "_root_faults": root_faults}


def print_sharded_verify(out: dict[str, Any]) -> None:
    """One line per fault, naming the shard (or the root), one per shard checked, and a summary."""
    for f in out["_root_faults"]:
        print(f"FAULT root {f.kind}: {f.message}")
    for note in out["root"]["notes"]:
        print(f"note: {note}")
    for name, rep in out["_reports"].items():
        for f in rep.faults:
            print(f"FAULT shard {name} {f.kind}: {f.message}")
        for note in rep.notes:
            print(f"note: shard {name}: {note}")
        c = rep.checked
        print(f"{'OK' if rep.ok else str(len(rep.faults)) + ' fault(s)'}: shard {name} ({c['arrays']} arrays, "
              f"{c['chunks']} chunks, {c['rows']} committed rows)")
    n = len(out["_root_faults"]) + sum(len(r.faults) for r in out["_reports"].values())
    what = f"{len(out['_reports'])} shard(s)"
    print(f"OK: {out['path']} ({what})" if out["ok"] else f"{n} fault(s) in {out['path']} ({what})")


# -- copy (merge) -----------------------------------------------------------------------------------------
def _shard_stores(path: str, options: Options) -> Iterator[tuple[str, Any]]:
    """Each shard's open store (name order), closed after use."""
    for name in _root(path, options)[1]:
        store = open_store(shard_url(path, name), options)
        try:
            yield name, store
        finally:
            store.close()


def _compare_merged(src: str, src_options: Options, dst: str, dst_options: Options, bar: Any) -> int:
    """Every step field of every shard equal to its rows of the merged store (episode ids are
    renumbered by the merge, so they are compared as boundaries by ``verify``, not as values);
    returns the rows compared."""
    copy = open_store(dst, dst_options)
    try:
        dt = copy.tables[STEPS]
        dpaths = {f.spec.array_path: j for j, f in enumerate(dt.fields)}
        first = 0
        for name, store in _shard_stores(src, src_options):
            st = store.tables[STEPS]
            which = [j for j, f in enumerate(st.fields) if f.spec.array_path != STEP_IDS]
            for lo, arrays in iter_blocks(st, which):
                hi = lo + len(arrays[0])
                if first + hi > dt.count:
                    raise CLIError(f"copy verification failed: the merged store has {dt.count} rows; shard {name} "
                                   f"reaches row {first + hi}")
                for j, a in zip(which, arrays):
                    p = st.fields[j].spec.array_path
                    b = dt.read_contiguous(first + lo, first + hi, [dpaths[p]])[0]
                    if not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
                        raise CLIError(f"copy verification failed: {p} of shard {name} differs within its rows "
                                       f"[{lo}, {hi})")
                bar.update(hi - lo)
            first += st.count
        if first != dt.count:
            raise CLIError(f"copy verification failed: the merged store has {dt.count} rows, the shards {first}")
        return first
    finally:
        copy.close()


def merge_copy(src: str, dst: str, *, src_options: Options, dst_options: Options, overwrite: bool,
               compressor: str | None, chunk_rows: int | None, bar: Callable[[int, str], Any],
               tqdm: bool | None, copy_store: Callable[..., dict[str, Any]], exists: Callable[[str, Options], bool]) -> dict[str, Any]:
    """``trajstore copy`` of a sharded dataset: :func:`~trajstore.shards.merge_shards` into one
    store, compared shard by shard with the source, verified.  A ``.zip``, another layout
    (``compressor``/``chunk_rows``) or ``overwrite`` of an existing store: merged into a local
    temporary folder first, then copied there by ``copy_store``."""
    from trajstore.shards import merge_shards

    if "://" not in dst:
        # A copy killed between its journal and its rename left dst half published: completed
        # now, so the checks below see it (not later, by the build's partial_path, as a surprise).
        recover(os.path.abspath(dst))
    if exists(dst, dst_options) and not overwrite:
        raise CLIError(f"{dst}: something already exists there; pass --overwrite to replace it")
    direct = not (dst.endswith(".zip") or compressor not in ("auto", "keep") or chunk_rows is not None
                  or exists(dst, dst_options))
    info = sharded_info(src, src_options)
    with contextlib.ExitStack() as stack:
        target, target_options = dst, dst_options
        if not direct:
            if "://" in dst:
                tmp = tempfile.mkdtemp(prefix=".trajstore-merge-")
            else:  # beside dst, under a temporary name that the next run removes if this one is killed
                tmp = partial_path(os.path.abspath(dst))
                os.makedirs(tmp)
            stack.callback(shutil.rmtree, tmp, True)
            target, target_options = os.path.join(tmp, "merged"), None
        rows = merge_shards(src, target, storage_options=src_options, dst_storage_options=target_options, tqdm=tqdm)
        b = bar(rows, "verify merge")
        try:
            _compare_merged(src, src_options, target, target_options, b)
        finally:
            b.close()
        verify_copy(target, target_options)
        if direct:
            store = open_store(dst, dst_options)
            try:
                stored = sum(n for _k, n in store.loc.iter_sizes(""))
                n_arrays = sum(len(t.fields) for t in store.tables.values())
                table_rows = {n: t.count for n, t in store.tables.items()}
            finally:
                store.close()
            method = "merge"
        else:
            out = copy_store(target, dst, compressor=compressor, chunk_rows=chunk_rows, dst_options=dst_options,
                             overwrite=overwrite)
            stored, n_arrays, table_rows, method = out["bytes"], out["arrays"], out["table_rows"], f"merge, {out['method']}"
    return {"source": src, "destination": dst, "kind": info["kind"], "method": method, "shards": len(info["shards"]),
            "rows": rows, "table_rows": table_rows, "episodes": info["episodes"], "arrays": n_arrays, "bytes": stored,
            "verified": True}


def verify_copy(path: str, storage_options: Options) -> None:
    """Raise :class:`CLIError` (``"copy verification failed: <first fault>"``, exit status 1) if the
    copy written at ``path`` does not verify (:func:`~trajstore.maintenance.staged.verify_written`)."""
    verify_written(path, storage_options, error=lambda fault: CLIError(f"copy verification failed: {fault}"))
