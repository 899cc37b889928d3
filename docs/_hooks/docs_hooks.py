"""MkDocs hooks for the dtensor-ulysses site: build-time work, so the site needs no network.

* **Notebooks**: every ``notebooks/*.ipynb`` becomes the page ``tutorials/<name>.ipynb``
  (rendered by mkdocs-jupyter with the outputs stored in the notebook) and is appended to the
  "Tutorials" section of the nav, in file-name order. ``<!-- notebooks -->`` in a page becomes a
  list of them. ``DOCS_NOTEBOOKS_DIR`` overrides the folder (the docs test uses it).
* **Math**: ``$...$`` and ``$$...$$`` (pymdownx.arithmatex, generic mode) are rendered to MathML
  with latex2mathml, which browsers display natively: no MathJax, no CDN. On notebook pages the
  CDN loaders that nbconvert inserts (MathJax, mermaid, widget scripts) are removed, the
  ``$...$`` of markdown cells are rendered the same way, and a link to download the ``.ipynb`` is
  added at the top.
* **Modules not written yet**: a ``::: dtensor_ulysses.X`` (mkdocstrings) line whose module has no
  source file yet becomes a note instead of a build error, so the API pages fill in by themselves.
* **Benchmark results**: ``<!-- bench-results: PATH -->`` becomes the command, device, versions
  and table of a ``benchmarks/bench_ulysses.py --json`` file, or a note while there is none.
* **Docstrings**: Sphinx roles (``:func:`x```) are shown as plain code, and the ``::`` that
  introduces an RST literal block as ``:``.
* **Commands**: ``<!-- cli-help: MODULE [SUBCOMMAND] -->`` becomes the output of
  ``python -m MODULE [SUBCOMMAND] --help``, and ``<!-- published-table -->`` the table of
  ``python -m simulations published --json``, both run at build time (a note if the module does
  not exist yet; a warning, which fails ``--strict``, if the command fails).
"""

from __future__ import annotations

import atexit
import html
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.dtensor_ulysses")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_ENV = "DOCS_NOTEBOOKS_DIR"
TUTORIALS_SECTION = "Tutorials"
TUTORIALS_DIR = "tutorials"


# ---------------------------------------------------------------------------------------------
# notebooks
# ---------------------------------------------------------------------------------------------
def _notebooks_dir() -> Path:
    return Path(os.environ.get(NOTEBOOKS_ENV) or ROOT / "notebooks")


def _notebooks() -> list[Path]:
    d = _notebooks_dir()
    return sorted(d.glob("*.ipynb")) if d.is_dir() else []


def _notebook_title(path: Path) -> str:
    """The first Markdown heading of the notebook, else its file name."""
    try:
        cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    except (OSError, ValueError):
        return path.stem
    for cell in cells:
        if cell.get("cell_type") != "markdown":
            continue
        src = cell.get("source", "")
        for line in (src if isinstance(src, str) else "".join(src)).splitlines():
            m = re.match(r"#+\s+(.*\S)", line)
            if m:
                return m.group(1)
    return path.stem


_build_notebooks: list[Path] = []  # the notebooks of the current build, listed once in on_config


def on_config(config):
    _build_notebooks[:] = _notebooks()
    nav = config.nav or []
    for item in nav:
        if isinstance(item, dict) and TUTORIALS_SECTION in item:
            section = item[TUTORIALS_SECTION]
            listed = json.dumps(section)
            for nb in _build_notebooks:
                uri = f"{TUTORIALS_DIR}/{nb.name}"
                if uri not in listed:
                    section.append({_notebook_title(nb): uri})
    return config


@cache
def _staging() -> Path:
    """A folder whose ``tutorials/`` links to the notebooks, so they are ordinary source files."""
    path = Path(tempfile.mkdtemp(prefix="docs-notebooks-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@event_priority(100)  # before mkdocs-jupyter, which turns .ipynb files into pages
def on_files(files, config):
    notebooks = _build_notebooks
    if not notebooks:
        return files
    src_dir = _staging()
    shutil.rmtree(src_dir / TUTORIALS_DIR, ignore_errors=True)
    (src_dir / TUTORIALS_DIR).mkdir()
    for nb in notebooks:
        link = src_dir / TUTORIALS_DIR / nb.name
        try:
            link.symlink_to(nb.resolve())
        except OSError:
            shutil.copyfile(nb, link)
        files.append(
            File(
                f"{TUTORIALS_DIR}/{nb.name}",
                src_dir=str(src_dir),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files


def on_serve(server, config, builder):
    for extra in (_notebooks_dir(), ROOT / "dtensor_ulysses", ROOT / "simulations"):
        if extra.is_dir():
            server.watch(str(extra))
    return server


def _notebook_list() -> str:
    nbs = _build_notebooks
    if not nbs:
        return (
            '!!! note "No notebooks yet"\n'
            "    The tutorials are the notebooks in `notebooks/`; each one appears here, and in "
            "the navigation, as soon as it is added.\n"
        )
    return "\n".join(f"- [{_notebook_title(nb)}]({nb.name})" for nb in nbs) + "\n"


# ---------------------------------------------------------------------------------------------
# modules and commands that may not exist yet
# ---------------------------------------------------------------------------------------------
def _module_source(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py", base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


_API_RE = re.compile(r"^::: (dtensor_ulysses(?:\.\w+)*|simulations(?:\.\w+)*)[ \t]*$", re.M)
_CLI_RE = re.compile(r"^<!-- cli-help: ([\w.]+)((?: [\w-]+)*) -->[ \t]*$", re.M)
_PUBLISHED_RE = re.compile(r"^<!-- published-table -->[ \t]*$", re.M)


def _api_or_note(m: re.Match) -> str:
    module = m.group(1)
    if _module_source(module) is not None:
        return m.group(0)
    return (
        f'!!! note "`{module}` is not in the package yet"\n'
        f"    Its API appears here, generated from its docstrings, as soon as the module lands.\n"
    )


@cache
def _run_cli(module: str, args: tuple[str, ...]) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    env.setdefault("COLUMNS", "100")
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _cli_help(m: re.Match, page_uri: str) -> str:
    """The ``--help`` of a command, run at build time."""
    module, args = m.group(1), (*m.group(2).split(), "--help")
    command = " ".join(["python -m", module, *args])
    if _module_source(module) is None:
        return (
            f'!!! note "`{module}` is not in the package yet"\n'
            f"    The output of `{command}` appears here when it lands.\n"
        )
    proc = _run_cli(module, args)
    if proc.returncode != 0:
        log.warning("%s: `%s` failed (exit %d):\n%s", page_uri, command, proc.returncode,
                    proc.stderr[-2000:])  # fmt: skip
        return f"`{command}` failed when the site was built.\n"
    return f"```text\n$ {command}\n{proc.stdout.rstrip()}\n```\n"


def _published_table(page_uri: str) -> str:
    """``python -m simulations published --json`` as a Markdown table, computed at build time."""
    command = "python -m simulations published --json"
    if _module_source("simulations") is None:
        return f"The table of `{command}` appears here when the simulator lands.\n"
    proc = _run_cli("simulations", ("published", "--json"))
    try:
        rows = json.loads(proc.stdout)
        cells = [
            [r["row"], r["status"].upper(), r["item"], r["published"], r["predicted"], r["band"],
             r.get("note", "")]
            for r in rows
        ]  # fmt: skip
    except (ValueError, KeyError, TypeError) as e:
        log.warning("%s: `%s` gave no table (exit %d, %r):\n%s", page_uri, command,
                    proc.returncode, e, proc.stderr[-2000:])  # fmt: skip
        return f"`{command}` failed when the site was built.\n"
    head = ["row", "status", "item", "published", "simulator", "band", "why"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in cells:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines) + "\n"


_BENCH_RE = re.compile(r"^<!-- bench-results: (\S+) -->[ \t]*$", re.M)


def _bench_results(m: re.Match, page_uri: str) -> str:
    """A results JSON of ``benchmarks/bench_ulysses.py``: command, device, versions, table."""
    path = ROOT / m.group(1)
    if not path.is_file():
        return (
            '!!! note "Measured numbers appear here when recorded"\n'
            f"    The table is read from `{m.group(1)}` when the site is built; that file does "
            "not exist yet. Record it with the command above.\n"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        env = data["environment"]
        load = env.get("load_average_1_5_15") or []
        device = (
            f"{env.get('cpu_model', 'unknown CPU')}, {env.get('cpu_count')} cores "
            f"({env.get('cpus_usable')} usable)"
            + (f", load average {load[0]:.2f} at the start" if load else "")
        )
        return (
            f"Recorded {data.get('timestamp_utc', '(no timestamp)')} with\n\n"
            f"```text\n{data['command']}\n```\n\n"
            f"Device: {device}. Versions: torch {env.get('torch')}, Python {env.get('python')}, "
            f"{env.get('os')} {env.get('machine')}; {env.get('process_group_backend', 'gloo')}, "
            f"attention {env.get('attention_backend', 'sdpa')}.\n\n"
            f"{data['table_markdown'].strip()}\n"
        )
    except (ValueError, KeyError, TypeError) as e:
        log.warning("%s: cannot read benchmark results %s: %r", page_uri, path, e)
        return f"`{m.group(1)}` could not be read when the site was built.\n"


def on_page_markdown(markdown, page, config, files):
    markdown = _BENCH_RE.sub(lambda m: _bench_results(m, page.file.src_uri), markdown)
    markdown = _API_RE.sub(_api_or_note, markdown)
    markdown = _CLI_RE.sub(lambda m: _cli_help(m, page.file.src_uri), markdown)
    markdown = _PUBLISHED_RE.sub(lambda m: _published_table(page.file.src_uri), markdown)
    return markdown.replace("<!-- notebooks -->", _notebook_list())


# ---------------------------------------------------------------------------------------------
# math: TeX -> MathML at build time
# ---------------------------------------------------------------------------------------------
_ARITHMATEX_RE = re.compile(r'<(span|div) class="arithmatex">\s*\\[(\[](.*?)\\[)\]]\s*</\1>', re.S)
_NB_MATHJAX_RE = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", re.S)
# nbconvert's loaders from CDNs: mermaid (an inline module importing from cdnjs) and, for notebooks
# with widget state, require.js and the widget manager. Offline they only fail, so they go.
_NB_MERMAID_RE = re.compile(r'<script type="module">(?:(?!</script>).)*?mermaid.*?</script>', re.S)
_NB_REMOTE_SCRIPT_RE = re.compile(
    r'<script\b[^>]*\bsrc="(?:https?:)?//[^"]*"[^>]*>\s*</script>', re.S | re.I
)
_NB_MARKDOWN_CELL_RE = re.compile(
    r'(<div class="[^"]*jp-MarkdownOutput[^"]*"[^>]*>)(.*?)(</div>)', re.S
)
_NB_MATH_RE = re.compile(r"\$\$(.+?)\$\$|(?<![\\$\w])\$([^$\n]+?)\$(?![\w$])", re.S)


def _mathml(tex: str, display: bool, where: str) -> str:
    from latex2mathml.converter import convert

    tex = html.unescape(tex).strip()
    try:
        out = convert(tex, display="block" if display else "inline")
    except Exception as e:  # noqa: BLE001 - any parse error is a broken formula in the docs
        log.warning("%s: cannot render TeX %r: %s", where, tex, e)
        return html.escape(tex)
    # Keep the TeX for copy/paste and screen readers.
    return out.replace("<math ", f'<math alttext="{html.escape(tex, quote=True)}" ', 1)


def _render_arithmatex(m: re.Match, where: str) -> str:
    display = m.group(1) == "div"
    math = _mathml(m.group(2), display, where)
    return f'<div class="math-display">{math}</div>' if display else math


def _render_notebook_cell(m: re.Match, where: str) -> str:
    def sub(mm: re.Match) -> str:
        if mm.group(1) is not None:
            return f'<div class="math-display">{_mathml(mm.group(1), True, where)}</div>'
        return _mathml(mm.group(2), False, where)

    body = re.split(r"(<code.*?</code>|<pre.*?</pre>)", m.group(2), flags=re.S)
    body = [part if i % 2 else _NB_MATH_RE.sub(sub, part) for i, part in enumerate(body)]
    return m.group(1) + "".join(body) + m.group(3)


_RST_ROLE_RE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc):(<code)")


def on_page_content(html_text, page, config, files):
    where = page.file.src_uri
    html_text = _RST_ROLE_RE.sub(r"\1", html_text)  # ":func:`x`" in docstrings: keep the `x`
    html_text = html_text.replace("::</p>", ":</p>")  # an RST literal-block marker ("Run::")
    html_text = _ARITHMATEX_RE.sub(lambda m: _render_arithmatex(m, where), html_text)
    if where.endswith(".ipynb"):
        name = Path(where).name  # mkdocs-jupyter (include_source) copies it next to the page
        for loader in (_NB_MATHJAX_RE, _NB_MERMAID_RE, _NB_REMOTE_SCRIPT_RE):
            html_text = loader.sub("", html_text)
        link = f'<p class="notebook-download"><a href="{name}" download>Download {name}</a></p>'
        html_text = link + "\n" + html_text
        html_text = _NB_MARKDOWN_CELL_RE.sub(lambda m: _render_notebook_cell(m, where), html_text)
    return html_text
