"""docs/design.md is the specification the code, the tests and the docs cite (issue 38): the
citations point at files the repository has, and every test the design and docs/reliability.md name
as the check of an invariant exists.

A test is named as `` `test_name` ``, `` `test_name[param]` ``, `` `test_prefix*` `` or
``tests/test_file.py::test_name``; it belongs to the last ``tests/<file>.py`` named before it.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CITED_BY = ["docs/design.md", "docs/reliability.md"]
TOKEN = re.compile(r"tests/(?P<file>\w+\.py)|(?:`|::)(?P<test>test_\w+)(?P<star>\*)?")


def cited_tests(text: str) -> list[tuple[str, str, bool]]:
    """``(test file, test name, name is a prefix)`` for every test the text names."""
    out, current = [], None
    for m in TOKEN.finditer(text):
        if m["file"]:
            current = m["file"]
        elif current is not None:
            out.append((current, m["test"], bool(m["star"])))
    return out


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test_")}


@pytest.mark.parametrize("doc", CITED_BY)
def test_every_cited_test_exists(doc: str) -> None:
    cited = cited_tests((ROOT / doc).read_text())
    assert len(cited) > 20, f"{doc}: the parser found only {cited}"
    missing = []
    for file, name, prefix in cited:
        path = ROOT / "tests" / file
        if not path.exists():
            missing.append(f"tests/{file} (file)")
            continue
        have = defined_tests(path)
        if not (any(h.startswith(name) for h in have) if prefix else name in have):
            missing.append(f"tests/{file}::{name}{'*' if prefix else ''}")
    assert not missing, f"{doc} names tests that do not exist: {missing}"


def test_no_citation_of_a_design_file_the_repository_lacks() -> None:
    """The design once lived in a file outside the repository; every citation now names docs/design.md."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    old_name = "DESIGN" + ".md"  # spelled apart so this file does not cite it
    stale = [f for f in files if f.endswith((".py", ".md")) and (ROOT / f).is_file()
             and old_name in (ROOT / f).read_text(errors="replace")]
    assert not stale, f"files citing {old_name}, which the repository does not have (use docs/design.md): {stale}"
    assert (ROOT / "docs/design.md").is_file()


def test_the_parser_reads_both_citation_styles() -> None:
    text = ("`tests/test_a.py` (`test_x[*]`, `test_y*`); `tests/test_c.py::test_z`, `test_w`; "
            "tests/test_d.py (`test_v`) `other`")
    assert cited_tests(text) == [("test_a.py", "test_x", False), ("test_a.py", "test_y", True),
                                 ("test_c.py", "test_z", False), ("test_c.py", "test_w", False),
                                 ("test_d.py", "test_v", False)]
