"""Shared helpers and fixtures of the ReplayBuffer tests (test_replay_buffer.py, test_views.py,
test_locations.py, test_errors.py), the suite's hypothesis profiles and its rules for parallel runs.

Values are generated per leaf with a seeded numpy Generator (much faster than
``space.sample()`` for image leaves) and compared leaf by leaf, dtype and backend included.
Every buffer a test opens goes through the ``buffers`` fixture, which closes it at teardown
(also when the test fails), so no writer is left for the garbage collector at exit.

Parallel runs (pytest-xdist).  The README's test command is ``python -m pytest -q -n auto
--dist loadfile`` (.ci/run runs exactly that): worker processes (see "Workers" below), each test file sent
whole to whichever worker is free and run there in file order.  ``python -m pytest -p no:xdist`` (or without ``-n``) runs the same
tests serially and must pass as well.  Every test must therefore hold when any other test runs at
the same time in another process, in any order:

- files only under ``tmp_path`` / ``tmp_path_factory`` (each worker has its own base temp folder)
  or ``tempfile.mkdtemp()``; never a fixed path, the working directory (``monkeypatch.chdir``
  only) or a file shared between tests;
- servers on port 0 (the OS picks a free one: test_remote.py's moto server), never a fixed port;
- environment variables through ``monkeypatch.setenv`` (a worker runs many tests in turn);
- no assertion on wall-clock time: a worker shares the cores with the others;
- a session- or module-scoped fixture is built once per worker that runs a test using it
  (``-n 2``: at most twice), so it must not assume it is the only one on the machine.

Tests that must run in one process together live in one file.  Today: tests/test_docs.py (the
sections of a docs page are a walkthrough in one folder, and its second lane runs every section
this process collected), tests/test_kill_loops.py (test_total_kills adds up the kills of the tests
before it) and tests/test_ray.py (one local Ray cluster for the module).  A test that checks what
other tests did (a total, a count) comes after them in their file.  (``--dist loadgroup`` with
``xdist_group`` marks would let a file's tests spread where no such reason holds, but with
pytest 9.2 and pytest-xdist 3.8 it does not group: xdist's rewrite of the node ids does not take,
and marked tests went to both workers.  Check before switching.)

Workers: ``-n auto`` starts one worker per CPU this process may use, plus one on machines of up
to 4 CPUs (``pytest_xdist_auto_num_workers`` below).  Many tests wait on other processes (the kill
loops sleep before each SIGKILL, readers wait for writers, docs sections wait on subprocesses): with
one worker per CPU, a quiet 2-core run kept its cores busy 79% of the time (12 min 36 s wall for
19 min 44 s of CPU); the extra worker fills those waits.

In a worker, torch uses one thread (``torch.set_num_threads(1)``): the workers already fill the
cores, and two threads per process on busy cores made small networks several times slower.

Hypothesis: the profile ``ci`` (loaded by default) is derandomized (fixed seeds: every run draws
the same examples) with no example database and no deadline; each test keeps its own example
budget.  ``python -m pytest tests/test_model.py --hypothesis-profile=long`` explores instead:
random seeds, at least 1,000 examples per state machine, 50 steps each, and failures kept in
``.hypothesis/`` to replay first on the next run.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import fsspec
import numpy as np
import pytest
import torch
from gymnasium.spaces import Box, Dict, Discrete, MultiBinary, MultiDiscrete, Tuple
from hypothesis import HealthCheck, settings

from trajstore import ReplayBuffer

# ---------------------------------------------------------------------------- run settings

_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=False,
                          suppress_health_check=_HEALTH)
settings.register_profile("long", derandomize=False, max_examples=1000, stateful_step_count=50, deadline=None,
                          print_blob=True, suppress_health_check=_HEALTH)
settings.load_profile("ci")  # --hypothesis-profile=long loads the other one after this module

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# ---------------------------------------------------------------------------- spaces


def box_space() -> Box:
    return Box(-1.0, 1.0, (3, 5, 2), np.float32)


def mixed_dict_space() -> Dict:
    """The issue's Dict: an image, a vector, a Discrete and a MultiBinary leaf."""
    return Dict([
        ("img", Box(0, 255, (84, 84, 4), np.uint8)),
        ("vec", Box(-np.inf, np.inf, (17,), np.float32)),
        ("act", Discrete(5)),
        ("mb", MultiBinary(6)),
    ])


def tuple_space() -> Tuple:
    return Tuple((Box(-2.0, 2.0, (2,), np.float32), Discrete(3, start=-1), MultiBinary((2, 2))))


def nested_space() -> Dict:
    """Dict in Dict, a Tuple inside, a scalar Box and a MultiDiscrete; keys deliberately unsorted."""
    return Dict([
        ("obs", Dict([("pos", Box(-5.0, 5.0, (3,), np.float64)), ("cam", Box(0, 255, (4, 4, 3), np.uint8))])),
        ("act", Discrete(4, start=-2)),
        ("extra", Tuple((Box(-1.0, 1.0, (), np.float32), MultiDiscrete([2, 3])))),
    ])


SPACES: dict[str, Callable[[], Any]] = {
    "box": box_space,
    "dict": mixed_dict_space,
    "tuple": tuple_space,
    "nested": nested_space,
}

# ---------------------------------------------------------------------------- values


def random_batch(space: Any, n: int, rng: np.random.Generator) -> Any:
    """``n`` random values of ``space`` as one batch (leading axis n on every leaf)."""
    if isinstance(space, Dict):
        return {k: random_batch(s, n, rng) for k, s in space.spaces.items()}
    if isinstance(space, Tuple):
        return tuple(random_batch(s, n, rng) for s in space.spaces)
    if isinstance(space, Discrete):
        return (space.start + rng.integers(0, space.n, size=n)).astype(space.dtype)
    if isinstance(space, MultiBinary):
        return rng.integers(0, 2, size=(n, *space.shape)).astype(space.dtype)
    if isinstance(space, MultiDiscrete):
        return (space.start + rng.integers(0, space.nvec, size=(n, *space.shape))).astype(space.dtype)
    assert isinstance(space, Box)
    if np.issubdtype(space.dtype, np.integer):
        info = np.iinfo(space.dtype)
        lo, hi = np.maximum(space.low, info.min), np.minimum(space.high, info.max)
        return rng.integers(lo, hi, size=(n, *space.shape), endpoint=True).astype(space.dtype)
    return rng.uniform(-1.0, 1.0, size=(n, *space.shape)).astype(space.dtype)


def random_rows(space: Any, n: int, seed: int | np.random.Generator) -> list[Any]:
    """``n`` random unbatched values of ``space``."""
    batch = random_batch(space, n, np.random.default_rng(seed))
    return [take(batch, i) for i in range(n)]


def take(batch: Any, idx: Any) -> Any:
    """``batch[idx]`` on every leaf."""
    if isinstance(batch, Mapping):
        return {k: take(v, idx) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(take(v, idx) for v in batch)
    return np.asarray(batch)[idx]


def stack(values: list[Any]) -> Any:
    """Unbatched values → one batch."""
    first = values[0]
    if isinstance(first, Mapping):
        return {k: stack([v[k] for v in values]) for k in first}
    if isinstance(first, tuple):
        return tuple(stack([v[i] for v in values]) for i in range(len(first)))
    return np.stack([np.asarray(v) for v in values])


def empty_batch(space: Any) -> Any:
    """A batch of 0 values of ``space``."""
    return random_batch(space, 0, np.random.default_rng(0))


def to_torch(value: Any) -> Any:
    """A nested numpy value as torch tensors (torch input to extend/append)."""
    if isinstance(value, Mapping):
        return {k: to_torch(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(to_torch(v) for v in value)
    return torch.from_numpy(np.array(value))


def leaf_items(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(leaf path, leaf value)`` pairs of a nested value: "obs/pos", "extra/0", "" for a root leaf."""
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in leaf_items(v, f"{prefix}/{k}" if prefix else str(k))]
    if isinstance(value, tuple):
        return [p for i, v in enumerate(value) for p in leaf_items(v, f"{prefix}/{i}" if prefix else str(i))]
    return [(prefix, value)]


def as_numpy(value: Any) -> Any:
    """A value read with any backend, as numpy."""
    if isinstance(value, Mapping):
        return {k: as_numpy(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(as_numpy(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.numpy()
    return value


def assert_same(got: Any, expected: Any, backend: str = "numpy", where: str = "value") -> None:
    """``got`` (read from a buffer) has the structure of ``expected`` (numpy) and equal leaves,
    each of the expected dtype and shape and of the backend's type (torch: a CPU tensor)."""
    if isinstance(expected, Mapping):
        assert isinstance(got, dict), f"{where}: expected a dict, got {type(got).__name__}"
        assert list(got) == list(expected), f"{where}: keys {list(got)} != {list(expected)}"
        for k in expected:
            assert_same(got[k], expected[k], backend, f"{where}[{k!r}]")
        return
    if isinstance(expected, tuple):
        assert isinstance(got, tuple), f"{where}: expected a tuple, got {type(got).__name__}"
        assert len(got) == len(expected), f"{where}: length {len(got)} != {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, backend, f"{where}[{i}]")
        return
    exp = np.asarray(expected)
    if backend == "torch":
        assert isinstance(got, torch.Tensor), f"{where}: expected a torch.Tensor, got {type(got).__name__}"
        want = torch.from_numpy(np.array(exp))
        assert got.device.type == "cpu", f"{where}: device {got.device}"
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert tuple(got.shape) == exp.shape, f"{where}: shape {tuple(got.shape)} != {exp.shape}"
        assert torch.equal(got, want), f"{where}: values differ"
        return
    # A scalar leaf (Discrete, shape-() Box) may come back as a numpy scalar, as space.sample() gives.
    scalar_ok = exp.shape == () and isinstance(got, np.generic)
    assert isinstance(got, np.ndarray) or scalar_ok, f"{where}: expected a numpy array, got {type(got).__name__}"
    assert got.dtype == exp.dtype, f"{where}: dtype {got.dtype} != {exp.dtype}"
    assert got.shape == exp.shape, f"{where}: shape {got.shape} != {exp.shape}"
    np.testing.assert_array_equal(got, exp, err_msg=where)


def ring_model(rows: list[Any], new: list[Any], capacity: int | None) -> list[Any]:
    """What a buffer holds after extending ``rows`` by ``new`` (UniEnv's ring rules)."""
    out = rows + list(new)
    return out if capacity is None else out[-capacity:]


# ---------------------------------------------------------------------------- files


def snapshot(root: str | os.PathLike[str]) -> dict[str, tuple[Any, ...]]:
    """Every file (path, size, mtime_ns, sha1) and folder (path, mtime_ns) under ``root``.

    Folder mtimes change when an entry is created or removed, so a temp file created and
    renamed away still shows up.
    """
    root = Path(root)
    out: dict[str, tuple[Any, ...]] = {}
    if root.is_file():
        st = root.stat()
        return {".": (st.st_size, st.st_mtime_ns, hashlib.sha1(root.read_bytes()).hexdigest())}
    for dirpath, dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        out[rel + "/"] = (os.stat(dirpath).st_mtime_ns,)
        for name in files:
            p = Path(dirpath, name)
            st = p.stat()
            out[os.path.join(rel, name)] = (st.st_size, st.st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest())
    return out


def changed(before: dict[str, tuple[Any, ...]], after: dict[str, tuple[Any, ...]], files_only: bool = True) -> set[str]:
    """Entries created, removed or modified between two snapshots (normalized, without "./")."""
    keys = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    if files_only:
        keys = {k for k in keys if not k.endswith("/")}
    return {os.path.normpath(k) for k in keys}


# ---------------------------------------------------------------------------- layouts and fixtures

#: Storage layouts the behaviour tests run on: memory-mapped raw chunks on a local folder,
#: lz4 chunks of 4 rows (chunk edges inside a ring of 10) through zarr, and an in-memory store.
LAYOUTS = {
    "raw": dict(local=True),
    "lz4": dict(local=True, compressor="lz4", chunk_rows=4),
    "memory": dict(local=False),
}


class Buffers:
    """Creates and opens buffers for one test and closes them all at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.opened: list[ReplayBuffer] = []
        self.mem_urls: list[str] = []
        self._n = 0

    def path(self, name: str | None = None) -> Path:
        """A fresh path under tmp_path (nothing is created there)."""
        self._n += 1
        return self.tmp_path / (name or f"store{self._n}")

    def memory_url(self) -> str:
        url = f"memory://trajstore-tests/{uuid.uuid4().hex}"
        self.mem_urls.append(url)
        return url

    def track(self, rb: ReplayBuffer) -> ReplayBuffer:
        self.opened.append(rb)
        return rb

    def create(self, space: Any, layout: str = "raw", **kwargs: Any) -> ReplayBuffer:
        """``ReplayBuffer.create`` in ``layout`` (see LAYOUTS); ``kwargs`` override."""
        opts = dict(LAYOUTS[layout])
        local = opts.pop("local")
        opts.setdefault("cache_path", self.path() if local else None)
        opts.update(kwargs)
        return self.track(ReplayBuffer.create(space, **opts))

    def load(self, path: Any, **kwargs: Any) -> ReplayBuffer:
        return self.track(ReplayBuffer.load_from(path, **kwargs))

    def close_all(self) -> None:
        for rb in reversed(self.opened):
            try:
                rb.close()
            except Exception:
                pass
        fs = fsspec.filesystem("memory")
        for url in self.mem_urls:
            try:
                fs.rm(url, recursive=True)
            except FileNotFoundError:
                pass


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Workers for ``-n auto``: the CPUs this process may use, plus one up to 4 CPUs (see above)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus + 1 if cpus <= 4 else cpus


@pytest.fixture
def buffers(tmp_path: Path):
    b = Buffers(tmp_path)
    try:
        yield b
    finally:
        b.close_all()


@pytest.fixture
def procs():
    """Children started by a test; any still alive at teardown are SIGKILLed."""
    started: list = []
    yield started
    for p in started:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(10)


@pytest.fixture(autouse=True, scope="session")
def _sb3_log_folder(tmp_path_factory: pytest.TempPathFactory):
    """SB3's logger makes a folder per ``learn`` (``/tmp/SB3-<time>``) unless ``SB3_LOGDIR`` names one:
    point it (and every child process, which inherits the environment) at this run's temp folder."""
    old = os.environ.get("SB3_LOGDIR")
    os.environ["SB3_LOGDIR"] = str(tmp_path_factory.mktemp("sb3_logs"))
    yield
    if old is None:
        os.environ.pop("SB3_LOGDIR", None)
    else:
        os.environ["SB3_LOGDIR"] = old


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Any:
    """``mount(mib)``: a tmpfs of that many MiB under ``tmp_path`` (root only: the test is skipped
    otherwise), unmounted at teardown; for tests of a really full disk."""
    mounted: list[Path] = []

    def mount(mib: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        mnt = tmp_path / f"fs{len(mounted)}"
        mnt.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(mnt)], capture_output=True,
                             text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip() or res.returncode}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
