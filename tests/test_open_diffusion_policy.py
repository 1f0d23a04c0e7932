"""open_diffusion_policy (issue 14): a Diffusion Policy store written by zarr-python (format 2 and 3,
folder and .zarr.zip) opened read-only in place as a TrajectoryReplayBuffer; its reads equal numpy
reads of the arrays and import_diffusion_policy's copy (rows, slices, columns, samples, sequence
windows, episodes); a SequenceDataset over it in DataLoader worker processes; writes refused and
nothing in the store touched; damaged stores refused with trajstore errors naming the path."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from test_interop_diffusion_policy import pusht_like, write_dp

from trajstore import TrajectoryReplayBuffer
from trajstore.errors import (
    BadOptionError,
    BadValueError,
    DamagedStoreError,
    NotATrajstoreError,
    ReadOnlyError,
    StoreNotFoundError,
    UnsupportedSpaceError,
)
from trajstore.interop import DiffusionPolicyBuffer, import_diffusion_policy, open_diffusion_policy

KEYS = ("action", "img", "keypoint", "n_contacts", "state")


def _files(path: Path) -> dict[str, str]:
    """Every file under ``path`` (or the file itself) with its SHA-256: a store read in place must
    stay byte for byte as it was, with no file added."""
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _copy_view(step: Any) -> dict[str, np.ndarray]:
    """The imported copy's step data in the in-place buffer's keys (obs/<key> -> <key>)."""
    return {"action": step["action"], **step["obs"]}


@pytest.mark.parametrize("zarr_format, name, whole", [
    (2, "pusht.zarr", True), (2, "pusht.zarr", False), (2, "pusht.zarr.zip", True),
    (3, "pusht.zarr", True), (3, "pusht.zarr.zip", True), (3, "pusht.zarr.zip", False)])
def test_reads_equal_numpy_and_the_imported_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zarr_format: int,
                                                 name: str, whole: bool) -> None:
    """``whole``: small arrays are held decoded whole (this store's are all small); False lowers the
    bound to 0 bytes, so every array is read through the decoded-chunk cache, chunk by chunk."""
    from trajstore.storage.fields import foreign

    if not whole:
        monkeypatch.setattr(foreign, "WHOLE_BYTES", 0)
    data, ends = pusht_like(n_eps=6, seed=zarr_format)
    src = tmp_path / name
    write_dp(src, data, ends, zarr_format, chunk=50)
    before = _files(src)
    n = int(ends[-1])
    starts = np.concatenate([[0], ends[:-1]])
    with open_diffusion_policy(src) as buf, import_diffusion_policy(src, tmp_path / "copy") as copy:
        assert isinstance(buf, TrajectoryReplayBuffer) and buf.read_only and buf.episode_space is None
        assert len(buf) == n and list(buf.step_space.spaces) == list(KEYS)
        for k in KEYS:
            assert buf.step_space[k].shape == data[k].shape[1:] and buf.step_space[k].dtype == data[k].dtype
        # rows: int, negative int, slice, index array, bool mask; and get_slice / get_column views
        rng = np.random.default_rng(0)
        idx = rng.integers(0, n, 40)
        mask = rng.random(n) < 0.1
        for sel, want in ((7, 7), (-1, n - 1), (slice(60, 140), slice(60, 140)), (idx, idx), (mask, mask)):
            got = buf[sel]
            assert got["episode_data"] is None
            for k in KEYS:
                np.testing.assert_array_equal(got["step_data"][k], data[k][want], err_msg=f"{k} {sel!r:.30}")
        view = buf.get_slice(slice(10, 90))
        np.testing.assert_array_equal(view[5:9]["step_data"]["img"], data["img"][15:19])
        col = buf.get_column(["step_data", "keypoint"])
        np.testing.assert_array_equal(col[idx], data["keypoint"][idx])
        # metadata: episode ids from meta/episode_ends
        _, meta = buf.get_at_with_metadata(idx)
        np.testing.assert_array_equal(meta["episode_ids"], np.searchsorted(ends, idx, side="right"))
        table = buf.episodes()
        np.testing.assert_array_equal(table["episode_id"], np.arange(len(ends)))
        np.testing.assert_array_equal(table["start"], starts)
        np.testing.assert_array_equal(table["length"], np.diff(np.concatenate([[0], ends])))
        assert not table["live"].any()
        for e in (0, 3, len(ends) - 1):
            ep = buf.get_episode(e)["step_data"]
            for k in KEYS:
                np.testing.assert_array_equal(ep[k], data[k][starts[e]: ends[e]])
        # samplers draw the same rows and windows as over the copy (same rows, same episode runs)
        a, b = buf.sample(64, rng=5)["step_data"], _copy_view(copy.sample(64, rng=5)["step_data"])
        for k in KEYS:
            np.testing.assert_array_equal(a[k], b[k])
        offsets = [-2, -1, 0, 1, 2, 3]
        for pad in ("edge", "zero"):
            (got, m1), (ref, m2) = buf.get_sequences(idx, offsets, pad=pad), copy.get_sequences(idx, offsets, pad=pad)
            np.testing.assert_array_equal(m1, m2)
            for k in KEYS:
                np.testing.assert_array_equal(got["step_data"][k], _copy_view(ref["step_data"])[k])
        (got, m1), (ref, m2) = (buf.sample_sequences(32, 16, rng=3, within_episode=True),
                                copy.sample_sequences(32, 16, rng=3, within_episode=True))
        assert m1.all() and m2.all()
        for k in KEYS:
            np.testing.assert_array_equal(got["step_data"][k], _copy_view(ref["step_data"])[k])
        fw, fm = buf.get_sequences(idx, {"state": [-1, 0], "action": range(8)})
        rw, rm = copy.get_sequences(idx, {"obs/state": [-1, 0], "action": range(8)})
        np.testing.assert_array_equal(fw["step_data"]["state"], rw["step_data"]["obs"]["state"])
        np.testing.assert_array_equal(fw["step_data"]["action"], rw["step_data"]["action"])
        # pickled as a handle: reopened by path in place
        again = pickle.loads(pickle.dumps(buf))
        assert type(again) is DiffusionPolicyBuffer and len(again) == n
        np.testing.assert_array_equal(again[idx]["step_data"]["state"], data["state"][idx])
        again.close()
    assert _files(src) == before  # read in place: nothing written, nothing added
    assert sorted(os.listdir(tmp_path)) == sorted([name, "copy"])


def test_torch_backend_and_closed(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    data, ends = pusht_like(n_eps=3)
    write_dp(tmp_path / "d.zarr", data, ends)
    buf = open_diffusion_policy(tmp_path / "d.zarr", backend="torch")
    got = buf[np.arange(5)]["step_data"]["state"]
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), data["state"][:5])
    buf.close()
    with pytest.raises(Exception, match="closed"):
        buf[0]


def test_sequence_dataset_in_dataloader_workers(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from trajstore.torch import SequenceDataset

    data, ends = pusht_like(n_eps=4, seed=7)
    write_dp(tmp_path / "d.zarr", data, ends)
    with open_diffusion_policy(tmp_path / "d.zarr") as buf:
        ds = SequenceDataset(buf, 8, ["state", "action"], within_episode=True, stride=3)
        loader = DataLoader(ds, batch_size=16, shuffle=False, num_workers=2, multiprocessing_context="fork")
        got = [b for b in loader]
        # the worker processes reopened the store by path, in place (BufferSource reopens the subclass)
        states = torch.cat([b["state"] for b in got]).numpy()
        actions = torch.cat([b["action"] for b in got]).numpy()
        assert len(states) == len(ds)
        anchors = np.asarray(ds._anchors)
        frames = anchors[:, None] + np.arange(8)
        np.testing.assert_array_equal(states, data["state"][frames])
        np.testing.assert_array_equal(actions, data["action"][frames])
        ep = np.searchsorted(ends, frames, side="right")
        assert (ep == ep[:, :1]).all()  # within_episode: every window inside one episode
        assert torch.cat([b["mask"] for b in got]).all()
        # a spawned worker gets the dataset pickled: the handle reopens in place by path
        clone = pickle.loads(pickle.dumps(ds))
        np.testing.assert_array_equal(clone[2]["state"].numpy(), data["state"][anchors[2] : anchors[2] + 8])


def test_writes_refused_store_untouched(tmp_path: Path) -> None:
    data, ends = pusht_like(n_eps=3)
    src = tmp_path / "d.zarr"
    write_dp(src, data, ends)
    before = _files(src)
    row = {k: v[0] for k, v in data.items()}
    with open_diffusion_policy(src) as buf:
        for call in (lambda: buf.append(row), lambda: buf.extend({k: v[:2] for k, v in data.items()}),
                     lambda: buf.set_at(0, row), lambda: buf.remove_at(0), buf.clear, buf.mark_episode_end,
                     lambda: buf.remove_episodes([0]), lambda: buf.set_episode_data_at(0, 1.0),
                     lambda: buf.append_flattened(np.zeros(3)), lambda: buf.extend_from(buf)):
            with pytest.raises(ReadOnlyError, match="read-only"):
                call()
        with pytest.raises(BadOptionError, match="import it"):
            buf.dumps(tmp_path / "elsewhere")
        buf.dumps()  # nothing to commit
        buf.flush()
        assert len(buf) == int(ends[-1])
    with pytest.raises(ReadOnlyError):
        DiffusionPolicyBuffer.load_from(src, read_only=False)
    assert _files(src) == before and sorted(os.listdir(tmp_path)) == ["d.zarr"]


def _edit_zarray(path: Path, **changes: Any) -> None:
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("case, error, words", [
    ("decreasing", BadValueError, ["increase strictly", "entry 2 is 20 after 40"]),
    ("negative", BadValueError, ["increase strictly", "entry 0 is -5"]),
    ("zero_first", BadValueError, ["increase strictly", "entry 0 is 0"]),
    ("beyond", BadValueError, ["ends at 90", "60 rows"]),
    ("short", BadValueError, ["ends at 50", "60 rows"]),
    ("float_ends", BadValueError, ["1-D integers"]),
    ("ends_2d", BadValueError, ["1-D integers"]),
    ("lengths", BadValueError, ["data/state has shape (59, 5)", "one row per step"]),
    ("more_ends_than_rows", BadValueError, ["entries for 60 steps"]),
    ("huge_rows", BadValueError, ["has shape (1000000000000000, 5)"]),
    ("huge_claim", DamagedStoreError, ["not plausible"]),
    ("huge_chunk", DamagedStoreError, ["bytes per chunk"]),
    ("huge_row", DamagedStoreError, ["elements", "not plausible"]),
    ("strings", UnsupportedSpaceError, ["data/label", "expected bool, integers or floats"]),
    ("bad_json", DamagedStoreError, ["metadata cannot be read"]),
    ("no_action", NotATrajstoreError, ["expected the array data/action"]),
    ("not_zarr", NotATrajstoreError, ["is not a zarr group"]),
    ("missing", StoreNotFoundError, ["no such file"]),
])
def test_damaged_or_foreign_stores_refused(tmp_path: Path, case: str, error: type, words: list[str]) -> None:
    src = tmp_path / "bad.zarr"
    data = {"state": np.arange(300, dtype=np.float32).reshape(60, 5), "action": np.zeros((60, 2), np.float32)}
    ends = np.array([20, 40, 60])
    if case == "decreasing":
        ends = np.array([20, 40, 20, 60])
    elif case == "negative":
        ends = np.array([-5, 40, 60])
    elif case == "zero_first":
        ends = np.array([0, 40, 60])
    elif case == "beyond":
        ends = np.array([20, 90])
    elif case == "short":
        ends = np.array([20, 50])
    elif case == "lengths":
        data["state"] = data["state"][:59]
    elif case == "more_ends_than_rows":
        ends = np.arange(1, 62)
    elif case == "no_action":
        del data["action"]
    elif case == "huge_claim":  # ends and array shapes agree on 10**15 rows; the chunks are not there
        ends = np.array([10**15])
    if case == "not_zarr":
        src.mkdir()
        (src / "notes.txt").write_text("hello")
    elif case != "missing":
        write_dp(src, data, ends)
    meta = src / "meta" / "episode_ends" / ".zarray"
    state = src / "data" / "state" / ".zarray"
    if case == "float_ends":
        _edit_zarray(meta, dtype="<f8")
    elif case == "ends_2d":
        _edit_zarray(meta, shape=[3, 1], chunks=[3, 1])
    elif case == "huge_rows":
        _edit_zarray(state, shape=[10**15, 5])
    elif case == "huge_claim":
        for p in (state, src / "data" / "action" / ".zarray"):
            _edit_zarray(p, shape=[10**15, 5 if p == state else 2], chunks=[1, 5 if p == state else 2])
    elif case == "huge_chunk":
        _edit_zarray(state, chunks=[10**9, 5])
    elif case == "huge_row":
        _edit_zarray(state, shape=[60, 10**5, 10**5], chunks=[1, 10**5, 10**5])
    elif case == "strings":
        label = zarr.open_group(str(src), mode="r+")["data"].create_array(  # type: ignore[union-attr]
            "label", shape=(60,), dtype="<U4")
        label[:] = np.array(["a"] * 60)
    elif case == "bad_json":
        state.write_text('{"zarr_format": 2, "shape": "many"')
    with pytest.raises(error) as e:
        open_diffusion_policy(src)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    if case != "missing":
        assert str(src) in str(e.value)


def test_damaged_chunk_and_linked_chunk_are_store_errors(tmp_path: Path) -> None:
    """A garbage chunk raises DamagedStoreError when read (other chunks still read); a chunk file
    that is a symbolic link to a file outside the store is never followed."""
    data, ends = pusht_like(n_eps=3)
    src = tmp_path / "d.zarr"
    write_dp(src, data, ends, chunk=32)
    (src / "data" / "state" / "1.0").write_bytes(b"\x02\x01garbage" * 10)
    outside = tmp_path / "secret.bin"
    outside.write_bytes(open(src / "data" / "action" / "0.0", "rb").read())
    os.unlink(src / "data" / "action" / "2.0")
    os.symlink(outside, src / "data" / "action" / "2.0")
    with open_diffusion_policy(src) as buf:
        np.testing.assert_array_equal(buf[np.arange(32)]["step_data"]["state"], data["state"][:32])
        with pytest.raises(DamagedStoreError, match=r"data/state.*chunk"):
            buf[40]
        with pytest.raises(DamagedStoreError, match=r"data/action"):
            buf[70]
        with pytest.raises(DamagedStoreError):
            buf.sample_sequences(64, 4)


def zip_claiming_2gib(path: Path) -> None:
    """A .zarr.zip (PushT-like, two episodes) at ``path`` whose central directory says the entry
    ``data/state/0.0`` expands to 2**31 - 1 bytes (a deflate bomb's claim)."""
    data, ends = pusht_like(n_eps=2)
    write_dp(path, data, ends)
    raw = bytearray(path.read_bytes())
    name = b"data/state/0.0"
    central = raw.index(b"PK\x01\x02" + bytes(raw[raw.rindex(name) - 46 + 4 : raw.rindex(name)]) + name)
    raw[central + 24 : central + 28] = (2**31 - 1).to_bytes(4, "little")  # uncompressed size
    path.write_bytes(bytes(raw))


def test_zip_entry_claiming_too_much_is_refused(tmp_path: Path) -> None:
    """A .zarr.zip whose central directory says a chunk entry expands to 2 GiB (a deflate bomb's
    claim) is refused at open, before zarr would read the entry whole."""
    src = tmp_path / "d.zarr.zip"
    zip_claiming_2gib(src)
    with pytest.raises(DamagedStoreError, match=r"zip entry 'data/state/0.0' expands to 2147483647 bytes"):
        open_diffusion_policy(src)
