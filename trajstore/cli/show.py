"""Read-only commands: ``info``, ``ls``, ``episodes``, ``head``, ``stats``, ``plot``, and ``demo``."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from trajstore.cli._common import (
    CLIError,
    add_store_args,
    fmt_bytes,
    fmt_num,
    non_negative_int,
    positive_int,
    print_json,
    print_spaces,
    print_table,
    progress,
)
from trajstore.cli.parts import run_on_parts, sb3_folder, shard_folder
from trajstore.cli.shards import (
    is_sharded_root,
    print_sharded_info,
    sharded_episodes,
    sharded_info,
    sharded_stats,
)
from trajstore.maintenance.moments import field_stats
from trajstore.maintenance.summary import (
    episode_table,
    head_rows,
    open_store,
    store_info,
)

__all__ = ["register", "print_info", "episode_text", "ratio_text", "robot_text"]


# -- info ----------------------------------------------------------------------------------------
def episode_text(eps: dict[str, Any], capacity: int | None = None) -> str:
    """``eps`` (:func:`trajstore.maintenance.summary.episode_counts`) as a user counts episodes: finished ones,
    the one in progress, and (trajectory rings) the ones evicted."""
    text = f"{eps['finished']} finished" + (" (+1 in progress)" if eps.get("in_progress") else "")
    if eps["source"] == "episode ids":
        gone = eps.get("finished_total", eps["finished"]) - eps["finished"]
        if gone > 0 and capacity is not None:
            text += f", {eps['finished_total']} since the store was created ({gone} evicted from the ring)"
        return text + f", {eps['with_data']} with episode data, current id {eps['current_id']}"
    return text + f", from {eps['source']}"


def ratio_text(info: dict[str, Any]) -> str:
    """The compression ratio where it means something (compressed arrays), ``raw`` otherwise."""
    ratio, raw = info.get("compression_ratio"), info.get("raw_arrays", 0)
    if not info.get("compressed_arrays"):
        return "raw (uncompressed; raw chunk files get disk blocks as rows arrive, a bounded step ahead)"
    ratio_s = "-" if ratio is None or ratio != ratio else f"{ratio:.2f}x"
    return f"compression ratio {ratio_s}" + (f" ({raw} raw array(s) not counted)" if raw else "")


def robot_text(robot: dict[str, Any]) -> str:
    """``fps 50, 2 tasks (3 episodes with one), statistics of 3 episodes stored`` from ``info["robot"]``."""
    fps = "no fps" if robot["fps"] is None else f"fps {robot['fps']:g}"
    st = robot["stats"]
    stats = ("no statistics stored" if st is None else
             f"statistics of {st['episodes']} episodes stored" + ("" if st["current"] else
                                                                 " (stale: rows rewritten since; trajstore stats --save)"))
    return f"{fps}, {robot['tasks']} task(s) ({robot['episodes_with_task']} episode(s) with one), {stats}"


def print_info(info: dict[str, Any]) -> None:
    """Print what ``trajstore info`` shows, from a :func:`~trajstore.maintenance.summary.store_info` dict."""
    print(f"store          {info['path']}")
    print(f"kind           {info['kind']} (format v{info['format_version']}, {info['created_by']}, {info['created_at']})")
    if info.get("dataset"):
        print("dataset")
        for key, value in info["dataset"].items():
            text = value if isinstance(value, str) else json.dumps(value)
            print(f"  {key:<14} {text if len(text) <= 100 else text[:97] + '...'}")
    for name, t in info["tables"].items():
        cap = "unbounded" if t["capacity"] is None else str(t["capacity"])
        print(f"table {name:<8} rows={t['rows']} capacity={cap} offset={t['offset']}")
    eps = info.get("episodes")
    if eps is not None:
        print(f"episodes       {episode_text(eps, info['tables']['step_data']['capacity'])}")
    print(f"size on disk   {fmt_bytes(info['stored_bytes'])}: {fmt_bytes(info['logical_bytes'])} of committed data, "
          f"{ratio_text(info)}")
    robot = info.get("robot")
    if robot and (robot["fps"] is not None or robot["tasks"] or robot["stats"] is not None):
        print(f"robot          {robot_text(robot)}")
    print_spaces(info["spaces_text"])
    print("arrays")
    print_table(["path", "shape", "dtype", "chunks", "codec", "stored"],
                [[a["path"], str(tuple(a["shape"])), a["dtype"], a["chunk_rows"], a["codec"], fmt_bytes(a["stored_bytes"])]
                 for a in info["arrays"]], right=("stored",), indent="  ")


def _cmd_info(args: argparse.Namespace) -> int:
    folder = sb3_folder(args.path, args.storage_options)
    if folder is not None:  # a stable-baselines3 buffer's cache_path: each store inside it
        run_on_parts(folder, args.json, lambda url: store_info(url, storage_options=args.storage_options), print_info,
                     _info_json)
        return 0
    sharded = is_sharded_root(args.path, args.storage_options)
    info = (sharded_info if sharded else store_info)(args.path, storage_options=args.storage_options)
    if args.json:
        print_json(_info_json(info))
    else:
        (print_sharded_info if sharded else print_info)(info)
    return 0


def _info_json(info: dict[str, Any]) -> dict[str, Any]:
    """``info --json``: the info without its text rendering of the spaces."""
    return {k: v for k, v in info.items() if k != "spaces_text"}


# -- ls --------------------------------------------------------------------------------------------
def _array_ratio(a: dict[str, Any]) -> str:
    if a["codec"] == "none":
        return "raw"
    return "-" if a["ratio"] is None else f"{a['ratio']:.2f}x"


def _arrays(path: str, storage_options: dict[str, Any] | None) -> list[dict[str, Any]]:
    from trajstore.maintenance.summary import array_list

    store = open_store(path, storage_options)
    try:
        return array_list(store)
    finally:
        store.close()


def _cmd_ls(args: argparse.Namespace) -> int:
    folder = sb3_folder(args.path, args.storage_options) or shard_folder(args.path, args.storage_options)
    if folder is not None:  # every store of a buffer folder, every shard of a dataset
        run_on_parts(folder, args.json, lambda url: _arrays(url, args.storage_options), _print_arrays)
        return 0
    arrays = _arrays(args.path, args.storage_options)
    if args.json:
        print_json(arrays)
        return 0
    _print_arrays(arrays)
    return 0


def _print_arrays(arrays: list[dict[str, Any]]) -> None:
    print_table(["path", "shape", "rows", "dtype", "chunks", "codec", "stored", "ratio"],
                [[a["path"], str(tuple(a["shape"])), a["committed_rows"], a["dtype"], str(tuple(a["chunks"])), a["codec"],
                  fmt_bytes(a["stored_bytes"]), _array_ratio(a)] for a in arrays],
                right=("rows", "stored", "ratio"))


# -- episodes ----------------------------------------------------------------------------------------
def _episodes(args: argparse.Namespace) -> dict[str, Any]:
    if is_sharded_root(args.path, args.storage_options):  # with the columns shard and shard_episode_id
        return sharded_episodes(args.path, args.storage_options, getattr(args, "reward_field", None))
    store = open_store(args.path, args.storage_options)
    try:
        return episode_table(store, getattr(args, "reward_field", None))
    finally:
        store.close()


def _listing(args: argparse.Namespace, eps: dict[str, Any]) -> dict[str, Any]:
    """``episodes --json`` of the table ``eps``, sorted and limited as ``args`` say."""
    n = len(eps["episode_id"])
    order = np.arange(n)
    if args.sort == "length":
        order = np.argsort(-eps["length"], kind="stable")
    elif args.sort == "return":
        if "return" not in eps:
            raise CLIError("--sort return: the store has no reward field; name one with --reward-field")
        order = np.argsort(-eps["return"], kind="stable")
    if args.limit is not None:
        order = order[: args.limit]
    extra = [c for c in ("return", "terminated", "truncated") if c in eps] + ["live"]
    sharded = "shard" in eps  # ids are global; the table shows each episode's shard and its id there
    cols = ["episode_id"] + (["shard", "shard_episode_id"] if sharded else []) + ["start", "length"] + extra
    records = [{c: eps[c][i] if c == "shard" else eps[c][i].item() for c in cols} for i in order.tolist()]
    return {"source": eps["source"], "reward_field": eps["reward_field"], "episodes_total": n,
            "episodes": [{("id" if c == "episode_id" else c): r[c] for c in cols} for r in records]}


def _print_listing(out: dict[str, Any]) -> None:
    """Print an ``episodes`` listing (:func:`_listing`); a store without episodes: why."""
    if "error" in out:
        print(f"no episodes: {out['error']}")
        return
    n, rows = out["episodes_total"], out["episodes"]
    print(f"{n} episode(s) (from {out['source']}" + (f", returns from {out['reward_field']}" if out["reward_field"]
                                                    else ", no reward field") + ")")
    sharded = bool(rows) and "shard" in rows[0]
    extra = [c for c in ("return", "terminated", "truncated", "live") if rows and c in rows[0]]
    cols = (["shard", "shard_episode_id"] if sharded else ["id"]) + ["start", "length"] + extra
    headers = (["shard", "id"] if sharded else ["id"]) + ["first row", "length"] + extra
    print_table(headers, [[fmt_num(r[c]) for c in cols] for r in rows], right=("id", "first row", "length", "return"))
    if n > len(rows):
        print(f"... {n - len(rows)} more (raise --limit)")


def _part_listing(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """The listing of one store of a buffer folder, or ``{"error": why}`` when it has no episodes
    (a replay buffer of several envs keeps one done flag per env in a row)."""
    from trajstore.errors import NoEpisodesError

    store = open_store(url, args.storage_options)
    try:
        return _listing(args, episode_table(store, args.reward_field))
    except NoEpisodesError as e:
        return {"error": str(e)}
    finally:
        store.close()


def _cmd_episodes(args: argparse.Namespace) -> int:
    folder = sb3_folder(args.path, args.storage_options)
    if folder is not None:  # every store of a stable-baselines3 buffer's cache_path
        run_on_parts(folder, args.json, lambda url: _part_listing(args, url), _print_listing)
        return 0
    out = _listing(args, _episodes(args))
    if args.json:
        print_json(out)
    else:
        _print_listing(out)
    return 0


# -- head ----------------------------------------------------------------------------------------------
def _cmd_head(args: argparse.Namespace) -> int:
    store = open_store(args.path, args.storage_options)
    try:
        out = head_rows(store, args.n, args.field, args.episode)
    finally:
        store.close()
    if args.json:
        print_json(out)
        return 0
    where = f"episode {args.episode}, " if args.episode is not None else ""
    print(f"{len(out['rows'])} row(s) of table {out['table']} ({where}{len(out['fields'])} array(s))")
    for row, values in zip(out["rows"], out["values"]):
        print(f"row {row}")
        for name, v in values.items():
            if isinstance(v, dict):
                s = f"shape={tuple(v['shape'])} {v['dtype']} min={fmt_num(v['min'])} max={fmt_num(v['max'])}"
            elif isinstance(v, list):
                s = np.array2string(np.asarray(v), precision=5, separator=", ", max_line_width=100)
            else:
                s = fmt_num(v) if isinstance(v, float) else str(v)
            print(f"  {name}: {s}")
    return 0


# -- stats -----------------------------------------------------------------------------------------------
def _cmd_stats(args: argparse.Namespace) -> int:
    if args.save or args.episodes is not None:  # per-episode statistics of a trajectory store (docs/robot.md)
        from trajstore.cli.robot import episode_stats_command

        return episode_stats_command(args)
    if is_sharded_root(args.path, args.storage_options):
        stats = sharded_stats(args.path, args.storage_options, args.field, lambda n, d: progress(n, d, unit="row"))
        return _print_stats(args, stats)
    folder = sb3_folder(args.path, args.storage_options)
    if folder is not None:  # every store of a stable-baselines3 buffer's cache_path
        run_on_parts(folder, args.json, lambda url: _store_stats(url, args), _stats_table)
        return 0
    return _print_stats(args, _store_stats(args.path, args))


def _store_stats(path: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    store = open_store(path, args.storage_options)
    try:
        if args.field is None:
            total = sum(t.count for t in store.tables.values())
        else:
            from trajstore.maintenance.summary import select_fields

            total = sum({t.name: t.count for t, _j in select_fields(store, args.field)}.values())
        bar = progress(total, "stats", unit="row")
        try:
            stats = field_stats(store, args.field, progress=bar.update)
        finally:
            bar.close()
    finally:
        store.close()
    return stats


def _print_stats(args: argparse.Namespace, stats: list[dict[str, Any]]) -> int:
    if args.json:
        print_json(stats)
    else:
        _stats_table(stats)
    return 0


def _stats_table(stats: list[dict[str, Any]]) -> None:
    print_table(["path", "rows", "dtype", "min", "max", "mean", "std", "nan", "inf"],
                [[s["path"], s["rows"], s["dtype"], fmt_num(s["min"]), fmt_num(s["max"]), fmt_num(s["mean"]),
                  fmt_num(s["std"]), s["nan"], s["inf"]] for s in stats],
                right=("rows", "min", "max", "mean", "std", "nan", "inf"))


# -- plot ------------------------------------------------------------------------------------------------
def _cmd_plot(args: argparse.Namespace) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise CLIError("plot needs matplotlib: pip install matplotlib (or trajstore[plot])") from None
    eps = _episodes(args)
    n = len(eps["episode_id"])
    if n == 0:
        raise CLIError("the store holds no episode to plot")
    idx = np.arange(n)
    series = [("length", eps["length"].astype(float))]
    if "return" in eps:
        series.insert(0, ("return", eps["return"]))
    fig, axes = plt.subplots(len(series), 2, figsize=(10, 3.2 * len(series)), squeeze=False)
    for r, (name, y) in enumerate(series):
        ax = axes[r][0]
        ax.plot(idx, y, marker="o" if n <= 50 else None, linewidth=1)
        ax.set_xlabel("episode index")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(name)
        ax.set_title(f"episode {name}")
        ax.grid(alpha=0.3)
        ax = axes[r][1]
        ax.hist(y, bins=min(30, max(5, n // 2)))
        ax.set_xlabel(name)
        ax.set_ylabel("episodes")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{name} histogram")
    fig.suptitle(f"{args.path}: {n} episodes" + (f" (returns from {eps['reward_field']})" if eps["reward_field"] else ""))
    fig.tight_layout()
    fig.savefig(args.output, dpi=args.dpi)
    plt.close(fig)
    if args.json:
        print_json({"output": str(args.output), "episodes": n, "reward_field": eps["reward_field"]})
    else:
        print(f"wrote {args.output} ({n} episodes)")
    return 0


# -- demo ------------------------------------------------------------------------------------------------
def _cmd_demo(args: argparse.Namespace) -> int:
    from trajstore.demo import record_demo
    from trajstore.errors import StoreExistsError

    try:
        path = record_demo(args.dir, env_id=args.env, episodes=args.episodes, seed=args.seed, overwrite=args.overwrite)
    except StoreExistsError:  # the library's message says overwrite=True; here it is a flag
        raise CLIError(f"{args.dir}: a store or other files already exist there; pass --overwrite to replace them, "
                       "or name a new folder") from None
    info = store_info(path)
    if args.json:
        print_json(_info_json(info))  # as `info --json`
        return 0
    print(f"recorded {args.episodes} episodes of {args.env} into {path}; reopened read-only:\n")
    print_info(info)
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the commands that show a store (``info``, ``ls``, ``episodes``, ``head``, ``stats``,
    ``plot``, ``demo``) to the subparsers ``sub``; ``common`` holds the options every command takes."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("info", parents=[common], formatter_class=fmt, help="summarize a store",
                       description="Kind, format version, creator, spaces, capacity, rows and offset of each table, "
                                   "episodes, size on disk and compression ratio, and the arrays.  Of a sharded dataset's root: "
                                   "its shards (rows, episodes, size), spaces and totals.")
    add_store_args(p)
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("ls", parents=[common], help="list every array with its layout and size",
                       description="Every array: path, shape, committed rows, dtype, chunk shape, codec, bytes stored "
                                   "and compression ratio (committed bytes / stored bytes).")
    add_store_args(p)
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("episodes", parents=[common], help="list episodes: first row, length, return, flags",
                       description="One line per episode with steps in the store: id, first row, length, return (sum "
                                   "of the reward field, when one exists or is named) and the terminated/truncated "
                                   "flags of its last step when recorded.  TrajectoryReplayBuffer stores group steps "
                                   "by episode id; ReplayBuffer stores split after rows flagged terminated/truncated "
                                   "(or done).  Of a sharded dataset's root: every shard's episodes, with a shard column.")
    add_store_args(p)
    p.add_argument("--limit", type=non_negative_int, default=None, metavar="N", help="show at most N episodes")
    p.add_argument("--sort", choices=("length", "return"), default=None,
                   help="order by length or return, largest first (default: by first row)")
    p.add_argument("--reward-field", default=None, metavar="NAME",
                   help="scalar step field holding rewards (default: a field named reward or rewards)")
    p.set_defaults(func=_cmd_episodes)

    p = sub.add_parser("head", parents=[common], help="print the first rows",
                       description="The first rows of the store (or of one episode).  Arrays with more than 16 "
                                   "elements are summarized as shape, dtype, min and max.")
    add_store_args(p)
    p.add_argument("-n", type=non_negative_int, default=5, metavar="N", help="rows to show (default 5)")
    p.add_argument("--field", default=None, metavar="A/B",
                   help="only this array or subtree (e.g. obs, step_data/obs, episode_data)")
    p.add_argument("--episode", type=int, default=None, metavar="ID", help="rows of this episode only")
    p.set_defaults(func=_cmd_head)

    p = sub.add_parser("stats", parents=[common], help="min, max, mean, std and NaN/inf counts of every array",
                       description="Per array, over every committed row: min, max, mean and std of the finite values "
                                   "and the NaN and inf counts.  Computed a bounded block of rows at a time, so "
                                   "memory stays flat whatever the store's size.  Of a sharded dataset's root: over every "
                                   "shard, one at a time.")
    add_store_args(p)
    p.add_argument("--field", default=None, metavar="A/B", help="only this array or subtree")
    p.add_argument("--save", action="store_true", help="compute every episode's statistics (count, mean, std, min, "
                   "max, quantiles) of a trajectory store and store them in it (docs/robot.md)")
    p.add_argument("--episodes", default=None, metavar="IDS", help="statistics with quantiles aggregated over these "
                   "episodes of a trajectory store ('all' or ids such as 0,3,7), from its stored statistics")
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser("plot", parents=[common], help="plot episode returns and lengths to a PNG (needs matplotlib)",
                       description="Episode return and length over episode index, plus their histograms, written "
                                   "to an image file.  Needs matplotlib (pip install matplotlib).")
    add_store_args(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE.png", help="image file to write")
    p.add_argument("--reward-field", default=None, metavar="NAME", help="scalar step field holding rewards")
    p.add_argument("--dpi", type=positive_int, default=100, help="image resolution (default 100)")
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("demo", parents=[common], help="record episodes of a gymnasium env into a new store",
                       description="Run a random policy in a gymnasium environment, store every transition (obs, "
                                   "action, reward, next_obs, terminated, truncated) in a new ReplayBuffer at DIR, "
                                   "reopen it read-only and print its info.")
    p.add_argument("dir", metavar="DIR", help="folder to create the store in")
    p.add_argument("--env", default="CartPole-v1", help="gymnasium env id (default CartPole-v1)")
    p.add_argument("--episodes", type=positive_int, default=5, help="episodes to record (default 5)")
    p.add_argument("--seed", type=int, default=0, help="reset seed of the first episode (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store at DIR")
    p.add_argument("--json", action="store_true", help="print the new store's info as JSON (as info --json)")
    p.set_defaults(func=_cmd_demo)
