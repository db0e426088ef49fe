"""The documentation site: it builds in strict mode, its generated reference holds every config
key and every command's flags, and a real headless Chromium renders it without console errors.

The site is built once per module (`python -m areal.docs build`, as a user builds it), into a
temporary directory. Screenshots go to $AREAL_DOCS_SCREENSHOTS when it is set (to look at).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

for _module in ("mkdocs", "material", "mkdocstrings"):
    pytest.importorskip(_module, reason=f'{_module} is not installed: pip install -e ".[docs]"')

from areal import config, config_loader, docs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "areal.docs", "build", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the site does not build in strict mode:\n{log[-4000:]}"
    assert "WARNING" not in log, log[-4000:]
    print(f"site built in {time.monotonic() - start:.1f}s")
    return out


def _nav_pages() -> list[str]:
    """Every page the nav of mkdocs.yml names (strict mode fails on a page outside it)."""
    return re.findall(r":\s*([\w/-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)


def test_every_page_in_the_nav_is_built(site):
    pages = _nav_pages()
    assert len(pages) >= 20
    for page in pages:
        html = page[: -len(".md")]
        html = "index.html" if html == "index" else html.removesuffix("/index") + "/index.html"
        assert (site / html).exists(), page
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == set(pages), "a page missing from the nav, or a nav entry without a page"


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html).replace("&quot;", '"').replace("&amp;", "&")


def test_every_config_key_is_in_the_reference(site):
    html = (site / "reference/configuration/index.html").read_text()
    text = _text(html)
    leaves = [
        key
        for key, f, _ in config_loader.walk(config.ExperimentConfig)
        if not config_loader.is_section(f.type)
    ]
    assert len(leaves) > 100
    for key in leaves:
        assert f'id="{key}"' in html, f"{key} has no row in the configuration reference"
    for row in docs.config_keys():
        assert row["doc"], f"{row['key']} has no docstring in its section's dataclass"
        assert row["doc"].split()[0] in text
    # The hand-kept table of the README missed these two; the generated one cannot.
    assert 'id="launcher.ray_address"' in html and "ray" in text


def _commands_in_code() -> set[str]:
    """Every module of areal that builds an argparse parser: each must be documented."""
    found = set()
    for path in (ROOT / "areal").rglob("*.py"):
        if "ArgumentParser(" in path.read_text():
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found.add(module.removesuffix(".__main__"))
    return found


def test_every_command_and_flag_is_in_the_reference(site):
    documented = {module for module, _ in docs.COMMANDS}
    assert _commands_in_code() <= documented, "a command missing from areal.docs.COMMANDS"
    text = _text((site / "reference/cli/index.html").read_text())
    for module in documented:
        assert f"python -m {module}" in text
        parser = docs.command_parser(module)
        flags = docs.command_flags(parser)
        assert flags, module
        for flag in flags:
            assert flag in text, f"{module}: {flag} is not in the commands reference"


def test_the_python_api_is_rendered_from_docstrings(site):
    text = _text((site / "reference/api/index.html").read_text())
    from areal import inline
    from areal.trainer import ppo
    from areal.workflow import api

    for name, obj in [
        ("build", inline.build),
        ("policy_loss", ppo.policy_loss),
        ("compute_advantages", ppo.compute_advantages),
        ("Workflow", api.Workflow),
    ]:
        assert name in text
        first = obj.__doc__.strip().splitlines()[0].split()[:4]
        assert " ".join(first) in " ".join(text.split()), name
    for name in ("Task", "TrainerBackend", "InferenceBackend", "InferenceClient", "Trajectory"):
        assert name in text


# ---- a real browser ----------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


# Search runs in Material's web worker after the page has loaded, so a DOM dump at load would
# miss it: this page opens the home page in a frame, types a query, and reports the results to
# the server (/__result), while an image the server holds until then (/__hold) keeps the
# page's load event, and so Chromium's screenshot, waiting for them.
SEARCH_HARNESS = """<!doctype html><html><body style="margin:0">
<iframe id="f" src="/" style="width:1280px;height:900px;border:0"></iframe>
<script>
const f = document.getElementById("f"), errors = [];
const report = (items, meta) => fetch("/__result?items=" + items + "&meta=" +
  encodeURIComponent(meta) + "&errors=" + encodeURIComponent(errors.join(" | ")));
f.addEventListener("load", () => {
  const w = f.contentWindow;
  w.addEventListener("error", e => errors.push(String(e.message)));
  const input = w.document.querySelector("[data-md-component=search-query]");
  const t0 = Date.now();
  const step = () => {
    input.focus(); input.value = "staleness";
    input.dispatchEvent(new w.Event("input", {bubbles: true}));
    input.dispatchEvent(new w.KeyboardEvent("keyup", {bubbles: true, key: "s"}));
    const items = w.document.querySelectorAll(".md-search-result__item").length;
    const meta = w.document.querySelector(".md-search-result__meta").textContent;
    if (items > 0 || Date.now() - t0 > 30000) report(items, meta); else setTimeout(step, 250);
  };
  step();
});
</script><img src="/__hold" width="1" height="1"></body></html>"""


class _Handler(http.server.SimpleHTTPRequestHandler):
    result: dict = {}
    reported = threading.Event()

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        url = urllib.parse.urlparse(self.path)
        if url.path == "/__search.html":
            body = SEARCH_HARNESS.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif url.path == "/__result":
            _Handler.result = urllib.parse.parse_qs(url.query)
            _Handler.reported.set()
            self.send_response(204)
            self.end_headers()
        elif url.path == "/__hold":
            _Handler.reported.wait(60)
            self.send_response(204)
            self.end_headers()
        else:
            super().do_GET()


@pytest.fixture(scope="module")
def served(site):
    _Handler.reported.clear()
    handler = functools.partial(_Handler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _chromium_args(tmp_path: Path) -> list[str]:
    return [
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--disable-extensions", f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr", "--v=0", "--window-size=1280,900", "--hide-scrollbars",
    ]  # fmt: skip


def _console_errors(stderr: str) -> list[str]:
    """Chromium's console lines (--enable-logging) that report an error."""
    return [
        line
        for line in stderr.splitlines()
        if "CONSOLE" in line and re.search(r"error|uncaught|failed|refused", line, re.I)
    ]


def _shots(tmp_path: Path) -> Path:
    shots = Path(os.environ.get("AREAL_DOCS_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    return shots


def _browse(url: str, tmp_path: Path, name: str) -> str:
    """The DOM of `url` after its scripts ran, in headless Chromium; fails on console errors.
    Takes a screenshot too (into $AREAL_DOCS_SCREENSHOTS when set)."""
    args = [*_chromium_args(tmp_path), "--virtual-time-budget=5000"]
    dom = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-3000:]
    errors = _console_errors(dom.stderr)
    assert not errors, f"{url}: console errors:\n" + "\n".join(errors)
    shot = _shots(tmp_path) / f"{name}.png"
    run = subprocess.run(
        [*args, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and shot.stat().st_size > 10_000, run.stderr[-3000:]
    return dom.stdout


@pytest.mark.skipif(_chromium() is None, reason="needs Chromium (apt-get install chromium)")
@pytest.mark.timeout(600)
def test_the_site_renders_in_a_headless_browser(served, tmp_path):
    home = _browse(served + "/", tmp_path, "home")
    assert "md-header" in home and "The CPU default in 2 minutes" in home
    assert "data-md-color-scheme" in home  # the light/dark toggle
    assert 'data-md-component="search-query"' in home

    guide = _browse(served + "/guides/objectives/", tmp_path, "guide")
    assert "Objectives: recipes and knobs" in guide
    assert 'data-md-type="copy"' in guide  # code blocks carry a copy button

    ref = _browse(served + "/reference/configuration/", tmp_path, "reference")
    assert 'id="trainer.lr"' in ref and "Adam learning rate" in ref

    api = _browse(served + "/reference/api/", tmp_path, "api")
    assert "policy_loss" in api

    # Search: type a query into the home page's search box and read the results.
    shot = _shots(tmp_path) / "search.png"
    run = subprocess.run(
        [*_chromium_args(tmp_path), f"--screenshot={shot}", served + "/__search.html"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert _Handler.reported.is_set(), "the search page never reported"
    result = _Handler.result
    assert int(result["items"][0]) > 0, f"the search found nothing for 'staleness': {result}"
    assert "matching" in result["meta"][0]
    assert not result.get("errors"), result["errors"]
    assert not _console_errors(run.stderr)
