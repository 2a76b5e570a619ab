"""The three places of the code, each with an index: every module of distlab (the library the chapters teach),
labkit (what the labs use) and coursetools (what builds and checks the course) is listed, with its job, in its
package's docstring and in the README's repository section; each lab has its exercise module; the library
imports neither of the other two."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("distlab", "labkit", "labkit.exercises", "coursetools")


def modules(package: str) -> list[str]:
    folder = ROOT.joinpath(*package.split("."))
    return sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__") + sorted(
        p.name for p in folder.iterdir() if (p / "__init__.py").exists())


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_index_lists_every_module(package):
    doc = importlib.import_module(package).__doc__
    listed = set(re.findall(r"^(\w+)\s", doc, flags=re.M))  # a module's name starts its line
    if package == "labkit.exercises":                       # "ch01 ... ch13" stands for the labs' modules
        listed |= {m for m in modules(package) if re.fullmatch(r"ch\d\d", m)}
    missing = [m for m in modules(package) if m not in listed]
    assert not missing, f"add these to {package}'s index (its __init__.py): {missing}"


def test_the_readme_lists_every_module():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The repository"):]
    missing = [f"{p}.{m}" for p in ("distlab", "labkit", "coursetools") for m in modules(p)
               if not re.search(rf"\b{m}\b", section)]
    assert not missing, f"add these to the README's repository section: {missing}"


def test_every_lab_has_its_exercise_module_and_imports_it_one_way():
    for lab in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        number = lab.name[:2]
        text = lab.read_text()
        if "exercises." not in text:
            continue
        assert (ROOT / "labkit" / "exercises" / f"ch{number}.py").exists(), f"{lab.name}: no labkit/exercises/ch{number}.py"
        assert f"from labkit.exercises import ch{number} as exercises" in text, (
            f"{lab.name} should import its checks as `from labkit.exercises import ch{number} as exercises`")


def test_the_library_and_the_scripts_import_neither_the_labs_kit_nor_the_course_tools():
    files = [*(ROOT / "distlab").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    offenders = [str(p.relative_to(ROOT)) for p in files
                 if re.search(r"^\s*(from|import)\s+(labkit|coursetools)\b", p.read_text(), flags=re.M)]
    assert not offenders, f"distlab and the scripts must stand alone (a cluster job needs nothing else): {offenders}"
