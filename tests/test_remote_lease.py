"""A remote store has one writer (issue 17): the lease object and the generation check before
every commit, on ``memory://`` and on S3 (moto server of test_remote.py), and a SIGKILLed remote
writer whose lease the next writer takes over with every committed row intact."""

from __future__ import annotations

import json
import os
import time

import _shard_workers as SW
import _workers as W
import numpy as np
import pytest
from _kill_workers import parse_log
from gymnasium.spaces import Box
from test_remote import s3_options  # noqa: F401  (the moto S3 server fixture)

from trajstore import ReplayBuffer
from trajstore.errors import BadOptionError, LockedError
from trajstore.storage import lease
from trajstore.storage.lease import LEASE_KEY

SPACE = Box(-np.inf, np.inf, (4,), np.float32)


def _rows(lo, hi):
    return np.repeat(np.arange(lo, hi, dtype=np.float32)[:, None], 4, axis=1)


@pytest.fixture(params=["memory", "s3"])
def remote(request):
    """(a fresh store URL, storage_options) on memory:// or the moto S3 server."""
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    if request.param == "memory":
        return f"memory://lease-{stamp}/store", None
    return f"s3://trajstore-test/lease-{stamp}", request.getfixturevalue("s3_options")


def test_second_writer_refused(remote):
    url, opts = remote
    a = ReplayBuffer.create(SPACE, cache_path=url, storage_options=opts)
    a.extend(_rows(0, 10))
    a.flush()
    with pytest.raises(LockedError, match="another writer holds"):
        ReplayBuffer.load_from(url, storage_options=opts)
    with pytest.raises(LockedError):
        ReplayBuffer.create(SPACE, cache_path=url, storage_options=opts, overwrite=True)
    r = ReplayBuffer.load_from(url, read_only=True, storage_options=opts)  # readers take no lease
    assert len(r) == 10
    a.close()
    b = ReplayBuffer.load_from(url, storage_options=opts)  # released at close
    b.extend(_rows(10, 15))
    b.close()
    assert len(ReplayBuffer.load_from(url, read_only=True, storage_options=opts)) == 15


def test_commit_refused_after_another_writer_committed(remote):
    """The generation check behind the lease: a's lease deleted by hand while a runs (what
    break_lease refuses to do to a live writer of this machine), b opens and commits, and a's
    next commit is refused instead of replacing b's record."""
    import fsspec

    url, opts = remote
    a = ReplayBuffer.create(SPACE, cache_path=url, storage_options=opts, commit_interval=3600)
    a.extend(_rows(0, 10))
    a.flush()
    fs, path = fsspec.core.url_to_fs(f"{url}/{LEASE_KEY}", **(opts or {}))
    fs.rm(path)
    b = ReplayBuffer.load_from(url, storage_options=opts)
    b.extend(_rows(100, 105))
    b.flush()
    a.extend(_rows(10, 20))
    with pytest.raises(LockedError, match="another writer committed"):
        a.flush()  # would replace b's commit and lose its rows
    b.close()
    got = ReplayBuffer.load_from(url, read_only=True, storage_options=opts)[:]
    np.testing.assert_array_equal(got, np.concatenate([_rows(0, 10), _rows(100, 105)]))


def test_multiprocessing_refused_and_copies_unleased(remote):
    url, opts = remote
    with pytest.raises(BadOptionError, match="shard"):
        ReplayBuffer.create(SPACE, cache_path=url, storage_options=opts, multiprocessing=True)
    a = ReplayBuffer.create(SPACE, cache_path=url, storage_options=opts)
    a.extend(_rows(0, 3))
    a.dumps(url + "-copy", storage_options=opts)
    copy = ReplayBuffer.load_from(url + "-copy", storage_options=opts)  # the lease stayed behind
    copy.extend(_rows(3, 4))
    copy.close()
    a.close()


def test_killed_s3_writer_lease_taken_over(s3_options, tmp_path, procs):  # noqa: F811
    url = f"s3://trajstore-test/killed-{time.monotonic_ns()}"
    log, ready = str(tmp_path / "log"), str(tmp_path / "ready")
    p = W.start(SW.write_rows, url, s3_options, log, ready)
    procs.append(p)
    W.wait_for_file(ready, p)
    deadline = time.monotonic() + 30
    while len(parse_log(log)) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    W.kill(p)
    acked = max(v for tag, v in parse_log(log) if tag == "F")
    import s3fs

    fs = s3fs.S3FileSystem(key=s3_options["key"], secret=s3_options["secret"],
                           endpoint_url=s3_options["endpoint_url"])
    assert fs.exists(f"{url[5:]}/{LEASE_KEY}")  # the killed writer left its lease
    buf = ReplayBuffer.load_from(url, storage_options=s3_options)  # its process is gone: taken over
    n = len(buf)
    assert n >= acked
    np.testing.assert_array_equal(buf[:], _rows(0, n))
    buf.extend(_rows(n, n + 5))
    buf.close()
    assert not fs.exists(f"{url[5:]}/{LEASE_KEY}")


@pytest.mark.parametrize("bad", ['"pid": 1' + "0" * 400, '"pid": -1', '"pid": true', '"renewed": 1' + "0" * 400,
                                 '"renewed": NaN', '"renewed": Infinity', '"renewed": -5', '"started": -1',
                                 '"started": 1' + "0" * 400, '"kernel": 7', '"kernel": "' + "k" * 300 + '"',
                                 '"owner": ' + "[" * 1500 + "]" * 1500],
                         ids=["huge-pid", "negative-pid", "bool-pid", "huge-time", "nan-time", "inf-time", "negative-time",
                              "negative-start", "huge-start", "int-kernel", "long-kernel", "nested"])
def test_hostile_lease_is_a_damaged_store(bad):
    """A lease is input: out-of-range numbers raise DamagedStoreError (not OverflowError from
    float() or os.kill), and NaN, which JSON allows and which would never be stale, is refused."""
    import fsspec

    from trajstore.errors import DamagedStoreError

    url = f"memory://lease-hostile-{os.getpid()}-{time.monotonic_ns()}/store"
    ReplayBuffer.create(SPACE, cache_path=url).close()
    fields = {"owner": '"x"', "host": '"elsewhere"', "pid": "1", "renewed": str(time.time())}
    key, value = bad.split(": ", 1)
    fields[key.strip('"')] = value
    with fsspec.open(f"{url}/{LEASE_KEY}", "wb") as f:
        f.write(("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}").encode())
    with pytest.raises(DamagedStoreError, match="not a writer lease"):
        ReplayBuffer.load_from(url)
    assert len(ReplayBuffer.load_from(url, read_only=True)) == 0  # readers never look at the lease


def test_unreadable_record_names_its_cause():
    """A commit whose generation check cannot read the record is refused with LockedError that
    says why (here the record was deleted under the writer)."""
    import fsspec

    from trajstore.storage.head import HEAD_KEY

    url = f"memory://lease-cause-{os.getpid()}-{time.monotonic_ns()}/store"
    a = ReplayBuffer.create(SPACE, cache_path=url)
    a.extend(_rows(0, 3))
    a.flush()
    fs, path = fsspec.core.url_to_fs(f"{url}/{HEAD_KEY}")
    record = fs.cat_file(path)
    fs.rm(path)
    a.extend(_rows(3, 5))
    with pytest.raises(LockedError, match="could not be read.*DamagedStoreError.*missing"):
        a.flush()
    fs.pipe_file(path, record)
    a.close()
    np.testing.assert_array_equal(ReplayBuffer.load_from(url, read_only=True)[:], _rows(0, 5))


# -- issue 37 section 5: a paused writer and its would-be successor --------------------------------

def _successor(url, opts):
    """Writer B: open the store, append 100 rows ``[1000 + i] * 4`` after what is committed and
    flush.  Returns ``(buffer, (lo, hi))`` of the rows B acknowledged, or ``(None, the error)``
    when B is refused."""
    try:
        b = ReplayBuffer.load_from(url, storage_options=opts, commit_interval=3600)
    except LockedError as e:
        return None, e
    lo = len(b)
    b.extend(_rows(lo, lo + 100) + 1000)
    b.flush()
    return b, (lo, lo + 100)


def _check_acknowledged(url, opts, a_rows, b_span):
    """Every row writer A acknowledged (``0 .. a_rows - 1``, value ``i``) and every row B did
    (``b_span``, value ``1000 + i``) reads back as written."""
    got = ReplayBuffer.load_from(url, read_only=True, storage_options=opts)[:]
    np.testing.assert_array_equal(got[:a_rows], _rows(0, a_rows), err_msg="a row of the first writer was lost")
    if b_span is not None:
        lo, hi = b_span
        np.testing.assert_array_equal(got[lo:hi], _rows(lo, hi) + 1000,
                                      err_msg="a committed row of the second writer was overwritten")


def _stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("where", ["this-machine", "another-machine"])
def test_sigstopped_s3_writer_never_overwrites_its_successor(s3_options, tmp_path, procs, monkeypatch, where):  # noqa: F811
    """Writer A (a child process) is stopped by a real SIGSTOP between its commit's lease check and
    its chunk writes, for longer than the lease timeout; writer B then tries to take the store
    over and write; A gets SIGCONT.  Before issue 37 B took the expired lease, committed, and A's
    resumed chunk writes landed on B's committed rows.  Now B is refused (LeaseHeldError: A may
    be alive) and A's commit completes; B writes once A has closed.  Every acknowledged row of
    both reads back as written."""
    import signal

    import _lease_workers as LW

    from trajstore.errors import LeaseHeldError

    url = f"s3://trajstore-test/paused-{where}-{time.monotonic_ns()}"
    log = str(tmp_path / "log")
    p = W.start(LW.pause_after_check, url, s3_options, log, where == "another-machine")
    procs.append(p)
    deadline = time.monotonic() + 60
    while not (any(tag == "P" for tag, _ in parse_log(log)) and _stopped(p.pid)):
        assert p.is_alive() and time.monotonic() < deadline, f"writer A never paused: {parse_log(log)}"
        time.sleep(0.01)
    monkeypatch.setattr(lease, "LEASE_TTL_S", 0.0)  # A has been stopped for longer than the lease timeout
    b, b_acked = _successor(url, s3_options)
    os.kill(p.pid, signal.SIGCONT)
    p.join(60)
    assert not p.is_alive()
    a_rows = max(v for tag, v in parse_log(log) if tag == "F")
    if b is not None:
        b.close()
    _check_acknowledged(url, s3_options, a_rows, b_acked if b is not None else None)
    # What the design promises: B is refused while A may be alive, saying why and what to do;
    # A's commit, which nobody took over, completes; once A closed, B writes.
    assert b is None and isinstance(b_acked, LeaseHeldError), b_acked
    if where == "another-machine":
        assert "trajstore.break_lease" in str(b_acked) and "transactions" in str(b_acked)
    assert a_rows == 200 and ("C", 0) in parse_log(log)
    b, b_acked = _successor(url, s3_options)
    b.close()
    _check_acknowledged(url, s3_options, 200, b_acked)


def test_paused_memory_writer_never_overwrites_its_successor(monkeypatch):
    """The same race in one process on memory://, deterministic: B tries to take over right after
    A's commit passed its lease check (A's lease expired), before A writes its chunks."""
    from trajstore.errors import LeaseHeldError

    url = f"memory://lease-paused-{os.getpid()}-{time.monotonic_ns()}/store"
    a = ReplayBuffer.create(SPACE, cache_path=url, chunk_rows=64, commit_interval=3600)
    a.extend(_rows(0, 100))
    a.flush()
    real = lease.RemoteLease.check
    successor = {}

    def check_then_successor(self, generation):
        real(self, generation)
        monkeypatch.setattr(lease.RemoteLease, "check", real)
        monkeypatch.setattr(lease, "LEASE_TTL_S", 0.0)  # A "paused" longer than the lease timeout
        successor["b"], successor["acked"] = _successor(url, None)

    monkeypatch.setattr(lease.RemoteLease, "check", check_then_successor)
    a.extend(_rows(100, 200))
    try:
        a.flush()
        a_rows = 200
    except LockedError:
        a_rows = 100
    b = successor["b"]
    if b is not None:
        b.close()
    _check_acknowledged(url, None, a_rows, successor["acked"] if b is not None else None)
    assert b is None and isinstance(successor["acked"], LeaseHeldError)
    assert a_rows == 200
    a.close()


def test_expired_lease_of_another_machine_is_broken_explicitly(remote):
    """A lease from another machine, not renewed for longer than the timeout, is not taken over:
    LeaseHeldError names it and break_lease; break_lease removes it (once), then a writer opens."""
    import fsspec

    import trajstore
    from trajstore.errors import LeaseHeldError

    url, opts = remote
    a = ReplayBuffer.create(SPACE, cache_path=url, storage_options=opts)
    a.extend(_rows(0, 10))
    a.close()
    fs, path = fsspec.core.url_to_fs(f"{url}/{LEASE_KEY}", **(opts or {}))
    stale = {"owner": "dead", "host": "elsewhere", "pid": 1, "kernel": "another-machine",
             "renewed": time.time() - 2 * lease.LEASE_TTL_S}
    raw = json.dumps(stale).encode()
    fs.pipe_file(path, raw)
    with pytest.raises(LeaseHeldError, match=r"host 'elsewhere'.*renewed \d+ s ago.*trajstore\.break_lease"):
        ReplayBuffer.load_from(url, storage_options=opts)
    assert trajstore.break_lease(url, storage_options=opts) is True
    b = ReplayBuffer.load_from(url, storage_options=opts)
    # A rival that read the same dead lease earlier loses the tombstone: b's lease stays.
    from trajstore.storage.location import resolve_location

    loc = resolve_location(url, read_only=False, storage_options=opts, must_exist=True)
    assert lease._take_over(loc, raw) is False
    assert json.loads(fs.cat_file(path))["pid"] == os.getpid()
    with pytest.raises(LeaseHeldError, match="alive on this machine"):
        trajstore.break_lease(url, storage_options=opts)  # b is alive here
    b.extend(_rows(10, 15))
    b.close()
    assert trajstore.break_lease(url, storage_options=opts) is False  # nothing left to break
    np.testing.assert_array_equal(ReplayBuffer.load_from(url, read_only=True, storage_options=opts)[:], _rows(0, 15))


def test_break_lease_refuses_local_folders(tmp_path):
    import trajstore

    ReplayBuffer.create(SPACE, cache_path=tmp_path / "s").close()
    with pytest.raises(BadOptionError, match="remote store"):
        trajstore.break_lease(str(tmp_path / "s"))


def _dead_pid():
    """The pid of a process of this machine that has exited (and was reaped)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_dead_writer_of_this_machine_taken_over_and_an_unfinished_takeover_reported():
    """A lease naming a process of this kernel that no longer exists is taken over at open (its
    tombstone left behind); a takeover whose writer was killed between its tombstone and its delete
    is reported as such (LeaseHeldError naming break_lease), and break_lease finishes it."""
    import socket
    import uuid

    import fsspec

    import trajstore
    from trajstore.errors import LeaseHeldError
    from trajstore.storage.location import resolve_location

    url = f"memory://lease-dead-{os.getpid()}-{time.monotonic_ns()}/store"
    a = ReplayBuffer.create(SPACE, cache_path=url)
    a.extend(_rows(0, 7))
    a.close()
    fs, path = fsspec.core.url_to_fs(f"{url}/{LEASE_KEY}")
    loc = resolve_location(url, read_only=False, must_exist=True)

    def dead_lease():
        raw = json.dumps({"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": _dead_pid(),
                          "kernel": lease._kernel_identity(), "renewed": time.time()}).encode()
        fs.pipe_file(path, raw)
        return raw

    raw = dead_lease()
    b = ReplayBuffer.load_from(url)  # its writer is gone for certain: no error, no break_lease
    assert loc.exists(lease.tombstone_key(raw))
    b.close()
    raw = dead_lease()
    assert lease.exclusive_put(loc, lease.tombstone_key(raw), b"{}")  # a rival killed right after its tombstone
    with pytest.raises(LeaseHeldError, match=r"being taken over.*trajstore\.break_lease"):
        ReplayBuffer.load_from(url)
    assert fs.cat_file(path) == raw  # nothing deleted
    assert trajstore.break_lease(url) is True
    c = ReplayBuffer.load_from(url)
    c.extend(_rows(7, 9))
    c.close()
    np.testing.assert_array_equal(ReplayBuffer.load_from(url, read_only=True)[:], _rows(0, 9))


def test_a_reused_pid_is_not_the_writer():
    """A lease is the writer's process, not its pid: a live process with the lease's pid but a
    different start time (the pid reused after the writer died) does not hold the store; one with
    the same start time does (LeaseHeldError), also when it is stopped."""
    import signal
    import socket
    import subprocess
    import sys

    import fsspec

    from trajstore.errors import LeaseHeldError

    url = f"memory://lease-reused-{os.getpid()}-{time.monotonic_ns()}/store"
    ReplayBuffer.create(SPACE, cache_path=url).close()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = lease._start_time(other.pid)
        assert started is not None
        os.kill(other.pid, signal.SIGSTOP)
        for when, held in ((started, True), (started + 1, False)):
            record = {"owner": f"o{when}", "host": socket.gethostname(), "pid": other.pid,
                      "kernel": lease._kernel_identity(), "started": when, "renewed": time.time() - 3600}
            with fsspec.open(f"{url}/{LEASE_KEY}", "wb") as f:
                f.write(json.dumps(record).encode())
            if held:
                with pytest.raises(LeaseHeldError, match=f"pid {other.pid}"):
                    ReplayBuffer.load_from(url)
            else:
                ReplayBuffer.load_from(url).close()  # the pid's process is not the writer's: taken over
    finally:
        other.kill()
        other.wait()


def test_writer_stopped_by_its_parent_keeps_the_store(s3_options, tmp_path, procs, monkeypatch):  # noqa: F811
    """The same without any hook in the writer: a writer appending and flushing on moto S3 gets a
    real SIGSTOP from outside at whatever instant it is in, stays stopped past the lease timeout,
    and a successor is refused; after SIGCONT it keeps committing; once SIGKILLed, the successor
    takes the store over with every row the writer acknowledged."""
    import signal

    from trajstore.errors import LeaseHeldError

    url = f"s3://trajstore-test/stopped-{time.monotonic_ns()}"
    log, ready = str(tmp_path / "log"), str(tmp_path / "ready")
    p = W.start(SW.write_rows, url, s3_options, log, ready)
    procs.append(p)
    W.wait_for_file(ready, p)
    deadline = time.monotonic() + 30
    while len(parse_log(log)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGSTOP)
    while not _stopped(p.pid):
        time.sleep(0.01)
    with monkeypatch.context() as m:
        m.setattr(lease, "LEASE_TTL_S", 0.0)  # stopped for longer than the lease timeout
        with pytest.raises(LeaseHeldError, match=f"pid {p.pid}"):
            ReplayBuffer.load_from(url, storage_options=s3_options)
    before = len(parse_log(log))
    os.kill(p.pid, signal.SIGCONT)
    while len(parse_log(log)) < before + 2 and time.monotonic() < deadline + 30:
        time.sleep(0.01)
    W.kill(p)
    acked = max(v for tag, v in parse_log(log) if tag == "F")
    assert len(parse_log(log)) >= before + 2  # it went on committing after SIGCONT
    buf = ReplayBuffer.load_from(url, storage_options=s3_options)  # killed on this machine: taken over
    n = len(buf)
    assert n >= acked
    np.testing.assert_array_equal(buf[:], _rows(0, n))
    buf.close()
