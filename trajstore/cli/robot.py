"""Robot metadata from the shell (docs/robot.md): ``trajstore task`` (list, assign, rename) and the
per-episode statistics of ``trajstore stats --save`` / ``--episodes``."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.cli._common import CLIError, add_store_args, fmt_num, print_json, print_table

__all__ = ["episode_stats_command", "register"]


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise CLIError(f"--episodes takes episode ids such as 0,3,7 (or 'all'); got {text!r}", 2) from None


def _open(args: argparse.Namespace, write: bool) -> TrajectoryReplayBuffer:
    return TrajectoryReplayBuffer.load_from(args.path, read_only=not write, storage_options=args.storage_options)


def episode_stats_command(args: argparse.Namespace) -> int:
    """``trajstore stats PATH --save`` (store every episode's statistics) and ``--episodes IDS``
    (print the statistics aggregated over them)."""
    buf = _open(args, write=args.save)
    with buf:
        if args.save:
            n = buf.save_stats()
            if not args.json and args.episodes is None:
                print(f"saved the statistics of {n} episodes in {args.path}")
        if args.episodes is None:
            if args.json:
                print_json({"saved": True})
            return 0
        eps = None if args.episodes == "all" else _ids(args.episodes)
        stats = buf.stats(eps, fields=None if args.field is None else [args.field])
    if args.json:
        print_json({f: {k: np.asarray(v).tolist() for k, v in s.items()} for f, s in stats.items()})
        return 0
    names = ["mean", "std", "min", "max", "q01", "q10", "q50", "q90", "q99"]
    rows = []
    for f, s in stats.items():  # one line per channel
        flat = {k: np.asarray(s[k], np.float64).ravel() for k in names}
        for c in range(len(flat["mean"])):
            rows.append([f if len(flat["mean"]) == 1 else f"{f}[{c}]", int(s["count"])] +
                        [fmt_num(float(flat[k][c])) for k in names])
    print_table(["field", "steps"] + names, rows, right=tuple(["steps"] + names))
    return 0


def _cmd_task(args: argparse.Namespace) -> int:
    buf = _open(args, write=args.action != "list")
    with buf:
        if args.action == "rename":
            buf.rename_task(args.old, args.new)
        elif args.action == "assign":
            buf.assign_task(_ids(args.episodes), args.task, new=not args.existing)
        tasks, by_episode = buf.tasks, buf.episode_tasks()
    if args.json:
        print_json({"tasks": tasks, "episodes": {str(e): t for e, t in by_episode.items()}})
        return 0
    count = {t: 0 for t in tasks}
    for t in by_episode.values():
        count[t] += 1
    print_table(["task_index", "task", "episodes"], [[k, t, count[t]] for k, t in enumerate(tasks)],
                right=("task_index", "episodes"))
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``task`` to the subparsers ``sub``."""
    p = sub.add_parser("task", parents=[common], help="list, assign or rename the tasks of a trajectory store",
                       description="A trajectory store's task dictionary and each episode's task (docs/robot.md). "
                                   "'list' shows them; 'assign TASK --episodes IDS' gives episodes a task (a new "
                                   "string is added to the dictionary unless --existing); 'rename OLD NEW' renames a "
                                   "task.  Each edit replaces the store's trajstore.robot.json at once.")
    tp = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = tp.add_parser("list", parents=[common], help="the tasks and how many episodes have each")
    add_store_args(q)
    q = tp.add_parser("assign", parents=[common], help="give episodes a task")
    add_store_args(q)
    q.add_argument("task", metavar="TASK")
    q.add_argument("--episodes", required=True, metavar="IDS", help="episode ids, e.g. 0,3,7")
    q.add_argument("--existing", action="store_true", help="refuse a task not in the dictionary yet")
    q = tp.add_parser("rename", parents=[common], help="rename a task")
    add_store_args(q)
    q.add_argument("old", metavar="OLD")
    q.add_argument("new", metavar="NEW")
    p.set_defaults(func=_cmd_task)
