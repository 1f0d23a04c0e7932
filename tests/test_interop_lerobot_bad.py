"""Issue 32's bad LeRobot inputs, each through import_lerobot and open_lerobot: missing
meta/info.json, schema/file mismatches (episode lengths, a missing column, a vector of another
length, frames of another size), an MP4 shorter than its episodes claim, timestamps out of order,
hostile path templates and feature names ('..', absolute), a missing data or video file.  Each
raises a specific trajstore error naming the file; nothing is written outside the destination (no
store, no partial folder, the source unchanged)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

pytest.importorskip("av")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from lerobot_fixture import write_v3, write_v21  # noqa: E402

from trajstore.errors import (  # noqa: E402
    ForeignFileError,
    NotATrajstoreError,
    StoreNotFoundError,
    TimeOrderError,
    TrajstoreError,
)
from trajstore.interop import import_lerobot, open_lerobot  # noqa: E402

LENGTHS = [6, 8, 4]
CAM = "observation.images.top"
DATA = "data/chunk-000/file-000.parquet"
MP4 = f"videos/{CAM}/chunk-000/file-000.mp4"


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_v3(str(tmp_path_factory.mktemp("lr") / "v3"), LENGTHS, (CAM,)))


@pytest.fixture(scope="module")
def v21(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_v21(str(tmp_path_factory.mktemp("lr") / "v21"), [4, 5]))


def _snapshot(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def _info(d: Path, **change: Any) -> None:
    info = json.loads((d / "meta/info.json").read_text())
    info.update(change)
    (d / "meta/info.json").write_text(json.dumps(info))


def _feature(d: Path, name: str, **change: Any) -> None:
    info = json.loads((d / "meta/info.json").read_text())
    info["features"][name].update(change)
    (d / "meta/info.json").write_text(json.dumps(info))


def _table(d: Path, key: str, edit: Callable[[Any], Any]) -> None:
    pq.write_table(edit(pq.read_table(d / key)), d / key)


def _set(t: Any, name: str, values: Any) -> Any:
    return t.set_column(t.column_names.index(name), name, values)


def _refused(d: Path, tmp_path: Path, error: type[TrajstoreError], match: str) -> None:
    """import_lerobot and open_lerobot (reading every row) of ``d`` raise ``error`` matching
    ``match``; neither leaves anything in ``tmp_path`` nor changes ``d``."""
    before, outside = _snapshot(d), sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(error, match=match):
        import_lerobot(d, tmp_path / "store")
    with pytest.raises(error, match=match):
        with open_lerobot(d) as b:
            b[:]
    assert _snapshot(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == outside  # no store, no partial folder


def _copy(src: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / "src" / name
    shutil.copytree(src, out)
    return out


def test_missing_info_json(v3: Path, v21: Path, tmp_path: Path) -> None:
    for src in (v3, v21):
        d = _copy(src, tmp_path, src.name)
        (d / "meta/info.json").unlink()
        _refused(d, tmp_path, NotATrajstoreError, rf"{src.name}/meta/info\.json: no such file")


def test_episode_lengths_contradict_the_data_file(v3: Path, tmp_path: Path) -> None:
    d = _copy(v3, tmp_path, "lengths")
    _table(d, "meta/episodes/chunk-000/file-000.parquet",
           lambda t: _set(_set(t, "length", [[6, 9, 4]]), "dataset_to_index", [[6, 15, 18]]))
    _refused(d, tmp_path, ForeignFileError, rf"{DATA}: episode 1 has 8 rows here; meta/episodes gives it 9")


def test_a_feature_missing_from_the_data_file(v3: Path, tmp_path: Path) -> None:
    d = _copy(v3, tmp_path, "column")
    _table(d, DATA, lambda t: t.drop(["action"]))
    _refused(d, tmp_path, ForeignFileError, rf"{DATA}: no column 'action'")


def test_a_vector_of_another_length_than_declared(v3: Path, tmp_path: Path) -> None:
    d = _copy(v3, tmp_path, "shape")
    _feature(d, "observation.state", shape=[4], names=None)  # the file holds 3 values per row
    _refused(d, tmp_path, ForeignFileError, rf"{DATA}: column 'observation.state': [0-9]+ values for [0-9]+ rows of shape \[4\]")


def test_values_of_another_kind_than_declared(v3: Path, tmp_path: Path) -> None:
    d = _copy(v3, tmp_path, "dtype")
    _feature(d, "action", dtype="int64")  # the file holds float32 fractions: casting would truncate them
    _refused(d, tmp_path, ForeignFileError, rf"{DATA}: column 'action': .*float.*int64")


def test_frames_of_another_size_than_declared(v3: Path, tmp_path: Path) -> None:
    d = _copy(v3, tmp_path, "size")
    _feature(d, CAM, shape=[40, 64, 3])  # the MP4's frames are 48x64
    _refused(d, tmp_path, ForeignFileError, rf"{MP4}: frames are 48x64; info.json declares 40x64")


def test_mp4_shorter_than_its_episodes(v3: Path, tmp_path: Path) -> None:
    d = _copy(v3, tmp_path, "short")
    small = Path(write_v3(str(tmp_path / "small"), [6, 4], (CAM,)))  # 10 frames; the episodes claim 18
    shutil.copy(small / MP4, d / MP4)
    shutil.rmtree(small)
    _refused(d, tmp_path, ForeignFileError, rf"{MP4}: .*episode declares")


def test_timestamps_out_of_order(v3: Path, v21: Path, tmp_path: Path) -> None:
    d = _copy(v3, tmp_path, "time")

    def back(t: Any) -> Any:
        ts = t.column("timestamp").to_numpy().copy()
        ts[8] = 0.0  # episode 1, step 2 goes back in time
        return _set(t, "timestamp", pa.array(ts))

    _table(d, DATA, back)
    _refused(d, tmp_path, TimeOrderError, rf"{DATA}: episode 1")
    d = _copy(v21, tmp_path, "time21")
    key = "data/chunk-000/episode_000001.parquet"
    _table(d, key, lambda t: _set(t, "timestamp", pa.array(np.array([0.0, 0.1, 0.3, 0.2, 0.4], np.float32))))
    _refused(d, tmp_path, TimeOrderError, rf"{key}: episode 1")


@pytest.mark.parametrize("field,template", [
    ("video_path", "../../{video_key}.mp4"),
    ("video_path", "videos/{video_key}/../../../{file_index}.mp4"),
    ("video_path", "/tmp/{video_key}/{file_index}.mp4"),
    ("video_path", "videos/{video_key.__class__}.mp4"),
    ("data_path", "../data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"),
    ("data_path", "data/{chunk_index!r}.parquet"),
])
def test_hostile_path_templates(v3: Path, tmp_path: Path, field: str, template: str) -> None:
    d = _copy(v3, tmp_path, "t")
    _info(d, **{field: template})
    _refused(d, tmp_path, ForeignFileError, rf"meta/info\.json: {field} ")


def test_hostile_v21_template(v21: Path, tmp_path: Path) -> None:
    d = _copy(v21, tmp_path, "t21")
    _info(d, data_path="data/../../{episode_index:06d}.parquet")
    _refused(d, tmp_path, ForeignFileError, r"meta/info\.json: data_path ")


def test_a_feature_named_dotdot_is_no_way_out(v3: Path, tmp_path: Path) -> None:
    """video_key renders a feature's name into the path: '..' (or an absolute part) is refused."""
    d = _copy(v3, tmp_path, "dots")
    info = json.loads((d / "meta/info.json").read_text())
    info["features"][".."] = info["features"].pop(CAM)
    (d / "meta/info.json").write_text(json.dumps(info))
    _table(d, "meta/episodes/chunk-000/file-000.parquet",
           lambda t: t.rename_columns([c.replace(CAM, "..") for c in t.column_names]))
    _refused(d, tmp_path, ForeignFileError, r"meta/info\.json: feature name '\.\.'")


def test_missing_data_or_video_file(v3: Path, tmp_path: Path) -> None:
    d = _copy(v3, tmp_path, "nodata")
    (d / DATA).unlink()
    _refused(d, tmp_path, StoreNotFoundError, rf"nodata/{DATA}")
    d = _copy(v3, tmp_path, "novideo")
    (d / MP4).unlink()
    _refused(d, tmp_path, StoreNotFoundError, rf"novideo/{MP4}")
