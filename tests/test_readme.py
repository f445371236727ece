"""The README's and the docs pages' examples run as written, and every command in them is one that exists.

Python blocks are executed. Shell commands (```sh blocks, and inline code naming a job) are checked, not run,
since most of them train or serve: each ``jobs/NAME.py`` must exist and accept every ``--flag`` given after it
(its ``--help``, run in this process), each ``make TARGET`` must be a Makefile target, each
``python -m MODULE`` an importable module, and each ``jobs/configs/*.yaml`` a file.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import runpy
import sys
from functools import cache
from pathlib import Path

import pytest

from speed.paths import repo_root

ROOT = repo_root()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "history.md"]  # the run log too
EXAMPLE_PAGES = ["README.md", "decoding.md", "models.md"]  # the pages with python examples; the others hold none
JOB = re.compile(r"(?:^|[\s/])(jobs/\w+\.py)((?:\s+\S+)*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def commands(text: str) -> list[str]:
    """The shell commands of a page: each line of its sh blocks (continuations joined, comments dropped), split
    at ``|``, ``&&`` and ``;``, and every inline code span that names a job."""
    found = []
    for block in blocks(text, "sh"):
        for line in block.replace("\\\n", " ").splitlines():
            found.extend(re.split(r"\|\||&&|;|\|", line.split(" #")[0]))
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " "))
    found.extend(s for s in spans if JOB.search(s))
    return [c.strip() for c in found if c.strip()]


@cache
def job_flags(job: str) -> frozenset[str]:
    """The flags ``jobs/<job>`` lists in its ``--help`` (run in this process: imports are paid once)."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [job, "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(ROOT / job), run_name="__main__")
    finally:
        sys.argv = argv
    assert exit_.value.code in (0, None), f"{job} --help failed"
    return frozenset(FLAG.findall(out.getvalue()))


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_python_examples_are_on_the_pages_expected():
    """Each page's python blocks are found, and a page gaining or losing its examples is noticed."""
    assert [p.name for p in PAGES if blocks(p.read_text(), "python")] == EXAMPLE_PAGES


@pytest.mark.parametrize("page", [p for p in PAGES if p.name in EXAMPLE_PAGES], ids=lambda p: p.name)
def test_python_blocks_run(page: Path):
    found = blocks(page.read_text(), "python")
    assert found, f"{page.name} has no python example"
    for block in found:
        exec(compile(block, str(page.relative_to(ROOT)), "exec"), {})


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_exist(page: Path):
    wrong = []
    for command in commands(page.read_text()):
        for job, rest in JOB.findall(command):
            if not (ROOT / job).is_file():
                wrong.append(f"{command!r}: no {job}")
                continue
            unknown = set(FLAG.findall(rest)) - job_flags(job)
            wrong.extend(f"{command!r}: {job} has no {flag}" for flag in sorted(unknown))
        for target in re.findall(r"(?:^|\s)make\s+([a-z][\w-]*)", command):
            if target not in make_targets():
                wrong.append(f"{command!r}: no make target {target}")
        for module in re.findall(r"python\s+-m\s+([\w.]+)", command):
            if importlib.util.find_spec(module) is None:
                wrong.append(f"{command!r}: no module {module}")
        for config in re.findall(r"jobs/configs/[\w.-]+\.yaml", command):
            if not (ROOT / config).is_file():
                wrong.append(f"{command!r}: no {config}")
    assert not wrong, "\n".join(wrong)


def test_the_checks_catch_a_wrong_command():
    """The command checks fail on an unknown flag, job, make target and module."""
    text = "```sh\n.venv/bin/python jobs/compare.py --baseline a --nope 1 && make nowhere\n```\n`jobs/gone.py --x`"
    got = commands(text)
    assert got == [".venv/bin/python jobs/compare.py --baseline a --nope 1", "make nowhere", "jobs/gone.py --x"]
    assert "--nope" not in job_flags("jobs/compare.py") and "--baseline" in job_flags("jobs/compare.py")
    assert "nowhere" not in make_targets() and {"demo", "test"} <= make_targets()
    assert anchor("SPEED's levers and what they buy") == "speeds-levers-and-what-they-buy"
    assert anchor("Serving (`jobs/bench_serve.py`)") == "serving-jobsbench_servepy"


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page: Path):
    """Every relative link names an existing file and, with ``#anchor``, one of its headings."""
    wrong = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            wrong.append(f"{target}: no {path}")
        elif fragment and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", file.read_text(), flags=re.S), flags=re.M)
            if fragment not in {anchor(h) for h in headings}:
                wrong.append(f"{target}: no heading #{fragment} in {path or page.name}")
    assert not wrong, "\n".join(wrong)
