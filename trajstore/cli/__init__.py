"""The ``trajstore`` command line: inspect, verify, repair, copy and plot stores.

Every command opens stores read-only unless it exists to change them (``repair``, ``copy``'s
destination, ``demo``), accepts any fsspec URL with ``--storage-options JSON``, prints a human
table by default and JSON with ``--json``, writes errors as one line to stderr (the full
traceback with ``--debug``) and exits 0 on success, 1 when it found a problem, 2 on usage
errors.  Progress bars (tqdm) appear only when stderr is a terminal.

Commands live in :mod:`.show` (info, ls, episodes, head, stats, plot, demo) and
:mod:`.maintain` (verify, repair, copy) and :mod:`.edit` (combine, split, filter, convert);
:mod:`.view` serves the read-only web page of ``trajstore view``; :mod:`.versions` (log, diff, tag,
push, pull: versions in icechunk repositories).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from trajstore import __version__
from trajstore.cli import edit as _edit
from trajstore.cli import interop as _interop
from trajstore.cli import maintain as _maintain
from trajstore.cli import robot as _robot
from trajstore.cli import show as _show
from trajstore.cli import versions as _versions
from trajstore.cli import view as _view
from trajstore.cli._common import CLIError, error_text
from trajstore.cli.parts import folder_hint
from trajstore.errors import NotATrajstoreError

__all__ = ["main", "build_parser"]

_EPILOG = """\
exit status: 0 ok, 1 a problem was found (or an error), 2 usage error.

examples:
  trajstore demo demo_store                 record 5 CartPole episodes and show them
  trajstore info demo_store                 what a store holds
  trajstore episodes demo_store --sort return --limit 10
  trajstore verify runs/buffer --deep       check every committed chunk
  trajstore copy runs/buffer buffer.zip     copy (verified) into a zip
  trajstore copy runs/apex apex-merged      merge a sharded dataset into one store (verified)
  trajstore split data --ratios train=0.9,val=0.1 data_   episodes into data_train, data_val
  trajstore filter data good --where "return > 100"       keep the episodes that match
  trajstore convert demo_store demo_traj    a replay store's episodes as a trajectory store
  trajstore view demo_store --open          browse its episodes, plots and frames in a web page
  trajstore info s3://bucket/buf --storage-options '{"anon": true}'
  trajstore push data icechunk+s3://bucket/data --tag v1   publish a version (docs/versions.md)
  trajstore pull icechunk+s3://bucket/data@v1 local --episodes 0:100 --fields obs,action

'trajstore COMMAND --help' describes each command."""


def build_parser() -> argparse.ArgumentParser:
    """The ``trajstore`` argument parser: every subcommand, each with its handler as ``func``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback on errors")
    p = argparse.ArgumentParser(
        prog="trajstore", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG,
        description="Inspect, check, repair, copy and plot trajstore stores (zarr v3 replay and trajectory data).")
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    p.add_argument("--version", action="version", version=f"trajstore {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _show.register(sub, common)
    _maintain.register(sub, common)
    _edit.register(sub, common)
    _interop.register(sub, common)
    _view.register(sub, common)
    _robot.register(sub, common)
    _versions.register(sub, common)
    # Subcommands in a sensible order in --help.
    order = ["info", "ls", "episodes", "head", "stats", "verify", "repair", "copy", "convert", "combine", "split", "filter", "plot",
             "view", "demo", "log", "diff", "tag", "push", "pull"]
    sub._choices_actions.sort(key=lambda a: order.index(a.dest) if a.dest in order else len(order))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trajstore`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False))
    try:
        return int(args.func(args))
    except BrokenPipeError:  # output piped into `head` and closed early
        return 0
    except KeyboardInterrupt:
        print(f"trajstore {args.command}: interrupted", file=sys.stderr)
        return 130
    except CLIError as e:
        if debug:
            raise
        print(f"trajstore {args.command}: error: {e}", file=sys.stderr)
        return e.code
    except NotATrajstoreError as e:  # a buffer folder or dataset root given to a one-store command
        if debug:
            raise
        hint = folder_hint(getattr(args, "path", None), getattr(args, "storage_options", None))
        print(f"trajstore {args.command}: error: {' '.join(str(e).split())}{hint}", file=sys.stderr)
        return 1
    except Exception as e:  # every other failure: one line, the traceback only with --debug
        if debug:
            raise
        msg = error_text(e)
        if isinstance(e, OSError):
            msg = _where_failed(args, e, msg)
        print(f"trajstore {args.command}: error: {msg}", file=sys.stderr)
        return 1


def _where_failed(args: argparse.Namespace, e: OSError, msg: str) -> str:
    """An I/O error as a user can act on it: the location it came from (the file it names, else the
    command's stores), and for a refused access (S3's bare "Forbidden") where credentials come from."""
    where = [str(e.filename)] if e.filename else [str(v) for k in ("path", "src", "dst") if (v := getattr(args, k, None))]
    where += [str(v) for v in getattr(args, "stores", None) or []]
    if where and not any(w in msg for w in where):
        msg = f"{' or '.join(where)}: {msg}"
    if isinstance(e, PermissionError):
        msg += (" (access refused: check the credentials and permissions for that location, e.g. --storage-options "
                "'{\"profile\": ...}' or the AWS_* environment variables)")
    return msg


if __name__ == "__main__":
    sys.exit(main())
