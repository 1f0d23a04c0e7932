"""A plain zarr-python reader opens an image field through the registration docs/format.md documents
(issue 31): the installed package's ``zarr.codecs`` entry point, in a fresh process that never
imports trajstore itself (zarr loads the codec class the entry point names).  The other route,
``import trajstore.images``, is tests/test_image_fields.py::test_plain_zarr_reader_opens_an_image_field.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box

from trajstore import ReplayBuffer

pytest.importorskip("imagecodecs")

ROOT = str(Path(__file__).resolve().parents[1])


def test_the_zarr_codecs_entry_point_opens_an_image_field_without_importing_trajstore(tmp_path):
    names = {e.name: e.value for e in importlib.metadata.entry_points(group="zarr.codecs")}
    if "trajstore.image" not in names:
        pytest.skip("trajstore is not installed here (pip install -e .): no entry point to test")
    assert names["trajstore.image"] == "trajstore.storage.fields.image_codecs:ImageCodec"
    y, x = np.mgrid[0:24, 0:32]
    frames = np.stack([((x * 7 + y * 3 + i * 11) % 256) for i in range(10)]).astype(np.uint8)
    with ReplayBuffer.create(Box(0, 255, (24, 32), np.uint8), cache_path=str(tmp_path / "s"), capacity=16,
                             compressor="png") as rb:
        rb.extend(frames)
    code = ("import sys, numpy as np, zarr\n"
            f"z = zarr.open_array({str(tmp_path / 's' / 'step_data')!r}, mode='r')\n"
            "np.save(sys.argv[1], z[:10])\n"
            "print(z.metadata.codecs[0].codecs[0].to_dict()['name'])\n")
    out = tmp_path / "plain.npy"
    res = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "trajstore.image"
    assert np.array_equal(np.load(out), frames)  # PNG: exact
