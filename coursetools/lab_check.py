"""``make lab-check``: every lab as a learner meets it, in JupyterLab in a real browser.

JupyterLab (the course's, with its settings: ``make lab``'s) serves a copy of ``notebooks/`` (a run never writes into
the course's own files: JupyterLab autosaves), and headless Chromium (Debian's package, over the DevTools protocol as
``coursetools.site_check`` drives it) opens each lab and runs it top to bottom with JupyterLab's own "Run All"
(``notebook:run-all-cells``). A full lab fails when

* a cell ends in an error (a traceback) or stays unrun (Run All stops at an error);
* a warning reaches the learner: a stderr output with ``Warning:`` in it (the planted hangs' gloo errors that chapter
  12 shows on purpose are stderr too, and allowed);
* a widget opens on other values than its cell passed (:data:`WIDGET_VALUES`: what its controls must show).

The learner's copies (``notebooks/student/``) must run to the end too: an exercise not written yet says so and the
notebook goes on. Each lab's time is printed; the last line is ``N passed, N failed``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from coursetools.site_check import browser, find_browser, new_tab, stop

REPO = Path(__file__).resolve().parent.parent
# a widget's controls must open on what its cell passed: each dropdown's selected option, in order, as the learner
# reads it (its label: lab 07's cell passes "1f1b", the schedule the dropdown labels "1F1B")
WIDGET_VALUES = {"11_choosing_a_strategy": ["70b", "h100-80gb"], "07_pipeline_parallel": ["1F1B"],
                 "02_why_distributed": ["A100-40GB"]}
RUN_TIMEOUT_S = 300

# the notebook's panel among JupyterLab's main-area widgets (headless, nothing has focus: currentWidget may be null)
FIND = """
var findPanel = (path) => {   // var: each evaluation declares it again
  const app = window.jupyterapp;
  for (const w of Array.from(app.shell.widgets('main'))) {
    if (w.context && w.content && w.sessionContext && w.context.path === path) return w;
  }
  return null;
};
"""

RUN_ALL = FIND + """
((path) => {
  const app = window.jupyterapp;
  window.__distlab = {state: 'waiting'};
  const start = async () => {
    for (let i = 0; i < 600; i++) {
      const panel = findPanel(path);
      if (panel && panel.context.isReady) {
        await panel.sessionContext.ready;
        const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
        if (kernel) {
          app.shell.activateById(panel.id);
          window.__distlab.state = 'running';
          await app.commands.execute('notebook:run-all-cells');
          window.__distlab.state = 'done';
          return;
        }
      }
      await new Promise(r => setTimeout(r, 200));
    }
    window.__distlab.state = 'no notebook';
  };
  start().catch(e => { window.__distlab = {state: 'error', error: String(e)}; });
  return true;
})(PATH)
"""

STATE = FIND + """
((path) => {
  const panel = findPanel(path);
  const kernel = panel && panel.sessionContext.session && panel.sessionContext.session.kernel;
  const others = Array.from(window.jupyterapp.shell.widgets('main'))
    .filter(w => w.context && w.sessionContext && w.context.path !== path).map(w => w.context.path);
  return {state: (window.__distlab || {}).state, error: (window.__distlab || {}).error,
          kernel: kernel ? kernel.status : null, others: others};
})(PATH)
"""

CELLS = FIND + """
((path) => {
  const panel = findPanel(path);
  const cells = [];
  for (const cell of panel.content.model.cells) {
    if (cell.type !== 'code') continue;
    const outputs = [];
    for (let i = 0; i < cell.outputs.length; i++) {
      const o = cell.outputs.get(i).toJSON();
      outputs.push({type: o.output_type, name: o.name || null, ename: o.ename || null, evalue: o.evalue || null,
                    text: Array.isArray(o.text) ? o.text.join('') : (o.text || '')});
    }
    cells.push({source: cell.sharedModel.getSource().slice(0, 80), count: cell.executionCount, outputs: outputs});
  }
  const selects = Array.from(panel.node.querySelectorAll('.jupyter-widgets select')).map(s => s.value);
  return {cells: cells, selects: selects};
})(PATH)
"""


CLOSE = FIND + """
((path) => {
  const panel = findPanel(path);
  panel.context.model.dirty = false;
  return panel.sessionContext.shutdown().then(() => { panel.dispose(); return true; });
})(PATH)
"""


def _with_path(script: str, path: str) -> str:
    return script.replace("(PATH)", f"({json.dumps(path)})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyterlab(folder: Path, state: Path):
    """JupyterLab on 127.0.0.1 over ``folder``, with a token, the app exposed to the page's scripts (the check
    calls its commands). Yields (base URL, token).

    Its workspace and user settings live under ``state``, never in the user's ``~/.jupyter``: JupyterLab restores
    the notebooks a workspace last had open, so a shared one would reopen every lab of the last check (their
    kernels starting beside the lab under test, Run All landing on another notebook) here, and in the learner's
    next ``make lab``."""
    port, token = free_port(), secrets.token_hex(16)
    command = [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser", f"--port={port}",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.token={token}", f"--notebook-dir={folder}",
               "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True",
               f"--LabApp.workspaces_dir={state / 'workspaces'}", f"--LabApp.user_settings_dir={state / 'settings'}"]
    if os.geteuid() == 0:
        command.append("--allow-root")
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=folder)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    log.seek(0)
                    raise RuntimeError("JupyterLab did not start:\n" + log.read()[-2000:])
                time.sleep(0.5)
        yield base, token
    finally:
        stop(process)
        log.close()


def problems_of(stem: str, cells: list[dict], selects: list[str], student: bool) -> list[str]:
    """What a learner would meet in a run's cells (pure: unit-tested on recorded cells)."""
    found = []
    for cell in cells:
        where = cell["source"].splitlines()[0][:60] if cell["source"] else "(empty cell)"
        if cell["count"] is None and cell["source"].strip():
            found.append(f"not run: {where}")
        for out in cell["outputs"]:
            if out["type"] == "error":
                found.append(f"error in {where}: {out['ename']}: {(out['evalue'] or '')[:120]}")
            elif out["type"] == "stream" and out["name"] == "stderr" and "Warning:" in out["text"]:
                line = next(ln for ln in out["text"].splitlines() if "Warning:" in ln)
                found.append(f"warning shown in {where}: {line.strip()[:160]}")
    wanted = WIDGET_VALUES.get(stem)
    if wanted and not student and selects[:len(wanted)] != wanted:
        found.append(f"widget opened on {selects[:len(wanted)]}, its cell passed {wanted}")
    return found


def run_problems(state: dict, timeout: float) -> list[str]:
    """What is wrong with the run itself (pure: unit-tested), before its cells are read."""
    found = []
    if state.get("others"):
        # Run All acts on the notebook JupyterLab calls current: with another open, the verdict would be a race's
        found.append(f"other notebooks open beside it: {', '.join(state['others'][:3])}")
    if state.get("state") != "done":
        found.append(f"Run All did not finish ({state.get('state')}, kernel {state.get('kernel')}) "
                     f"within {timeout:.0f} s")
    return found


def run_lab(tab, base: str, token: str, path: str, timeout: float = RUN_TIMEOUT_S) -> dict:
    started = time.monotonic()
    tab.events.clear()
    # ?reset: the page starts from an empty workspace; without it JupyterLab reopens every notebook the last page had
    # open (a closed panel's layout entry outlives it), each starting its kernel beside this lab's
    tab.call("Page.navigate", url=f"{base}/lab/tree/{path}?reset&token={token}")
    tab.wait_for("Page.loadEventFired", timeout=60)
    deadline = time.monotonic() + 60
    while not tab.evaluate("!!(window.jupyterapp && window.jupyterapp.started)"):
        if time.monotonic() > deadline:
            return {"path": path, "seconds": time.monotonic() - started, "problems": ["JupyterLab did not start"]}
        time.sleep(0.5)
    tab.evaluate(_with_path(RUN_ALL, path))
    state = {}
    while time.monotonic() - started < timeout:
        state = tab.evaluate(_with_path(STATE, path)) or {}
        if state.get("state") in ("done", "error", "no notebook") and state.get("kernel") in ("idle", None):
            break
        time.sleep(1)
    seconds = time.monotonic() - started
    row = {"path": path, "seconds": seconds, "problems": run_problems(state, timeout)}
    if state.get("state") == "done":
        result = tab.evaluate(_with_path(CELLS, path))
        wanted = [] if path.startswith("student/") else WIDGET_VALUES.get(Path(path).stem, [])
        settle = time.monotonic() + 10   # a widget's view renders in the page after its cell has finished
        while len(result["selects"]) < len(wanted) and time.monotonic() < settle:
            time.sleep(0.5)
            result = tab.evaluate(_with_path(CELLS, path))
        row["cells"] = len(result["cells"])
        row["problems"] += problems_of(Path(path).stem, result["cells"], result["selects"],
                                       student=path.startswith("student/"))
    # stop its kernel and close it unsaved (the close command would ask in a dialog), so the next lab starts clean
    with contextlib.suppress(Exception):
        tab.evaluate(_with_path(CLOSE, path))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("labs", nargs="*", help="lab names or numbers (default: every lab and every learner's copy)")
    p.add_argument("--no-student", action="store_true", help="the full labs only")
    p.add_argument("--report", type=Path, default=None, help="every lab's result (JSON)")
    args = p.parse_args(argv)
    executable = find_browser()
    if executable is None:
        return 2
    names = sorted(path.name for path in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if args.labs:
        names = [n for n in names if any(n.startswith(a) or n[:2] == a.zfill(2) for a in args.labs)]
    paths = names + ([] if args.no_student else [f"student/{n}" for n in names
                                                 if (REPO / "notebooks" / "student" / n).exists()])
    results = []
    with tempfile.TemporaryDirectory(prefix="distlab-labs-") as folder:
        shutil.copytree(REPO / "notebooks", Path(folder) / "notebooks",
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        with jupyterlab(Path(folder) / "notebooks", Path(folder) / "jupyter") as (base, token), \
                browser(executable) as endpoint:
            tab = new_tab(endpoint)
            tab.call("Emulation.setDeviceMetricsOverride", width=1400, height=1000, deviceScaleFactor=1, mobile=False)
            tab.call("Emulation.setFocusEmulationEnabled", enabled=True)   # headless: the page has the focus
            for path in paths:
                row = run_lab(tab, base, token, path)
                results.append(row)
                verdict = "ok" if not row["problems"] else "FAIL: " + "; ".join(row["problems"][:4])
                print(f"{path:45s} {row['seconds']:6.1f} s  {verdict}", flush=True)
    if args.report:
        args.report.write_text(json.dumps(results, indent=1))
    failed = [r for r in results if r["problems"]]
    for row in failed:   # again at the end, whole, where a log's tail shows it
        print(f"FAILED {row['path']}:\n" + "\n".join(f"  {problem}" for problem in row["problems"]))
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
