"""The mapped engine's run-time switches live in one module, ``trajstore.storage.fields._syscalls``,
and every reader sees them change: ``VirtualArray.populate`` (in ``_vmap``) turning
``MADV_POPULATE_WRITE`` off for the process when the kernel refuses it, and ``disable`` turning the
engine off.  A copy of one of these values imported by name into another module would keep its
value of import time, and these tests would fail.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gymnasium.spaces import Box

from trajstore import ReplayBuffer
from trajstore.storage.fields import _syscalls, _vmap
from trajstore.storage.fields import layout as fields

pytestmark = pytest.mark.skipif(not _syscalls.AVAILABLE, reason="the mapped engine is off in this process")


def _engines(rb: ReplayBuffer) -> set[str]:
    return {type(f).__name__ for t in rb._store.tables.values() for f in t.fields}


def test_a_refused_advice_in_populate_turns_it_off_for_the_process(tmp_path, monkeypatch):
    if not _syscalls.populate_write_works():
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE")
    monkeypatch.setattr(_syscalls, "POPULATE_WRITE", True)  # restored after the test
    monkeypatch.setattr(_syscalls, "MADV_POPULATE_WRITE", 0x7FFF)  # an advice no kernel knows: EINVAL
    va = _vmap.VirtualArray(2, _syscalls.PAGE, (1,), np.dtype(np.uint8), True)
    chunk = tmp_path / "chunk"
    chunk.write_bytes(bytes(_syscalls.PAGE))
    fd = os.open(chunk, os.O_RDWR)
    try:
        va.map_chunk(0, fd, str(chunk))
        assert va.populate(0, 16) is False
    finally:
        va.close()
        os.close(fd)
    assert _syscalls.POPULATE_WRITE is False
    assert not _syscalls.populate_write_works()  # not tried again: the answer is kept


def test_disable_turns_the_engine_off_also_for_stores_that_mapped_before(tmp_path, monkeypatch):
    """The store was probed and mapped before ``disable`` (its answer is cached per root): opened
    again afterwards, its raw fields use the portable engine and read the same rows."""
    for name in ("AVAILABLE", "SUPPORTED", "UNAVAILABLE_REASON"):
        monkeypatch.setattr(_syscalls, name, getattr(_syscalls, name))  # restored after the test
    monkeypatch.setattr(fields, "_MAPS", {})
    rows = np.arange(100 * 8 * 8 * 3).reshape(100, 8, 8, 3).astype(np.uint8)
    with ReplayBuffer.create(Box(0, 255, (8, 8, 3), np.uint8), cache_path=tmp_path / "s", chunk_rows=64) as rb:
        assert _engines(rb) == {"MappedField"}
        rb.extend(rows)
    _syscalls.disable("reserving address space failed (test)")
    assert (_syscalls.AVAILABLE, _syscalls.SUPPORTED) == (False, False)
    assert _syscalls.UNAVAILABLE_REASON == "reserving address space failed (test)"
    with ReplayBuffer.load_from(tmp_path / "s") as rb:
        assert _engines(rb) == {"ChunkedField"}
        assert np.array_equal(rb[:], rows)
