"""Slurm's install when make test finds it missing: two pytest workers start a cluster each at once, and both must get
one. A stand-in apt-get that behaves as dpkg's frontend lock does (a second apt-get while one runs fails at once with
apt's message) takes the place of Debian's, so the test installs nothing and runs anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("slurmctld", "slurmd", "sbatch", "munged", "mungekey")

FAKE_APT_GET = textwrap.dedent("""\
    #!/bin/sh
    # dpkg's frontend lock: held for the whole command; a second apt-get meanwhile fails as apt's does
    if ! /bin/mkdir "$FAKE_DPKG_LOCK" 2>/dev/null; then
        echo "E: Unable to acquire the dpkg frontend lock (/var/lib/dpkg/lock-frontend), is another process using it?" >&2
        exit 100
    fi
    for word in "$@"; do
        if [ "$word" = install ]; then
            echo install >> "$FAKE_APT_LOG"
            /bin/sleep 2
            for tool in {tools}; do
                printf '#!/bin/sh\\n' > "$FAKE_BIN/$tool" && /bin/chmod +x "$FAKE_BIN/$tool"
            done
        fi
    done
    /bin/rmdir "$FAKE_DPKG_LOCK"
    """).format(tools=" ".join(TOOLS))


@pytest.mark.skipif(os.geteuid() != 0, reason="ensure_installed installs only as root")
def test_two_workers_starting_a_cluster_at_once_both_get_slurm_installed_once(tmp_path):
    bin_dir, tmp = tmp_path / "bin", tmp_path / "tmp"
    bin_dir.mkdir(), tmp.mkdir()
    (bin_dir / "apt-get").write_text(FAKE_APT_GET)
    (bin_dir / "apt-get").chmod(0o755)
    log = tmp_path / "apt.log"
    # PATH: the stand-in alone (the real Slurm, where installed, must not be found); TMPDIR: the install lock's folder
    env = dict(os.environ, PATH=str(bin_dir), TMPDIR=str(tmp), FAKE_BIN=str(bin_dir), FAKE_APT_LOG=str(log),
               FAKE_DPKG_LOCK=str(tmp_path / "dpkg-lock"), PYTHONPATH=str(ROOT))
    code = "from coursetools.slurm_cluster import ensure_installed; ensure_installed(); print('installed')"
    workers = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outputs = [worker.communicate(timeout=60) for worker in workers]
    for worker, (out, err) in zip(workers, outputs):
        assert worker.returncode == 0 and out.strip() == "installed", err
    assert log.read_text().split() == ["install"]  # the second found it installed, and ran no apt-get
