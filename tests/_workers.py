"""Child-process code for ``test_crash.py`` and ``test_concurrency.py``.

Every function that runs in a child lives at module level and takes only picklable
arguments, so it runs under any ``multiprocessing`` start method.  :func:`start` uses the
context named by the environment variable ``TRAJSTORE_TEST_START`` (default
``"forkserver"``: children fork from a server process that has already imported
trajstore, so a SIGKILL round costs milliseconds instead of a 0.7 s interpreter start;
``TRAJSTORE_TEST_START=spawn`` runs the very same code under spawn).

Row contents are deterministic functions of an integer, so a reader can check any row it
sees without knowing what the writer did:

* append tests: row number ``seq`` (absolute, never reused) -> :func:`encode`;
* rewrite tests (set_at / remove_at): row ``key`` at ``version`` -> :func:`encode_kv`.

Side files written by children are replaced atomically (temp + ``os.replace``), so the
parent never reads a torn value, even after a SIGKILL.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
import traceback
from typing import Any, Callable

import numpy as np
from gymnasium.spaces import Box, Dict, Discrete

from trajstore import ReplayBuffer

N_DISCRETE = 97
SPACE = Dict({
    "obs": Box(-np.inf, np.inf, (17,), np.float32),
    "img": Box(0, 255, (8, 8, 3), np.uint8),
    "d": Discrete(N_DISCRETE),
})
_PATTERN = np.arange(8 * 8 * 3, dtype=np.int16).reshape(8, 8, 3)

HEAD = "trajstore.head.json"

# ----------------------------------------------------------------------------------------
# starting children
# ----------------------------------------------------------------------------------------
_PRELOAD = ["numpy", "zarr", "gymnasium", "trajstore"]


def context(name: str | None = None) -> Any:
    """The multiprocessing context for children (see module docstring)."""
    name = name or os.environ.get("TRAJSTORE_TEST_START", "forkserver")
    ctx = multiprocessing.get_context(name)
    if name == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # ignored once the server runs: harmless
    return ctx


def start(target: Callable[..., Any], *args: Any, ctx: Any = None) -> Any:
    """Start ``target(*args)`` in a child process (daemonic: never outlives the tests)."""
    p = (ctx or context()).Process(target=target, args=args, daemon=True)
    p.start()
    return p


def wait_for_file(path: str, proc: Any, timeout: float = 60.0) -> None:
    """Wait until ``path`` exists; fail early when ``proc`` died first."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc is not None and not proc.is_alive():
            raise AssertionError(f"child {proc.pid} exited with {proc.exitcode} before {os.path.basename(path)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.002)


def kill(proc: Any, timeout: float = 20.0) -> None:
    """SIGKILL ``proc`` and reap it; fail if it had already died on its own."""
    alive = proc.is_alive()
    if alive:
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout)
    assert not proc.is_alive(), f"child {proc.pid} survived SIGKILL"
    assert alive and proc.exitcode == -signal.SIGKILL, (
        f"child {proc.pid} died on its own (exit code {proc.exitcode}) before it was killed; see its stderr")


# ----------------------------------------------------------------------------------------
# row contents
# ----------------------------------------------------------------------------------------
def _img(base: np.ndarray) -> np.ndarray:
    """(B, 8, 8, 3) uint8 image ``(base + pattern) % 251`` (computed in int16: cheap for big B)."""
    b = (np.asarray(base, dtype=np.int64) % 251).astype(np.int16)
    return ((b[:, None, None, None] + _PATTERN) % 251).astype(np.uint8)


def encode(seq: Any) -> dict[str, np.ndarray]:
    """Batch of rows for absolute sequence numbers ``seq`` (B,)."""
    seq = np.asarray(seq, dtype=np.int64).reshape(-1)
    return {
        "obs": np.repeat((seq + 1).astype(np.float32)[:, None], 17, axis=1),
        "img": _img(seq * 7),
        "d": seq % N_DISCRETE,
    }


def one(batch: dict[str, np.ndarray], i: int = 0) -> dict[str, Any]:
    """Row ``i`` of a batch, as an unbatched value."""
    return {k: v[i] for k, v in batch.items()}


def batched(value: dict[str, Any]) -> dict[str, np.ndarray]:
    """An unbatched row as a batch of one."""
    return {k: np.asarray(v)[None] for k, v in value.items()}


def decode(batch: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(seq, ok)``: the sequence number each row claims (from obs) and whether every leaf
    of the row equals :func:`encode` of it (an all-zero row is never ok)."""
    obs = np.asarray(batch["obs"], dtype=np.float32)
    n = len(obs)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    v = obs[:, 0].astype(np.float64)
    integral = np.isfinite(v) & (v == np.round(v)) & (v >= 1) & (v < 2**24)
    seq = np.where(integral, v, 1).astype(np.int64) - 1
    exp = encode(seq)
    ok = integral & (obs == exp["obs"]).all(axis=1)
    ok &= (np.asarray(batch["img"]) == exp["img"]).reshape(n, -1).all(axis=1)
    ok &= np.asarray(batch["d"]) == exp["d"]
    return seq, ok


def encode_kv(key: Any, version: Any) -> dict[str, np.ndarray]:
    """Rows identified by ``key`` carrying ``version`` in every leaf."""
    key = np.asarray(key, dtype=np.int64).reshape(-1)
    version = np.broadcast_to(np.asarray(version, dtype=np.int64), key.shape)
    obs = np.empty((len(key), 17), np.float32)
    obs[:, :8] = (key + 1)[:, None]
    obs[:, 8:] = version[:, None]
    return {
        "obs": obs,
        "img": _img(key * 7 + version * 13),
        "d": (key * 31 + version) % N_DISCRETE,
    }


def describe_kv(batch: dict[str, Any], i: int) -> str:
    """Which leaves of row ``i`` disagree with the key/version its obs claims (for messages)."""
    obs = np.asarray(batch["obs"])[i]
    key, ver = int(obs[0]) - 1, int(obs[8])
    exp = encode_kv([max(key, 0)], [max(ver, 0)])
    parts = [f"obs claims key {key} version {ver}"]
    for leaf in ("obs", "img", "d"):
        got = np.asarray(batch[leaf])[i]
        if not np.array_equal(got, exp[leaf][0]):
            parts.append(f"{leaf} differs{' (all zeros)' if not np.any(got) else ''}")
    return ", ".join(parts)


def decode_kv(batch: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(key, version, ok)`` of every row; ok: all leaves agree with :func:`encode_kv`."""
    obs = np.asarray(batch["obs"], dtype=np.float32)
    n = len(obs)
    if n == 0:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros(0, bool)
    k, v = obs[:, 0].astype(np.float64), obs[:, 8].astype(np.float64)
    integral = (k == np.round(k)) & (k >= 1) & (k < 2**24) & (v == np.round(v)) & (v >= 0) & (v < 2**24)
    key = np.where(integral, k, 1).astype(np.int64) - 1
    ver = np.where(integral, v, 0).astype(np.int64)
    exp = encode_kv(key, ver)
    ok = integral & (obs == exp["obs"]).all(axis=1)
    ok &= (np.asarray(batch["img"]) == exp["img"]).reshape(n, -1).all(axis=1)
    ok &= np.asarray(batch["d"]) == exp["d"]
    return key, ver, ok


# ----------------------------------------------------------------------------------------
# small file helpers
# ----------------------------------------------------------------------------------------
def write_atomic(path: str, text: str, fsync: bool = True) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def read_int(path: str, default: int = 0) -> int:
    try:
        with open(path) as f:
            return int(f.read())
    except FileNotFoundError:
        return default


def touch(path: str) -> None:
    with open(path, "w"):
        pass


def read_head(store: str) -> dict[str, Any]:
    """The commit record as documented in docs/format.md (plain JSON)."""
    with open(os.path.join(store, HEAD)) as f:
        return json.load(f)


def tree_snapshot(root: str) -> dict[str, tuple[int, int, int]]:
    """Every file and folder under ``root`` with (size, mtime_ns, inode): equal snapshots
    mean nothing was created, removed, replaced or modified."""
    out: dict[str, tuple[int, int, int]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size if name in files else 0, st.st_mtime_ns, st.st_ino)
    return out


def orphans(root: str) -> list[str]:
    """Temp files a writer open must have removed: anything in .trajstore-tmp, *.partial."""
    found = []
    tmp = os.path.join(root, ".trajstore-tmp")
    for dirpath, _dirs, files in os.walk(tmp):
        found += [os.path.relpath(os.path.join(dirpath, f), root) for f in files]
    for dirpath, _dirs, files in os.walk(root):
        found += [os.path.relpath(os.path.join(dirpath, f), root) for f in files if f.endswith(".partial")]
    return sorted(found)


def _next_seq(rb: ReplayBuffer, store: str) -> int:
    """Next absolute sequence number: rows are numbered from 0 at create, and the number of
    a row equals its absolute row number, so it continues after the last committed row."""
    if len(rb):
        seq, ok = decode(batched(rb[-1]))
        assert ok[0], "last row is damaged"
        return int(seq[0]) + 1
    return int(read_head(store)["tables"]["step_data"]["end"])


# ----------------------------------------------------------------------------------------
# children: append loops
# ----------------------------------------------------------------------------------------
def append_loop(store: str, side: str, ready: str, seed: int, max_batch: int, max_unflushed: int,
                deadline_s: float = 60.0) -> None:
    """Open ``store`` as the writer and append rows ``encode(seq)`` forever, mixing append,
    extend of random sizes and flush; after every flush returns, write the number of rows
    flushed so far (= next seq) to ``side`` (fsync'd).  Runs until SIGKILLed."""
    rng = np.random.default_rng(seed)
    rb = ReplayBuffer.load_from(store)
    seq = _next_seq(rb, store)
    unflushed = 0
    touch(ready)
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        r = rng.random()
        if r < 0.25:
            rb.append(one(encode([seq])))
            seq += 1
            unflushed += 1
        elif r < 0.93:
            b = int(rng.integers(1, max_batch + 1))
            rb.extend(encode(np.arange(seq, seq + b)))
            seq += b
            unflushed += b
        if r >= 0.93 or unflushed >= max_unflushed:
            rb.flush(fsync=bool(rng.random() < 0.05))
            write_atomic(side, str(seq))
            unflushed = 0
    os._exit(0)


def committed_writer(store: str, bound: str, ready: str, seed: int, duration_s: float, max_batch: int,
                     max_unflushed: int, pause_s: float = 0.0, min_rows: int = 0) -> None:
    """Writer for the concurrent-reader test.  Only explicit flushes and, in a full ring, the
    eviction records that precede overwrites commit new rows (``commit_interval`` is huge), and
    *before* each flush (ring: each write) the writer records in ``bound`` how many rows it may
    make visible: an upper bound of what any reader may see."""
    rng = np.random.default_rng(seed)
    rb = ReplayBuffer.load_from(store, commit_interval=1e9)
    seq = _next_seq(rb, store)
    write_atomic(bound, str(seq), fsync=False)
    write_atomic(bound + ".done", str(seq), fsync=False)
    touch(ready)
    t_end = time.monotonic() + duration_s
    t_max = t_end + 60.0
    unflushed = 0
    while time.monotonic() < t_end or (seq < min_rows and time.monotonic() < t_max):
        b = int(rng.integers(1, max_batch + 1))
        if rb.capacity is not None:
            write_atomic(bound, str(seq + b), fsync=False)
        if b == 1:
            rb.append(one(encode([seq])))
        else:
            rb.extend(encode(np.arange(seq, seq + b)))
        seq += b
        if rb.capacity is not None:
            # Rows surely written into their ring slots (so older rows' slots were reused): the
            # table's end (white box), not `seq`, since appended rows wait in RAM for a while.
            write_atomic(bound + ".done", str(rb._table.state.end), fsync=False)
        unflushed += b
        if unflushed >= max_unflushed or rng.random() < 0.2:
            write_atomic(bound, str(seq), fsync=False)
            rb.flush()
            unflushed = 0
        if pause_s:
            time.sleep(pause_s)
    write_atomic(bound, str(seq), fsync=False)
    rb.close()


def _result(path: str, **kw: Any) -> None:
    write_atomic(path, json.dumps(kw), fsync=False)


def _used(rb: ReplayBuffer) -> tuple[int, int]:
    """White box: rows ``[start, end)`` of the commit record whose rows the last read returned
    (a read may return an older record's rows when they are still intact under the newest)."""
    t = rb.row_source().last_read.tables["step_data"]
    return int(t.start), int(t.end)


def reader_loop(store: str, bound: str, result: str, ready: str, stop: str, seed: int) -> None:
    """Read-only reader next to :func:`committed_writer`: loops len(), rb[-1], rb[i], rb[:]
    and sample(256) until ``stop`` exists, and checks every row it gets.  Writes
    ``{"errors": [...], ...}`` to ``result``."""
    errors: list[str] = []
    stats = {"loops": 0, "rows_checked": 0, "sampled": 0, "max_len": 0}
    try:
        rng = np.random.default_rng(seed)
        rb = ReplayBuffer.load_from(store, read_only=True)
        cap = rb.capacity
        touch(ready)
        t_max = time.monotonic() + 120.0

        def err(msg: str) -> None:
            if len(errors) < 20:
                errors.append(msg)

        while not os.path.exists(stop) and time.monotonic() < t_max and len(errors) < 20:
            stats["loops"] += 1
            n = len(rb)
            b = read_int(bound)
            stats["max_len"] = max(stats["max_len"], n)
            if cap is None and n > b:
                err(f"len {n} exceeds the writer's committed count {b}")
            if cap is not None and n > cap:
                err(f"len {n} exceeds capacity {cap}")
            if n == 0:
                continue
            # rb[-1]
            for j in range(16):
                i = -1 if j % 2 == 0 else int(rng.integers(0, n))
                b0 = read_int(bound + ".done")
                try:
                    last = rb[i]
                except IndexError:
                    continue  # the ring shrank between len() and the read (eviction): allowed
                used = _used(rb)
                s, ok = decode(batched(last))
                b = read_int(bound)
                if cap is not None and i >= 0:
                    # Reads are retried until the commit record they used is still the latest
                    # afterwards: the row is exactly that record's row i.
                    a = used[0] + i
                    if a >= used[1] or not ok[0] or s[0] != a:
                        err(f"rb[{i}] should be absolute row {a} of the commit record [{used[0]}, {used[1]}) it used; "
                            f"it returned {'garbage' if not ok[0] else f'row {s[0]}'} ({b} rows committed)")
                    continue
                if not ok[0]:
                    err(f"rb[{i}] is garbage: obs[0]={float(last['obs'][0])} d={int(last['d'])}")
                elif s[0] >= b or (cap is not None and not used[0] <= s[0] < used[1]):
                    err(f"rb[{i}] returned row {s[0]}; {b} rows were committed, and the commit record "
                        f"the read used names rows [{used[0]}, {used[1]})")
                elif cap is not None and s[0] < b0 - cap:
                    err(f"rb[{i}] returned row {s[0]}, overwritten before the read began ({b0} rows were written)")
                elif cap is None and i == -1 and s[0] + 1 < n:
                    err(f"rb[-1] returned row {s[0]} after len() said {n}")
            # rb[:]
            x = rb[:]
            used_start = _used(rb)[0]
            b = read_int(bound)
            s, ok = decode(x)
            m = len(s)
            stats["rows_checked"] += m
            if m > b:
                err(f"rb[:] returned {m} rows but only {b} were committed")
            if cap is None:
                if m < n:
                    err(f"rb[:] returned {m} rows after len() said {n} (unbounded buffer shrank)")
                if not ok.all():
                    bad = int(np.flatnonzero(~ok)[0])
                    err(f"rb[:] row {bad} of {m} is garbage (obs[0]={float(x['obs'][bad, 0])}, d={int(x['d'][bad])})")
                elif not np.array_equal(s, np.arange(m)):
                    err(f"rb[:] rows are not 0..{m - 1} in order")
            else:
                # Retried until no commit happened while it read: exactly the used record's rows.
                absolute = used_start + np.arange(m)
                if not ok.all():
                    bad = int(np.flatnonzero(~ok)[0])
                    err(f"ring rb[:] row {bad} (absolute {absolute[bad]}) is garbage (obs[0]={float(x['obs'][bad, 0])}, "
                        f"d={int(x['d'][bad])}, img[0,0,0]={int(x['img'][bad, 0, 0, 0])})")
                elif not np.array_equal(s, absolute):
                    err("ring rb[:] rows are not the committed absolute rows in order")
                if m and absolute[-1] >= b:
                    err(f"ring rb[:] reaches absolute row {absolute[-1]} but only {b} were committed")
            # Lazy views read like the buffer, exactly one commit record's rows: the oldest 48
            # rows (those a ring writer overwrites next) through a slice view and through the
            # "obs" column of one.
            x = rb.get_slice(slice(0, 48))[:]
            start = _used(rb)[0]
            s, ok = decode(x)
            if not ok.all() or not np.array_equal(s, np.arange(start, start + len(s))):
                err(f"slice view rows {s.tolist()} (ok={bool(ok.all())}) are not the first {len(s)} rows from {start}")
            col = np.asarray(rb.get_slice(slice(0, 48)).get_column("obs")[:])
            start = _used(rb)[0]
            if not (col == np.arange(start, start + len(col))[:, None] + 1.0).all():
                err(f"column view rows {col[:, 0].tolist()} are not the first {len(col)} rows from {start}")
            # sample(256)
            b0 = read_int(bound + ".done")
            smp = rb.sample(256, rng=rng)
            b = read_int(bound)
            s, ok = decode(smp)
            stats["sampled"] += len(s)
            if not ok.all():
                bad = int(np.flatnonzero(~ok)[0])
                err(f"sample row {bad} is garbage/torn (obs[0]={float(smp['obs'][bad, 0])}, d={int(smp['d'][bad])}, "
                    f"img[0,0,0]={int(smp['img'][bad, 0, 0, 0])})")
            elif (s >= b).any():
                err(f"sample returned row {int(s.max())} but only {b} were committed")
            elif cap is not None and (s < b0 - cap).any():
                # (The head's start may legitimately move back a little: the writer commits an
                # eviction with a guard band, then its real start; rows in between are intact.)
                err(f"sample returned row {int(s.min())}, overwritten before the call began ({b0} rows were written)")
        rb.close()
    except BaseException:
        errors.append("reader crashed:\n" + traceback.format_exc())
    _result(result, errors=errors, **stats)


# ----------------------------------------------------------------------------------------
# children: set_at / remove_at
# ----------------------------------------------------------------------------------------
def rewrite_loop(store: str, log_path: str, ready: str, seed: int, deadline_s: float = 60.0) -> None:
    """Writer that loops set_at (new version on random rows), remove_at (random rows) and
    small appends, logging each operation to ``log_path`` *before* running it (``I ...``)
    and ``D`` after it returned.  Runs until SIGKILLed."""
    rng = np.random.default_rng(seed)
    rb = ReplayBuffer.load_from(store)
    x = rb[:]
    key, ver, ok = decode_kv(x)
    assert ok.all()
    next_key = int(key.max()) + 1 if len(key) else 0
    next_ver = int(ver.max()) + 1 if len(ver) else 1
    log = open(log_path, "a", buffering=1)  # one write() per line: never torn by SIGKILL
    touch(ready)
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        n = len(rb)
        r = rng.random()
        if n < 100 or r < 0.12:
            b = int(rng.integers(1, 40))
            log.write(f"I A {next_key} {b}\n")
            rb.extend(encode_kv(np.arange(next_key, next_key + b), 0))
            rb.flush()
            next_key += b
        elif r < 0.6:
            if rng.random() < 0.2:
                lo = int(rng.integers(0, n))
                sl = slice(lo, min(n, lo + int(rng.integers(1, 200))))
                idx = np.arange(n)[sl]
                target: Any = sl
            else:
                idx = rng.choice(n, size=int(rng.integers(1, 30)), replace=False)
                target = idx
            keys, _v, ok = decode_kv(rb[idx])
            assert ok.all()
            log.write(f"I S {next_ver} {' '.join(map(str, idx.tolist()))}\n")
            rb.set_at(target, encode_kv(keys, next_ver))
            next_ver += 1
        else:
            if rng.random() < 0.2:
                lo = int(rng.integers(0, n))
                sl = slice(lo, min(n, lo + int(rng.integers(1, 20))))
                idx = np.arange(n)[sl]
                target = sl
            else:
                idx = rng.choice(n, size=int(rng.integers(1, 6)), replace=False)
                target = idx
            log.write(f"I R {' '.join(map(str, idx.tolist()))}\n")
            rb.remove_at(target)
        log.write("D\n")
    os._exit(0)


def rewrite_writer(store: str, ready: str, stop: str, seed: int, duration_s: float) -> None:
    """set_at / remove_at / append loop for a concurrent reader (no log, no kill)."""
    rng = np.random.default_rng(seed)
    rb = ReplayBuffer.load_from(store)
    key, ver, _ok = decode_kv(rb[:])
    next_key, next_ver = int(key.max()) + 1, int(ver.max()) + 1
    touch(ready)
    t_end = time.monotonic() + duration_s
    while time.monotonic() < t_end and not os.path.exists(stop):
        n = len(rb)
        r = rng.random()
        if n < 200 or r < 0.15:
            b = int(rng.integers(1, 64))
            rb.extend(encode_kv(np.arange(next_key, next_key + b), 0))
            rb.flush()
            next_key += b
        elif r < 0.75:
            idx = rng.choice(n, size=int(rng.integers(1, 40)), replace=False)
            keys, _v, _ok = decode_kv(rb[idx])
            rb.set_at(idx, encode_kv(keys, next_ver))
            next_ver += 1
        else:
            rb.remove_at(rng.choice(n, size=int(rng.integers(1, 6)), replace=False))
    rb.close()


def rewrite_reader(store: str, result: str, ready: str, duration_s: float) -> None:
    """Read-only reader next to :func:`rewrite_writer`: every row it sees must be a whole
    row (all leaves at one key and version), keys strictly increasing."""
    errors: list[str] = []
    loops = 0
    try:
        rb = ReplayBuffer.load_from(store, read_only=True)
        touch(ready)
        t_end = time.monotonic() + duration_s
        while time.monotonic() < t_end and len(errors) < 10:
            loops += 1
            x = rb[:]
            key, ver, ok = decode_kv(x)
            if not ok.all():
                bad = int(np.flatnonzero(~ok)[0])
                errors.append(f"read {loops}: row {bad} of {len(ok)} is not a whole row: {describe_kv(x, bad)}")
            elif len(key) and not (np.diff(key) > 0).all():
                errors.append(f"read {loops}: keys are not increasing (rows duplicated or out of order)")
        rb.close()
    except BaseException:
        errors.append(f"reader crashed after {loops} reads:\n" + traceback.format_exc())
    _result(result, errors=errors, loops=loops)


def rewrite_and_die(store: str, version: int, renames_before_kill: int) -> None:
    """set_at every row to ``version``, and SIGKILL ourselves during the roll-forward,
    after ``renames_before_kill`` staged chunks were moved into place (fault injection:
    the commit record then still names the staged chunks as ``pending``)."""
    from trajstore.storage.location import Location

    rb = ReplayBuffer.load_from(store)
    keys, _v, _ok = decode_kv(rb[:])
    real_rename = Location.rename
    done = [0]

    def rename(self: Any, src: str, dst: str) -> None:
        if done[0] >= renames_before_kill:
            os.kill(os.getpid(), signal.SIGKILL)
        done[0] += 1
        real_rename(self, src, dst)

    Location.rename = rename  # type: ignore[method-assign]
    rb.set_at(np.arange(len(keys)), encode_kv(keys, version))
    os._exit(3)  # not reached when the roll-forward renames anything


# ----------------------------------------------------------------------------------------
# children: locks, orphans
# ----------------------------------------------------------------------------------------
def hold_writer(store: str, ready: str, n_rows: int) -> None:
    """Open ``store`` as the writer, append and flush ``n_rows``, signal, then wait to be killed."""
    rb = ReplayBuffer.load_from(store)
    seq = _next_seq(rb, store)
    rb.extend(encode(np.arange(seq, seq + n_rows)))
    rb.flush()
    rb.extend(encode(np.arange(seq + n_rows, seq + n_rows + 7)))  # uncommitted
    touch(ready)
    time.sleep(120)
    os._exit(0)


def try_open(store: str, result: str) -> None:
    """From another process: try a second writer (load_from and create(overwrite=True)) and
    a reader; report what happened."""
    out: dict[str, Any] = {}
    for what in ("load_from", "create_overwrite", "read_only"):
        try:
            if what == "load_from":
                ReplayBuffer.load_from(store).close()
            elif what == "create_overwrite":
                ReplayBuffer.create(SPACE, cache_path=store, overwrite=True).close()
            else:
                with ReplayBuffer.load_from(store, read_only=True) as r:
                    seq, ok = decode(r[:])
                    out["reader_rows"] = len(seq)
                    out["reader_ok"] = bool(ok.all())
            out[what] = "ok"
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out[what] = f"{type(e).__module__}.{type(e).__name__}: {e}"
    _result(result, **out)


# ----------------------------------------------------------------------------------------
# children: multiprocessing=True writers
# ----------------------------------------------------------------------------------------
def encode_tag(w: int, i: Any) -> dict[str, np.ndarray]:
    """Rows tagged (writer w, number i)."""
    i = np.asarray(i, dtype=np.int64).reshape(-1)
    obs = np.empty((len(i), 17), np.float32)
    obs[:, 0] = w
    obs[:, 1] = i
    obs[:, 2:] = (w * 100_000 + i)[:, None]
    return {
        "obs": obs,
        "img": _img(w * 31 + i * 7),
        "d": (w * 13 + i) % N_DISCRETE,
    }


def decode_tag(batch: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    obs = np.asarray(batch["obs"])
    w = obs[:, 0].astype(np.int64)
    i = obs[:, 1].astype(np.int64)
    ok = np.ones(len(w), bool)
    for wv in np.unique(w):
        sel = w == wv
        exp = encode_tag(int(wv), i[sel])
        ok[sel] = ((obs[sel] == exp["obs"]).all(axis=1)
                   & (np.asarray(batch["img"])[sel] == exp["img"]).reshape(int(sel.sum()), -1).all(axis=1)
                   & (np.asarray(batch["d"])[sel] == exp["d"]))
    return w, i, ok


def mp_append(rb: ReplayBuffer, w: int, n: int, result: str) -> None:
    """A multiprocessing=True writer: append rows (w, 0..n-1), mostly one at a time."""
    try:
        i = 0
        rng = np.random.default_rng(w)
        while i < n:
            b = 1 if rng.random() < 0.8 else int(min(n - i, rng.integers(2, 20)))
            if b == 1:
                rb.append(one(encode_tag(w, [i])))
            else:
                rb.extend(encode_tag(w, np.arange(i, i + b)))
            i += b
        _result(result, ok=True)
    except BaseException:
        _result(result, ok=False, error=traceback.format_exc())
        raise


def join_result(proc: Any, path: str, timeout: float) -> dict[str, Any]:
    """Wait for a child that reports through a JSON result file; SIGKILL it if it overstays.

    Returns the result, or ``{"ok": False, "error": ...}`` when the child left none."""
    proc.join(timeout)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
    if not os.path.exists(path):
        return {"ok": False, "error": f"exit code {proc.exitcode}"}
    with open(path) as f:
        return json.load(f)


def die_after_head_exchange(store: str, rows_per_commit: int, commits: int) -> None:
    """Append and flush ``commits`` times into the ring ``store``; at the last flush, SIGKILL this
    process right after the commit record's exchange (``trajstore.storage._replace``), before
    the old record's temp name is removed: the instant that exchange adds to a commit."""
    from trajstore.storage import _replace

    real = _replace._renameat2

    def exchange_then_die(*args: Any) -> int:
        rc = real(*args)
        if rc == 0 and args[3].endswith(b"trajstore.head.json") and os.environ.get("_TS_DIE_NOW") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return rc

    _replace._renameat2 = exchange_then_die
    rb = ReplayBuffer.load_from(store)
    seq = _next_seq(rb, store)
    for c in range(commits):
        rb.extend(encode(np.arange(seq, seq + rows_per_commit)))
        seq += rows_per_commit
        if c == commits - 1:
            os.environ["_TS_DIE_NOW"] = "1"
        rb.flush()
    os._exit(3)  # not reached: the last flush kills this process
