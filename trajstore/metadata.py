"""Dataset description: a free-form, JSON-only record stored next to the data.

It lives in ``<store root>/trajstore.dataset.json`` (written atomically: temp file + rename
locally, one PUT on object stores), so a byte copy of the store (``dumps(other_path)``,
``trajstore copy``) carries it along.  :func:`set_dataset_info` also copies it into the root
group's zarr attributes under ``"dataset"``, for plain zarr readers and xarray (trajstore reads
only the file).  Suggested keys: ``name``, ``env_id``, ``env_spec``,
``algorithm``, ``author``, ``license``, ``code_permalink``, ``library_versions``,
``description``; any JSON value is accepted.
"""

from __future__ import annotations

import json
import math
import os
from importlib import metadata as _im
from typing import Any

from trajstore.buffers.base import StoredBuffer
from trajstore.errors import (
    BadArgumentError,
    BadValueError,
    DamagedStoreError,
    ReadOnlyError,
)
from trajstore.storage.keys import DATASET_KEY
from trajstore.storage.location import Location, resolve_location
from trajstore.storage.published import DATASET_ATTR, set_root_attribute
from trajstore.storage.schema import load_json

__all__ = ["DATASET_KEY", "set_dataset_info", "get_dataset_info", "env_description", "library_versions"]

_LIBRARIES = ("trajstore", "numpy", "zarr", "gymnasium", "torch", "stable-baselines3")


def _check_json(value: Any, where: str = "dataset info") -> None:
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadValueError(f"{where}: {value!r} is not valid JSON (use null or a string)")
        return
    if isinstance(value, (list, tuple)):
        for k, v in enumerate(value):
            _check_json(v, f"{where}[{k}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise BadArgumentError(f"{where}: keys must be strings; got {k!r}")
            _check_json(v, f"{where}.{k}")
        return
    raise BadArgumentError(f"{where}: {type(value).__name__} is not JSON (only dict, list, str, int, float, bool, None)")


def _location(target: Any, storage_options: dict[str, Any] | None, write: bool) -> tuple[Location, bool]:
    """The store's location and whether we opened it (and must close it)."""
    if isinstance(target, StoredBuffer):
        loc = target.store.loc
        if write and target.read_only:
            raise ReadOnlyError(f"{target.cache_path!r} is open read-only: set dataset info through a writer or by path")
        return loc, False
    path = os.fspath(target)
    if write and not ("://" in path or "::" in path) and path.endswith(".zip"):
        raise ReadOnlyError(f"{path!r}: a .zip store is written once; set dataset info before dumps(...zip)")
    loc = resolve_location(path, read_only=not write, storage_options=storage_options, must_exist=True)
    return loc, True


def get_dataset_info(target: Any, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The dataset description of a store (path, URL or open buffer); ``{}`` when it has none."""
    loc, opened = _location(target, storage_options, write=False)
    try:
        data = loc.get(DATASET_KEY)
    finally:
        if opened:
            loc.close()
    if data is None:
        return {}
    info = load_json(data, str(loc.url), DATASET_KEY)
    if not isinstance(info, dict):
        raise DamagedStoreError(f"{loc.url}: {DATASET_KEY} holds {type(info).__name__}; expected an object")
    return info


def set_dataset_info(target: Any, *, storage_options: dict[str, Any] | None = None, replace: bool = False,
                     **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into the dataset description of a store (``replace=True``: replace it);
    a field set to ``None`` is removed.  Returns the new description.

    ``target`` is a writer buffer or a store path / URL (not a ``.zip``: set the description
    before writing the zip).  Values must be JSON (dict, list, str, int, finite float, bool).
    """
    _check_json(fields)
    info = {} if replace else get_dataset_info(target, storage_options=storage_options)
    info.update(fields)
    info = {k: v for k, v in info.items() if v is not None}
    loc, opened = _location(target, storage_options, write=True)
    try:
        loc.put(DATASET_KEY, json.dumps(info, indent=2, sort_keys=True).encode("utf-8"))
        # A copy for plain zarr readers (xarray shows it in a Dataset's attrs); trajstore reads the file above.
        set_root_attribute(loc, DATASET_ATTR, info or None)
    finally:
        if opened:
            loc.close()
    return info


def library_versions(names: tuple[str, ...] = _LIBRARIES) -> dict[str, str]:
    """Installed versions of ``names`` (those not installed are left out)."""
    out = {}
    for name in names:
        try:
            out[name] = _im.version(name)
        except _im.PackageNotFoundError:
            pass
    return out


def env_description(env: Any) -> dict[str, Any]:
    """``{"env_id", "env_spec", "library_versions"}`` of a gymnasium env (or vector env)."""
    spec = getattr(env, "spec", None)
    if spec is None:
        spec = getattr(getattr(env, "unwrapped", None), "spec", None)
    out: dict[str, Any] = {"library_versions": library_versions()}
    if spec is not None:
        out["env_id"] = spec.id
        try:
            out["env_spec"] = json.loads(spec.to_json())
        except (ValueError, TypeError):  # specs with callables or objects in kwargs do not serialize
            out["env_spec"] = {"id": spec.id, "max_episode_steps": spec.max_episode_steps}
    return out
