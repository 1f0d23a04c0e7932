"""Commands on the versions of a dataset in an icechunk repository (docs/versions.md): ``log``,
``diff``, ``tag``, ``push`` and ``pull``; see :mod:`trajstore.maintenance.versions` and
:mod:`trajstore.maintenance.push_pull`."""

from __future__ import annotations

import argparse
from typing import Any

from trajstore.cli._common import CLIError, add_store_args, fmt_bytes, json_arg, print_json, print_table

__all__ = ["register", "parse_episodes"]


def parse_episodes(text: str) -> tuple[int, int]:
    """``"0:100"`` as ``(0, 100)``: episode ids ``0 <= id < 100`` (argparse type of ``--episodes``)."""
    lo, colon, hi = text.partition(":")
    try:
        out = (int(lo), int(hi)) if colon else (int(lo), int(lo) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI (episode ids LO <= id < HI) such as 0:100; got {text!r}") from None
    if out[0] < 0 or out[1] <= out[0]:
        raise argparse.ArgumentTypeError(f"expected 0 <= LO < HI; got {text!r}")
    return out


def _version(text: str | None) -> Any:
    from trajstore.maintenance.versions import check_version

    return None if text is None else check_version(text)


def _cmd_log(args: argparse.Namespace) -> int:
    from trajstore.maintenance.versions import log

    entries = log(args.path, limit=args.limit, storage_options=args.storage_options)
    if args.json:
        print_json([{**e, "time": e["time"].isoformat()} for e in entries])
        return 0
    print_table(["snapshot", "time (UTC)", "rows", "episodes", "tags", "message"],
                [[e["snapshot"], e["time"].strftime("%Y-%m-%d %H:%M:%S"), e["rows"],
                  "-" if e["episodes"] is None else e["episodes"], ",".join(e["tags"]), e["message"]]
                 for e in entries], right=["rows", "episodes"])
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from trajstore.maintenance.versions import diff

    out = diff(args.path, _version(args.a), _version(args.b), storage_options=args.storage_options)
    if args.json:
        print_json(out)
        return 0
    ep, fl = out["episodes"], out["fields"]
    print(f"{args.a} ({out['a']}) -> {args.b} ({out['b']})")
    print(f"rows: {out['rows'][0]} -> {out['rows'][1]}; chunks rewritten: {out['chunks_changed']}")
    print(f"episodes: {len(ep['added'])} added {_ids(ep['added'])}, {len(ep['removed'])} removed "
          f"{_ids(ep['removed'])}, {len(ep['changed'])} changed {_ids(ep['changed'])}")
    print(f"fields: added {fl['added'] or '-'}, removed {fl['removed'] or '-'}, changed {fl['changed'] or '-'}")
    return 0


def _ids(ids: list[int]) -> str:
    if not ids:
        return ""
    return "(" + ", ".join(map(str, ids[:10])) + (", ...)" if len(ids) > 10 else ")")


def _cmd_tag(args: argparse.Namespace) -> int:
    from trajstore.maintenance.versions import tag

    snap = tag(args.path, args.name, version=_version(args.version), storage_options=args.storage_options)
    print_json({"tag": args.name, "snapshot": snap}) if args.json else print(f"tagged {snap} {args.name}")
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    from trajstore.maintenance.push_pull import push

    out = push(args.local, args.remote, tag=args.tag, force=args.force, message=args.message,
               storage_options=args.storage_options, remote_options=args.remote_options,
               progress=False if args.json else None)
    if args.json:
        print_json(out)
    else:
        print(f"pushed {args.local} to {args.remote} as {out['snapshot']}" + (f" (tag {out['tag']})" if out["tag"] else "")
              + f": {out['uploaded']} of {out['keys']} keys uploaded ({fmt_bytes(out['uploaded_bytes'])} of "
              f"{fmt_bytes(out['bytes'])}), {out['unchanged']} already there, {out['deleted']} removed")
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    from trajstore.maintenance.push_pull import pull

    if args.episodes is not None and args.where is not None:
        raise CLIError("pull takes --episodes or --where, not both", code=2)
    fields = [f.strip() for f in args.fields.split(",") if f.strip()] if args.fields else None
    out = pull(args.remote, args.local, episodes=args.episodes, where=args.where, fields=fields,
               verify=not args.no_verify, overwrite=args.overwrite, storage_options=args.storage_options,
               progress=False if args.json else None)
    if args.json:
        print_json(out)
    else:
        share = (f" ({out['bytes_read'] / out['remote_bytes']:.1%} of the version's {fmt_bytes(out['remote_bytes'])})"
                 if out["remote_bytes"] else "")
        print(f"pulled {out['episodes']} of {out['of']} episodes ({out['steps']} steps; fields "
              f"{', '.join(out['fields'])}) of {out['source']} at {out['snapshot']} into {out['destination']}: "
              f"{fmt_bytes(out['bytes_read'])} read in {out['requests']} requests{share}; "
              + ("checksums checked, verified" if out["verified"] else "verified (checksums not checked)"))
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``log``, ``diff``, ``tag``, ``push`` and ``pull`` to the subparsers ``sub``."""
    where = "an icechunk location: icechunk://PATH or icechunk+s3://BUCKET/PREFIX"
    p = sub.add_parser("log", parents=[common], help="the commits of a versioned store",
                       description=f"The commits of the store at PATH ({where}), newest first: snapshot id, time, "
                                   "rows, episodes, tags and message.")
    add_store_args(p)
    p.add_argument("--limit", type=int, default=None, metavar="N", help="at most N commits")
    p.set_defaults(func=_cmd_log)

    p = sub.add_parser("diff", parents=[common], help="what changed between two versions",
                       description=f"Episodes added, removed and changed, rows and fields between versions A and B "
                                   f"(a tag, a snapshot id or an ISO datetime) of the store at PATH ({where}).")
    add_store_args(p)
    p.add_argument("a", metavar="A", help="the older version")
    p.add_argument("b", metavar="B", help="the newer version")
    p.set_defaults(func=_cmd_diff)

    p = sub.add_parser("tag", parents=[common], help="name a version for good",
                       description=f"Name the latest commit (or --version) of the store at PATH ({where}) NAME; "
                                   "a tag never moves.")
    add_store_args(p)
    p.add_argument("name", metavar="NAME", help="the tag, e.g. v1.0")
    p.add_argument("--version", default=None, help="tag this version (a snapshot id or ISO datetime) instead")
    p.set_defaults(func=_cmd_tag)

    p = sub.add_parser("push", parents=[common], help="publish a store as the next version of a remote dataset",
                       description=f"Upload the store LOCAL to REMOTE ({where}) as its next version: only the keys "
                                   "whose bytes the remote's last push lacks go out, with the content checksums "
                                   "pull checks, in one commit (a push cut short publishes nothing).")
    p.add_argument("local", metavar="LOCAL", help="the store to publish (a folder or URL)")
    p.add_argument("remote", metavar="REMOTE", help=where)
    p.add_argument("--tag", default=None, help="tag the new version, e.g. v1")
    p.add_argument("--message", default=None, help="the commit message (default: 'push from LOCAL')")
    p.add_argument("--force", action="store_true", help="push even when REMOTE holds another dataset")
    p.add_argument("--storage-options", type=json_arg, default=None, metavar="JSON", help="fsspec options for LOCAL")
    p.add_argument("--remote-options", type=json_arg, default=None, metavar="JSON",
                   help="options for REMOTE (S3: key, secret, endpoint_url, client_kwargs.region_name)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_push)

    p = sub.add_parser("pull", parents=[common], help="a local store of some episodes and fields of a version",
                       description=f"Write the episodes (--episodes or --where) and fields (--fields) asked for of "
                                   f"REMOTE[@VERSION] ({where}) into LOCAL, a new local memory-mapped store: built "
                                   "under a temporary name, verified, then renamed; every key read is checked "
                                   "against the checksums recorded at push.")
    p.add_argument("remote", metavar="REMOTE[@VERSION]", help=where + ", optionally @TAG or @SNAPSHOT")
    p.add_argument("local", metavar="LOCAL", help="the new local store (a folder)")
    p.add_argument("--episodes", type=parse_episodes, default=None, metavar="LO:HI", help="episode ids LO <= id < HI")
    p.add_argument("--where", default=None, metavar="EXPR", help='episodes for which EXPR holds, e.g. "return > 100"')
    p.add_argument("--fields", default=None, metavar="A,B", help="top-level step fields to keep, e.g. obs,action")
    p.add_argument("--no-verify", action="store_true", help="do not check checksums (a version never pushed)")
    p.add_argument("--overwrite", action="store_true", help="replace a store at LOCAL")
    p.add_argument("--storage-options", type=json_arg, default=None, metavar="JSON", help="options for REMOTE")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_pull)
