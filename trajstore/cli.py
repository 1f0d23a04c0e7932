"""The ``trajstore`` command line: inspect stores and record a demo store.

Every command opens stores read-only unless it exists to change them, prints a human
table by default and JSON with ``--json``, writes errors as one line to stderr (the full
traceback with ``--debug``) and exits 0 on success, 1 when it found a problem, 2 on
usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from .errors import TrajstoreError
from .summary import store_info

__all__ = ["main"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _print_info(info: dict[str, Any]) -> None:
    print(f"store          {info['path']}")
    print(f"kind           {info['kind']} (format v{info['format_version']}, {info['created_by']}, {info['created_at']})")
    for name, t in info["tables"].items():
        cap = "unbounded" if t["capacity"] is None else str(t["capacity"])
        print(f"table {name:<8} rows={t['rows']} capacity={cap} offset={t['offset']}")
    print(f"size on disk   {_fmt_bytes(info['stored_bytes'])} (data {_fmt_bytes(info['logical_bytes'])} "
          f"committed, ratio {info['compression_ratio']:.2f}x)")
    print("spaces")
    for name, tree in info["spaces_text"].items():
        print(f"  {name}:")
        for line in tree.splitlines():
            print(f"    {line}")
    print("arrays")
    w = max((len(a["path"]) for a in info["arrays"]), default=4)
    print(f"  {'path':<{w}}  {'shape':<22} {'dtype':<8} {'chunks':<10} {'codec':<8} {'stored':>10}")
    for a in info["arrays"]:
        print(f"  {a['path']:<{w}}  {str(tuple(a['shape'])):<22} {a['dtype']:<8} {a['chunk_rows']:<10} "
              f"{a['codec']:<8} {_fmt_bytes(a['stored_bytes']):>10}")


def _cmd_info(args: argparse.Namespace) -> int:
    info = store_info(args.path, storage_options=args.storage_options)
    if args.json:
        info = {k: v for k, v in info.items() if k != "spaces_text"}
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import record_demo

    path = record_demo(args.dir, env_id=args.env, episodes=args.episodes, seed=args.seed, overwrite=args.overwrite)
    print(f"recorded {args.episodes} episodes of {args.env} into {path}; reopened read-only:\n")
    _print_info(store_info(path))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trajstore", description="Inspect and create trajstore stores (zarr v3 RL data).")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="summarize a store: kind, spaces, rows, size on disk, arrays")
    info.add_argument("path", help="store folder, .zip file or fsspec URL")
    info.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON",
                      help="fsspec options for URLs, as JSON")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=_cmd_info)

    demo = sub.add_parser("demo", help="record episodes of a gymnasium env into a new store and show its info")
    demo.add_argument("dir", help="folder to create the store in")
    demo.add_argument("--env", default="CartPole-v1", help="gymnasium env id (default CartPole-v1)")
    demo.add_argument("--episodes", type=int, default=5, help="episodes to record (default 5)")
    demo.add_argument("--seed", type=int, default=0, help="reset seed of the first episode (default 0)")
    demo.add_argument("--overwrite", action="store_true", help="replace an existing store at DIR")
    demo.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trajstore`` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # output piped into `head` and closed early
        return 0
    except (TrajstoreError, OSError, ValueError) as e:
        if args.debug:
            raise
        print(f"trajstore {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
