"""`make lab` opens JupyterLab on notebooks/ with the course's kernel: checked headless."""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from distlab.runtime import free_port

REPO = Path(__file__).resolve().parents[2]


def test_jupyterlab_serves_the_notebooks_and_the_kernel():
    port, token = free_port(), "course-test"
    jupyter = Path(sys.executable).with_name("jupyter")
    command = [str(jupyter), "lab", "--no-browser", f"--port={port}", f"--IdentityProvider.token={token}",
               "--notebook-dir=notebooks", "--ServerApp.open_browser=False"]
    if os.geteuid() == 0:
        command.append("--allow-root")  # as the Makefile does
    # the learner's environment: without the forked kernel spec make test puts first on JUPYTER_PATH for its own runs
    # (tests/helpers.py forked_kernels: a folder under distlab-python-*, made by the process that started make test)
    env = dict(os.environ)
    kept = [entry for entry in env.pop("JUPYTER_PATH", "").split(os.pathsep)
            if entry and not Path(entry).parent.name.startswith("distlab-python-")]
    if kept:
        env["JUPYTER_PATH"] = os.pathsep.join(kept)
    server = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, contents = time.monotonic() + 60, None
        while time.monotonic() < deadline and contents is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents/?token={token}", timeout=2) as r:
                    contents = json.load(r)
            except OSError:
                assert server.poll() is None, server.stderr.read().decode()[-2000:]
                time.sleep(0.5)
        assert contents is not None, "JupyterLab did not answer within 60 s"
        names = {item["name"] for item in contents["content"]}
        assert "student" in names and any(n.startswith("01_") for n in names), names
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=5) as page:
            assert page.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/kernelspecs?token={token}", timeout=5) as r:
            spec = json.load(r)["kernelspecs"]["python3"]["spec"]
        assert Path(spec["argv"][0]).parent == Path(sys.executable).parent, spec["argv"]
        # the course's overrides reach the running lab: JupyterLab's own default is "none" (ask with a prompt)
        notification = "@jupyterlab/apputils-extension:notification"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab/api/settings/{notification}?token={token}",
                                    timeout=5) as r:
            assert json.load(r)["schema"]["properties"]["fetchNews"]["default"] == "false"
    finally:
        server.terminate()
        server.wait(timeout=20)


def test_jupyterlab_opens_without_the_news_prompt():
    """The course's overrides (jupyter/overrides.json, installed by `make lab` and `make test`) answer JupyterLab's
    "notified about official Jupyter news?" question: no news fetch, no prompt over the first lab."""
    source = json.loads((REPO / "jupyter" / "overrides.json").read_text())
    assert source["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    installed = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    assert installed.is_file() and json.loads(installed.read_text()) == source, "run `make lab` (or `make test`)"
