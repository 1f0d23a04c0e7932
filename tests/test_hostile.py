"""Hostile and damaged stores (docs/design.md 3, invariants 5-7): a store on disk is input.

A corpus of tampered stores, each built from a real store (ReplayBuffer and
TrajectoryReplayBuffer, raw and lz4 layouts).  For every case, in a forked child with a
bounded address space and a deadline:

- ``load_from(read_only=True)`` (then reading every row), ``verify_store(deep=True)``, the CLI's
  ``verify`` and ``info``, ``store_info``, then ``load_from()`` as a writer that appends a row
  and closes;
- each either works or raises a :mod:`trajstore.errors` type (the CLI: exit status 1 with a
  one-line message);
- a store that does not open is a failure for ``verify`` too;
- nothing outside the store changes: every file of a sibling folder (the target of the links
  the cases plant) is hashed before and after.

Each case is its own test id; the whole file runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict, Discrete

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.errors import TrajstoreError
from trajstore.storage.keys import FORMAT_VERSION

HEAD = "trajstore.head.json"
DEADLINE_S = 20
AS_HEADROOM = 2 << 30  # address space a case may add to the forked test process


# ------------------------------------------------------------------------------------------ base stores
def _rb_space() -> Dict:
    return Dict([("obs", Box(-1.0, 1.0, (3,), np.float32)), ("a", Discrete(4))])


def _make_rb(path: Path, compressor: str | None) -> None:
    kw = dict(capacity=2048) if compressor is None else dict(compressor=compressor, chunk_rows=64)
    rb = ReplayBuffer.create(_rb_space(), cache_path=path, **kw)
    rng = np.random.default_rng(0)
    rb.extend({"obs": rng.uniform(-1, 1, (300, 3)).astype(np.float32), "a": rng.integers(0, 4, 300)})
    rb.close()


def _make_traj(path: Path, compressor: str | None) -> None:
    kw = dict(chunk_rows=64) if compressor is None else dict(compressor=compressor, chunk_rows=64)
    tb = TrajectoryReplayBuffer.create(Box(-1.0, 1.0, (2,), np.float32), cache_path=path,
                                       episode_data_instance_space=Box(-1.0, 1.0, (), np.float32),
                                       episode_data_storage_kwargs={"chunk_rows": 64}, **kw)
    for e in range(3):
        tb.extend(np.full((40, 2), e / 10, np.float32))
        tb.set_current_episode_data(np.float32(e / 10))
        tb.mark_episode_end()
    tb.close()


BASES: dict[str, tuple[str, Callable[[Path, str | None], None], str | None]] = {
    "rb-raw": ("rb", _make_rb, None),
    "rb-lz4": ("rb", _make_rb, "lz4"),
    "traj-raw": ("traj", _make_traj, None),
    "traj-lz4": ("traj", _make_traj, "lz4"),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for name, (_kind, make, comp) in BASES.items():
        make(root / name, comp)
        out[name] = root / name
    return out


# ------------------------------------------------------------------------------------------ tampering
def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj))


def edit_head(fn: Callable[[dict], Any], replace: bool = False) -> Callable[[Path, Path], None]:
    """Edit the commit record in place with ``fn`` (``replace``: by what ``fn`` returns)."""
    def tamper(store: Path, outside: Path) -> None:
        head = _json(store / HEAD)
        new = fn(head)
        _write_json(store / HEAD, new if replace else head)
    return tamper


def edit_attrs(fn: Callable[[dict], Any], replace: bool = False) -> Callable[[Path, Path], None]:
    """Edit ``attributes.trajstore`` of the root zarr.json (``replace``: by what ``fn`` returns)."""
    def tamper(store: Path, outside: Path) -> None:
        root = _json(store / "zarr.json")
        new = fn(root["attributes"]["trajstore"])
        if replace:
            root["attributes"]["trajstore"] = new
        _write_json(store / "zarr.json", root)
    return tamper


def edit_root(fn: Callable[[dict], Any], replace: bool = False) -> Callable[[Path, Path], None]:
    def tamper(store: Path, outside: Path) -> None:
        root = _json(store / "zarr.json")
        new = fn(root)
        _write_json(store / "zarr.json", new if replace else root)
    return tamper


def edit_array(field: str, fn: Callable[[dict], Any], consolidated: bool = True) -> Callable[[Path, Path], None]:
    """Edit an array's zarr.json and (``consolidated``) its entry in the root's consolidated metadata."""
    def tamper(store: Path, outside: Path) -> None:
        meta = _json(store / field / "zarr.json")
        fn(meta)
        _write_json(store / field / "zarr.json", meta)
        if consolidated:
            root = _json(store / "zarr.json")
            fn(root["consolidated_metadata"]["metadata"][field])
            _write_json(store / "zarr.json", root)
    return tamper


def both(*fns: Callable[[Path, Path], None]) -> Callable[[Path, Path], None]:
    def tamper(store: Path, outside: Path) -> None:
        for fn in fns:
            fn(store, outside)
    return tamper


def replace_with(rel: str, what: str, target: str | None = None) -> Callable[[Path, Path], None]:
    """Replace ``rel`` by a ``fifo``, a ``dir``, a ``link`` (to ``target``: ``outside:<rel>`` or an
    absolute path; the original is first moved there when it is an ``outside:`` path), or a file
    of ``size:<n>`` bytes (sparse)."""
    def tamper(store: Path, outside: Path) -> None:
        p = store / rel
        if what == "link" and target is not None and target.startswith("outside:"):
            dest = outside / target[len("outside:"):]
            dest.parent.mkdir(parents=True, exist_ok=True)
            if p.exists() and not dest.exists():
                shutil.move(str(p), str(dest)) if p.is_dir() else shutil.copyfile(p, dest)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        p.parent.mkdir(parents=True, exist_ok=True)
        if what == "fifo":
            os.mkfifo(p)
        elif what == "dir":
            p.mkdir()
            (p / "junk").write_bytes(b"x")
        elif what == "link":
            assert target is not None
            os.symlink(outside / target[len("outside:"):] if target.startswith("outside:") else target, p)
        elif what.startswith("size:"):
            with open(p, "wb") as f:
                f.truncate(int(what[5:]))
        elif what.startswith("bytes:"):
            p.write_bytes(bytes.fromhex(what[6:]))
    return tamper


def stale_lock(store: Path, outside: Path) -> None:
    """The previous writer died (its lock file still says "open"): the next writer cleans orphans."""
    (store / "trajstore.lock").write_text("open pid=1")


def set_field(i: int, **kv: Any) -> Callable[[dict], None]:
    def fn(a: dict) -> None:
        a["tables"]["step_data"]["fields"][i].update(kv)
    return fn


def deep_list(n: int) -> Any:
    return json.loads("[" * n + "]" * n)


def add_raw(rel: str, key: str, text: str) -> Callable[[Path, Path], None]:
    """Add ``"key": <text>`` (raw JSON text, e.g. nesting too deep for Python's json) to the object
    in ``rel``."""
    def tamper(store: Path, outside: Path) -> None:
        body = (store / rel).read_text().rstrip()
        assert body.endswith("}")
        (store / rel).write_text(body[:-1] + f', "{key}": {text}}}')
    return tamper


def _pending(prefix: Any, chunks: Any) -> Callable[[dict], None]:
    def fn(h: dict) -> None:
        h["pending"] = {"prefix": prefix, "chunks": chunks}
        h["generation"] = max(h["generation"], 7)
    return fn


def _one_billion_rows(store: Path, outside: Path) -> None:
    """chunk_rows=1 everywhere and a record (and arrays) claiming 10**9 rows."""
    root = _json(store / "zarr.json")
    for t in root["attributes"]["trajstore"]["tables"].values():
        for f in t["fields"]:
            f["chunk_rows"] = 1
            for meta in (root["consolidated_metadata"]["metadata"][f["path"]],):
                meta["chunk_grid"]["configuration"]["chunk_shape"][0] = 1
                meta["shape"][0] = 10 ** 9
            arr = _json(store / f["path"] / "zarr.json")
            arr["chunk_grid"]["configuration"]["chunk_shape"][0] = 1
            arr["shape"][0] = 10 ** 9
            _write_json(store / f["path"] / "zarr.json", arr)
    _write_json(store / "zarr.json", root)
    head = _json(store / HEAD)
    for t in head["tables"].values():
        t.update(end=10 ** 9, allocated=10 ** 9)
    _write_json(store / HEAD, head)


def _huge_row_shape(store: Path, outside: Path) -> None:
    """The obs leaf claims rows of 12000 x 12000 (a 2.9 KB zarr.json)."""
    root = _json(store / "zarr.json")
    a = root["attributes"]["trajstore"]
    a["tables"]["step_data"]["fields"][0]["shape"] = [12000, 12000]
    a["spaces"]["step_data"]["spaces"][0][1]["shape"] = [12000, 12000]
    for meta in (root["consolidated_metadata"]["metadata"]["step_data/obs"],):
        meta["shape"] = [meta["shape"][0], 12000, 12000]
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [meta["chunk_grid"]["configuration"]["chunk_shape"][0],
                                                              12000, 12000]
    _write_json(store / "zarr.json", root)


def _garbage_chunk(rel: str) -> Callable[[Path, Path], None]:
    def tamper(store: Path, outside: Path) -> None:
        data = bytearray((store / rel).read_bytes())
        for i in range(16, len(data)):
            data[i] = (data[i] * 7 + 13) % 256
        (store / rel).write_bytes(bytes(data))
    return tamper


def _chunk_link_out(rel: str, size: int) -> Callable[[Path, Path], None]:
    """A chunk file that is a link to a file outside the store (big enough to be mapped)."""
    def tamper(store: Path, outside: Path) -> None:
        victim = outside / "victim_chunk.bin"
        victim.write_bytes(bytes(range(256)) * (size // 256 + 1))
        (store / rel).unlink()
        os.symlink(victim, store / rel)
    return tamper


def _dir_link_out(rel: str) -> Callable[[Path, Path], None]:
    """A folder of the store moved outside and linked back (a "symlinked store subfolder")."""
    def tamper(store: Path, outside: Path) -> None:
        dest = outside / ("moved_" + rel.replace("/", "_"))
        shutil.move(str(store / rel), str(dest))
        os.symlink(dest, store / rel)
    return tamper


def _staged_chunk_link(store: Path, outside: Path) -> None:
    """A valid pending rewrite whose staged chunk is a link to a file outside the store (a writer
    rolling forward would move the link into place; a reader would map its target)."""
    edit_head(_pending(".trajstore-staging/7", {"step_data/a": [0]}))(store, outside)
    staged = store / ".trajstore-staging" / "7" / "step_data" / "a" / "c" / "0"
    staged.parent.mkdir(parents=True)
    victim = outside / "staged_victim.bin"
    victim.write_bytes(b"\x01" * (1 << 16))
    os.symlink(victim, staged)


def _staging_link(store: Path, outside: Path) -> None:
    os.symlink(outside / "victim", store / ".trajstore-staging")


def _staging_sub_link(store: Path, outside: Path) -> None:
    (store / ".trajstore-staging").mkdir()
    os.symlink(outside / "victim", store / ".trajstore-staging" / "9")


def _tmp_link(store: Path, outside: Path) -> None:
    shutil.rmtree(store / ".trajstore-tmp", ignore_errors=True)
    os.symlink(outside / "victim", store / ".trajstore-tmp")


def _lock_link(store: Path, outside: Path) -> None:
    (store / "trajstore.lock").unlink(missing_ok=True)
    os.symlink(outside / "file.bin", store / "trajstore.lock")


def _field_path(path: str) -> Callable[[Path, Path], None]:
    return edit_attrs(set_field(0, path=path))


def _head_link_out(store: Path, outside: Path) -> None:
    shutil.copyfile(store / HEAD, outside / "head.json")
    (store / HEAD).unlink()
    os.symlink(outside / "head.json", store / HEAD)


def _root_link_out(store: Path, outside: Path) -> None:
    shutil.copyfile(store / "zarr.json", outside / "zarr.json")
    (store / "zarr.json").unlink()
    os.symlink(outside / "zarr.json", store / "zarr.json")


def _deep_spaces(a: dict) -> None:
    sp: Any = {"type": "Box", "dtype": "float32", "shape": [3], "low": -1.0, "high": 1.0}
    for _ in range(40):
        sp = {"type": "Tuple", "spaces": [sp]}
    a["spaces"]["step_data"] = sp


def _huge_head(store: Path, outside: Path) -> None:
    head = _json(store / HEAD)
    head["state"]["pad"] = "x" * (2 << 20)
    _write_json(store / HEAD, head)


def _huge_root(store: Path, outside: Path) -> None:
    with open(store / "zarr.json", "r+b") as f:
        f.truncate(20 << 20)  # zarr.json with 20 MiB of trailing NULs (sparse)


# Every case: (id, bases it applies to, tamper).  ``R`` = ReplayBuffer bases, ``T`` = trajectory, ``*`` = all.
RAW, LZ4 = ("rb-raw", "traj-raw"), ("rb-lz4", "traj-lz4")
ALL = tuple(BASES)
TWO = ("rb-raw", "traj-lz4")  # one of each buffer kind and layout, for cases that do not depend on them
OBS_CHUNK = {"rb-raw": "step_data/obs/c/0/0", "rb-lz4": "step_data/obs/c/0/0",
             "traj-raw": "step_data/c/0/0", "traj-lz4": "step_data/c/0/0"}


CASES: list[tuple[str, tuple[str, ...], Any]] = [
    # -- 5. confinement --------------------------------------------------------------------------
    ("pending-prefix-dotdot", TWO, edit_head(_pending("../outside/victim", {"step_data/a": [0]}))),
    ("pending-prefix-staging-dotdot", TWO, edit_head(_pending(".trajstore-staging/../../outside/victim", {}))),
    ("pending-prefix-absolute", TWO, lambda s, o: edit_head(_pending(str(o / "victim"), {}))(s, o)),
    ("pending-chunks-unknown-field", TWO, edit_head(_pending(".trajstore-staging/7", {"nope": [0]}))),
    ("pending-chunks-dotdot-field", TWO, edit_head(_pending(".trajstore-staging/7", {"../outside/victim": [0]}))),
    ("pending-chunk-negative", ("rb-raw",), edit_head(_pending(".trajstore-staging/7", {"step_data/a": [-1]}))),
    ("pending-chunk-huge", ("rb-raw",), edit_head(_pending(".trajstore-staging/7", {"step_data/a": [10 ** 12]}))),
    ("pending-chunk-str", ("rb-raw",), edit_head(_pending(".trajstore-staging/7", {"step_data/a": ["0"]}))),
    ("pending-chunks-list", ("rb-raw",), edit_head(_pending(".trajstore-staging/7", [0]))),
    ("pending-not-object", ("rb-raw",), edit_head(lambda h: h.update(pending=[1, 2]))),
    ("staged-chunk-link", ("rb-raw", "rb-lz4"), _staged_chunk_link),
    ("staging-link-stale-lock", ("rb-raw", "rb-lz4", "traj-lz4"), both(_staging_link, stale_lock)),
    ("staging-sub-link-stale-lock", ("rb-raw", "traj-lz4"), both(_staging_sub_link, stale_lock)),
    ("tmp-link", ("rb-raw", "traj-lz4"), _tmp_link),
    ("tmp-link-stale-lock", ("rb-raw", "traj-lz4"), both(_tmp_link, stale_lock)),
    ("lock-link", ("rb-raw", "traj-lz4"), _lock_link),
    ("lock-fifo", ("rb-raw",), replace_with("trajstore.lock", "fifo")),
    ("field-path-dotdot", ("rb-lz4",), _field_path("step_data/../../outside/x")),
    ("field-path-absolute", ("rb-lz4",), lambda s, o: _field_path(str(o / "absdir"))(s, o)),
    ("field-path-other-table", ("rb-raw",), _field_path("episode_data/obs")),
    ("field-path-hidden", ("rb-raw",), _field_path("step_data/.trajstore-staging")),
    ("field-path-not-str", ("rb-raw",), _field_path(["step_data", "obs"])),
    ("field-paths-nested", ("rb-raw",), edit_attrs(set_field(1, path="step_data/obs/c"))),
    ("chunk-link-out", ALL, lambda s, o: _chunk_link_out(OBS_CHUNK[s.name.split("__")[0]], 1 << 20)(s, o)),
    ("chunk-folder-link-out", ("rb-lz4",), _dir_link_out("step_data/obs/c")),
    ("array-folder-link-out", ("rb-lz4",), _dir_link_out("step_data/obs")),
    ("table-folder-link-out", TWO, _dir_link_out("step_data")),
    ("head-link-out", TWO, _head_link_out),
    ("root-link-out", ("rb-raw", "traj-lz4"), _root_link_out),
    ("array-meta-link-out", ("rb-lz4",), replace_with("step_data/obs/zarr.json", "link",
                                                              "outside:obs_zarr.json")),
    # -- 6. hostile files ------------------------------------------------------------------------
    ("head-fifo", TWO, replace_with(HEAD, "fifo")),
    ("root-fifo", ("rb-raw", "traj-lz4"), replace_with("zarr.json", "fifo")),
    ("array-meta-fifo", ("rb-lz4",), replace_with("step_data/obs/zarr.json", "fifo")),
    ("group-meta-fifo", ("rb-raw",), replace_with("step_data/zarr.json", "fifo")),
    ("dataset-fifo", ("rb-raw",), replace_with("trajstore.dataset.json", "fifo")),
    ("head-dev-zero", TWO, replace_with(HEAD, "link", "/dev/zero")),
    ("root-dev-zero", ("rb-raw", "traj-lz4"), replace_with("zarr.json", "link", "/dev/zero")),
    ("array-meta-dev-zero", ("rb-lz4",), replace_with("step_data/obs/zarr.json", "link", "/dev/zero")),
    ("chunk-dev-zero", ALL, lambda s, o: replace_with(OBS_CHUNK[s.name.split("__")[0]], "link", "/dev/zero")(s, o)),
    ("chunk-fifo", ALL, lambda s, o: replace_with(OBS_CHUNK[s.name.split("__")[0]], "fifo")(s, o)),
    ("head-huge", ("rb-raw",), _huge_head),
    ("root-huge", ("rb-raw",), _huge_root),
    ("row-shape-12000x12000", ("rb-lz4",), _huge_row_shape),
    ("chunk-rows-1-rows-1e9", ("rb-lz4", "traj-lz4"), _one_billion_rows),
    ("head-rows-1e9", ("rb-lz4", "traj-raw"), edit_head(lambda h: h["tables"]["step_data"].update(end=10 ** 9,
                                                                                                  allocated=10 ** 9))),
    ("head-allocated-1e18", ("rb-lz4",), edit_head(lambda h: h["tables"]["step_data"].update(allocated=10 ** 18))),
    ("chunk-rows-huge", ("rb-raw",), edit_attrs(set_field(0, chunk_rows=1 << 40))),
    # -- 7. malformed metadata -------------------------------------------------------------------
    ("format-version-str", ("rb-raw",), edit_attrs(lambda a: a.update(format_version="1"))),
    ("format-version-negative", ("rb-raw",), edit_attrs(lambda a: a.update(format_version=-7))),
    ("format-version-zero", ("rb-raw",), edit_attrs(lambda a: a.update(format_version=0))),
    ("format-version-bool", ("rb-raw",), edit_attrs(lambda a: a.update(format_version=True))),
    ("format-version-float", ("rb-raw",), edit_attrs(lambda a: a.update(format_version=1.0))),
    ("format-version-missing", ("rb-raw",), edit_attrs(lambda a: a.pop("format_version"))),
    ("format-version-newer", ("rb-raw",), edit_attrs(lambda a: a.update(format_version=FORMAT_VERSION + 1))),
    ("root-node-array", ("rb-raw", "traj-lz4"), edit_root(lambda r: r.update(node_type="array"))),
    ("root-not-object", ("rb-raw",), edit_root(lambda r: [r], replace=True)),
    ("root-garbage", ("rb-raw",), replace_with("zarr.json", "bytes:00ff7b7b")),
    ("root-empty", ("rb-raw",), replace_with("zarr.json", "size:0")),
    ("root-deep", ("rb-raw",), add_raw("zarr.json", "extra", "[" * 100_000 + "]" * 100_000)),
    ("root-dir", ("rb-raw",), replace_with("zarr.json", "dir")),
    ("attrs-not-object", ("rb-raw",), edit_attrs(lambda a: [a], replace=True)),
    ("attrs-deep", ("rb-raw",), edit_attrs(lambda a: a.update(extra=deep_list(500)))),
    ("kind-unknown", ("rb-raw",), edit_attrs(lambda a: a.update(kind="Other"))),
    ("kind-not-str", ("rb-raw",), edit_attrs(lambda a: a.update(kind=["ReplayBuffer"]))),
    ("tables-not-object", ("rb-raw",), edit_attrs(lambda a: a.update(tables=[1]))),
    ("tables-extra", ("rb-raw",), edit_attrs(lambda a: a["tables"].update(other=a["tables"]["step_data"]))),
    ("table-missing", ("traj-raw",), edit_attrs(lambda a: a["tables"].pop("step_data"))),
    ("fields-not-list", ("rb-raw",), edit_attrs(lambda a: a["tables"]["step_data"].update(fields={"a": 1}))),
    ("fields-empty", ("rb-raw",), edit_attrs(lambda a: a["tables"]["step_data"].update(fields=[]))),
    ("field-not-object", ("rb-raw",), edit_attrs(lambda a: a["tables"]["step_data"]["fields"].__setitem__(0, 5))),
    ("field-key-missing", ("rb-raw",), edit_attrs(lambda a: a["tables"]["step_data"]["fields"][0].pop("dtype"))),
    ("field-shape-negative", ("rb-raw",), edit_attrs(set_field(0, shape=[-3]))),
    ("field-shape-float", ("rb-raw",), edit_attrs(set_field(0, shape=[3.0]))),
    ("field-shape-deep", ("rb-raw",), edit_attrs(set_field(0, shape=[[[3]]]))),
    ("field-dtype-object", ("rb-raw",), edit_attrs(set_field(0, dtype="O"))),
    ("field-dtype-void", ("rb-raw",), edit_attrs(set_field(0, dtype="V1000000000"))),
    ("field-dtype-unicode", ("rb-raw",), edit_attrs(set_field(0, dtype="<U10"))),
    ("field-dtype-mismatch", ("rb-lz4",), edit_attrs(set_field(0, dtype="f8"))),
    ("field-layout-unknown", ("rb-raw",), edit_attrs(set_field(0, layout="mmap"))),
    ("field-layout-swapped", ("rb-lz4",), edit_attrs(lambda a: [f.update(layout="compressed" if f["layout"] ==
                                                                         "raw" else "raw")
                                                               for f in a["tables"]["step_data"]["fields"]])),
    ("field-chunk-rows-zero", ("rb-raw",), edit_attrs(set_field(0, chunk_rows=0))),
    ("field-chunk-rows-bool", ("rb-raw",), edit_attrs(set_field(0, chunk_rows=True))),
    ("field-chunk-rows-nan", ("rb-raw",), edit_attrs(set_field(0, chunk_rows=float("nan")))),
    ("capacity-infinity", ("rb-raw",), edit_attrs(lambda a: a["tables"]["step_data"].update(capacity=float("inf")))),
    ("field-shape-mismatch-space", ("rb-lz4",), edit_attrs(set_field(0, shape=[4]))),
    ("fields-reordered", ("traj-raw",), edit_attrs(lambda a: a["tables"]["step_data"]["fields"].reverse())),
    ("capacity-negative", ("rb-raw",), edit_attrs(lambda a: a["tables"]["step_data"].update(capacity=-5))),
    ("capacity-str", ("rb-raw",), edit_attrs(lambda a: a["tables"]["step_data"].update(capacity="2048"))),
    ("capacity-shrunk", ("rb-raw",), edit_attrs(lambda a: a["tables"]["step_data"].update(capacity=100))),
    ("spaces-missing", ("rb-raw",), edit_attrs(lambda a: a.pop("spaces"))),
    ("spaces-garbage", ("rb-raw",), edit_attrs(lambda a: a["spaces"].update(step_data={"type": "Pickle", "x": 1}))),
    ("spaces-deep", ("rb-raw",), edit_attrs(_deep_spaces)),
    ("spaces-low-above-high", ("rb-raw",), edit_attrs(lambda a: a["spaces"]["step_data"]["spaces"][0][1].update(
        low=5.0, high=-5.0))),
    ("array-meta-dtype", ("rb-lz4",), edit_array("step_data/obs", lambda m: m.update(data_type="float64"))),
    ("array-meta-dtype-complex", ("rb-lz4",), edit_array("step_data/obs", lambda m: m.update(data_type="complex128"))),
    ("array-meta-row-shape", ("rb-lz4",), edit_array("step_data/obs", lambda m: m["shape"].__setitem__(1, 4))),
    ("array-meta-rows-negative", ("rb-lz4",), edit_array("step_data/obs", lambda m: m["shape"].__setitem__(0, -1))),
    ("array-meta-chunks", ("rb-lz4",), edit_array("step_data/obs", lambda m: m["chunk_grid"]["configuration"]
                                                           ["chunk_shape"].__setitem__(0, 7))),
    ("array-meta-codec-raw", ("rb-raw",), edit_array("step_data/obs", lambda m: m["codecs"].append(
        {"name": "blosc", "configuration": {"cname": "lz4", "clevel": 5, "shuffle": "shuffle", "typesize": 4,
                                            "blocksize": 0}}))),
    ("array-meta-codec-unknown", ("rb-lz4",), edit_array("step_data/obs", lambda m: m["codecs"].__setitem__(
        1, {"name": "evil", "configuration": {}}))),
    ("array-meta-key-encoding", ("rb-lz4",), edit_array("step_data/obs", lambda m: m.update(
        chunk_key_encoding={"name": "v2", "configuration": {"separator": "."}}))),
    ("array-meta-fill-garbage", ("rb-lz4",), edit_array("step_data/obs", lambda m: m.update(fill_value={"a": 1}))),
    ("array-meta-only-file", ("rb-raw",), edit_array("step_data/obs", lambda m: m.update(data_type="int32"),
                                                     consolidated=False)),
    ("array-meta-missing", ("rb-lz4",), lambda s, o: (s / "step_data/obs/zarr.json").unlink()),
    ("array-meta-not-object", ("rb-lz4",), replace_with("step_data/obs/zarr.json", "bytes:5b315d")),
    ("array-meta-stale-shape", ("rb-lz4",), edit_array("step_data/obs", lambda m: m["shape"].__setitem__(0, 64))),
    ("consolidated-missing-entry", ("rb-raw",), edit_root(lambda r: r["consolidated_metadata"]["metadata"].pop(
        "step_data/obs"))),
    ("consolidated-garbage", ("rb-raw",), edit_root(lambda r: r.update(consolidated_metadata=[1]))),
    ("head-garbage", ("rb-raw",), replace_with(HEAD, "bytes:00ff7b")),
    ("head-empty", ("rb-raw",), replace_with(HEAD, "size:0")),
    ("head-dir", ("rb-raw", "traj-lz4"), replace_with(HEAD, "dir")),
    ("head-missing", ("rb-raw",), lambda s, o: (s / HEAD).unlink()),
    ("head-not-object", ("rb-raw",), edit_head(lambda h: [h], replace=True)),
    ("head-null", ("rb-raw",), lambda s, o: (s / HEAD).write_text("null")),
    ("head-deep", ("rb-raw",), add_raw(HEAD, "extra", "[" * 100_000 + "]" * 100_000)),
    ("head-tables-list", ("rb-raw",), edit_head(lambda h: h.update(tables=[1, 2]))),
    ("head-table-missing", ("traj-raw",), edit_head(lambda h: h["tables"].pop("episode_data"))),
    ("head-table-entry-list", ("rb-raw",), edit_head(lambda h: h["tables"].update(step_data=[0, 1, 2]))),
    ("head-allocated-negative", TWO, edit_head(lambda h: h["tables"]["step_data"].update(allocated=-1))),
    ("head-start-after-end", ("rb-raw", "traj-lz4"), edit_head(lambda h: h["tables"]["step_data"].update(start=200))),
    ("head-end-negative", ("rb-raw",), edit_head(lambda h: h["tables"]["step_data"].update(end=-1))),
    ("head-count-above-allocated", ("rb-lz4",), edit_head(lambda h: h["tables"]["step_data"].update(allocated=10))),
    ("head-ring-allocated-wrong", ("rb-raw",), edit_head(lambda h: h["tables"]["step_data"].update(allocated=4096))),
    ("head-end-str", ("rb-raw",), edit_head(lambda h: h["tables"]["step_data"].update(end="300"))),
    ("head-end-float", ("rb-raw",), edit_head(lambda h: h["tables"]["step_data"].update(end=300.0))),
    ("head-end-huge-int", ("rb-raw",), edit_head(lambda h: h["tables"]["step_data"].update(end=10 ** 30))),
    ("head-end-nan", ("rb-raw",), lambda s, o: (s / HEAD).write_text((s / HEAD).read_text().replace('"end":300', '"end":NaN'))),
    ("head-end-infinity", ("rb-raw",), lambda s, o: (s / HEAD).write_text(
        (s / HEAD).read_text().replace('"end":300', '"end":Infinity'))),
    ("head-end-1e400", ("rb-raw",), lambda s, o: (s / HEAD).write_text(
        (s / HEAD).read_text().replace('"end":300', '"end":1e400'))),
    ("head-generation-str", ("rb-raw",), edit_head(lambda h: h.update(generation="1"))),
    ("head-state-list", ("rb-raw",), edit_head(lambda h: h.update(state=[1]))),
    ("head-episode-id-str", ("traj-raw",), edit_head(lambda h: h["state"].update(next_episode_id="9"))),
    ("head-episode-id-negative", ("traj-raw",), edit_head(lambda h: h["state"].update(current_episode_id=-4))),
    ("head-format-newer", ("rb-raw",), edit_head(lambda h: h.update(format_version=99))),
    ("head-format-str", ("rb-raw",), edit_head(lambda h: h.update(format_version="1"))),
    # -- chunk damage ----------------------------------------------------------------------------
    ("chunk-garbage-lz4", LZ4, lambda s, o: _garbage_chunk(OBS_CHUNK[s.name.split("__")[0]])(s, o)),
    ("chunk-truncated", TWO, lambda s, o: replace_with(OBS_CHUNK[s.name.split("__")[0]], "bytes:0102")(s, o)),
    ("chunk-empty", TWO, lambda s, o: replace_with(OBS_CHUNK[s.name.split("__")[0]], "size:0")(s, o)),
    ("chunk-dir", TWO, lambda s, o: replace_with(OBS_CHUNK[s.name.split("__")[0]], "dir")(s, o)),
    ("chunk-huge-sparse", ("rb-lz4",), replace_with("step_data/obs/c/0/0", "size:4294967296")),
    ("chunk-name-junk", ("rb-lz4",), lambda s, o: (s / "step_data/obs/c/00x").write_bytes(b"junk")),
]


def _case_params() -> list[Any]:
    out = []
    for cid, bases, tamper in CASES:
        for base in bases:
            out.append(pytest.param(base, tamper, id=f"{cid}[{base}]"))
    return out


# ------------------------------------------------------------------------------------------ harness
def _snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` without following links: files by content hash, links by target."""
    out = {}
    for dirpath, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, folder)
            if os.path.islink(p):
                out[rel] = "link:" + os.readlink(p)
            elif os.path.isdir(p):
                out[rel] = "dir"
            else:
                with open(p, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def _exercise(kind: str, path: str) -> dict[str, Any]:
    """Everything a user does with a store, each step's outcome: ``ok``, ``T:<trajstore error>`` or
    ``X:<any other exception>`` (the latter is a bug)."""
    from trajstore.cli import main
    from trajstore.maintenance.summary import store_info
    from trajstore.maintenance.verify import verify_store

    cls = ReplayBuffer if kind == "rb" else TrajectoryReplayBuffer
    out: dict[str, Any] = {}

    def attempt(name: str, fn: Callable[[], Any]) -> Any:
        try:
            r = fn()
            out[name] = "ok"
            return r
        except TrajstoreError as e:
            out[name] = f"T:{type(e).__name__}: {e}"
        except Exception as e:
            out[name] = f"X:{type(e).__name__}: {e}"
        return None

    def read_only() -> None:
        with cls.load_from(path, read_only=True) as b:
            n = len(b)
            out["rows"] = n
            if n:
                attempt("read", lambda: (b[:], b.sample(8)))

    def cli(*argv: str) -> tuple[int, str]:
        text = io.StringIO()
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            try:
                code = main(list(argv))
            except SystemExit as e:
                code = int(e.code or 0)
        return code, text.getvalue()[-2000:]

    def write() -> None:
        b = cls.load_from(path)
        try:
            def append() -> None:
                row = b[0] if kind == "rb" else b[0]["step_data"]
                b.append(row)
                b.flush()

            if len(b):
                attempt("write", append)
        finally:
            b.close()

    attempt("open_ro", read_only)
    rep = attempt("verify", lambda: verify_store(path, deep=True))
    out["verify_ok"] = None if rep is None else rep.ok
    out["verify_faults"] = [] if rep is None else [f.kind for f in rep.faults]
    out["cli_verify"] = cli("verify", path)  # (verify_store above decoded every chunk)
    attempt("info", lambda: store_info(path))
    out["cli_info"] = cli("info", path)
    attempt("open_rw", write)
    return out


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def run_isolated(fn: Callable[[], Any], out_file: Path, deadline: float = DEADLINE_S) -> tuple[Any, float]:
    """``fn()`` in a forked child with ``AS_HEADROOM`` more address space than this process and an
    alarm at ``deadline`` seconds; returns (its JSON result or an error string, seconds)."""
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            limit = _vm_size() + AS_HEADROOM
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(int(deadline))
            # where a hung child is stuck, in the test's captured stderr
            faulthandler.dump_traceback_later(max(deadline - 1.5, 0.5), exit=False)
            result = fn()
            out_file.write_text(json.dumps(result, default=str))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            try:
                out_file.write_text(json.dumps(f"child crashed: {type(e).__name__}: {e}"))
            except BaseException:
                code = 3
        finally:
            os._exit(code)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > deadline + 5:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"timed out after {deadline + 5} s", time.monotonic() - t0
        time.sleep(0.01)
    elapsed = time.monotonic() - t0
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        why = "hung (alarm)" if sig == signal.SIGALRM else f"killed by signal {sig}"
        return f"child {why}", elapsed
    if not out_file.exists():
        return f"child exited {os.WEXITSTATUS(status)} without a result", elapsed
    return json.loads(out_file.read_text()), elapsed




def _check_outcome(res: dict[str, Any]) -> list[str]:
    """The contract, as a list of broken promises (empty: all kept)."""
    bad = []
    for op in ("open_ro", "read", "verify", "info", "open_rw", "write"):
        v = res.get(op)
        if isinstance(v, str) and v.startswith("X:"):
            bad.append(f"{op} raised a non-trajstore error: {v}")
    for cmd in ("cli_verify", "cli_info"):
        code, text = res[cmd]
        if code not in (0, 1) or "Traceback" in text or (code and not text.strip()):
            bad.append(f"{cmd}: exit {code}, output {text!r}")
    opens = res.get("open_ro") == "ok"
    if not opens:
        if res.get("verify_ok"):
            bad.append(f"the store does not open ({res.get('open_ro')}) but verify_store found no fault")
        if res["cli_verify"][0] == 0:
            bad.append("the store does not open but `trajstore verify` exits 0")
    # The CLI runs a shallow verify: it may pass a store whose only faults are chunks that do not decode.
    shallow = [k for k in res.get("verify_faults", []) if k != "undecodable-chunk"]
    code = res["cli_verify"][0]
    if res.get("verify") == "ok" and ((shallow and code != 1) or (res["verify_ok"] and code != 0)):
        bad.append(f"verify_store faults {res['verify_faults']} but the CLI exits {code}")
    if (res.get("info") == "ok") != (res["cli_info"][0] == 0):
        bad.append(f"store_info {res.get('info')!r} but `trajstore info` exits {res['cli_info'][0]}")
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("base,tamper", _case_params())
def test_hostile_store(bases: dict[str, Path], tmp_path: Path, base: str, tamper: Any, request) -> None:
    sandbox = tmp_path / "sandbox"
    outside = sandbox / "outside"
    (outside / "victim").mkdir(parents=True)
    for i in range(3):
        (outside / "victim" / f"f{i}").write_bytes(os.urandom(64))
    (outside / "victim" / "0").mkdir()
    (outside / "victim" / "0" / "keep").write_bytes(b"keep")
    (outside / "file.bin").write_bytes(os.urandom(4096))
    store = sandbox / f"{base}__case"
    shutil.copytree(bases[base], store, symlinks=True)
    tamper(store, outside)
    before = _snapshot(outside)
    kind = BASES[base][0]
    res, elapsed = run_isolated(lambda: _exercise(kind, str(store)), tmp_path / "result.json")
    assert isinstance(res, dict), f"{request.node.callspec.id}: {res}"
    problems = _check_outcome(res)
    assert _snapshot(outside) == before, f"files outside the store changed: {res}"
    assert elapsed < DEADLINE_S, f"took {elapsed:.1f} s"
    assert not problems, "\n".join(problems) + f"\n{json.dumps(res, indent=1, default=str)[:3000]}"
    if os.environ.get("TRAJSTORE_HOSTILE_LOG"):
        with open(os.environ["TRAJSTORE_HOSTILE_LOG"], "a") as f:
            f.write(json.dumps({"case": request.node.callspec.id, "elapsed": round(elapsed, 2), **res},
                               default=str) + "\n")


def test_cli_subprocess_reports_hostile_store_in_one_line(bases: dict[str, Path], tmp_path: Path) -> None:
    """``python -m trajstore verify`` / ``info`` on a store whose commit record is a FIFO: exit 1
    with one line on stderr, no traceback, within the deadline."""
    store = tmp_path / "s"
    shutil.copytree(bases["rb-raw"], store)
    replace_with(HEAD, "fifo")(store, tmp_path)
    for cmd in ("verify", "info"):
        p = subprocess.run([sys.executable, "-m", "trajstore", cmd, str(store)], capture_output=True, text=True,
                           timeout=DEADLINE_S)
        assert p.returncode == 1, (cmd, p.returncode, p.stdout, p.stderr)
        text = p.stderr if cmd == "info" else p.stdout + p.stderr
        assert "Traceback" not in text and "FIFO" in text, (cmd, text)


@pytest.mark.parametrize("wrap", ["[{}]", '{{"a": {}}}'])
def test_metadata_nesting_limit_is_exact(wrap):
    """``load_json`` accepts nesting of exactly MAX_DEPTH levels and refuses one more, for lists and
    objects, and a file whose strings hold many brackets is parsed as usual (the bracket count
    only decides whether the nesting is walked)."""
    from trajstore.errors import DamagedStoreError
    from trajstore.storage.schema import MAX_DEPTH, load_json

    def nested(levels: int) -> str:
        text = "0"
        for _ in range(levels):
            text = wrap.format(text)
        return text

    assert load_json(nested(MAX_DEPTH).encode(), "w", "k") is not None
    with pytest.raises(DamagedStoreError, match="deeper than"):
        load_json(nested(MAX_DEPTH + 1).encode(), "w", "k")
    many = json.dumps({"s": "[{" * 500, "t": [[1]]}).encode()
    assert load_json(many, "w", "k")["t"] == [[1]]
