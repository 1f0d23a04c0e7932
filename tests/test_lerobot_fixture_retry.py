"""tests/lerobot_fixture.py encodes each MP4 in a forked child with a time limit and tries again when
an attempt hangs or fails (libsvtav1 deadlocked once in the suite): a hung first attempt is killed
and the second one writes the file."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lerobot_fixture  # noqa: E402

pytest.importorskip("av")


def test_a_hung_attempt_is_killed_and_made_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "first-attempt"
    real = lerobot_fixture._encode_once

    def hang_once(*args: object) -> None:
        if not marker.exists():  # (in the child: the parent sees only the file)
            marker.write_text("x")
            time.sleep(3600)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(lerobot_fixture, "_encode_once", hang_once)
    monkeypatch.setattr(lerobot_fixture, "ENCODE_LIMIT_S", 2.0)
    out = tmp_path / "v.mp4"
    frames = lerobot_fixture.frames_of(0, 6)
    lerobot_fixture._encode(str(out), lambda: [iter(frames)], 10, "h264")
    assert marker.exists() and out.stat().st_size > 0
    assert "hung for 2 s (attempt 1 of 3)" in capfd.readouterr().err
    import av

    with av.open(str(out)) as c:
        got = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    assert got.shape == frames.shape


def test_three_failures_are_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise OSError("no")

    monkeypatch.setattr(lerobot_fixture, "_encode_once", fail)
    with pytest.raises(RuntimeError, match="failed three times"):
        lerobot_fixture._encode(str(tmp_path / "v.mp4"), lambda: [], 10, "h264")
    assert not os.path.exists(tmp_path / "v.mp4")
