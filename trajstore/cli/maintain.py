"""Commands that check or change stores: ``verify``, ``repair``, ``copy``."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

import numpy as np

from trajstore.cli._common import (
    CLIError,
    add_store_args,
    fmt_bytes,
    json_arg,
    positive_int,
    print_json,
    progress,
)
from trajstore.cli.copy_codecs import (
    KEYWORDS,
    adopt_segments,
    check_keys,
    copy_compressor_arg,
    field_choice,
    lossy_fields,
    source_codec,
)
from trajstore.cli.parts import run_on_parts, sb3_folder
from trajstore.cli.shards import is_sharded_root, merge_copy, print_sharded_verify, verify_copy, verify_sharded
from trajstore.maintenance.repair import RepairReport, repair_store
from trajstore.maintenance.summary import iter_blocks, open_store
from trajstore.maintenance.verify import VerifyReport, verify_store
from trajstore.metadata import DATASET_KEY
from trajstore.storage.fields.image import ImageField
from trajstore.storage.fields.video import VideoField
from trajstore.storage.publish import destination_full, partial_path, publish, remove_entry

__all__ = ["register", "copy_store"]


# -- verify ---------------------------------------------------------------------------------------
def _rows_text(table_rows: dict[str, int], total: int) -> str:
    """Committed rows as a user counts them: steps, and episode-data rows apart (never summed)."""
    if not table_rows:
        return f"{total} committed rows"
    names = {"step_data": "step rows", "episode_data": "episode-data rows"}
    return ", ".join(f"{n} {names.get(t, t + ' rows')}" for t, n in table_rows.items())


def _print_verify(rep: VerifyReport, indent: str = "") -> None:
    c = rep.checked
    what = f"{c['arrays']} arrays, {c['chunks']} chunks, {_rows_text(c.get('table_rows') or {}, c['rows'])}"
    if rep.deep:
        what += f", {c['decoded']} chunks decoded"
    for f in rep.faults:
        print(f"{indent}FAULT {f.kind}: {f.message}")
    for note in rep.notes:
        print(f"{indent}note: {note}")
    if rep.ok:
        print(f"{indent}OK: {rep.url} ({what})")
    else:
        print(f"{indent}{len(rep.faults)} fault(s) in {rep.url} ({what})")


def _cmd_verify(args: argparse.Namespace) -> int:
    if is_sharded_root(args.path, args.storage_options):  # every shard, and the root record
        out = verify_sharded(args.path, args.storage_options, args.deep, lambda n, d: progress(n, d, unit="chunk"))
        if args.json:
            print_json({k: v for k, v in out.items() if not k.startswith("_")})
        else:
            print_sharded_verify(out)
        return 0 if out["ok"] else 1
    folder = sb3_folder(args.path, args.storage_options)
    if folder is not None:  # a stable-baselines3 buffer's cache_path: its record and every store inside
        reps = run_on_parts(folder, args.json, lambda url: verify_store(
            url, storage_options=args.storage_options, deep=args.deep, progress=lambda n, d: progress(n, d, unit="chunk")),
            _print_verify, lambda rep: rep.to_json())
        ok = not folder.problems and all(rep.ok for rep in reps)
        if not args.json:
            print(f"\n{'OK' if ok else 'FAULTS'}: {folder.path} ({len(reps)} store(s)"
                  + (f", {len(folder.problems)} problem(s) with the folder" if folder.problems else "") + ")")
        return 0 if ok else 1
    rep = verify_store(args.path, storage_options=args.storage_options, deep=args.deep,
                       progress=lambda n, d: progress(n, d, unit="chunk"))
    if args.json:
        print_json(rep.to_json())
    else:
        _print_verify(rep)
    return 0 if rep.ok else 1


# -- repair --------------------------------------------------------------------------------------------
def _print_repair(rep: RepairReport) -> None:
    verb = {"delete": "would delete" if rep.dry_run else "deleted", "write": "would write" if rep.dry_run else "wrote",
            "rollback": "would roll back" if rep.dry_run else "rolled back",
            "resize": "would resize" if rep.dry_run else "resized", "keep": "would keep" if rep.dry_run else "kept"}
    if rep.before is not None and rep.before.faults:
        print("found:")
        for f in rep.before.faults:
            print(f"  FAULT {f.kind}: {f.message}")
    for ch in rep.changes:
        print(f"{verb[ch['action']]} {ch['key']}: {ch['why']}")
    for p in rep.problems:
        print(f"recovery impossible: {p}" if not rep.recovered else f"problem: {p}")
    if not rep.changes and rep.recovered:
        print("nothing to repair")
    if rep.after is not None:
        _print_verify(rep.after)
    elif rep.dry_run and rep.changes:
        print(f"dry run: {len(rep.changes)} change(s) listed, nothing written")


def _cmd_repair(args: argparse.Namespace) -> int:
    rep = repair_store(args.path, storage_options=args.storage_options, dry_run=args.dry_run, deep=args.deep,
                       progress=lambda n, d: progress(n, d, unit="chunk"))
    if args.json:
        print_json(rep.to_json())
    else:
        _print_repair(rep)
    return 0 if rep.recovered else 1


# -- copy ------------------------------------------------------------------------------------------------
def _is_url(p: str) -> bool:
    return "://" in p or "::" in p


def _exists(path: str, options: dict[str, Any] | None) -> bool:
    if _is_url(path):
        from trajstore.storage.location import resolve_location

        loc = resolve_location(path, read_only=True, storage_options=options, must_exist=False)
        try:
            return bool(loc.list_prefix(""))
        finally:
            loc.close()
    return os.path.exists(path) and (not os.path.isdir(path) or any(os.scandir(path)))


def _same(a: str, b: str) -> bool:
    if _is_url(a) or _is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)


def _compare(src: Any, dst: Any, bar: Any, lossy: dict[str, str]) -> tuple[int, dict[str, float]]:
    """Every committed row of every array equal (NaN equal to NaN), or for the fields of ``lossy``
    (transcoded into a lossy codec) the same shape and dtype; returns the arrays compared and the
    PSNR (dB, peak 255) of each lossy field against the source."""
    n = 0
    sse = {p: 0.0 for p in lossy}
    count = {p: 0 for p in lossy}
    for name, st in src.tables.items():
        dt = dst.tables.get(name)
        if dt is None or dt.count != st.count:
            raise CLIError(f"copy verification failed: table {name!r} has {None if dt is None else dt.count} rows in "
                           f"the copy, {st.count} in the source")
        dpaths = {f.spec.array_path: j for j, f in enumerate(dt.fields)}
        for j, f in enumerate(st.fields):
            p = f.spec.array_path
            if p not in dpaths:
                raise CLIError(f"copy verification failed: the copy lacks array {p}")
            for lo, (a,) in iter_blocks(st, [j]):
                b = dt.read_contiguous(lo, lo + len(a), [dpaths[p]])[0]
                if p in lossy and a.shape == b.shape and a.dtype == b.dtype:
                    sse[p] += float(((a.astype(np.float64) - b) ** 2).sum())
                    count[p] += a.size
                elif a.shape != b.shape or not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
                    raise CLIError(f"copy verification failed: {p} differs within rows [{lo}, {lo + len(a)})")
                bar.update(len(a))
            n += 1
    psnr = {p: float("inf") if not sse[p] else 10 * float(np.log10(255.0**2 * count[p] / sse[p])) for p in lossy}
    return n, psnr


def _is_zip(path: str) -> bool:
    return not _is_url(path) and path.endswith(".zip") and not os.path.isdir(path)


def copy_store(src: str, dst: str, *, compressor: str | dict[str, Any] | None = "auto", chunk_rows: int | None = None,
               src_options: dict[str, Any] | None = None, dst_options: dict[str, Any] | None = None,
               overwrite: bool = False) -> dict[str, Any]:
    """Copy the store ``src`` to ``dst`` (any locations, a ``.zip`` included), then verify the copy.

    A ``.zip`` destination is written small (:func:`trajstore.core.zipcopy.write_zip`): only chunks
    holding committed rows, and with ``compressor="auto"`` (the default) raw fields compressed
    with lz4 row blocks (``"keep"``: every field's own codec; ``"none"``: raw chunks).  Other
    destinations: with ``compressor`` ``"auto"``/``"keep"`` and no ``chunk_rows`` a byte copy of
    the committed store (``dumps``); otherwise a new store with the same kind, spaces and
    capacities and the requested layout is created and every committed row (and, for
    trajectories, every episode id, every episode-data row and the episode counters) is copied
    through the buffer API, a bounded block of rows at a time.  ``compressor`` may be a dict
    ``{field: codec}`` (``trajstore copy --compressor cam=h264,*=keep``): each named field is
    written with its codec (``"keep"``, ``"none"``, lz4/zstd, a per-frame image codec, a video
    codec: a raw or per-frame field of a trajectory store becomes a video field, one segment per
    episode; a video field becomes frames or raw rows), the others keep theirs (or take ``"*"``'s);
    :mod:`trajstore.cli.copy_codecs`.  Frames and video segments kept in their codec pass as
    their bytes.  The copy is then compared row by row with the source (fields transcoded into a
    lossy codec: shape, dtype and PSNR, reported) and verified.
    A local folder is written, compared and verified under a
    temporary name beside ``dst`` and only then published (:func:`trajstore.storage.publish.publish`:
    ``dst`` is its old store or the verified copy at every instant); a zip is written beside and
    renamed.  A failed copy leaves ``dst`` as it was and nothing beside it; a full disk is a
    :class:`~trajstore.errors.StoreFullError` naming ``dst``.

    Returns
    -------
    dict
        ``source, destination, kind, method`` (``"byte copy"``, ``"relayout"`` or ``"zip"``),
        ``rows`` (step rows), ``table_rows`` (rows of each table), ``episodes`` (as ``trajstore
        info``: finished episodes and the one in progress, or None), ``arrays``, ``bytes`` (stored
        bytes of the copy), ``lossy`` (``{array path: {"codec": settings, "psnr_db": PSNR against
        the source}}`` of the fields transcoded into a lossy codec) and ``verified``.

    Raises
    ------
    BadOptionError
        A ``compressor`` key that names no field, or a codec a field cannot hold (video: step
        fields of an unbounded trajectory store, not a ``.zip``).
    """
    if _same(src, dst):
        raise CLIError("SRC and DST are the same store", code=2)
    # A local folder is written beside DST, compared and verified there, then published: DST is
    # its old store or the verified copy at every instant, and a failed copy leaves nothing.
    folder = os.path.abspath(dst) if not _is_url(dst) and not _is_zip(dst) else None
    target = partial_path(folder) if folder is not None else dst  # (completes a publish a kill cut short)
    if _exists(dst, dst_options) and not overwrite:
        raise CLIError(f"{dst}: something already exists there; pass --overwrite to replace it")
    try:
        out = _copy_and_check(src, target, compressor, chunk_rows, src_options, dst_options)
        if folder is not None:
            publish([(target, folder)], overwrite=overwrite)
    except BaseException as e:
        if folder is not None:
            remove_entry(target)
        raise destination_full(e, dst)  # e itself unless a full disk
    if _is_zip(dst):
        out["bytes"] = os.path.getsize(dst)
    return {"source": src, "destination": dst, **out, "verified": True}


def _copy_and_check(src: str, dst: str, compressor: str | dict[str, Any] | None, chunk_rows: int | None,
                    src_options: dict[str, Any] | None, dst_options: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`copy_store`'s copy to ``dst`` (a new location), compared with the source and verified."""
    from trajstore import ReplayBuffer, TrajectoryReplayBuffer
    from trajstore.core.zipcopy import write_zip
    from trajstore.maintenance.summary import STEPS, episode_counts
    from trajstore.spaces import ValuePlan, space_from_json

    source = open_store(src, src_options)
    try:
        kind = source.attrs.get("kind")
        table_rows = {name: t.count for name, t in source.tables.items()}
        rows_total = sum(table_rows.values())
        episodes = episode_counts(source)
        to_zip = _is_zip(dst)
        relayout = compressor not in ("auto", "keep") or chunk_rows is not None
        if isinstance(compressor, dict):
            check_keys(source, compressor)
        if to_zip:
            method = "zip"
            write_zip(source, dst, compressor=compressor, chunk_rows=chunk_rows)
        elif not relayout:
            method = "byte copy"  # (dumps' copy; into the temporary folder copy_store publishes)
            source.copy_to(dst, storage_options=dst_options, stage=False)
        else:
            method = "relayout"
            _relayout(source, kind, dst, compressor, chunk_rows, dst_options, ValuePlan, space_from_json, STEPS,
                      ReplayBuffer, TrajectoryReplayBuffer, rows_total)
        copy = open_store(dst, dst_options)
        try:
            lossy = lossy_fields(source, copy)
            bar = progress(rows_total, "verify copy", unit="row")
            try:
                n_arrays, psnr = _compare(source, copy, bar, lossy)
            finally:
                bar.close()
            if kind == "TrajectoryReplayBuffer":
                for key in ("current_episode_id", "next_episode_id"):
                    if source.committed.state.get(key) != copy.committed.state.get(key):
                        raise CLIError(f"copy verification failed: {key} is {copy.committed.state.get(key)} in the "
                                       f"copy, {source.committed.state.get(key)} in the source")
            stored = sum(n for _k, n in copy.loc.iter_sizes(""))
        finally:
            copy.close()
    finally:
        source.close()
    verify_copy(dst, dst_options)
    return {"kind": kind, "method": method, "rows": table_rows[STEPS], "table_rows": table_rows, "episodes": episodes,
            "arrays": n_arrays, "bytes": stored,
            "lossy": {p: {"codec": label, "psnr_db": round(psnr[p], 2)} for p, label in lossy.items()}}


def _relayout(source: Any, kind: str | None, dst: str, compressor: str | dict[str, Any] | None, chunk_rows: int | None,
              dst_options: dict[str, Any] | None, ValuePlan: Any, space_from_json: Any, STEPS: str,
              ReplayBuffer: Any, TrajectoryReplayBuffer: Any, rows_total: int) -> None:
    """A new store at ``dst`` (a folder or URL; zips go through ``write_zip``) with the requested layout."""
    spaces = source.attrs["spaces"]
    steps = source.tables[STEPS]

    images = {f.spec.array_path: f for f in steps.fields if isinstance(f, (ImageField, VideoField))}

    def comp(path: str) -> Any:
        if isinstance(compressor, dict):  # field by field (copy_codecs): a dict by path for a table
            table = next(t for t in source.tables.values() if any(f.spec.array_path == path for f in t.fields))
            by_path = {f.spec.array_path: field_choice(source, f, compressor) for f in table.fields}
            if path == "step_episode_ids":  # the ids' own storage option: one codec
                return by_path[path]
            return {**{p: c for p, c in by_path.items() if p != "step_episode_ids"}, "*": None}
        if compressor in ("keep", "auto"):
            if path == steps.fields[0].spec.array_path and images:
                # Image and video fields keep their codecs; the others (as without them) the first one's.
                other = next((f.spec.array_path for f in steps.fields if f.spec.array_path not in images), None)
                return {**{p: f.codec for p, f in images.items()}, "*": None if other is None else
                        source_codec(source, other)}
            return source_codec(source, path)
        return None if compressor == "none" else compressor

    step_plan = ValuePlan(space_from_json(spaces[STEPS]))
    n_leaves = len(step_plan.leaves)
    bar = progress(rows_total, f"copy to {dst}", unit="row")
    try:
        if kind == "ReplayBuffer":
            out = ReplayBuffer.create(step_plan.space, cache_path=dst, capacity=steps.capacity, overwrite=True,
                                      storage_options=dst_options,
                                      compressor=comp(steps.fields[0].spec.array_path), chunk_rows=chunk_rows)
        else:
            ep_space = space_from_json(spaces["episode_data"]) if "episode_data" in spaces else None
            et = source.tables.get("episode_data")
            out = TrajectoryReplayBuffer.create(
                step_plan.space, step_data_capacity=steps.capacity, cache_path=dst, overwrite=True,
                storage_options=dst_options,
                step_episode_id_storage_kwargs={"compressor": comp("step_episode_ids"), "chunk_rows": chunk_rows},
                episode_data_instance_space=ep_space, episode_data_capacity=None if et is None else et.capacity,
                episode_data_storage_kwargs=({"compressor": comp(et.fields[0].spec.array_path), "chunk_rows": chunk_rows}
                                             if et is not None else None),
                compressor=comp(steps.fields[0].spec.array_path), chunk_rows=chunk_rows)
        description = source.loc.get(DATASET_KEY)  # the dataset description travels with the data
        if description is not None:
            out.store.loc.put(DATASET_KEY, description)
        try:
            which = list(range(len(steps.fields)))
            # Frames of image fields stored in the same codec in the copy pass as their bytes.
            passed = [(sf, f) for f in out.row_source().table.fields
                      if isinstance(f, ImageField) and isinstance(sf := images.get(f.spec.array_path), ImageField)
                      and sf.codec == f.codec]
            if kind != "ReplayBuffer":  # video segments kept in their settings: their bytes
                adopt_segments(steps, out.row_source().table.fields)
            for lo, arrays in iter_blocks(steps, which):
                value = step_plan.from_arrays(arrays[:n_leaves])
                with contextlib.ExitStack() as stack:
                    rows = np.asarray(steps.physical(np.arange(lo, lo + len(arrays[0]))))
                    for sf, df in passed:
                        stack.enter_context(df.frames_as_encoded(len(out), sf.encoded_rows(rows)))
                    if kind == "ReplayBuffer":
                        out.extend(value)
                    else:
                        out.extend({"step_data": value, "episode_ids": arrays[n_leaves]})
                bar.update(len(arrays[0]))
            if kind == "TrajectoryReplayBuffer":
                et = source.tables.get("episode_data")
                if et is not None and et.count:
                    ep_plan = ValuePlan(space_from_json(spaces["episode_data"]))
                    m = len(ep_plan.leaves)
                    for _lo, arrays in iter_blocks(et, list(range(len(et.fields)))):
                        for i, eid in enumerate(arrays[m].tolist()):
                            out.set_episode_data_at(int(eid), ep_plan.from_arrays([a[i] for a in arrays[:m]]))
                        bar.update(len(arrays[0]))
                state = source.committed.state
                out.current_episode_id = int(state.get("current_episode_id", 0))
                # Keep the source's next fresh id, so ids are never reused.
                out.id_counter.next = max(int(state.get("next_episode_id", 0)), out.current_episode_id + 1)
        finally:
            out.close()
    finally:
        bar.close()


def _cmd_copy(args: argparse.Namespace) -> int:
    if args.storage_options is not None:
        args.src_options = args.src_options or args.storage_options
        args.dst_options = args.dst_options or args.storage_options
    if _same(args.src, args.dst):
        raise CLIError("SRC and DST are the same store", code=2)
    if is_sharded_root(args.src, args.src_options):  # merged into one store
        out = merge_copy(args.src, args.dst, src_options=args.src_options, dst_options=args.dst_options,
                         overwrite=args.overwrite, compressor=args.compressor, chunk_rows=args.chunk_rows,
                         bar=lambda n, d: progress(n, d, unit="row"), tqdm=False if args.json else None,
                         copy_store=copy_store, exists=_exists)
    else:
        out = copy_store(args.src, args.dst, compressor=args.compressor, chunk_rows=args.chunk_rows,
                         src_options=args.src_options, dst_options=args.dst_options, overwrite=args.overwrite)
    if args.json:
        print_json(out)
    else:
        eps = out.get("episodes")
        what = f"{out['rows']} steps"
        if eps:
            what += f", {eps['finished']} finished episodes" + (" (+1 in progress)" if eps["in_progress"] else "")
        if "episode_data" in out["table_rows"]:
            what += f", {out['table_rows']['episode_data']} episode-data rows"
        if "shards" in out:
            what += f" of {out['shards']} shard(s), merged"
        lossy = out.get("lossy") or {}
        match = "matches the source" if not lossy else "matches the source (" + ", ".join(
            f"{p.split('/', 1)[-1]} {v['codec']} at {v['psnr_db']:.1f} dB PSNR" for p, v in lossy.items()) + ")"
        print(f"copied {what} from {out['source']} to {out['destination']} ({out['arrays']} arrays, {out['method']}, "
              f"{fmt_bytes(out['bytes'])}); the copy {match} and verifies")
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the commands that check and change a store (``verify``, ``repair``, ``copy``) to the
    subparsers ``sub``; ``common`` holds the options every command takes."""
    p = sub.add_parser("verify", parents=[common], help="check a store for damage (exit 1 when a fault is found)",
                       description="Check the commit record against the arrays, that every chunk holding a committed "
                                   "row exists and has its full size, and (trajectory stores) the episode table.  "
                                   "--deep also decodes every committed chunk.  Each fault names the key and the "
                                   "rows it damages.  Of a sharded dataset's root: every shard, the root record and each shard's "
                                   "spaces, one line per fault naming the shard.  Exit status 0: no fault; 1: faults "
                                   "found.  Read-only.")
    add_store_args(p)
    p.add_argument("--deep", action="store_true", help="also decode every chunk that holds committed rows")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("repair", parents=[common], help="fix a damaged store, or say why it cannot be fixed",
                       description="Remove orphaned temp files, unfinished staging and chunks beyond the committed "
                                   "rows; roll a commit record that names missing or damaged rows back to the intact "
                                   "rows it named; replace a lost commit record only when that is provably safe.  "
                                   "Lists exactly what it changed.  Exit status 0: the store verifies afterwards; 1: "
                                   "recovery impossible (nothing is changed then).  Local stores are locked while "
                                   "repaired; stop any writer of a remote store first.")
    add_store_args(p)
    p.add_argument("--dry-run", action="store_true", help="list the changes without writing anything")
    p.add_argument("--deep", action="store_true", help="also treat chunks that do not decode as damaged rows")
    p.set_defaults(func=_cmd_repair)

    p = sub.add_parser("copy", parents=[common], help="copy, rechunk or recompress a store (the copy is verified)",
                       description="Copy the store SRC to DST: local folders, .zip files and fsspec URLs in any "
                                   "direction.  A .zip is written for sharing: only chunks holding committed rows, "
                                   "raw arrays compressed with lz4 (--compressor none keeps them raw).  To other "
                                   "destinations, without --compressor/--chunk-rows the bytes are copied as they are; "
                                   "with them a new store with the requested layout is written.  The copy is then "
                                   "compared row by row with the source and verified.  A sharded dataset's root is merged "
                                   "into one store (merge_shards), compared shard by shard and verified.")
    p.add_argument("src", metavar="SRC", help="source store (folder, .zip or URL)")
    p.add_argument("dst", metavar="DST", help="destination (folder, .zip or URL)")
    p.add_argument("--compressor", type=copy_compressor_arg, default="auto", metavar="CODEC|FIELD=CODEC,...",
                   help=f"codec of the copy: {KEYWORDS[0]} (default: a .zip gets lz4 for raw arrays, other destinations "
                        "keep the source's), keep (the source's), none (raw), lz4 or zstd (smallest, slower reads); "
                        "or field by field, e.g. cam=h264,depth=png,*=keep (fields not named keep their codec, or "
                        "take *'s; per-frame image codecs such as jpeg:90 and video codecs h264, av1, lerobot "
                        "transcode frames, episodes becoming video segments)")
    p.add_argument("--chunk-rows", type=positive_int, default=None, metavar="N", help="rows per chunk in the copy")
    p.add_argument("--src-options", type=json_arg, default=None, metavar="JSON", help="fsspec options for SRC")
    p.add_argument("--dst-options", type=json_arg, default=None, metavar="JSON", help="fsspec options for DST")
    p.add_argument("--storage-options", type=json_arg, default=None, metavar="JSON",
                   help="fsspec options for both (when --src-options/--dst-options are not given)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store at DST")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_copy)
