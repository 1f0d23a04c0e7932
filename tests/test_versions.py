"""Versions of a dataset in an icechunk repository (issue 33, parts 2 and 3): tags, reading old
versions, log, diff, push (incremental, checksummed) and pull (episodes, where, fields; verified),
from Python and the command line, and the bad input of each: nothing written at a destination."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid

import icechunk
import numpy as np
import pytest
import zarr
from gymnasium.spaces import Box, Dict
from test_remote import s3_options  # noqa: F401  (the moto S3 server fixture)

import trajstore
from trajstore import TrajectoryReplayBuffer
from trajstore.errors import (
    ChecksumError,
    DatasetMismatchError,
    NotATrajstoreError,
    StoreExistsError,
    UnknownFieldError,
    VersionNotFoundError,
)
from trajstore.maintenance.push_pull import pull, push
from trajstore.maintenance.versions import diff, log, snapshot_of

STEP = Dict({"obs": Box(-1e9, 1e9, (16,), np.float32), "action": Box(-1e9, 1e9, (4,), np.float32)})
EPISODE = Dict({"return": Box(-1e9, 1e9, (), np.float64)})


def _record(path, episodes, steps=50, first=0, **kw):
    """A trajectory store at ``path`` with ``episodes`` episodes of ``steps`` steps: step ``i`` of
    episode ``e`` holds obs ``e * 1000 + i``, its return is ``e``."""
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EPISODE, cache_path=path, chunk_rows=128,
                                        episode_data_storage_kwargs={"chunk_rows": 64}, **kw)
    _extend(buf, range(first, first + episodes), steps)
    return buf


def _extend(buf, episodes, steps=50):
    for e in episodes:
        obs = np.repeat((e * 1000 + np.arange(steps, dtype=np.float32))[:, None], 16, axis=1)
        buf.extend({"obs": obs, "action": obs[:, :4] * -1})
        buf.set_current_episode_data({"return": np.float64(e)})
        buf.mark_episode_end()


def _tree(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def test_tag_time_travel_log_and_diff(tmp_path):
    url = f"icechunk://{tmp_path / 'repo'}"
    buf = _record(url, 3)
    buf.flush()
    v1 = trajstore.tag(url, "v1.0")
    before_edit = datetime.datetime.now(datetime.timezone.utc)
    time.sleep(0.01)
    buf.remove_episodes([1])
    _extend(buf, [3])
    buf.close()
    old = trajstore.load_from(url, version="v1.0")
    assert isinstance(old, TrajectoryReplayBuffer) and old.read_only
    assert old.episodes()["episode_id"].tolist() == [0, 1, 2] and len(old) == 150
    old.close()
    for version in (v1, before_edit):  # a snapshot id and a datetime name the same version
        same = trajstore.load_from(url, version=version)
        assert same.episodes()["episode_id"].tolist() == [0, 1, 2]
        same.close()
    new = trajstore.load_from(url)
    assert new.episodes()["episode_id"].tolist() == [0, 2, 3]
    new.close()
    entries = log(url)
    assert entries[0]["rows"] == 150 and entries[0]["episodes"] == 3
    assert [e["tags"] for e in entries if e["snapshot"] == v1] == [["v1.0"]]
    assert entries[-1]["message"].startswith("create:") and any(e["message"].startswith("edit:") for e in entries)
    d = diff(url, "v1.0", snapshot_of(url))
    assert d["rows"] == [150, 150] and d["episodes"] == {"added": [3], "removed": [1], "changed": []}
    assert d["fields"] == {"added": [], "removed": [], "changed": []} and d["chunks_changed"] > 0
    with pytest.raises(StoreExistsError, match="tags never move"):
        trajstore.tag(url, "v1.0")
    with pytest.raises(VersionNotFoundError, match="no version named 'v2'"):
        trajstore.load_from(url, version="v2")
    with pytest.raises(VersionNotFoundError, match="nothing was committed by"):
        trajstore.load_from(url, version=datetime.datetime(2000, 1, 1))
    local = tmp_path / "local"
    _record(str(local), 1).close()
    with pytest.raises(NotATrajstoreError, match="icechunk locations only"):
        trajstore.tag(str(local), "v1")


@pytest.mark.parametrize("capacity", [None, 100])
def test_log_reads_episodes_from_commit_metadata(tmp_path, monkeypatch, capacity):
    """A writer names each commit's episodes in its snapshot's metadata, so log opens no snapshot
    (here: opening one fails the test); the counts equal what each snapshot's reader sees, also in
    a ring that evicts episodes and with an episode spanning commits."""
    import trajstore.maintenance.versions as V

    url = f"icechunk://{tmp_path / 'repo'}"
    kw = {} if capacity is None else {"step_data_capacity": capacity}
    buf = _record(url, 1, steps=30, commit_interval=3600, **kw)
    buf.flush()
    for e in range(1, 6):
        obs = np.full((20, 16), e, np.float32)
        buf.extend({"obs": obs, "action": obs[:, :4]})
        buf.flush()  # an episode in progress: it counts
        buf.extend({"obs": obs[:10], "action": obs[:10, :4]})
        buf.mark_episode_end()
        buf.flush()
    buf.close()
    truth = {}
    for snap in icechunk.Repository.open(icechunk.local_filesystem_storage(str(tmp_path / "repo"))).ancestry(
            branch="main"):
        if (snap.metadata or {}).get("trajstore"):
            old = trajstore.load_from(url, version=snap.id)
            truth[snap.id] = len(old.episodes()["episode_id"])
            old.close()
    monkeypatch.setattr(V, "_episodes_at", lambda *a: pytest.fail("log opened a snapshot"))
    entries = log(url)
    assert {e["snapshot"]: e["episodes"] for e in entries} == truth and len(truth) >= 11
    assert entries[0]["episodes"] == (6 if capacity is None else 4)


def test_push_is_incremental_and_pull_takes_a_verified_subset(tmp_path, s3_options):  # noqa: F811
    local = str(tmp_path / "local")
    remote = f"icechunk+s3://trajstore-test/versions-{uuid.uuid4().hex}"
    _record(local, 100).close()
    first = push(local, remote, tag="v1", remote_options=s3_options)
    assert first["uploaded"] == first["keys"] and first["uploaded_bytes"] == first["bytes"]
    buf = TrajectoryReplayBuffer.load_from(local)
    _extend(buf, [100])
    buf.close()
    second = push(local, remote, tag="v2", remote_options=s3_options)
    # Only what the new episode touched goes out: the last chunks, their metadata, the record's files.
    assert second["unchanged"] > 0 and second["uploaded_bytes"] < first["bytes"] / 5, second
    again = push(local, remote, remote_options=s3_options)
    assert again["uploaded_bytes"] <= 4096, again  # nothing changed: the run index and metadata at most

    out = str(tmp_path / "pulled")
    got = pull(f"{remote}@v1", out, episodes=(0, 10), fields=["obs"], storage_options=s3_options)
    assert got["episodes"] == 10 and got["of"] == 100 and got["steps"] == 500 and got["verified"]
    # 10% of the episodes of one field: at most 15% of the version's bytes were read
    assert got["bytes_read"] <= 0.15 * got["remote_bytes"], got
    small = TrajectoryReplayBuffer.load_from(out, read_only=True)
    assert small.step_space == Dict({"obs": STEP["obs"]}) and small.episode_space == EPISODE
    assert small.episodes()["episode_id"].tolist() == list(range(10))
    np.testing.assert_array_equal(small[:]["step_data"]["obs"][:, 0],
                                  (np.arange(10)[:, None] * 1000 + np.arange(50)).ravel())
    assert (np.asarray(small.get_episode(7)["episode_data"]["return"]) == 7).all()
    assert trajstore.verify_store(out).ok
    small.close()
    best = pull(remote, str(tmp_path / "best"), where="return >= 98", storage_options=s3_options)
    assert best["episodes"] == 3 and best["of"] == 101  # 98, 99 and 100 of the latest version


def test_pull_at_default_chunking_reads_its_episodes_rows_and_checks_each_block(tmp_path):
    """A store at its default chunking (raw chunks of 2 MiB: 32,768 rows of obs): a pull of 10% of
    its episodes fetches the runs of rows they hold as byte ranges, each 64 KiB block checked
    against the push's block checksums, so it reads at most 15% of the version's bytes (a whole
    chunk of each field was about 40% here).  A damaged block is refused when a pull reads it."""
    local = str(tmp_path / "local")
    remote = f"icechunk://{tmp_path / 'remote'}"
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EPISODE, cache_path=local)
    _extend(buf, range(80), steps=1000)
    buf.close()
    push(local, remote, tag="v1")
    out = tmp_path / "pulled"
    got = pull(f"{remote}@v1", str(out), episodes=(0, 8))
    assert got["verified"] and got["episodes"] == 8 and got["steps"] == 8000
    assert got["bytes_read"] <= 0.15 * got["remote_bytes"], got
    small = TrajectoryReplayBuffer.load_from(str(out), read_only=True)
    np.testing.assert_array_equal(small[:]["step_data"]["obs"][:, 3],
                                  (np.arange(8)[:, None] * 1000 + np.arange(1000)).ravel())
    np.testing.assert_array_equal(small[:]["step_data"]["action"], -small[:]["step_data"]["obs"][:, :4])
    small.close()
    # Another program changes row 20,000 of obs's first chunk (1.25 MiB in: a block no pull of
    # episodes 0..7 reads) and row 5: the first pull reads only intact blocks, the second is refused.
    repo = icechunk.Repository.open(icechunk.local_filesystem_storage(str(tmp_path / "remote")))
    for row in (20_000, 5):
        session = repo.writable_session("main")
        zarr.open_array(session.store, path="step_data/obs", mode="r+")[row] = -1.0
        snap = session.commit(f"another program's change of row {row}")
        dst = tmp_path / f"after-{row}"
        if row == 20_000:
            assert pull(remote, str(dst), version=snap, episodes=(0, 8), verify=True)["steps"] == 8000
            with pytest.raises(ChecksumError, match=r"step_data/obs/c/0/0 bytes 1245184\.\.1310719 do not match"):
                pull(remote, str(tmp_path / "all"), version=snap)
            continue
        with pytest.raises(ChecksumError, match=r"step_data/obs/c/0/0 bytes 0\.\.65535 do not match"):
            pull(remote, str(dst), version=snap, episodes=(0, 8))
        assert not dst.exists()


def test_pull_bad_input_writes_nothing(tmp_path):
    local = str(tmp_path / "local")
    remote = f"icechunk://{tmp_path / 'remote'}"
    _record(local, 4).close()
    push(local, remote, tag="v1")
    dst = tmp_path / "dst"

    def nothing_written():
        assert not dst.exists() and not [p for p in os.listdir(tmp_path) if "partial" in p or p.startswith(".")]

    with pytest.raises(VersionNotFoundError, match="no version named 'nope'"):
        pull(f"{remote}@nope", str(dst))
    nothing_written()
    with pytest.raises(UnknownFieldError, match="reward"):
        pull(remote, str(dst), fields=["obs", "reward"])
    nothing_written()
    other = f"icechunk://{tmp_path / 'other'}"
    push(local, other)
    foreign_snapshot = snapshot_of(other)
    with pytest.raises(VersionNotFoundError, match="not a version of this dataset"):
        pull(remote, str(dst), version=foreign_snapshot)
    nothing_written()
    # A repository of another program's layout: pull, push, tag and log refuse it or skip its commits.
    foreign_path = tmp_path / "foreign"
    foreign = icechunk.Repository.create(icechunk.local_filesystem_storage(str(foreign_path)))
    session = foreign.writable_session("main")
    zarr.create_group(session.store, attributes={"made_by": "another program"}).create_array("x", shape=(4,), dtype="i4")
    session.commit("another program's data")
    before_files = os.listdir(foreign_path)
    with pytest.raises(NotATrajstoreError, match="not a trajstore store"):
        pull(f"icechunk://{foreign_path}", str(dst))
    nothing_written()
    with pytest.raises(NotATrajstoreError, match="not a trajstore store"):
        push(local, f"icechunk://{foreign_path}")
    with pytest.raises(NotATrajstoreError, match="not a trajstore store"):
        trajstore.tag(f"icechunk://{foreign_path}", "mine")
    assert [s.message for s in foreign.ancestry(branch="main")][0] == "another program's data"
    assert not foreign.list_tags() and os.listdir(foreign_path) == before_files
    assert log(f"icechunk://{foreign_path}") == []
    # A version written after its push holds no matching checksums; a damaged chunk fails its checksum.
    buf = TrajectoryReplayBuffer.load_from(remote)
    _extend(buf, [4])
    buf.close()
    with pytest.raises(ChecksumError, match="committed to after its push"):
        pull(remote, str(dst))
    assert pull(remote, str(dst), verify=False)["episodes"] == 5  # the user may pull it unchecked
    # Another program changes a pushed chunk behind the checksums' back (record and checksums kept).
    repo = icechunk.Repository.open(icechunk.local_filesystem_storage(str(tmp_path / "remote")))
    repo.reset_branch("main", repo.lookup_tag("v1"))
    session = repo.writable_session("main")
    zarr.open_array(session.store, path="step_data/obs", mode="r+")[1] = 456.0
    damaged = session.commit("another program's change")
    dst2 = tmp_path / "dst2"
    with pytest.raises(ChecksumError, match="step_data/obs/c/0/0 does not match the checksum recorded at push"):
        pull(remote, str(dst2), version=damaged)
    assert not dst2.exists() and not [p for p in os.listdir(tmp_path) if "partial" in p]
    # A push onto another dataset's remote is refused before a byte goes out (here: its spaces and
    # capacity differ; a dataset is also told apart by its creation time).
    stranger = str(tmp_path / "stranger")
    _record(stranger, 2, step_data_capacity=1000).close()
    before = log(remote)
    with pytest.raises(DatasetMismatchError, match="another dataset"):
        push(stranger, remote)
    assert log(remote) == before
    with pytest.raises(StoreExistsError):
        push(local, remote, tag="v1")
    assert log(remote) == before


def test_cli_log_diff_tag_push_pull(tmp_path, capsys):
    from trajstore.cli import main

    local = str(tmp_path / "local")
    remote = f"icechunk://{tmp_path / 'remote'}"
    _record(local, 20).close()

    def run(*args, ok=True):
        code = main(list(args))
        out = capsys.readouterr()
        assert (code == 0) == ok, out.err
        return out

    # (one real process: the console entry point, whose JSON icechunk's log lines must not corrupt)
    p = subprocess.run([sys.executable, "-m", "trajstore", "push", local, remote, "--tag", "v0", "--json"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == 0 and json.loads(p.stdout)["tag"] == "v0", p.stderr
    run("push", local, remote, "--tag", "v1")

    run("tag", remote, "v1.0")
    out = json.loads(run("log", remote, "--json").out)
    assert out[0]["tags"] == ["v1", "v1.0"] and out[1]["tags"] == ["v0"] and out[0]["episodes"] == 20 and out[0]["message"].startswith("push from")
    pulled = tmp_path / "pulled"
    text = run("pull", f"{remote}@v1.0", str(pulled), "--episodes", "0:2", "--fields", "action").out
    assert "pulled 2 of 20 episodes" in text and "checksums checked" in text
    assert json.loads(run("diff", remote, "v0", "v1.0", "--json").out)["episodes"]["changed"] == []
    bad = run("pull", f"{remote}@v9", str(tmp_path / "x"), ok=False)
    assert "no version named 'v9'" in bad.err and not (tmp_path / "x").exists()
    assert "tags never move" in run("tag", remote, "v1", ok=False).err
    digest = hashlib.sha256(open(os.path.join(pulled, "trajstore.head.json"), "rb").read()).hexdigest()
    assert digest and "trajstore.checksums.json" not in _tree(pulled)


def test_a_push_killed_at_random_instants_publishes_a_whole_version_or_nothing(tmp_path, procs):
    """A child pushes a store again and again (one episode more each time) and is SIGKILLed after
    a random delay, 12 times; after each kill the remote's latest version pulls with its checksums
    checked and holds whole episodes only, never fewer than an acknowledged push."""
    import random

    import _icechunk_workers as IW
    import _workers as W
    from _kill_workers import parse_log

    from trajstore.errors import StoreNotFoundError

    local = str(tmp_path / "local")
    remote = f"icechunk://{tmp_path / 'remote'}"
    _record(local, 3).close()
    log = str(tmp_path / "log")
    rng = random.Random(7)
    for i in range(12):
        ready = str(tmp_path / f"ready{i}")
        p = W.start(IW.push_loop, local, remote, log, ready)
        procs.append(p)
        W.wait_for_file(ready, p)
        time.sleep(rng.uniform(0.0, 0.3))
        W.kill(p)
        pushes = sum(1 for tag, _ in parse_log(log) if tag == "P")
        try:
            got = pull(remote, str(tmp_path / f"check{i}"))
        except StoreNotFoundError:
            assert pushes == 0  # the first push never committed: nothing was published
            continue
        assert got["verified"] and got["steps"] == 150 + 40 * (got["episodes"] - 3)
    assert sum(1 for tag, _ in parse_log(log) if tag == "P") > 0


def test_command_line_versions_are_tags_ids_or_dates():
    from trajstore.maintenance.versions import check_version

    assert check_version("WK5YXQ440K3E8B4RKTCG") == "WK5YXQ440K3E8B4RKTCG"  # a snapshot id with a T
    assert check_version("v1.0") == "v1.0"
    assert check_version("2026-05-01T12:00") == datetime.datetime(2026, 5, 1, 12, 0)
    with pytest.raises(VersionNotFoundError):
        check_version("2026-13-45")
