"""pbs/README.md's recipes as a first real job meets them (issue 30)."""

from __future__ import annotations

from pbs_helpers import ROOT

README = (ROOT / "pbs" / "README.md").read_text()


def test_the_conda_environment_and_its_package_cache_go_to_the_work_space_before_conda_env_create():
    # conda env create installs into envs_dirs and caches into pkgs_dirs, both under ~/.conda unless told
    create = README.index("conda env create -f environment.yml")
    for setting in ("conda config --add envs_dirs /glade/work/$USER/", "conda config --add pkgs_dirs /glade/work/$USER/"):
        assert -1 < README.find(setting) < create, setting
    assert "conda config --show envs_dirs pkgs_dirs" in README and "conda env list" in README  # how to check


def test_the_aws_ofi_nccl_recipe_has_hwloc_a_cxx20_compiler_and_a_check():
    recipe = " ".join(README[README.index("## NCCL on Slingshot"):README.index("## What `common.sh` does")].split())
    assert "--with-hwloc=" in recipe and "C++20" in recipe and "module load cuda gcc" in recipe
    assert "ldd $DISTLAB_NCCL_PLUGIN_DIR/libnccl-net-ofi.so" in recipe and "grep ncclNetPlugin_v" in recipe
