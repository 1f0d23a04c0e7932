"""Soak: one writer appending to a full ring as fast as it can, four read-only readers next to
it (docs/design.md 3.1, 3.2, 3.4, 3.8), for a bounded time on real stores and real processes.

The writer appends single rows and batches of 2..32 rows; every reader loops len(), rb[-1],
rb[i], rb[:], get_slice(slice(0, 48))[:] and sample(256) and checks each row it gets (see
``_soak_workers.py``): never a torn row (fields of one row disagree), never an uncommitted
row, never a row evicted before the read began; ``len()`` of the full ring never below
``capacity - 2 * guard`` (ring writes are committed in blocks of ``guard`` rows, see
``trajstore.core.table.Table.guard`` and ``Store.ensure_evicted``); ``sample`` never raises.
Each reader reports ``{"errors": [...], stats}`` in a JSON file; the stats are printed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _soak_workers as S

from trajstore import ReplayBuffer

N_READERS = 4


def _wait_for(path: str, proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if not proc.is_alive():
            raise AssertionError(f"child {proc.pid} exited with {proc.exitcode} before {os.path.basename(path)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.005)


def _join(proc, timeout: float) -> None:
    proc.join(timeout)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        raise AssertionError(f"child {proc.pid} hung")


def _load(path: str, proc) -> dict:
    if not os.path.exists(path):
        raise AssertionError(f"child {proc.pid} left no result (exit code {proc.exitcode}); see its stderr")
    with open(path) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("capacity,options,duration_s", [
    (1000, {}, 10.0),
    (20000, {"compressor": "lz4", "chunk_rows": 512}, 12.0),
], ids=["ring1000-raw", "ring20000-lz4"])
def test_soak_full_ring_one_writer_four_readers(tmp_path, procs, capacity, options, duration_s):
    store = str(tmp_path / "store")
    with ReplayBuffer.create(S.SPACE, cache_path=store, capacity=capacity, **options) as rb:
        rb.extend(S.encode(np.arange(capacity)))  # a full ring from the start
    files = {k: str(tmp_path / k) for k in ("limit", "written", "wready", "go", "stop", "wresult")}
    writer = S.start(S.soak_writer, store, files, duration_s, 7)
    procs.append(writer)
    _wait_for(files["wready"], writer)
    readers = []
    for k in range(N_READERS):
        res, ready = str(tmp_path / f"result{k}"), str(tmp_path / f"rready{k}")
        p = S.start(S.soak_reader, store, files, res, ready, 100 + k)
        procs.append(p)
        readers.append((p, res, ready))
    for p, _res, ready in readers:
        _wait_for(ready, p)
    S.touch(files["go"])
    _join(writer, duration_s + 90)
    S.touch(files["stop"])
    for p, _res, _ready in readers:
        _join(p, 120)

    w = _load(files["wresult"], writer)
    guard = S.guard(capacity)
    print(f"\nsoak capacity={capacity} {options or 'raw'} guard={guard}: writer {w.get('writes')} writes, "
          f"{w.get('rows')} rows ({w.get('rows', 0) / capacity:.1f} laps), {w.get('flushes')} flushes")
    errors = [f"writer: {e}" for e in w["errors"]]
    for k, (p, res, _ready) in enumerate(readers):
        out = _load(res, p)
        stats = {key: v for key, v in out.items() if key != "errors"}
        print(f"  reader {k}: {stats}")
        errors += [f"reader {k}: {e}" for e in out["errors"]]
        if not out["errors"]:
            assert out["polls"] >= 3 and out["sampled"] > 0, f"reader {k} hardly ran: {stats}"
    assert errors == [], "\n".join(errors)
    assert w["rows"] >= 2 * guard, f"the writer appended only {w['rows']} rows"

    # What the writer left: a full ring of whole, consecutive rows ending with its last row.
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        assert len(ro) == capacity
        seq, ok = S.decode(ro[:])
        assert ok.all() and (np.diff(seq) == 1).all() and int(seq[-1]) == w["last_seq"]
