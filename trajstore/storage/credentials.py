"""Secrets in ``storage_options``: which keys hold them, and keeping them out of pickled handles.

``storage_options`` travel with everything that reopens a store in another process: Ray actor
arguments (pickled into Ray's object store) and dask task graphs (pickled to the scheduler and
workers, visible in dashboards and logs).  Secrets there would be copied in plain text.  Ray
refuses them (:func:`check_storage_options`); dask graphs carry :func:`scrub`'s reference instead
and resolve it in the worker (:func:`resolve`).
"""

from __future__ import annotations

import json
import re
import secrets as _secrets
import threading
from collections.abc import Callable, Mapping
from typing import Any

from trajstore.errors import BadOptionError

__all__ = ["SECRET_KEY", "secret_keys", "check_storage_options", "OptionsRef", "scrub", "resolve"]

#: storage_options keys (at any depth) that name a secret.
SECRET_KEY = re.compile(r"secret|token|passw|credential|(^|_)key$|access_key|session|signature|auth", re.I)


def secret_keys(options: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the keys of ``options`` (nested mappings included) that name a secret."""
    out = []
    for k, v in options.items():
        name = f"{prefix}{k}"
        if SECRET_KEY.search(str(k)):
            out.append(name)
        elif isinstance(v, Mapping):
            out.extend(secret_keys(v, name + "."))
    return out


def check_storage_options(storage_options: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None) -> None:
    """Refuse ``storage_options`` that would pickle a secret into Ray's stores.

    Parameters
    ----------
    storage_options : dict, zero-argument callable or None
        A dict may hold non-secret fsspec settings only (``profile``, ``endpoint_url``, ``anon``,
        ``client_kwargs`` without keys...); a callable is resolved inside the actor.

    Raises
    ------
    BadOptionError
        A key (at any depth) names a secret, or the value is neither a mapping, a callable nor None.
    """
    if storage_options is None or callable(storage_options):
        return
    if not isinstance(storage_options, Mapping):
        raise BadOptionError("storage_options must be a dict of non-secret settings, a zero-argument callable "
                             f"resolved in the actor, or None; got {type(storage_options).__name__}")
    bad = secret_keys(storage_options)
    if bad:
        raise BadOptionError(f"storage_options hold credentials ({', '.join(bad)}); Ray would pickle them into its "
                             "object store with the actor's arguments. Pass a profile ({'profile': name}), set them "
                             "in the actors' environment, or pass a callable that reads them inside the actor")


def _without_secrets(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (_without_secrets(v) if isinstance(v, Mapping) else v) for k, v in options.items()
            if not SECRET_KEY.search(str(k))}


# Options with secrets, by reference token; only this process (and processes forked from it) holds them.
_HELD: dict[str, dict[str, Any]] = {}
_TOKENS: dict[str, str] = {}  # canonical JSON of held options -> their token (one token per distinct options)
_LOCK = threading.Lock()


class OptionsRef:
    """What a pickled recipe carries instead of storage options holding secrets: the non-secret
    settings and a random token.  :func:`resolve` gives the full options in the process that made
    the reference, the non-secret settings elsewhere (the filesystem then finds credentials in
    that process's environment, AWS config profile or instance role)."""

    __slots__ = ("token", "settings")

    def __init__(self, token: str, settings: dict[str, Any]) -> None:
        self.token = token
        self.settings = settings

    def __reduce__(self) -> Any:
        return (OptionsRef, (self.token, self.settings))

    def __repr__(self) -> str:
        return f"OptionsRef({self.token!r}, {self.settings!r})"


def scrub(obj: Any) -> Any:
    """``obj`` (a recipe's arguments: tuples, lists, dicts, other values) with every mapping that
    holds a secret key replaced by an :class:`OptionsRef`; everything else as it is."""
    if isinstance(obj, (tuple, list)):
        return type(obj)(scrub(v) for v in obj)
    if isinstance(obj, Mapping) and secret_keys(obj):
        full = dict(obj)
        try:
            canon = json.dumps(full, sort_keys=True, default=repr)
        except (TypeError, ValueError):  # keys that are not strings: no sharing of tokens
            canon = None
        with _LOCK:
            token = _TOKENS.get(canon) if canon is not None else None
            if token is None:
                token = _secrets.token_hex(16)
                _HELD[token] = full
                if canon is not None:
                    _TOKENS[canon] = token
        return OptionsRef(token, _without_secrets(full))
    return obj


def resolve(obj: Any) -> Any:
    """Undo :func:`scrub`: each :class:`OptionsRef` becomes the full options where this process
    holds them, else its non-secret settings."""
    if isinstance(obj, (tuple, list)):
        return type(obj)(resolve(v) for v in obj)
    if isinstance(obj, OptionsRef):
        with _LOCK:
            held = _HELD.get(obj.token)
        return dict(held) if held is not None else dict(obj.settings)
    return obj
