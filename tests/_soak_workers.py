"""Child-process code for ``test_soak.py``: one writer appending to a full ring as fast as it
can, and read-only readers checking every row they get.

Every function that runs in a child lives at module level and takes only picklable arguments,
so it runs under any ``multiprocessing`` start method; :func:`context` follows
``TRAJSTORE_TEST_START`` like ``_workers.py`` (default ``"forkserver"``).

Row ``seq`` (absolute, never reused) carries its number in every field (:func:`encode`), so a
reader can tell a whole row from a torn one without knowing what the writer did.  The writer
publishes two counts, each replaced atomically (temp + ``os.replace``), so a reader never
reads a torn number:

* ``limit``: written *before* each append/extend: no row at or beyond it exists anywhere yet,
  so no commit record can name one (commits also happen inside a write: a full ring commits an
  eviction record before it overwrites rows, and that record names every row written so far);
* ``written``: written *after* each append/extend: the rows the writer has handed to its table
  (white box: ``Table.state.end``; single-row appends are staged in RAM first and are not in
  their ring slot until the stager drains).  Once row ``s + capacity`` is handed over, the slot
  of row ``s`` has been (or is being) reused, and every commit record since names rows ``> s``.

A reader samples ``written`` before each read and ``limit`` after it, and flags a row as

* torn: its fields disagree (:func:`decode`);
* uncommitted: ``seq >= limit`` (read after the read returned);
* evicted: ``seq < written_before_read - capacity`` (its slot was reused before the read began).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from typing import Any

import numpy as np
from gymnasium.spaces import Box, Dict

from trajstore import ReplayBuffer

OBS_DIM = 8
SPACE = Dict({
    "obs": Box(-np.inf, np.inf, (OBS_DIM,), np.float64),
    "check": Box(np.iinfo(np.int64).min, np.iinfo(np.int64).max, (), np.int64),
    "img": Box(0, 255, (6, 6), np.uint8),
})
_PATTERN = np.arange(36, dtype=np.int64).reshape(6, 6)
_KEY = 0x5DEECE66D  # check = seq XOR key: a zeroed or stale check field never decodes to the obs' seq


def guard(capacity: int) -> int:
    """Rows per ring commit block (trajstore.core.table.Table.guard): a reader of a full ring sees
    ``len >= capacity - 2 * guard``."""
    return max(1, min(capacity // 32, 4096))


# ----------------------------------------------------------------------------------------
# rows
# ----------------------------------------------------------------------------------------
def encode(seq: Any) -> dict[str, np.ndarray]:
    """Rows for absolute sequence numbers ``seq`` (B,)."""
    seq = np.asarray(seq, np.int64).reshape(-1)
    return {
        "obs": (seq[:, None] + np.arange(OBS_DIM)).astype(np.float64),
        "check": seq ^ _KEY,
        "img": ((seq[:, None, None] * 7 + _PATTERN) % 251).astype(np.uint8),
    }


def decode(batch: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(seq, ok)`` of a batch: the number the check field claims, and whether every field of
    the row encodes that same number."""
    check = np.asarray(batch["check"], np.int64).reshape(-1)
    seq = check ^ _KEY
    n = len(seq)
    if n == 0:
        return seq, np.zeros(0, bool)
    exp = encode(seq)
    ok = (np.asarray(batch["obs"]).reshape(n, OBS_DIM) == exp["obs"]).all(axis=1)
    ok &= (np.asarray(batch["img"]).reshape(n, 6, 6) == exp["img"]).reshape(n, -1).all(axis=1)
    ok &= seq >= 0
    return seq, ok


def describe(batch: dict[str, Any], i: int) -> str:
    obs = np.asarray(batch["obs"]).reshape(-1, OBS_DIM)[i]
    check = int(np.asarray(batch["check"]).reshape(-1)[i]) ^ _KEY
    img = np.asarray(batch["img"]).reshape(-1, 6, 6)[i]
    return f"check says {check}, obs[:3]={obs[:3].tolist()}, img[0,:3]={img[0, :3].tolist()}"


# ----------------------------------------------------------------------------------------
# processes and side files
# ----------------------------------------------------------------------------------------
_PRELOAD = ["numpy", "zarr", "gymnasium", "trajstore"]


def context(name: str | None = None) -> Any:
    name = name or os.environ.get("TRAJSTORE_TEST_START", "forkserver")
    ctx = multiprocessing.get_context(name)
    if name == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def start(target: Any, *args: Any) -> Any:
    p = context().Process(target=target, args=args, daemon=True)
    p.start()
    return p


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def touch(path: str) -> None:
    with open(path, "w"):
        pass


def _result(path: str, **kw: Any) -> None:
    write_atomic(path, json.dumps(kw))


# ----------------------------------------------------------------------------------------
# children
# ----------------------------------------------------------------------------------------
def soak_writer(store: str, files: dict[str, str], duration_s: float, seed: int) -> None:
    """Append single rows and batches of 2..32 rows to the (full) ring at ``store`` as fast as
    possible for ``duration_s`` seconds (after ``files["go"]`` exists), publishing ``limit``
    and ``written`` around every write, with an explicit flush now and then."""
    errors: list[str] = []
    stats: dict[str, Any] = {"writes": 0, "rows": 0, "flushes": 0}
    try:
        rng = np.random.default_rng(seed)
        rb = ReplayBuffer.load_from(store)
        table = rb._table  # white box: rows handed to the table (see the module docstring)
        seq = table.state.end
        first = seq
        assert len(rb) == rb.capacity, f"the ring is not full: {len(rb)} of {rb.capacity} rows"
        write_atomic(files["limit"], str(seq))
        write_atomic(files["written"], str(seq))
        touch(files["wready"])
        while not os.path.exists(files["go"]):
            time.sleep(0.002)
        t_end = time.monotonic() + duration_s
        while time.monotonic() < t_end:
            b = 1 if rng.random() < 0.5 else int(rng.integers(2, 33))
            write_atomic(files["limit"], str(seq + b))
            if b == 1:
                rb.append({k: v[0] for k, v in encode([seq]).items()})
            else:
                rb.extend(encode(np.arange(seq, seq + b)))
            seq += b
            write_atomic(files["written"], str(table.state.end))
            stats["writes"] += 1
            if rng.random() < 0.003:
                rb.flush()
                stats["flushes"] += 1
        rb.close()
        write_atomic(files["written"], str(seq))
        stats["rows"] = seq - first
        stats["last_seq"] = seq - 1
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.append("writer crashed:\n" + traceback.format_exc())
    _result(files["wresult"], errors=errors, **stats)


def soak_reader(store: str, files: dict[str, str], result: str, ready: str, seed: int) -> None:
    """Read-only reader: loops len(), rb[-1], rb[i], rb[:], get_slice(slice(0, 48))[:] and
    sample(256) until ``files["stop"]`` exists, checking every row (see the module docstring)."""
    errors: list[str] = []
    stats: dict[str, Any] = {"polls": 0, "rows_checked": 0, "sampled": 0, "index_errors": 0,
                             "min_len": None, "max_len": 0, "newest": -1}

    def err(msg: str) -> None:
        if len(errors) < 25:
            errors.append(f"poll {stats['polls']}: {msg}")

    try:
        rng = np.random.default_rng(seed)
        rb = ReplayBuffer.load_from(store, read_only=True)
        cap = rb.capacity
        assert cap is not None
        min_len = cap - 2 * guard(cap)
        touch(ready)
        t_max = time.monotonic() + 300.0

        def check(what: str, batch: dict[str, Any], w0: int, consecutive: bool = False) -> np.ndarray:
            """Rows of one read: whole, committed when read, not evicted before it began."""
            lim = read_int(files["limit"])
            seq, ok = decode(batch)
            stats["rows_checked"] += len(seq)
            if not ok.all():
                bad = int(np.flatnonzero(~ok)[0])
                err(f"{what}: torn row at position {bad} of {len(seq)} ({describe(batch, bad)})")
                return seq
            if len(seq) and seq.max() >= lim:
                err(f"{what}: row {int(seq.max())} was not committed: at most rows < {lim} existed when the read returned")
            if len(seq) and seq.min() < w0 - cap:
                err(f"{what}: row {int(seq.min())} was evicted before the read began "
                    f"({w0} rows were written, so its slot held row >= {int(seq.min()) + cap})")
            if consecutive and len(seq) > 1 and not (np.diff(seq) == 1).all():
                k = int(np.flatnonzero(np.diff(seq) != 1)[0])
                err(f"{what}: rows are not consecutive: ... {int(seq[k])}, {int(seq[k + 1])} ...")
            return seq

        while not os.path.exists(files["stop"]) and time.monotonic() < t_max and len(errors) < 25:
            stats["polls"] += 1
            n = len(rb)
            stats["min_len"] = n if stats["min_len"] is None else min(stats["min_len"], n)
            stats["max_len"] = max(stats["max_len"], n)
            if not min_len <= n <= cap:
                err(f"len() = {n}: a reader of a full ring of {cap} must see between {min_len} and {cap} rows")
            # rb[-1]: the newest committed row; never older than one seen before.
            w0 = read_int(files["written"])
            seq = check("rb[-1]", {k: np.asarray(v)[None] for k, v in rb[-1].items()}, w0)
            if len(seq) and seq[0] < stats["newest"]:
                err(f"rb[-1] went back in time: row {int(seq[0])} after row {stats['newest']}")
            stats["newest"] = max(stats["newest"], int(seq[0]))
            # rb[i] for random i < len().
            for _ in range(4):
                i = int(rng.integers(0, max(n, 1)))
                w0 = read_int(files["written"])
                try:
                    row = rb[i]
                except IndexError:
                    stats["index_errors"] += 1  # the ring shrank (by < 2 guard rows) since len(): allowed
                    continue
                check(f"rb[{i}]", {k: np.asarray(v)[None] for k, v in row.items()}, w0)
            # rb[:]: the rows of one commit record, consecutive.
            w0 = read_int(files["written"])
            x = rb[:]
            seq = check("rb[:]", x, w0, consecutive=True)
            if not min_len <= len(seq) <= cap:
                err(f"rb[:] returned {len(seq)} rows; a full ring of {cap} holds between {min_len} and {cap}")
            # A lazy view of the oldest rows (the next to be overwritten).
            w0 = read_int(files["written"])
            v = rb.get_slice(slice(0, 48))[:]
            seq = check("get_slice(slice(0, 48))[:]", v, w0, consecutive=True)
            if len(seq) != 48:
                err(f"get_slice(slice(0, 48))[:] returned {len(seq)} rows")
            # sample(256): never raises, whole rows only.
            w0 = read_int(files["written"])
            try:
                smp = rb.sample(256, rng=rng)
            except Exception as e:  # noqa: BLE001 - reported
                err(f"sample(256) raised {type(e).__name__}: {e}")
                continue
            seq = check("sample(256)", smp, w0)
            stats["sampled"] += len(seq)
            if len(seq) != 256:
                err(f"sample(256) returned {len(seq)} rows")
        rb.close()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.append("reader crashed:\n" + traceback.format_exc())
    _result(result, errors=errors, **stats)
