"""Find the code snippets of docs/ that are marked for testing, and run them.

A fenced block is tested when the line before it is an HTML comment (invisible on the site):

    <!-- test -->                  ```python: run in one process (no process group)
    <!-- test: ranks=2 -->         ```python: run on every rank of a torchrun world of 2 CPU ranks
                                   (gloo); all such blocks share one world, in page order, each in
                                   a fresh namespace, as if it were the script passed to torchrun
    <!-- test: bash -->            ```bash: run with bash -euo pipefail from the repository root
    <!-- test: bash expect -->     ... and its output must contain the next ```text block
                                   (lines compared after stripping; lines with "..." are skipped);
                                   ``expect`` works for python blocks too (output of rank 0)

``requires=a.b,c`` in the comment skips the block while one of those modules has no source file
yet (for pages that describe a contract the code does not implement yet).

Also here: the commands in any ```bash block (``python -m MODULE [SUB] --flags``, ``torchrun ...
-m MODULE``, ``python path/to/script.py --flags``), so a test can check that every flag the docs
use is one the command accepts.

Run as a script, this module is the snippet runner: ``python tests/docs/snippets.py FILE.json``
runs the listed snippets in one process; under torchrun, on every rank of the world.
``python tests/docs/snippets.py --help-of JSON`` prints the ``--help`` of each listed command.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_MARK_RE = re.compile(r"^<!--\s*test(?::\s*(.*?))?\s*-->\s*$")
_FENCE_RE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass
class Snippet:
    page: str  # path relative to docs/
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    ranks: int = 0  # 0: one plain process
    bash: bool = False
    expect: str | None = None
    requires: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def _blocks(text: str):
    """(line, lang, code, marker-or-None) for every top-level fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE_RE.match(lines[i].strip()) if not lines[i].startswith((" ", "\t")) else None
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mark = _MARK_RE.match(lines[k].strip()) if k >= 0 else None
        yield i + 1, lang, "\n".join(lines[i + 1 : j]) + "\n", mark
        i = j + 1


def module_exists(module: str) -> bool:
    base = ROOT.joinpath(*module.split("."))
    return any(
        p.is_file() for p in (base.with_suffix(".py"), base / "__init__.py", base / "__main__.py")
    )


def collect(docs: Path = DOCS) -> list[Snippet]:
    """Every marked snippet under ``docs``, in path then line order."""
    out: list[Snippet] = []
    for path in sorted(docs.rglob("*.md")):
        page = path.relative_to(docs).as_posix()
        blocks = list(_blocks(path.read_text(encoding="utf-8")))
        for n, (line, lang, code, mark) in enumerate(blocks):
            if mark is None:
                continue
            opts = (mark.group(1) or "").split()
            snip = Snippet(page, line, lang, code)
            for opt in opts:
                key, _, value = opt.partition("=")
                if key == "ranks":
                    snip.ranks = int(value)
                elif key == "bash":
                    snip.bash = True
                elif key == "expect":
                    following = blocks[n + 1] if n + 1 < len(blocks) else None
                    if following is None or following[1] != "text":
                        raise ValueError(f"{snip.where}: 'expect' needs a ```text block after it")
                    snip.expect = following[2]
                elif key == "requires":
                    snip.requires = value.split(",")
                else:
                    raise ValueError(f"{snip.where}: unknown test option {opt!r}")
            want = "bash" if snip.bash else "python"
            if lang != want:
                raise ValueError(f"{snip.where}: marked as {want} but the block is ```{lang}")
            out.append(snip)
    return out


def missing_requirements(snip: Snippet) -> list[str]:
    return [m for m in snip.requires if not module_exists(m)]


def expected_lines_missing(expect: str, output: str) -> list[str]:
    """Lines of ``expect`` (stripped, non-empty, without "...") that ``output`` lacks."""
    have = {line.strip() for line in output.splitlines()}
    return [
        line.strip()
        for line in expect.splitlines()
        if line.strip() and "..." not in line and line.strip() not in have
    ]


# ---------------------------------------------------------------------------------------------
# commands in bash blocks
# ---------------------------------------------------------------------------------------------
@dataclass
class Command:
    where: str
    text: str
    target: list[str]  # ["-m", "simulations", "predict"] or ["benchmarks/bench.py"]
    flags: list[str]


def _logical_lines(code: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", code)
    return [
        ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")
    ]


def commands(docs: Path = DOCS) -> list[Command]:
    """Project commands in ```bash blocks: the module or script each runs, and its flags."""
    out: list[Command] = []
    for path in sorted(docs.rglob("*.md")):
        out += commands_in(path, f"docs/{path.relative_to(docs).as_posix()}")
    return out


def commands_in(path: Path, where: str) -> list[Command]:
    """The project commands in the ```bash blocks of one Markdown file (``where``: its name)."""
    out: list[Command] = []
    for line, lang, code, _ in _blocks(path.read_text(encoding="utf-8")):
        if lang not in ("bash", "sh", "shell"):
            continue
        for text in _logical_lines(code):
            for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", text):
                try:
                    tokens = shlex.split(part)
                except ValueError:
                    continue
                cmd = _parse(tokens)
                if cmd is not None:
                    out.append(Command(f"{where}:{line}", part, *cmd))
    return out


def _parse(tokens: list[str]) -> tuple[list[str], list[str]] | None:
    for i, tok in enumerate(tokens):
        if tok == "-m" and i + 1 < len(tokens):
            module = tokens[i + 1]
            if module == "dtensor_ulysses.launch":  # a launcher: torchrun's options, then -m
                continue
            if not module.startswith(("dtensor_ulysses", "simulations", "benchmarks")):
                return None
            rest = tokens[i + 2 :]
            target = ["-m", module]
            if module == "simulations" and rest and not rest[0].startswith("-"):
                target.append(rest[0])
                rest = rest[1:]
            return target, _flags(rest)
        if tok.endswith(".py") and tok.startswith(("benchmarks/", "simulations/")):
            return [tok], _flags(tokens[i + 1 :])
    return None


def _flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--") and len(t) > 2]


# ---------------------------------------------------------------------------------------------
# the runner
# ---------------------------------------------------------------------------------------------
def _run_one(snip: dict) -> None:
    # padded so that tracebacks give the line numbers of the Markdown file
    source = "\n" * snip["line"] + snip["code"]
    code = compile(source, str(DOCS / snip["page"]), "exec")
    exec(code, {"__name__": "__main__", "__file__": str(DOCS / snip["page"])})


def help_texts(targets: list[list[str]]) -> dict[str, str]:
    """``--help`` of each target (``["-m", module, *sub]`` or ``[script.py]``), in this process.

    One process for all of them, so torch is imported once; a target whose ``--help`` fails maps
    to ``"FAILED: "`` and the error.
    """
    import runpy

    out = {}
    for target in targets:
        buf = io.StringIO()
        saved_argv = sys.argv
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                if target[0] == "-m":
                    sys.argv = [target[1], *target[2:], "--help"]
                    runpy.run_module(target[1], run_name="__main__", alter_sys=True)
                else:
                    sys.argv = [target[0], "--help"]
                    runpy.run_path(str(ROOT / target[0]), run_name="__main__")
            text = "FAILED: --help returned without exiting\n" + buf.getvalue()
        except SystemExit as e:
            ok = e.code in (0, None)
            text = buf.getvalue() if ok else f"FAILED: exit {e.code}\n{buf.getvalue()}"
        except BaseException:
            text = f"FAILED: {traceback.format_exc()}\n{buf.getvalue()}"
        finally:
            sys.argv = saved_argv
        out[" ".join(target)] = text
    return out


def main(argv: list[str]) -> int:
    if argv[0] == "--help-of":
        os.environ.setdefault("COLUMNS", "200")
        print(json.dumps(help_texts(json.loads(argv[1]))))
        return 0
    snippets = json.loads(Path(argv[0]).read_text())
    world = int(os.environ.get("WORLD_SIZE", "0"))
    failed = 0
    for snip in snippets:
        where = f"docs/{snip['page']}:{snip['line']}"
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                _run_one(snip)
            lacking = expected_lines_missing(snip["expect"] or "", out.getvalue())
            if lacking and int(os.environ.get("RANK", "0")) == 0:
                raise AssertionError(
                    "the output lacks these lines of the ```text block after the snippet:\n"
                    + "\n".join(lacking)
                    + "\n--- output\n"
                    + out.getvalue()
                )
        except BaseException:
            print(f"DOCS-SNIPPET-FAILED {where}\n{traceback.format_exc()}", file=sys.stderr)
            if world:  # the other ranks may wait in a collective: stop the world now
                sys.stderr.flush()
                os._exit(1)
            failed += 1
            continue
        if world:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"DOCS-SNIPPET-OK {where}", flush=True)
    return 1 if failed else 0


def dump(snippets: list[Snippet], path: Path) -> Path:
    path.write_text(json.dumps([asdict(s) for s in snippets]))
    return path


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
