"""Exports to foreign formats killed with SIGKILL at random instants (export_d4rl, export_diffusion_policy;
export_lerobot's is in test_interop_lerobot.py, export_minari's in test_interop_minari.py): with
``overwrite=True`` the destination is always a whole export, the one before or the new one, that
the matching import reads back, and a later export completes and leaves no partial file or folder.
Real exports in a child process, real SIGKILLs; nothing in the package has a test hook.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

pytest.importorskip("h5py")
sys.path.insert(0, str(Path(__file__).parent))
from test_interop_d4rl import write_d4rl  # noqa: E402

from trajstore.interop import export_d4rl, export_diffusion_policy, import_d4rl, import_diffusion_policy  # noqa: E402

_PROGRAM = """
import sys
from trajstore import interop
open(sys.argv[4], "w").close()
getattr(interop, "export_" + sys.argv[1])(sys.argv[2], sys.argv[3], overwrite=True)
"""

#: format -> (its export, its import, the destination's name)
FORMATS: dict[str, tuple[Callable[..., Any], Callable[..., Any], str]] = {
    "d4rl": (export_d4rl, import_d4rl, "out.hdf5"),
    "diffusion_policy": (export_diffusion_policy, import_diffusion_policy, "out.zarr"),
}


def _steps(fmt: str, dst: Path, scratch: Path) -> int:
    """The steps of the export at ``dst``, read back by the format's own import."""
    with FORMATS[fmt][1](dst, scratch, overwrite=True) as back:
        return len(back)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_export_killed_at_random_instants_leaves_the_old_or_the_new(fmt: str, tmp_path: Path) -> None:
    sizes = (150_000, 100_000)  # two sources told apart by their length
    sources = []
    for i, n in enumerate(sizes):
        write_d4rl(tmp_path / f"src{i}.hdf5", n, seed=i, next_obs=False)
        import_d4rl(tmp_path / f"src{i}.hdf5", tmp_path / f"s{i}").close()
        sources.append(tmp_path / f"s{i}")
    export, _, name = FORMATS[fmt]
    dst = tmp_path / name
    export(sources[0], dst)
    before = _steps(fmt, dst, tmp_path / "back")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    rng = np.random.default_rng(9)
    took, killed, kept = None, 0, 0
    for r in range(8):
        src = sources[(r + 1) % 2]
        ready = tmp_path / f"ready{r}"
        child = subprocess.Popen([sys.executable, "-c", _PROGRAM, fmt, str(src), str(dst), str(ready)], env=env)
        try:
            deadline = time.monotonic() + 120
            while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            t0 = time.monotonic()
            if took is None:  # the first round runs to its end: how long an export takes
                child.wait(120)
                took = time.monotonic() - t0
            time.sleep(rng.uniform(0.05, 1.0) * took)
            killed += child.poll() is None
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            child.kill()
            child.wait()
        now = _steps(fmt, dst, tmp_path / "back")
        assert now in (before, sizes[(r + 1) % 2]), (r, now, before)
        kept += now == before
        before = now
    assert killed >= 3 and kept, (killed, kept)  # kills before the publish left the export before
    export(sources[1], dst, overwrite=True)
    assert _steps(fmt, dst, tmp_path / "back") == sizes[1]
    assert not [p.name for p in tmp_path.iterdir() if ".trajstore-" in p.name]
