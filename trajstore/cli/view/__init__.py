"""``trajstore view PATH``: a read-only web page over a store, served on 127.0.0.1.

The page (``static/``: plain HTML, CSS and JavaScript, no build step) shows the overview of a
store, its episode table (sorted, filtered with ``trajstore filter --where``'s expressions, paged)
and one episode at a time: its scalar and small vector fields plotted against step (or time, for a
store with a frame rate or a ``timestamp`` field) with uPlot
(vendored: ``static/uPlot.iife.min.js``, MIT, its licence beside it) and its image and video
fields as frames under a scrubber that moves a cursor on the plots.  The overview shows
the frame rate, the task dictionary and the stored statistics (docs/robot.md).  The page polls the
store, so a store a writer is filling shows its new episodes.

:mod:`.data` reads the store (read-only), :mod:`.robot` its time, tasks and statistics,
:mod:`.frames` makes the thumbnails, :mod:`.server` answers HTTP.  :func:`open_view` builds a server for scripts and tests.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from trajstore.cli._common import add_store_args, non_negative_int

if TYPE_CHECKING:
    from trajstore.cli.view.server import ViewServer

__all__ = ["register", "open_view", "version_options"]


def open_view(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
              host: str = "127.0.0.1", port: int = 0) -> "ViewServer":
    """A server for the store (or stable-baselines3 buffer folder, or sharded dataset root) at
    ``path``, bound to ``host:port`` (0: a free port) and not yet serving: call
    ``serve_forever()`` (in a thread) and ``shutdown()`` + ``server_close()`` when done.

    Nothing is opened here beyond finding the stores of a folder: a store that cannot be opened
    gives its error on the page (and in the API answers), as the CLI would print it.
    """
    from trajstore.cli.parts import sb3_folder, shard_folder
    from trajstore.cli.view.data import StorePart
    from trajstore.cli.view.server import make_server

    p = os.fspath(path)
    folder = sb3_folder(p, storage_options) or shard_folder(p, storage_options)
    if folder is None:
        parts = [StorePart("", p, storage_options)]
        info: dict[str, Any] = {"path": p, "layout": "store", "describe": p, "problems": []}
    else:
        parts = [StorePart(name, url, storage_options) for name, url in folder.parts]
        info = {"path": p, "layout": folder.layout, "describe": folder.describe(), "problems": folder.problems}
    return make_server(parts, info, host, port)


def version_options(path: str, version: str | None, storage_options: dict[str, Any] | None) -> dict[str, Any] | None:
    """``storage_options`` that open version ``version`` (a tag, snapshot id or ISO datetime) of the
    icechunk store at ``path`` read-only; unchanged when ``version`` is None.

    Raises
    ------
    BadOptionError
        A version for a store that is not in an icechunk repository (only those have versions).
    """
    if version is None:
        return storage_options
    from trajstore.errors import BadOptionError
    from trajstore.maintenance.versions import check_version
    from trajstore.storage.icechunk_location import VERSION_OPTION, is_icechunk_url

    if not is_icechunk_url(path):
        raise BadOptionError(f"--version {version!r}: {path!r} has no versions (only icechunk:// and icechunk+s3:// "
                             "stores do; docs/versions.md)")
    return {**(storage_options or {}), VERSION_OPTION: check_version(version)}


def _cmd_view(args: argparse.Namespace) -> int:
    from trajstore.errors import NotATrajstoreError, StoreNotFoundError, TrajstoreError, VersionNotFoundError

    options = version_options(args.path, args.version, args.storage_options)
    server = open_view(args.path, storage_options=options, host=args.host, port=args.port)
    if len(server.parts) == 1:
        # Nothing to show at all (no store there, no such version): say so now, as the other
        # commands do.  A store that is there but damaged is served: the page shows what is wrong.
        try:
            with server.parts[0].lock:
                server.parts[0].store()
        except (StoreNotFoundError, NotATrajstoreError, VersionNotFoundError):
            server.server_close()
            raise
        except (TrajstoreError, OSError, ValueError):
            pass
    print(f"trajstore view: serving {args.path} read-only at {server.url} (Ctrl-C stops)", flush=True)
    if args.open:
        import webbrowser

        webbrowser.open(server.url)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the ``view`` command to the subparsers ``sub``."""
    p = sub.add_parser("view", parents=[common], help="browse a store in a web page (read-only, on 127.0.0.1)",
                       description="Serve a read-only page over the store: its overview, its episodes (sorted, "
                                   "filtered with --where expressions, paged) and each episode's fields plotted "
                                   "against step with its image frames under a scrubber.  The page follows a "
                                   "store a writer is filling.  Binds 127.0.0.1 unless --host says otherwise.")
    add_store_args(p, json_flag=False)
    p.add_argument("--port", type=non_negative_int, default=8765, help="port (default 8765; 0: any free port)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; the page has no login)")
    p.add_argument("--open", action="store_true", help="open the page in the default web browser")
    p.add_argument("--version", metavar="VERSION", default=None,
                   help="an icechunk store's version to show: a tag, a snapshot id or an ISO datetime "
                        "(docs/versions.md; default: the branch's latest snapshot)")
    p.set_defaults(func=_cmd_view)
