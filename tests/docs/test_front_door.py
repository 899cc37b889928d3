"""The README as a front door, and the reference pages that took over its inventories.

* The README marks exactly the two set-up commands ``.ci/readme_command.py`` reads (``main`` and
  ``test``; ``.ci/run`` runs the test one verbatim), gives the advice on PyTorch's CPU build before
  the first command it applies to, shows the four ways in (the trainer, ``with_ulysses`` with
  ``pip install -e ".[hf]"``, ``UlyssesAccelerator``, the library) and links only to files that
  exist.
* ``docs/getting-started/install.md``'s extras table lists every extra of ``pyproject.toml``.
* ``docs/reference/tests.md`` names, for every check, test files that exist.
* ``docs/reference/index.md``'s table of public names names only ``du.*`` names that exist.

No process is spawned and nothing is built: these read files.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs import snippets as docs

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _readme_commands() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("readme_command", ROOT / ".ci/readme_command.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.commands(README)


def test_readme_marks_the_two_setup_commands():
    cmds = _readme_commands()
    assert set(cmds) == {"main", "test"}, cmds
    assert " && python -m pytest" in cmds["test"]  # what .ci/run splits on
    assert "torchrun" in cmds["main"] and "-m dtensor_ulysses.train" in cmds["main"]


def test_cpu_build_advice_comes_before_the_commands():
    advice = README.find("download.pytorch.org/whl/cpu")
    assert advice != -1, "the README no longer says how to get PyTorch's CPU build"
    assert advice < README.find("<!-- setup:main -->") < README.find("<!-- setup:test -->")


def test_readme_shows_the_four_ways_in():
    assert "-m dtensor_ulysses.train" in README  # the trainer
    assert "with_ulysses(" in README and 'pip install -e ".[hf]"' in README
    assert "UlyssesAccelerator(" in README  # a custom accelerate loop
    assert "du.ulysses_attention(" in README  # the library
    assert len(README.splitlines()) <= 200, "the README is a front door: details go to docs/"


def test_readme_links_exist():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    local = [u for u in links if not u.startswith(("http://", "https://"))]
    assert local, "the README links to the docs"
    missing = [u for u in local if not (ROOT / u).exists()]
    assert not missing, missing


def test_install_page_lists_every_extra():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        tomllib = pytest.importorskip("tomli")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    page = (ROOT / "docs/getting-started/install.md").read_text(encoding="utf-8")
    listed = set(re.findall(r'^\| `([\w-]+)` \|.*pip install -e "\.\[\1\]"', page, re.M))
    assert listed == set(extras), f"extras table {sorted(listed)} != pyproject {sorted(extras)}"


def test_tests_page_names_test_files_that_exist():
    page = (ROOT / "docs/reference/tests.md").read_text(encoding="utf-8")
    bullets = re.findall(r"^- \*\*(.+?)\*\*(.*?)(?=^- \*\*|\Z)", page, re.M | re.S)
    assert len(bullets) >= 15, "docs/reference/tests.md lost its inventory"
    problems = []
    for title, body in bullets:
        paths = re.findall(r"`(tests/[\w/]+\.py)`", body)
        if not paths and title != "Hygiene":
            problems.append(f"{title}: names no test file")
        problems += [f"{title}: {p} does not exist" for p in paths if not (ROOT / p).is_file()]
    assert not problems, "\n".join(problems)


def test_public_names_table_names_public_names():
    import dtensor_ulysses as du

    page = (ROOT / "docs/reference/index.md").read_text(encoding="utf-8")
    table = page[page.index("## The public names at a glance") :]
    names = set(re.findall(r"`du\.(\w+)", table))
    assert len(names) >= 10, names
    assert names <= set(du.__all__), sorted(names - set(du.__all__))


def test_readme_trainer_flags_exist():
    """Every flag of the README's trainer commands is in the trainer's --help (torch-free)."""
    cmds = [c for c in docs.commands_in(ROOT / "README.md", "README.md")
            if c.target == ["-m", "dtensor_ulysses.train"]]  # fmt: skip
    assert len(cmds) >= 2, "the README shows the trainer"
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))  # fmt: skip
    env.pop("RANK", None)
    text = subprocess.run(
        [sys.executable, "-m", "dtensor_ulysses.train", "--help"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    bad = [f"{c.where}: {f}" for c in cmds for f in c.flags
           if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]  # fmt: skip
    assert not bad, "not options of the trainer:\n" + "\n".join(bad)
