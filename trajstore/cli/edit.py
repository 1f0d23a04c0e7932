"""Commands that write new stores from episodes of existing ones: ``combine``, ``split``, ``filter``,
and ``convert`` (a replay store's episodes as a trajectory store).

Each streams a bounded block of steps at a time, writes its destination(s) under a temporary
name, verifies them and only then renames them into place (nothing is left behind on error);
see :mod:`trajstore.maintenance.combine`.
"""

from __future__ import annotations

import argparse
from typing import Any

from trajstore.cli._common import CLIError, json_arg, print_json

__all__ = ["register", "parse_ratios"]


def parse_ratios(text: str) -> dict[str, float]:
    """``"train=0.9,val=0.1"`` as ``{"train": 0.9, "val": 0.1}`` (argparse type of ``--ratios``)."""
    out: dict[str, float] = {}
    for part in text.split(","):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or not name:
            raise argparse.ArgumentTypeError(f"expected NAME=FRACTION[,NAME=FRACTION...] such as train=0.9,val=0.1; "
                                             f"got {text!r}")
        if name in out:
            raise argparse.ArgumentTypeError(f"split {name!r} is named twice in {text!r}")
        try:
            out[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"the fraction of {name!r} is not a number: {value!r}") from None
    return out


def _bar(args: argparse.Namespace) -> bool | None:
    return False if args.json else None  # a bar only on a terminal, never around JSON


def _cmd_combine(args: argparse.Namespace) -> int:
    from trajstore.maintenance.combine import combine

    if len(args.stores) < 2:
        raise CLIError("combine needs at least one source and a destination: trajstore combine A [B ...] DST", code=2)
    *sources, dst = args.stores
    out = combine(sources, dst, tqdm=_bar(args), overwrite=args.overwrite)
    if args.json:
        print_json(out)
    else:
        parts = ", ".join(f"{s} ({e} episodes, {n} steps)" for s, e, n in zip(out["sources"], out["episodes"],
                                                                                out["steps"]))
        print(f"combined {parts} into {out['destination']}: {sum(out['episodes'])} episodes, "
              f"{sum(out['steps'])} steps, episode field 'source' = index of the source; verified")
    return 0


def _cmd_split(args: argparse.Namespace) -> int:
    from trajstore.maintenance.combine import split

    out = split(args.src, args.ratios, args.dst_prefix, seed=args.seed, tqdm=_bar(args), overwrite=args.overwrite)
    if args.json:
        print_json(out)
    else:
        for name, s in out["splits"].items():
            print(f"{name}: {s['episodes']} episodes, {s['steps']} steps -> {s['destination']}")
        print(f"split {out['source']} (seed {out['seed']}); every split verified")
    return 0


def _cmd_filter(args: argparse.Namespace) -> int:
    from trajstore.maintenance.combine import filter_store

    out = filter_store(args.src, args.dst, args.where, tqdm=_bar(args), overwrite=args.overwrite)
    if args.json:
        print_json(out)
    else:
        print(f"kept {out['episodes']} of {out['of']} episodes ({out['steps']} steps) where {out['where']}: "
              f"{out['destination']}; verified")
    return 0


def _convert_source(args: argparse.Namespace) -> str:
    """The store to convert: SRC itself, or the ``transitions`` store of a stable-baselines3
    replay buffer's folder (one env: a row of several envs holds one done flag per env)."""
    from trajstore.cli.parts import sb3_folder

    folder = sb3_folder(args.src, args.storage_options)
    if folder is None:
        return str(args.src)
    parts = dict(folder.parts)
    n_envs = (folder.record or {}).get("n_envs")
    if "transitions" not in parts:
        raise CLIError(f"{args.src}: a stable-baselines3 {folder.kind} folder; convert takes a replay buffer's "
                       f"folder (its transitions store) or a store with terminated/truncated flags, e.g. one of "
                       f"{', '.join(parts) or 'its stores'} (rollout histories already are trajectory stores)")
    if n_envs != 1:
        raise CLIError(f"{args.src}: a stable-baselines3 {folder.kind} of n_envs={n_envs}: each row holds every env's "
                       "transition, so rows do not form episodes; convert takes buffers of n_envs=1")
    return parts["transitions"]


def _cmd_convert(args: argparse.Namespace) -> int:
    from trajstore.maintenance.convert import to_trajectory

    src = _convert_source(args)
    out = to_trajectory(src, args.dst, reward_field=args.reward_field, storage_options=args.storage_options,
                        tqdm=_bar(args), overwrite=args.overwrite)
    if args.json:
        print_json(out)
    else:
        what = f"{out['episodes']} episodes" + (" (the last one in progress)" if out["in_progress"] else "")
        returns = f"returns from {out['reward_field']}" if out["reward_field"] else "no reward field: returns 0"
        print(f"converted {src} into the trajectory store {out['destination']}: {what}, {out['steps']} steps, "
              f"episode data return and length ({returns}); verified")
    return 0


def _output_args(p: argparse.ArgumentParser, overwrite: str = "replace an existing store at DST") -> None:
    """``--overwrite`` and ``--json``, which every command writing new stores takes."""
    p.add_argument("--overwrite", action="store_true", help=overwrite)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``combine``, ``split`` and ``filter`` to the subparsers ``sub``; ``common`` holds the
    options every command takes."""
    p = sub.add_parser("combine", parents=[common], help="one store from the episodes of several (verified)",
                       description="Write every episode of the stores A B ... to a new store DST (a local folder). "
                                   "The sources must have equal step and episode spaces.  Episodes get fresh ids "
                                   "0, 1, ... and an episode field 'source' holding the index of their store in the "
                                   "argument list (0 for A).  DST is written under a temporary name, verified, then "
                                   "renamed; nothing is left behind on error.")
    p.add_argument("stores", nargs="+", metavar="STORE", help="source stores, then the destination DST")
    _output_args(p)
    p.set_defaults(func=_cmd_combine)

    p = sub.add_parser("convert", parents=[common], help="a replay store's episodes as a trajectory store (verified)",
                       description="Write a ReplayBuffer store whose rows flag episode ends (terminated/truncated "
                                   "or done fields: trajstore demo, a stable-baselines3 replay buffer of one env) "
                                   "to a new TrajectoryReplayBuffer store DST: the same rows, the episodes "
                                   "'trajstore episodes SRC' lists as episode ids, and each episode's return and "
                                   "length as episode data.  combine, split, filter and "
                                   "TrajectoryReplayBuffer.load_from then take DST.  SRC may be a "
                                   "stable-baselines3 buffer's cache_path (its transitions store is converted).  DST "
                                   "is written under a temporary name, verified, then renamed.")
    p.add_argument("src", metavar="SRC", help="replay store (folder, .zip or URL) or a stable-baselines3 cache_path")
    p.add_argument("dst", metavar="DST", help="destination (a local folder)")
    p.add_argument("--to", choices=("trajectory",), default="trajectory",
                   help="kind of the new store (trajectory: the only one)")
    p.add_argument("--reward-field", default=None, metavar="NAME",
                   help="scalar step field summed into each episode's return (default: reward or rewards)")
    p.add_argument("--storage-options", type=json_arg, default=None, metavar="JSON", help="fsspec options for SRC")
    _output_args(p)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("split", parents=[common], help="split a store's episodes into several stores (verified)",
                       description="Share the episodes of SRC out among new stores DST_PREFIX + NAME, one per "
                                   "NAME=FRACTION of --ratios (fractions summing to 1).  Every episode goes to exactly "
                                   "one split, keeping its id, steps and episode data; the assignment is a random "
                                   "permutation seeded by --seed, so it is reproducible.  Each split is verified "
                                   "before any is renamed into place.")
    p.add_argument("src", metavar="SRC", help="store to split")
    p.add_argument("--ratios", type=parse_ratios, default={"train": 0.9, "val": 0.1}, metavar="NAME=F,...",
                   help="split names and fractions (default train=0.9,val=0.1)")
    p.add_argument("dst_prefix", metavar="DST_PREFIX", help="each split is written to DST_PREFIX + NAME "
                                                            "(out/pendulum_ gives out/pendulum_train)")
    p.add_argument("--seed", type=int, default=0, help="seed of the episode permutation (default 0)")
    _output_args(p, "replace existing stores at the destinations")
    p.set_defaults(func=_cmd_split)

    p = sub.add_parser("filter", parents=[common], help="keep the episodes matching an expression (verified)",
                       description="Write the episodes of SRC for which --where holds to a new store DST (ids, steps "
                                   "and episode data kept).  The expression is a small safe language, never Python "
                                   "eval: numbers, episode fields (episode_id, start, length, live, has_data and every "
                                   "scalar episode-data field; Dict keys joined by '.'; task, each episode's task string), "
                                   "comparisons == != < <= > >=, and/or/not, parentheses, quoted strings.  Examples: "
                                   "--where 'return > 100 and length >= 50', --where \"task == 'pick cube'\".")
    p.add_argument("src", metavar="SRC", help="store to filter")
    p.add_argument("dst", metavar="DST", help="destination (a local folder)")
    p.add_argument("--where", required=True, metavar="EXPR", help="which episodes to keep, e.g. 'return > 100'")
    _output_args(p)
    p.set_defaults(func=_cmd_filter)
