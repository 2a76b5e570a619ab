"""Every distlab module is listed, with its job, in distlab/__init__.py and in the README's repository section."""

import re
from pathlib import Path

import distlab

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(p.stem for p in (ROOT / "distlab").glob("*.py") if p.stem != "__init__") + sorted(
    p.name for p in (ROOT / "distlab").iterdir() if (p / "__init__.py").exists())


def test_the_package_index_lists_every_module():
    listed = set(re.findall(r"^(\w+)\s", distlab.__doc__, flags=re.M))  # a module's name starts its line
    missing = [m for m in MODULES if m not in listed]
    assert not missing, f"add these to distlab/__init__.py's index: {missing}"


def test_the_readme_lists_every_module():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The repository"):]
    missing = [m for m in MODULES if not re.search(rf"\b{m}\b", section)]
    assert not missing, f"add these to the README's repository section: {missing}"
