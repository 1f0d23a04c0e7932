"""The HTTP side of ``trajstore view``: a standard-library threading server on 127.0.0.1.

Routes (GET only; anything else is 405):

- ``/``: the page; ``/static/NAME``: its script, style and the vendored uPlot (a fixed set of
  files loaded into memory at start: no request names a file);
- ``/api/parts``: the stores shown (one, or a buffer folder's stores, or a dataset's shards) and
  any error opening them;
- ``/api/status``, ``/api/overview``, ``/api/stats``, ``/api/episodes``, ``/api/episode``: JSON
  (:class:`~trajstore.cli.view.data.StorePart`);
- ``/api/frame``: one frame of an image field as PNG or JPEG, made on demand.

Every parameter is checked (names against the store, numbers against their ranges, unknown
parameters refused); a bad request is a 4xx with a JSON ``{"error": message}``, and a store that
cannot be read gives the message the CLI prints, the server going on.  Requests are bounded in
size (the URL) and in number (at most :data:`MAX_INFLIGHT` at once, the rest 503).  A ``Host``
header naming another machine is refused (a web page elsewhere cannot reach the server through
DNS rebinding).
"""

from __future__ import annotations

import http.server
import json
import threading
from importlib import resources
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from trajstore.cli._common import error_text, sanitize_json
from trajstore.cli.view.data import StorePart
from trajstore.cli.view.frames import FORMATS, encode_frame, thumbnail
from trajstore.errors import (
    BadOptionError,
    ConcurrentWriteError,
    IndexOutOfRangeError,
    NoEpisodesError,
    UnknownEpisodeError,
    UnknownFieldError,
    UnknownTaskError,
)

__all__ = ["ViewServer", "make_server", "STATIC", "MAX_INFLIGHT", "MAX_URL"]

#: The files the page is made of (name -> content type); read from the package at start.
STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "app.css": "text/css; charset=utf-8", "uPlot.iife.min.js": "text/javascript; charset=utf-8",
          "uPlot.min.css": "text/css; charset=utf-8"}
#: Requests answered at once; more wait up to :data:`_WAIT_S`, then get 503.
MAX_INFLIGHT = 16
_WAIT_S = 10.0
#: Longest request target accepted (a where expression fits well inside).
MAX_URL = 8192
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_PARAMS: dict[str, set[str]] = {"parts": set(), "status": {"part"}, "overview": {"part"}, "stats": {"part"},
           "episodes": {"part", "where", "sort", "desc", "offset", "limit"}, "episode": {"part", "id"},
           "frame": {"part", "id", "field", "step", "fmt", "size"}}


class RequestError(Exception):
    """A request the server refuses: ``status`` (4xx) and the message shown."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _status_of(e: Exception) -> int:
    if isinstance(e, RequestError):
        return e.status
    if isinstance(e, (UnknownEpisodeError, UnknownFieldError, UnknownTaskError)):
        return 404
    if isinstance(e, (BadOptionError, IndexOutOfRangeError)):
        return 400
    if isinstance(e, NoEpisodesError):
        return 409
    if isinstance(e, ConcurrentWriteError):
        return 503  # a writer turned the ring under the read: asking again answers
    return 422  # the store cannot be read (damaged, hostile, gone): the CLI's message


class ViewServer(http.server.ThreadingHTTPServer):
    """The server of one ``trajstore view`` session: ``parts`` (the stores), ``folder`` (what
    the path is, for a buffer folder or dataset root), ``static`` (the page's files)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], parts: list[StorePart], folder: dict[str, Any]) -> None:
        super().__init__(address, _Handler)
        self.parts, self.folder = parts, folder
        pkg = resources.files("trajstore.cli.view") / "static"
        self.static = {name: (pkg / name).read_bytes() for name in STATIC}
        self.slots = threading.BoundedSemaphore(MAX_INFLIGHT)

    @property
    def url(self) -> str:
        """The page's address."""
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/"

    def server_close(self) -> None:
        """Close the socket and every store opened for the page."""
        super().server_close()
        for p in self.parts:
            with p.lock:
                p.close()


def make_server(parts: list[StorePart], folder: dict[str, Any], host: str = "127.0.0.1", port: int = 0) -> ViewServer:
    """A :class:`ViewServer` bound to ``host:port`` (port 0: a free one), not yet serving."""
    return ViewServer((host, port), parts, folder)


def _int(q: dict[str, str], name: str, default: int | None = None, lo: int = 0, hi: int = 2**62) -> int:
    raw = q.get(name)
    if raw is None:
        if default is None:
            raise RequestError(400, f"missing parameter {name!r}")
        return default
    try:
        v = int(raw)
    except ValueError:
        raise RequestError(400, f"{name} must be an integer; got {raw[:40]!r}") from None
    if not lo <= v <= hi:
        raise RequestError(400, f"{name} must be {lo}..{hi}; got {v}")
    return v


class _Handler(http.server.BaseHTTPRequestHandler):
    server: ViewServer
    protocol_version = "HTTP/1.1"
    # Headers and body leave in separate writes: with Nagle's algorithm a keep-alive client's
    # delayed ACK held each answer ~40 ms (19 thumbnails/s on one connection).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # quiet: the terminal shows the URL and errors only

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if not self.server.slots.acquire(timeout=_WAIT_S):
            self._send(503, b'{"error": "too many requests at once"}', "application/json")
            return
        try:
            self._route()
        finally:
            self.server.slots.release()

    def _refuse_method(self) -> None:
        self.close_connection = True  # a body, if any, is never read
        self._send(405, b'{"error": "read-only: only GET is served"}', "application/json")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _refuse_method  # noqa: N815

    def _route(self) -> None:
        try:
            if len(self.path) > MAX_URL:
                raise RequestError(414, f"request target of {len(self.path)} characters; at most {MAX_URL}")
            self._check_host()
            split = urlsplit(self.path)
            path = split.path
            if path == "/":
                self._send(200, self.server.static["index.html"], STATIC["index.html"])
            elif path.startswith("/static/") and path[8:] in STATIC:
                self._send(200, self.server.static[path[8:]], STATIC[path[8:]])
            elif path.startswith("/api/") and path[5:] in _PARAMS:
                self._api(path[5:], self._query(split.query, _PARAMS[path[5:]]))
            else:
                raise RequestError(404, f"nothing at {path[:200]!r}: this server serves the page, /static/ "
                                        "files and /api/ answers only (never a file path)")
        except Exception as e:  # every failure is an answer; the server goes on
            status = _status_of(e)
            self._send(status, json.dumps({"error": error_text(e), "type": type(e).__name__}).encode(),
                       "application/json")

    def _check_host(self) -> None:
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
        bound = str(self.server.server_address[0])
        if bound not in _LOOPBACK:
            return  # --host chose a network address: its users name it as their network does
        if host and host not in _LOOPBACK:
            raise RequestError(421, f"Host {host[:100]!r} is not this server ({bound})")

    def _query(self, raw: str, allowed: set[str]) -> dict[str, str]:
        try:
            q = parse_qs(raw, keep_blank_values=True, strict_parsing=False, max_num_fields=len(allowed) + 1)
        except ValueError as e:
            raise RequestError(400, f"bad query: {e}") from None
        unknown = sorted(set(q) - allowed)
        if unknown:
            raise RequestError(400, f"unknown parameter(s) {unknown}; this endpoint takes {sorted(allowed)}")
        if any(len(v) > 1 for v in q.values()):
            raise RequestError(400, "each parameter at most once")
        return {k: v[0] for k, v in q.items()}

    def _part(self, q: dict[str, str]) -> StorePart:
        return self.server.parts[_int(q, "part", 0, 0, len(self.server.parts) - 1)]

    def _api(self, what: str, q: dict[str, str]) -> None:
        if what == "parts":
            self._json({"folder": self.server.folder,
                        "parts": [{"index": i, "name": p.name, "url": p.url} for i, p in enumerate(self.server.parts)]})
            return
        part = self._part(q)
        with part.lock:
            if what == "frame":
                self._frame(part, q)
                return
            answer: Callable[[], Any] = {
                "status": part.status, "overview": part.overview, "stats": part.stats,
                "episode": lambda: part.episode(_int(q, "id", lo=-(2**62))),
                "episodes": lambda: part.episodes(q.get("where", ""), q.get("sort", ""), q.get("desc", "0") == "1",
                                                  _int(q, "offset", 0), _int(q, "limit", 100, 1, 10**6)),
            }[what]
            self._json(answer())

    def _frame(self, part: StorePart, q: dict[str, str]) -> None:
        fmt = q.get("fmt", "png")
        if fmt not in FORMATS:
            raise RequestError(400, f"fmt must be one of {sorted(FORMATS)}; got {fmt[:20]!r}")
        if "field" not in q:
            raise RequestError(400, "missing parameter 'field'")
        frame = part.frame(_int(q, "id", lo=-(2**62)), q["field"], _int(q, "step"))
        body = encode_frame(thumbnail(frame, _int(q, "size", 0)), fmt)
        self._send(200, body, FORMATS[fmt])

    def _json(self, obj: Any) -> None:
        self._send(200, json.dumps(sanitize_json(obj), allow_nan=False).encode(), "application/json")

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", "default-src 'self'; img-src 'self' blob:; style-src 'self' 'unsafe-inline'")
        self.end_headers()
        self.wfile.write(body)
