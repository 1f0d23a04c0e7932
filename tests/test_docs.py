"""Every fenced Python and shell block of README.md and docs/*.md runs (issue 13: "every documented
example runs", so a documented example can never drift from the code again).

What runs: ```python / ```py blocks and ```bash / ```sh / ```shell / ```console blocks. A line of
a shell block is a command (a trailing backslash continues it; ``#`` comments are bash's); in a
console block only the ``$ `` lines are commands, the others are sample output and are not
compared (it holds timestamps, paths and sizes). Other fences (```text, ```json, plain ```) are
listings and do not run; format.md's JSON examples are compared with a real store by
test_format_json_matches_a_real_store instead.

Sections: the runnable blocks under one heading (any level, up to the next heading) are one test,
``<file>::<heading>``. They run in document order in one fresh interpreter (a subprocess with a
timeout): the Python blocks share one namespace, and each shell command runs through
``bash -o pipefail -c`` from that interpreter, with this venv's ``bin`` first on PATH (so
``trajstore`` and ``python`` are the venv's) and stdin closed. Sections run with
``OMP_NUM_THREADS=1``: the examples' small torch networks gain nothing from a second thread, and on
busy shared cores two threads per process slowed SAC's training steps 7x (230 against 33 ms). No section sees another's Python
names, so each section's imports are complete as a reader would paste them. Working directory:

- README.md: a fresh tmp dir per section (a reader jumps to any section);
- a docs/ page: one tmp dir per page, its sections in document order, because a page is a
  walkthrough (offline.md records ``data/pendulum`` once and later sections read it; sb3.md's
  "Resuming a run" reopens the model the section above saved). Selecting one section (``-k``) first
  runs the sections above it on its page.

Blocks are compiled with their file name and line numbers, so a traceback points at the doc line;
a failing shell command is reported as ``<file>:<line>`` with its exit status and output. Any
exception or non-zero exit fails the section, and so does a section of ``EXPECTED_OUTPUT`` that does
not print what it names (sb3.md's resumed SAC run reports the 300 transitions the run above saved).
docs/sb3.md runs here only (tests/test_sb3_training.py ran it a second time, uncapped, in one process).

Substitutions (the only changes made to documented code before it runs):

1. ``.learn(N`` with N > 300 becomes ``.learn(300`` (SAC still passes its 100 learning_starts
   and trains); the README's SAC example states how long the full ``learn(10_000)`` takes.
2. README's setup commands ``python3 -m venv .venv && .venv/bin/pip install ... [&& REST]``: the
   venv and install steps are not run (they build the environment this suite runs in; CI runs
   exactly these commands); REST runs, with ``.venv/bin/`` meaning this venv, unless it runs pytest
   (that is this suite).
3. ``python -m pytest ARGS`` (it would rerun tests of this very suite) runs as
   ``python -m pytest --collect-only -q ARGS`` from the repository root: the named tests exist and
   import.
4. ``python scripts/X.py``: the repository's script, run from the section's tmp dir, with
   ``--quick`` when the script has that option, plus SCRIPT_ARGS (ring_fullness.py: ``--seconds 1``).
5. ``s3://``: a moto S3 server on 127.0.0.1 (one per test session) stands in for S3. Every
   section runs with dummy ``AWS_*`` credentials and its own AWS config files (the real ones are
   never read), which define the profile ``lab`` (cli.md's ``--dst-options '{"profile": "lab"}'``);
   a section that mentions ``s3://`` or ``https://s3.example.org`` also gets
   ``FSSPEC_S3_ENDPOINT_URL`` and ``AWS_ENDPOINT_URL`` pointing at the server, and the example
   endpoint ``https://s3.example.org`` of docs/offline.md is replaced by the server's URL. Bucket
   ``bucket`` exists, allows anonymous reads (README's ``--storage-options '{"anon": true}'``) and
   holds ``s3://bucket/buf``, a ``trajstore demo`` store (the store README's ``trajstore info``
   inspects).
6. ``Client("tcp://scheduler:8786")`` (docs/offline.md, a cluster's scheduler) becomes
   ``Client(n_workers=2, threads_per_worker=1, dashboard_address=None)``: a local cluster of two
   worker processes.

Two lanes: the tests run in document order, and meanwhile a background thread runs the selected
sections from the last one backwards (a README section or a whole docs/ page at a time, whichever
lane reaches it first; the other waits for its result), until the lanes meet. Each section is one
subprocess, so on 2 cores both run at once (this module's time about halves). Sections that use the
moto S3 server (substitution 5) and the pages holding one run in the foreground lane only: their
buckets and keys are shared.

A block is skipped only with a marker on the line right before its fence that says why:
``<!-- docs-test: skip (reason) -->``. No block has one today.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
LEARN_STEPS = 300
TIMEOUT_S = 300
SCRIPT_ARGS = {"ring_fullness.py": ["--seconds", "1"]}  # 4 s per capacity by default, no --quick
EXAMPLE_ENDPOINT = "https://s3.example.org"
SCHEDULER = 'Client("tcp://scheduler:8786")'
LOCAL_CLUSTER = "Client(n_workers=2, threads_per_worker=1, dashboard_address=None)"
# sections that train or took more than ~15 s (on 2 shared cores); checked to exist. A docs/ page's
# sections below a slow one are slow too (run alone, they run it first).
SLOW_SECTIONS = {
    ("README.md", "stable-baselines3"),
    ("README.md", "Command line"),  # a dozen CLI processes and the moto server's seed store
    ("docs/reliability.md", "Reproduce"),  # collects five test modules, runs scripts/ring_fullness.py
    ("docs/sb3.md", "Off-policy: SAC, TD3, DDPG, DQN"),
    ("docs/sb3.md", "Resuming a run"),
    ("docs/sb3.md", "On-policy: PPO and A2C"),
    ("docs/sb3.md", "PPO's experience as an offline dataset"),
    ("docs/scale.md", "Ray"),  # a local Ray cluster starts three times (10-20 s each)
}

# output a section must print (its run passes only then): what a reader is told it shows
EXPECTED_OUTPUT = {
    ("docs/sb3.md", "Resuming a run"): "resuming with 300 transitions",  # the SAC run above saved 300
}

PYTHON_LANGS = {"python", "py"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
_HEADING = re.compile(r"^#{1,6}\s+(.*\S)\s*$")
_FENCE = re.compile(r"^```(\S*)\s*$")
_SKIP = re.compile(r"^<!--\s*docs-test:\s*skip\s*\((.*\S.*)\)\s*-->\s*$")
_MARKER = re.compile(r"docs-test")
_LEARN = re.compile(r"\.learn\(\s*([0-9_]+)")
_SETUP = re.compile(r"^python3 -m venv \.venv && \.venv/bin/pip install [^&]*(?:&& (.*))?$", re.S)
_PYTEST = re.compile(r"^(\S*python3?) -m pytest\b(.*)$", re.S)
_SCRIPT = re.compile(r"(?<![\w/.])scripts/([\w-]+\.py)\b")


@dataclass(frozen=True)
class Step:
    """One Python block or one shell command of a doc, at its first line."""

    kind: str  # "python" | "shell"
    line: int
    code: str
    skip: str | None = None  # the reason given by a docs-test skip marker
    cwd: str | None = None  # shell only: where it runs (None: the section's tmp dir)


def _shell_commands(lang: str, body: list[str], first: int) -> list[tuple[int, str]]:
    """(line, command) of a shell block: console blocks keep only ``$ `` lines; a trailing
    backslash joins the next line."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for k, raw in enumerate(body):
        line = first + k
        if pending is not None:
            start, text = pending
            text += "\n" + raw
        elif lang == "console":
            if not raw.startswith("$ "):
                continue
            start, text = line, raw[2:]
        else:
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            start, text = line, raw
        if text.endswith("\\"):
            pending = (start, text)
        else:
            pending = None
            out.append((start, text))
    if pending is not None:
        out.append(pending)
    return out


def doc_sections(text: str, name: str = "README.md") -> dict[str, list[Step]]:
    """Heading -> its runnable steps in document order (headings without any are left out)."""
    sections: dict[str, list[Step]] = {}
    seen: set[str] = set()
    heading = "(top)"
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence:
            lang, fence_line, body = fence.group(1).lower(), i + 1, []
            skip = None
            if i > 0 and _MARKER.search(lines[i - 1]):
                m = _SKIP.match(lines[i - 1].strip())
                assert m, (f"{name}:{i}: malformed docs-test marker {lines[i - 1]!r} "
                           "(write <!-- docs-test: skip (reason) -->)")
                skip = m.group(1)
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            assert i < len(lines), f"{name}:{fence_line}: unclosed code fence"
            if lang in PYTHON_LANGS:
                sections.setdefault(heading, []).append(
                    Step("python", fence_line + 1, "\n".join(body) + "\n", skip))
            elif lang in SHELL_LANGS:
                for line, cmd in _shell_commands(lang, body, fence_line + 1):
                    sections.setdefault(heading, []).append(Step("shell", line, cmd, skip))
        else:
            m = _HEADING.match(lines[i])
            if m:
                heading, k = m.group(1), 2
                while heading in seen:  # a repeated heading gets its own test id: "Usage (2)"
                    heading, k = f"{m.group(1)} ({k})", k + 1
                seen.add(heading)
        i += 1
    return sections


SECTIONS = {doc: doc_sections((ROOT / doc).read_text(encoding="utf-8"), doc) for doc in DOCS}


def substitute_python(code: str, endpoint: str | None = None) -> str:
    """Substitutions 1, 5 and 6 of the module docstring."""
    code = _LEARN.sub(lambda m: f".learn({min(int(m.group(1).replace('_', '')), LEARN_STEPS)}", code)
    if endpoint is not None:
        code = code.replace(EXAMPLE_ENDPOINT, endpoint)
    return code.replace(SCHEDULER, LOCAL_CLUSTER)


def _script_has_quick(name: str) -> bool:
    path = ROOT / "scripts" / name
    return path.is_file() and "--quick" in path.read_text(encoding="utf-8")


def substitute_shell(cmd: str) -> tuple[str | None, str | None, str]:
    """Substitutions 2-4: (command or None when nothing is left to run, cwd or None, why)."""
    setup = _SETUP.match(cmd)
    why = ""
    if setup:
        why = "the venv and pip install steps build the environment this suite runs in (CI runs them)"
        if setup.group(1) is None or _PYTEST.match(setup.group(1).replace(".venv/bin/", "")):
            return None, None, why + ("" if setup.group(1) is None else "; the rest is this test suite")
        cmd = setup.group(1).replace(".venv/bin/", f"{VENV_BIN}/")
    test = _PYTEST.match(cmd)
    if test:
        return f"{test.group(1)} -m pytest --collect-only -q{test.group(2)}", str(ROOT), why
    script = _SCRIPT.search(cmd)
    if script:
        name = script.group(1)
        extra = (["--quick"] if _script_has_quick(name) else []) + SCRIPT_ARGS.get(name, [])
        cmd = _SCRIPT.sub(lambda m: str(ROOT / "scripts" / m.group(1)), cmd)
        cmd += "".join(" " + shlex.quote(a) for a in extra)
    return cmd, None, why


def _uses_s3(steps: list[Step]) -> bool:
    return any("s3://" in s.code or EXAMPLE_ENDPOINT in s.code for s in steps)


_RUNNER = r'''
import json, subprocess, sys


def main() -> None:
    doc, steps = json.load(open(sys.argv[1]))
    ns = {"__name__": "__main__"}
    for kind, line, code, cwd in steps:
        if kind == "python":
            # pad so the doc's line numbers appear in tracebacks
            exec(compile("\n" * (line - 1) + code, doc, "exec"), ns)
            continue
        sys.stdout.flush()
        print(f"{doc}:{line}: $ {code}", flush=True)
        proc = subprocess.run(["bash", "-o", "pipefail", "-c", code], cwd=cwd, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        if proc.returncode != 0:
            sys.exit(f"{doc}:{line}: command exited {proc.returncode}: {code}")


if __name__ == "__main__":  # not when a spawned worker (DataLoader, dask) re-imports this file
    main()
'''


def run_steps(doc: str, steps: list[Step], cwd: Path, env: dict[str, str] | None = None,
              timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run the steps in order in one fresh interpreter whose working directory is cwd."""
    (cwd / "_doc_steps.json").write_text(json.dumps([doc, [[s.kind, s.line, s.code, s.cwd] for s in steps]]))
    (cwd / "_doc_run.py").write_text(_RUNNER)
    return subprocess.run([sys.executable, "_doc_run.py", "_doc_steps.json"], check=False, cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


class DocS3:
    """The S3 of substitution 5: scripts/bench_core.py's moto server on 127.0.0.1 with the bucket
    ``bucket``, readable anonymously, holding a demo store at ``s3://bucket/buf``."""

    def __init__(self, home: Path) -> None:
        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_core import MotoS3

        self.moto = MotoS3(bucket="bucket")
        self.endpoint = self.moto.endpoint
        # anonymous GET/HEAD/LIST (moto checks s3:HeadObject for HEAD, where AWS checks GetObject)
        self.moto.client.put_bucket_policy(Bucket="bucket", Policy=json.dumps({"Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Principal": "*",
            "Action": ["s3:GetObject", "s3:HeadObject", "s3:ListBucket"],
            "Resource": ["arn:aws:s3:::bucket", "arn:aws:s3:::bucket/*"]}]}))
        env = doc_env(home, self.endpoint)
        for cmd in (["trajstore", "demo", str(home / "seed"), "--episodes", "2"],
                    ["trajstore", "copy", str(home / "seed"), "s3://bucket/buf"]):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, f"seeding s3://bucket/buf: {cmd} failed:\n{proc.stderr}"


def doc_env(home: Path, endpoint: str | None) -> dict[str, str]:
    """The environment of a section: the venv first on PATH, AWS settings of substitution 5."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    creds = "aws_access_key_id = testing\naws_secret_access_key = testing\n"
    (home / "aws_config").write_text("[default]\nregion = us-east-1\n[profile lab]\nregion = us-east-1\n")
    (home / "aws_credentials").write_text(f"[default]\n{creds}[lab]\n{creds}")
    env.update(AWS_CONFIG_FILE=str(home / "aws_config"), AWS_SHARED_CREDENTIALS_FILE=str(home / "aws_credentials"),
               AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    if endpoint is not None:
        env.update(FSSPEC_S3_ENDPOINT_URL=endpoint, AWS_ENDPOINT_URL=endpoint)
    return env


# Module scope, not session: the server's threads must be gone before later test modules fork
# (tests/test_hostile.py forks the test process; a child that inherits a lock a server thread held
# at the fork hangs).
@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocS3]:
    pytest.importorskip("moto.server", reason="needs moto[server] (the test extra)")
    pytest.importorskip("s3fs", reason="needs s3fs (the test extra)")
    s3 = DocS3(tmp_path_factory.mktemp("moto"))
    try:
        yield s3
    finally:
        s3.moto.stop()


@dataclass
class Page:
    """A docs/ page run as a walkthrough (one folder, sections in document order), or one README
    section (a folder of its own). The lane that holds ``lock`` runs its sections."""

    cwd: Path
    results: dict[str, str | None]  # heading -> None (passed) or why it failed
    lock: threading.Lock = field(default_factory=threading.Lock)


def _page_key(doc: str, heading: str) -> str:
    return f"{doc}::{heading}" if doc == "README.md" else doc


_PAGES_LOCK = threading.Lock()  # guards the pages dict itself (both lanes add pages)


def _page(pages: dict[str, Page], doc: str, heading: str, base: Path) -> Page:
    with _PAGES_LOCK:
        key = _page_key(doc, heading)
        if key not in pages:
            stem = "readme" if doc == "README.md" else Path(doc).stem
            pages[key] = Page(Path(tempfile.mkdtemp(prefix=f"{stem}-", dir=base)), {})
        return pages[key]


def _run_through(doc: str, heading: str, page: Page, request: pytest.FixtureRequest | None) -> list[str]:
    """With ``page.lock`` held: run the page's sections above ``heading`` (a docs/ page) and
    ``heading`` itself, each unless a lane ran it already; returns the headings above that failed."""
    earlier = []
    if doc != "README.md":
        for h in SECTIONS[doc]:
            if h == heading:
                break
            if h not in page.results:
                page.results[h] = _run_section(doc, h, page.cwd, request)
            if page.results[h] is not None:
                earlier.append(h)
    if heading not in page.results:
        page.results[heading] = _run_section(doc, heading, page.cwd, request)
    return earlier


@pytest.fixture(scope="session")
def pages() -> dict[str, Page]:
    return {}


def _selected(session: pytest.Session) -> list[tuple[str, str]]:
    """(doc, heading) of this session's test_doc_section_runs items, in run order."""
    out = []
    for item in session.items:
        spec = getattr(item, "callspec", None)
        if getattr(item, "originalname", None) == "test_doc_section_runs" and spec is not None:
            out.append((spec.params["doc"], spec.params["heading"]))
    return out


def _background(pages: dict[str, Page], todo: list[tuple[str, str]], base: Path, stop: threading.Event) -> None:
    """The second lane: ``todo`` from its end, each page's selected sections; stops where the
    foreground lane holds a page (everything before it is done or being done there)."""
    for doc, heading in reversed(todo):
        if stop.is_set():
            return
        page = _page(pages, doc, heading, base)
        if not page.lock.acquire(blocking=False):
            return
        try:
            _run_through(doc, heading, page, None)
        finally:
            page.lock.release()


@pytest.fixture(scope="module")
def _second_lane(request: pytest.FixtureRequest, pages: dict[str, Page],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Starts the background lane over the selected sections it may run (none on a page or in a
    README section that uses S3); joins it at the end of the module."""
    selected = _selected(request.session)
    s3_pages = {_page_key(d, h) for d, h in selected
                if any(_uses_s3(SECTIONS[d][x]) for x in (SECTIONS[d] if d != "README.md" else [h]))}
    todo = [(d, h) for d, h in selected if _page_key(d, h) not in s3_pages]
    stop = threading.Event()
    lane = threading.Thread(target=_background, args=(pages, todo, tmp_path_factory.getbasetemp(), stop),
                            name="docs-second-lane", daemon=True)
    if len(selected) > 1:
        lane.start()
    yield
    stop.set()  # after a failure with -x: finish the running section only
    if lane.is_alive():
        lane.join(TIMEOUT_S + 60)


def _prepare(doc: str, steps: list[Step], endpoint: str | None) -> tuple[list[Step], list[str]]:
    """The steps as they run (substituted, skipped ones left out) and a note for each left out."""
    out: list[Step] = []
    notes: list[str] = []
    for s in steps:
        if s.skip is not None:
            notes.append(f"{doc}:{s.line}: skipped by its marker: {s.skip}")
            continue
        if s.kind == "python":
            out.append(replace(s, code=substitute_python(s.code, endpoint)))
            continue
        cmd, cwd, why = substitute_shell(s.code)
        if cmd is None:
            notes.append(f"{doc}:{s.line}: not run: {why}")
        else:
            out.append(replace(s, code=cmd, cwd=cwd))
    return out, notes


def _run_section(doc: str, heading: str, cwd: Path, request: pytest.FixtureRequest | None) -> str | None:
    """Run one section in cwd; None when it passed, else the failure (naming the doc line).
    ``request`` gives the moto server to a section that uses S3 (the background lane has none and
    never runs one)."""
    steps = SECTIONS[doc][heading]
    endpoint = None
    if _uses_s3(steps):
        assert request is not None, f"{doc}::{heading} uses S3: the foreground lane runs it"
        endpoint = request.getfixturevalue("moto_s3").endpoint
    run, _notes = _prepare(doc, steps, endpoint)
    if not run:
        return None
    home = cwd.parent / f"{cwd.name}-env"
    home.mkdir(exist_ok=True)
    try:
        proc = run_steps(doc, run, cwd, doc_env(home, endpoint))
    except subprocess.TimeoutExpired as e:
        return f"{doc} section {heading!r} did not finish within {TIMEOUT_S} s\n{e.stderr or ''}"
    if proc.returncode != 0:
        return (f"{doc} section {heading!r} failed (exit {proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    expected = EXPECTED_OUTPUT.get((doc, heading))
    if expected is not None and expected not in proc.stdout:
        return f"{doc} section {heading!r} did not print {expected!r}:\n{proc.stdout[-3000:]}"
    return None


def _is_slow(doc: str, heading: str) -> bool:
    """Slow itself, or on a docs/ page below a slow section (which it runs first when run alone)."""
    headings = list(SECTIONS[doc])
    above = headings[:headings.index(heading)] if doc != "README.md" else []
    return any((doc, h) in SLOW_SECTIONS for h in [*above, heading])


def _params() -> list[Any]:
    return [pytest.param(doc, h, id=f"{doc}::{h}", marks=[pytest.mark.slow] if _is_slow(doc, h) else [])
            for doc in DOCS for h in SECTIONS[doc]]


@pytest.mark.parametrize(("doc", "heading"), _params())
def test_doc_section_runs(doc: str, heading: str, tmp_path_factory: pytest.TempPathFactory,
                          pages: dict[str, Page], request: pytest.FixtureRequest, _second_lane: None) -> None:
    run, notes = _prepare(doc, SECTIONS[doc][heading], None)
    if not run:
        pytest.skip("; ".join(notes))
    page = _page(pages, doc, heading, tmp_path_factory.getbasetemp())
    with page.lock:  # waits while the background lane runs this page
        earlier = _run_through(doc, heading, page, request)
    failure = page.results[heading]
    if failure is not None and earlier:
        failure += f"\n(sections above it on the page failed too: {earlier})"
    if failure is not None:
        pytest.fail(failure, pytrace=False)


def test_docs_have_examples() -> None:
    """The parser finds the sections it should (a fence syntax change would silently run nothing)."""
    assert {"Quick start", "Offline RL datasets", "stable-baselines3", "Command line"} <= set(SECTIONS["README.md"])
    assert {"Inspecting", "Copying"} <= set(SECTIONS["docs/cli.md"])
    assert {"Recording gymnasium environments", "Remote stores", "Dask (`trajstore.dask`)"} <= set(
        SECTIONS["docs/offline.md"])
    assert "Off-policy: SAC, TD3, DDPG, DQN" in SECTIONS["docs/sb3.md"]
    assert "Reproduce" in SECTIONS["docs/reliability.md"]
    assert {(d, h) for d, h in SLOW_SECTIONS if h not in SECTIONS.get(d, {})} == set(), "stale SLOW_SECTIONS"
    assert {(d, h) for d, h in EXPECTED_OUTPUT if h not in SECTIONS.get(d, {})} == set(), "stale EXPECTED_OUTPUT"
    skips = [(d, s.line, s.skip) for d in DOCS for steps in SECTIONS[d].values() for s in steps if s.skip]
    assert len(skips) <= 2, f"keep docs-test skips rare: {skips}"


def test_parser_and_substitutions() -> None:
    assert substitute_python("model.learn(10_000)\nm.learn( 5000, progress_bar=True)\nm.learn(200)") == (
        f"model.learn({LEARN_STEPS})\nm.learn({LEARN_STEPS}, progress_bar=True)\nm.learn(200)")
    assert substitute_python(f'o = {{"endpoint_url": "{EXAMPLE_ENDPOINT}"}}', "http://127.0.0.1:1") == (
        'o = {"endpoint_url": "http://127.0.0.1:1"}')
    text = ("# a\n```python\nx = 1\n```\n## b\n```bash\nls  # list\n# a comment\n\necho a \\\n  b\n```\n"
            "```console\n$ trajstore info s\nstore  s\n```\n<!-- docs-test: skip (needs a GPU) -->\n"
            "```python\ny = 2\n```\n```text\nnot run\n```\n")
    assert doc_sections(text) == {
        "a": [Step("python", 3, "x = 1\n")],
        "b": [Step("shell", 7, "ls  # list"), Step("shell", 10, "echo a \\\n  b"),
              Step("shell", 14, "trajstore info s"), Step("python", 19, "y = 2\n", "needs a GPU")]}
    assert doc_sections("# u\n```sh\nls\n```\n# u\n```sh\npwd\n```\n") == {
        "u": [Step("shell", 3, "ls")], "u (2)": [Step("shell", 7, "pwd")]}
    with pytest.raises(AssertionError, match="malformed docs-test marker"):
        doc_sections("<!-- docs-test: skip -->\n```python\nx = 1\n```\n")
    assert substitute_shell("python3 -m venv .venv && .venv/bin/pip install -q -e .")[0] is None
    assert substitute_shell('python3 -m venv .venv && .venv/bin/pip install -q -e ".[test]" && '
                            ".venv/bin/python -m pytest -q")[0] is None
    assert substitute_shell("python3 -m venv .venv && .venv/bin/pip install -q -e . && "
                            ".venv/bin/trajstore demo d --overwrite")[0] == f"{VENV_BIN}/trajstore demo d --overwrite"
    assert substitute_shell("python -m pytest -q tests/test_a.py \\\n  tests/test_b.py") == (
        "python -m pytest --collect-only -q -q tests/test_a.py \\\n  tests/test_b.py", str(ROOT), "")
    cmd, cwd, _ = substitute_shell("python scripts/ring_fullness.py")
    assert (cmd, cwd) == (f"python {ROOT}/scripts/ring_fullness.py --seconds 1", None)
    assert substitute_shell("trajstore info demo_store") == ("trajstore info demo_store", None, "")


def test_a_failing_step_names_the_doc_line(tmp_path: Path) -> None:
    """Names carry over between the Python blocks of a section; an exception or a failing command
    exits non-zero naming the doc file and line."""
    ok = run_steps("docs/x.md", [Step("python", 3, "x = 41\n"), Step("shell", 5, "echo hi > f.txt"),
                                 Step("python", 7, "assert x + 1 == 42 and open('f.txt').read() == 'hi\\n'\n")],
                   tmp_path)
    assert ok.returncode == 0, ok.stderr
    bad = run_steps("docs/x.md", [Step("python", 3, "x = 1\n"), Step("python", 7, "y = x\nraise ValueError('boom')\n")],
                    tmp_path)
    assert bad.returncode != 0
    assert 'File "docs/x.md", line 8' in bad.stderr and "ValueError: boom" in bad.stderr
    cmd = run_steps("docs/x.md", [Step("shell", 12, "true | false")], tmp_path)
    assert cmd.returncode != 0 and "docs/x.md:12: command exited 1: true | false" in cmd.stderr


def _json_blocks(doc: str) -> list[Any]:
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [json.loads(m) for m in re.findall(r"^```json\n(.*?)^```", text, flags=re.S | re.M)]


def test_format_json_matches_a_real_store(tmp_path: Path) -> None:
    """docs/format.md's schema example is what a store created with its spaces and capacity holds
    (up to the creation time), and its commit record example has a real record's keys."""
    from trajstore import ReplayBuffer
    from trajstore.spaces import space_from_json

    schema, record = _json_blocks("docs/format.md")
    space = space_from_json(schema["spaces"]["step_data"])
    ReplayBuffer.create(space, cache_path=tmp_path / "s", capacity=schema["tables"]["step_data"]["capacity"]).close()
    real = json.loads((tmp_path / "s" / "zarr.json").read_text())["attributes"]["trajstore"]
    assert real["created_at"] and schema.pop("created_at") and real.pop("created_at")
    assert schema == real, "docs/format.md: the schema example differs from a real store's"
    head = json.loads((tmp_path / "s" / "trajstore.head.json").read_text())
    assert set(record) == set(head) and set(record["tables"]["step_data"]) == set(head["tables"]["step_data"]), (
        "docs/format.md: the commit record example differs from a real record")
