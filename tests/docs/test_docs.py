"""The documentation site: it builds with ``--strict``, its snippets run, the flags its commands use
exist, and it loads in headless Chromium without errors.

* ``mkdocs build --strict`` into ``build/docs-site`` (once per session).
* Every ``<!-- test -->`` snippet runs (see ``tests/docs/snippets.py``): one process for the
  single-process ones, one torchrun world per rank count for the multi-rank ones, bash blocks from
  the repository root.
* Every ``--flag`` of a project command in a ```bash block appears in that command's ``--help``.
* The built site has no ``<script>``, stylesheet, image or frame from another host.
* Chromium (Debian's ``chromium``, driven by Playwright; never a downloaded browser) loads every
  page of the nav from a local ``http.server``: no console error, no failed or off-host request,
  every ``<img>`` decoded, formulas laid out, the nav and the search work; every notebook figure
  shown at a scale where its smallest text stays legible (``MIN_FIGURE_SCALE``), and every code
  block too wide for the column scrolls instead of being cut. Screenshots go to
  ``build/screenshots/`` (a CI artifact, not committed).
* A notebook with outputs, math and an image renders as a tutorial page the same way.

Skips, with the reason, when the docs extra (``pip install -e ".[docs]"``), Playwright
(``pip install playwright``) or Chromium (``apt-get install chromium``) is missing.
"""

from __future__ import annotations

import base64
import contextlib
import html.parser
import importlib.util
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

import pytest

from tests.docs import snippets as docs

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
SITE = BUILD / "docs-site"
SCREENSHOTS = BUILD / "screenshots"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-default-apps",
    "--disable-extensions",
]
SNIPPETS = docs.collect()


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))  # fmt: skip
    env.update(extra)
    return env


def _need_docs_extra() -> None:
    missing = [
        m
        for m in (
            "mkdocs",
            "material",
            "mkdocstrings_handlers.python",
            "mkdocs_jupyter",
            "latex2mathml",
        )  # fmt: skip
        if importlib.util.find_spec(m.split(".")[0]) is None
    ]
    if missing:
        pytest.skip(f"docs dependencies missing ({', '.join(missing)}): pip install -e '.[docs]'")


def _mkdocs_build(config: Path, site_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    shutil.rmtree(site_dir, ignore_errors=True)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(config),
            "-d",
            str(site_dir),
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def site() -> Path:
    _need_docs_extra()
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    out = _mkdocs_build(ROOT / "mkdocs.yml", SITE, _env())
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout}\n{out.stderr}"[-8000:]
    return SITE


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------
def test_build_strict(site):
    for page in ("index.html", "concepts/all-to-all/index.html", "concepts/formulas/index.html",
                 "reference/api/attention/index.html", "404.html"):  # fmt: skip
        assert (site / page).is_file(), page
    for page, module, names in (
        ("attention", "attention.ulysses", ("UlyssesAttention", "to_heads")),
        ("attention", "attention.dtensor_api", ("seq_to_head", "ulysses_attention")),
        ("plan", "plan.splits", ("kv_head_index", "SeqLayout")),
    ):  # one API page per subpackage, a section per module
        api = (site / f"reference/api/{page}/index.html").read_text(encoding="utf-8")
        assert all(f'id="dtensor_ulysses.{module}.{n}"' in api for n in names), module  # docstrings
    formulas = (site / "concepts/formulas/index.html").read_text(encoding="utf-8")
    assert formulas.count("<math") > 10 and 'class="arithmatex"' not in formulas  # all rendered


class _Resources(html.parser.HTMLParser):
    ATTRS = {"script": "src", "img": "src", "iframe": "src", "source": "src", "audio": "src",
             "video": "src", "embed": "src", "object": "data", "link": "href"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "link" and not {"stylesheet", "icon", "preload", "modulepreload",
                                  "manifest"} & set((a.get("rel") or "").split()):  # fmt: skip
            return
        url = a.get(self.ATTRS.get(tag, ""))
        if url:
            self.urls.append(url)


def _off_host(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    return bool(parts.netloc) and parts.hostname not in ("127.0.0.1", "localhost")


def test_no_resources_from_other_hosts(site):
    bad = []
    for page in site.rglob("*.html"):
        parser = _Resources()
        parser.feed(page.read_text(encoding="utf-8"))
        bad += [f"{page.relative_to(site)}: {u}" for u in parser.urls if _off_host(u)]
    for css in site.rglob("*.css"):
        text = css.read_text(encoding="utf-8", errors="replace")
        bad += [f"{css.relative_to(site)}: {u}" for u in re.findall(r"url\(\s*['\"]?(//[^)'\"]+|"
                r"https?:[^)'\"]+)", text)]  # fmt: skip
        bad += [f"{css.relative_to(site)}: @import" for _ in re.findall(r"@import\s+url\(\s*['\"]?"
                r"(?:https?:)?//", text)]  # fmt: skip
    assert not bad, "the site loads resources from other hosts:\n" + "\n".join(bad[:30])


# ---------------------------------------------------------------------------------------------
# snippets
# ---------------------------------------------------------------------------------------------
def _runnable(kind) -> list[docs.Snippet]:
    return [s for s in SNIPPETS if kind(s) and not docs.missing_requirements(s)]


def _report(proc: subprocess.CompletedProcess) -> str:
    out, err = proc.stdout[-4000:], proc.stderr[-8000:]
    return f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


def test_snippets_found():
    assert any(s.ranks == 0 and not s.bash for s in SNIPPETS)
    assert any(s.ranks > 1 for s in SNIPPETS)


@pytest.mark.timeout(300)
def test_single_process_snippets(tmp_path):
    todo = _runnable(lambda s: not s.bash and s.ranks == 0)
    spec = docs.dump(todo, tmp_path / "snippets.json")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "docs" / "snippets.py"), str(spec)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, _report(proc)
    assert proc.stdout.count("DOCS-SNIPPET-OK") == len(todo), _report(proc)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ranks", sorted({s.ranks for s in SNIPPETS if s.ranks > 1}))
def test_multi_rank_snippets(ranks, tmp_path):
    todo = _runnable(lambda s: s.ranks == ranks)
    spec = docs.dump(todo, tmp_path / "snippets.json")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), str(ROOT / "tests" / "docs" / "snippets.py"), str(spec)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    assert proc.returncode == 0, _report(proc)
    assert proc.stdout.count("DOCS-SNIPPET-OK") == len(todo), _report(proc)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("snip", [s for s in SNIPPETS if s.bash], ids=lambda s: s.where)
def test_bash_snippets(snip):
    missing = docs.missing_requirements(snip)
    if missing:
        pytest.skip(f"{snip.where} needs {', '.join(missing)}, not in the package yet")
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", snip.code],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    assert proc.returncode == 0, f"{snip.where}\n{_report(proc)}"
    if snip.expect is not None:
        missing_lines = docs.expected_lines_missing(snip.expect, proc.stdout)
        assert not missing_lines, (
            f"{snip.where}: output lacks\n" + "\n".join(missing_lines) + (f"\n{_report(proc)}")
        )


# ---------------------------------------------------------------------------------------------
# the flags of every command in the docs
# ---------------------------------------------------------------------------------------------
def _target_exists(target: list[str]) -> bool:
    if target[0] == "-m":
        return docs.module_exists(target[1])
    return (ROOT / target[0]).is_file()


@pytest.mark.timeout(300)
def test_command_flags_exist():
    cmds = [c for c in docs.commands() if _target_exists(c.target)]  # skip modules not written yet
    assert any(c.target[:2] == ["-m", "dtensor_ulysses.demo"] for c in cmds)
    targets = sorted({tuple(c.target) for c in cmds})
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "docs" / "snippets.py"), "--help-of",
         json.dumps([list(t) for t in targets])],
        cwd=ROOT, env=_env(COLUMNS="200"), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, _report(proc)
    helps = json.loads(proc.stdout.strip().splitlines()[-1])
    problems, checked = [], 0
    for c in cmds:
        text = helps[" ".join(c.target)]
        if text.startswith("FAILED"):
            problems.append(f"{c.where}: `{' '.join(c.target)} --help` failed:\n{text[-1500:]}")
            continue
        for flag in c.flags:
            checked += 1
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                problems.append(f"{c.where}: {flag} is not an option of `{' '.join(c.target)}`")
    assert not problems, "\n".join(problems)
    assert checked > 0


# ---------------------------------------------------------------------------------------------
# the site in a browser
# ---------------------------------------------------------------------------------------------
def _chromium() -> str:
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("Playwright is not installed: pip install playwright (no browser download)")
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):  # fmt: skip
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("Chromium is not installed: apt-get install chromium")


@contextlib.contextmanager
def _serve(directory: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory",
         str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(base, timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"http.server on port {port} did not start") from None
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def _browser():
    executable = _chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            yield context
        finally:
            browser.close()


_IMAGES_JS = """() => Array.from(document.images).map(i => ({
    src: i.currentSrc || i.src, complete: i.complete, width: i.naturalWidth,
    shown: i.getBoundingClientRect().width, output: !!i.closest('.jupyter-wrapper')}))"""
# A notebook figure is a PNG at ``tutorial.widgets.figure_png``'s dpi whose smallest text (legends,
# bar labels) is SMALLEST_PT; shown scaled down to fit the column, that text must stay at least
# MIN_TEXT_PX CSS pixels tall (8 px: below it digits like 3/8 and 1/7 blur together at 1x). At
# 90 dpi, 7 pt is 8.75 px, so a figure may be shown at no less than 0.91 of its natural width:
# a figure is drawn about as wide as the column (6.4 in = 576 px; the column is ~584 px at 1280).
FIGURE_DPI = int(
    re.search(r"def figure_png\(.*?dpi: int = (\d+)",
              (ROOT / "notebooks/tutorial/widgets.py").read_text()).group(1)
)  # fmt: skip
SMALLEST_PT = 7
MIN_TEXT_PX = 8.0
MIN_FIGURE_SCALE = MIN_TEXT_PX / (SMALLEST_PT * FIGURE_DPI / 72)
# Every code block (a Markdown ``pre > code``, a notebook cell or output ``pre``) wider than its box
# must scroll (overflow-x auto/scroll, scrollbar not hidden), never be cut.
_PRE_JS = """() => Array.from(document.querySelectorAll('.md-content pre, .md-content pre > code'))
    .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => {
        const s = getComputedStyle(e); return {tag: e.tagName, x: s.overflowX,
        bar: s.scrollbarWidth, w: e.scrollWidth, cw: e.clientWidth,
        text: e.textContent.trim().slice(0, 60)}; })"""
_MATH_JS = """() => Array.from(document.querySelectorAll('math')).map(m => {
    const r = m.getBoundingClientRect(); return {w: r.width, h: r.height,
    tex: m.getAttribute('alttext')}; })"""


def _check_page(context, url: str, shot: Path | None, settle: bool = False) -> list[str]:
    """Load ``url``; return what went wrong (console errors, bad requests, broken images)."""
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)  # fmt: skip
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} {r.failure}"))
    page.on("request", lambda r: problems.append(f"off-host request: {r.url}")
            if _off_host(r.url) else None)  # fmt: skip
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}")
            if r.status >= 400 else None)  # fmt: skip
    try:
        response = page.goto(url, wait_until="load")
        if response is None or response.status != 200:
            problems.append(f"HTTP {response and response.status}: {url}")
        if settle:  # wait for late requests too (500 ms without network traffic)
            page.wait_for_load_state("networkidle")
        for img in page.evaluate(_IMAGES_JS):
            if not img["complete"] or img["width"] == 0:
                problems.append(f"image did not load: {img['src']}")
            elif img["output"] and img["shown"] < MIN_FIGURE_SCALE * img["width"]:
                scale = img["shown"] / img["width"]
                problems.append(
                    f"figure shown at {img['shown']:.0f} of its {img['width']} px (x{scale:.2f} "
                    f"< x{MIN_FIGURE_SCALE:.2f}): its {SMALLEST_PT} pt text is "
                    f"{scale * SMALLEST_PT * FIGURE_DPI / 72:.1f} px, under {MIN_TEXT_PX:.0f} px: "
                    f"{img['src'][:60]}"
                )
        for pre in page.evaluate(_PRE_JS):
            if pre["x"] not in ("auto", "scroll") or pre["bar"] == "none":
                problems.append(
                    f"{pre['tag'].lower()} cut at {pre['cw']} of {pre['w']} px (overflow-x "
                    f"{pre['x']}, scrollbar {pre['bar']}): {pre['text']!r}"
                )
        for m in page.evaluate(_MATH_JS):
            if m["w"] <= 0 or m["h"] <= 0:
                problems.append(f"formula not laid out: {m['tex']}")
        if shot is not None:
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
    finally:
        page.close()
    return [f"{url}: {p}" for p in problems]


def _shot_name(base: str, url: str) -> str:
    path = url[len(base) :].strip("/") or "index"
    return re.sub(r"[^\w.-]+", "_", path) + ".png"


@pytest.mark.timeout(300)
def test_site_in_chromium(site):
    with _browser() as context, _serve(site) as base:
        home = context.new_page()
        home.goto(base, wait_until="load")
        links = home.eval_on_selector_all(
            "nav.md-nav--primary a.md-nav__link[href]", "els => els.map(e => e.href)"
        )
        pages = sorted({urllib.parse.urldefrag(u)[0] for u in links if u.startswith(base)})
        assert len(pages) >= 20, pages

        # every nav link answers 200
        for url in pages:
            with urllib.request.urlopen(url, timeout=10) as r:
                assert r.status == 200, url

        # the nav works: click through to a page and back home
        home.click("nav.md-nav--primary a.md-nav__link[href$='concepts/all-to-all/']")
        home.wait_for_url(re.compile(r".*/concepts/all-to-all/$"))
        assert "all-to-all" in home.inner_text("h1").lower()
        home.click("a.md-header__button.md-logo")
        home.wait_for_url(base)

        # search runs offline (its index and worker are served by the site)
        home.locator("input.md-search__input").fill("kv_head_index")
        home.wait_for_selector(".md-search-result__item", timeout=20_000)
        home.close()

        problems = []
        for url in pages:
            settle = url == base or "/tutorials/" in url or url.endswith("/formulas/")
            api = "/reference/api/" in url  # generated pages: checked, not photographed
            shot = None if api else SCREENSHOTS / _shot_name(base, url)
            problems += _check_page(context, url, shot, settle)
        assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# a notebook, rendered as a tutorial
# ---------------------------------------------------------------------------------------------
def _png(width: int = 4, height: int = 3) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = b"".join(b"\x00" + b"\x30\x60\xc0" * width for _ in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw))
        + (chunk(b"IEND", b""))
    )


def _notebook() -> dict:
    def md(text):
        return {"cell_type": "markdown", "metadata": {}, "source": text}

    def code(text, outputs):
        return {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": text,
                "outputs": outputs}  # fmt: skip

    png = base64.b64encode(_png()).decode()
    return {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"},
                     "language_info": {"name": "python"}},  # fmt: skip
        "cells": [
            md("# Fixture tutorial\n\nInline $s = S / P$ and a display formula:\n\n"
               "$$\\frac{P-1}{P} \\cdot 4 B s N H e$$\n\nCode keeps its dollars: `$HOME`."),
            code("print('hello')", [{"output_type": "stream", "name": "stdout",
                                     "text": "hello\n"}]),
            code("plot()", [{"output_type": "display_data", "metadata": {},
                             "data": {"image/png": png, "text/plain": "<Figure>"}}]),
        ],
    }  # fmt: skip


@pytest.mark.timeout(300)
def test_notebook_renders_as_tutorial(tmp_path):
    _need_docs_extra()
    import yaml

    nb_dir = tmp_path / "notebooks"
    nb_dir.mkdir()
    (nb_dir / "01-fixture.ipynb").write_text(json.dumps(_notebook()))
    docs_dir = tmp_path / "docs"
    (docs_dir / "tutorials").mkdir(parents=True)
    (docs_dir / "index.md").write_text("# Home\n")
    (docs_dir / "tutorials" / "index.md").write_text("# Tutorials\n\n<!-- notebooks -->\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs_dir)
    config["hooks"] = [str(ROOT / h) for h in config["hooks"]]
    config["exclude_docs"] = ""
    config["extra_css"] = []
    config["plugins"] = [p for p in config["plugins"] if "mkdocstrings" not in p]
    config["nav"] = [{"Home": "index.md"}, {"Tutorials": ["tutorials/index.md"]}]
    cfg = tmp_path / "mkdocs.yml"
    cfg.write_text(yaml.safe_dump(config))
    out = _mkdocs_build(cfg, tmp_path / "site", _env(DOCS_NOTEBOOKS_DIR=str(nb_dir)))
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"[-8000:]

    page = (tmp_path / "site" / "tutorials" / "01-fixture" / "index.html").read_text()
    assert "cdnjs" not in page and "mathjax" not in page.lower()
    assert page.count("<math") == 2 and "$HOME" in page and "hello" in page
    index = (tmp_path / "site" / "tutorials" / "index.html").read_text()
    assert 'href="01-fixture/"' in index and "Fixture tutorial" in index
    with _browser() as context, _serve(tmp_path / "site") as base:
        problems = _check_page(context, base + "tutorials/01-fixture/",
                               SCREENSHOTS / "fixture-notebook.png", settle=True)  # fmt: skip
        assert not problems, "\n".join(problems)
        with urllib.request.urlopen(base + "tutorials/01-fixture/01-fixture.ipynb") as r:
            assert json.loads(r.read())["cells"]  # the download link's target
