"""The quickstart notebook in a real browser: JupyterLab (headless, loopback, token auth) and Debian's
Chromium driven by playwright run every cell with interactive=True, and a rendered figure (<img>) and a
rendered ipywidgets slider appear.

Needs Debian's chromium (`apt-get install -y chromium`) and the Python packages jupyterlab and
playwright (`playwright install` is not needed: the system browser is used)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "notebooks" / "01_routing_quickstart.ipynb"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
BROWSER_PARAMS = {"interactive": True, "tokens": 1024, "model": ""}  # random logits only: no model to load

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} missing: apt-get install -y chromium"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise AssertionError(f"JupyterLab exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"JupyterLab did not answer {url} within {timeout_s} s")


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on 127.0.0.1 (random port, token) serving a copy of the quickstart with the browser's
    parameters injected the way papermill injects them."""
    pytest.importorskip("jupyterlab")
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    root = tmp_path / "root"
    root.mkdir()
    nb = parameterize_notebook(load_notebook_node(str(QUICKSTART)), BROWSER_PARAMS)
    nbformat.write(nb, str(root / QUICKSTART.name))
    port, token = _free_port(), os.urandom(16).hex()
    env = {**os.environ, "MOELAB_FIGURES": str(tmp_path / "figures"), "MOELAB_RUN_DIR": str(tmp_path / "run"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces")}
    settings = tmp_path / "lab-settings" / "@jupyterlab"
    for rel, doc in {  # start the notebook's kernel without asking; no news or update checks (offline)
        "notebook-extension/tracker.jupyterlab-settings": {"autoStartDefaultKernel": True},
        "apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        (settings / rel).parent.mkdir(parents=True, exist_ok=True)
        (settings / rel).write_text(json.dumps(doc))
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root,
    )
    try:
        _wait_until_up(f"http://127.0.0.1:{port}/api/status?token={token}", proc, 90)
        yield {"url": f"http://127.0.0.1:{port}", "token": token, "tmp": tmp_path}
    finally:
        proc.kill()  # its kernel exits with it (ipykernel polls its parent)
        proc.wait()
        log.close()


def _start_kernel(page, timeout_s: float = 90) -> None:
    """Wait until the notebook's kernel is idle, accepting JupyterLab's kernel dialog should it still ask."""
    t0 = time.time()
    idle = page.locator(".jp-StatusBar-TextItem", has_text="Python 3 (ipykernel) | Idle")
    select = page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept")
    while time.time() - t0 < timeout_s:
        if select.count() and select.first.is_visible():
            select.first.click()
        elif idle.count():
            return
        page.wait_for_timeout(300)
    raise AssertionError(f"the notebook's kernel was not idle within {timeout_s} s")


def test_quickstart_renders_figure_and_widget_in_chromium(lab):
    sync_api = pytest.importorskip("playwright.sync_api")
    tmp = lab["tmp"]
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{lab['url']}/lab/tree/{QUICKSTART.name}?token={lab['token']}", timeout=90_000)
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
            _start_kernel(page)
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
            img = page.wait_for_selector(".jp-OutputArea-output img", timeout=150_000)
            slider = page.wait_for_selector(".jupyter-widgets .widget-slider, .widget-slider", timeout=150_000)
            # the explorer's own figure renders inside the widget's output
            explorer_img = ".widget-output img, .jupyter-widgets .jp-OutputArea-output img"
            page.wait_for_selector(explorer_img, timeout=60_000)
            # moving a slider (keyboard, as a person would) redraws the explorer's figure
            before = page.locator(explorer_img).last.get_attribute("src")
            handle = page.locator(".widget-slider .noUi-handle").first
            handle.focus()
            for _ in range(5):
                handle.press("ArrowLeft")
            page.wait_for_function(
                "([sel, old]) => { const imgs = document.querySelectorAll(sel);"
                " return imgs.length && imgs[imgs.length - 1].getAttribute('src') !== old; }",
                arg=[explorer_img, before], timeout=60_000)
            page.screenshot(path=str(tmp / "quickstart.png"), full_page=False)
            box = img.bounding_box()
            assert box and box["width"] > 100 and box["height"] > 50, box
            assert slider.is_visible()
            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            tracebacks = [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t]
            assert not tracebacks, tracebacks
        except sync_api.Error:
            page.screenshot(path=str(tmp / "failure.png"))
            print(f"screenshot of the failure: {tmp / 'failure.png'}")
            raise
        finally:
            browser.close()
    assert (tmp / "figures" / "01_quickstart_random_E8_k2.png").exists()
    # the run in the browser wrote its named results like a headless run: the summary is the figure's table
    from moelab.results import load_saved

    saved = load_saved(tmp / "run")
    summary, stats = saved["01_summary_random"], saved["01_policy_stats_random"].set_index("policy")
    assert summary == stats["expert_reduction"].to_dict()
    (native,) = [name for name in summary if name.endswith("(native)")]
    assert summary[native] == 0.0 and 0 < summary["EntropyAdaptiveK"] < 1

