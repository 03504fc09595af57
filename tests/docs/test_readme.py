"""The README as a newcomer meets it: the two commands first, every page it points to there.

Issue 50: the README starts with exactly two commands for a fresh machine (`scripts/demo`, the main
job; `scripts/test`, the suite and what `.ci/run` runs), and the long reference lives in docs/ pages
that the README links and that exist. No processes: these read files only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# Where the README's old sections went (issue 50): each must be linked from the README.
MOVED_TO = ("architecture.md", "configuration.md", "benchmarks.md", "reliability.md", "usage.md")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


def _first_code_block(text: str) -> list[str]:
    match = re.search(r"```[a-z]*\n(.*?)```", text, re.S)
    assert match, "the README has no code block"
    return [line for line in match.group(1).splitlines() if line.strip()]


def test_first_two_commands_are_the_two_scripts(readme: str) -> None:
    first = readme.split("\n## ", 1)[0]  # the part above the first section
    commands = [line.split("#", 1)[0].split() for line in _first_code_block(first)]
    assert [c[0] for c in commands] == ["scripts/demo", "scripts/test"], commands
    assert all(len(c) == 1 for c in commands), f"the commands take no arguments: {commands}"
    for name in ("demo", "test"):
        script = ROOT / "scripts" / name
        assert script.is_file() and script.stat().st_mode & 0o111, f"{script} is not executable"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^exec scripts/test$", ci, re.M), ".ci/run must run exactly scripts/test"


def test_every_local_link_exists_and_moved_sections_are_linked(readme: str) -> None:
    targets = [t for t in LINK.findall(readme) if not re.match(r"[a-z]+:", t)]
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    linked = {Path(t).name for t in targets if t.startswith("docs/")}
    assert set(MOVED_TO) <= linked, f"not linked from the README: {set(MOVED_TO) - linked}"


def test_docs_pages_link_only_existing_files() -> None:
    for page in sorted((ROOT / "docs").glob("*.md")):
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_readme_is_short_and_its_prose_lines_fit(readme: str) -> None:
    lines = readme.splitlines()
    assert len(lines) <= 150, f"README has {len(lines)} lines"
    prose, in_code = [], False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and not line.startswith("|") and len(line) > 120:
            prose.append(number)
    assert not prose, f"README lines over 120 characters outside tables and code: {prose}"
