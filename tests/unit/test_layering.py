"""The house's arrows point one way: coursetools (what builds and checks the course) may use labkit and distlab;
labkit (what the labs import) may use distlab; distlab (what the chapters teach) uses neither. A lab or a learner's
copy must never need the course's build tools."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"distlab": ("labkit", "coursetools"), "labkit": ("coursetools",)}


def imported_packages(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_a_package_above_it(package):
    wrong = {str(path.relative_to(ROOT)): sorted(imported_packages(path.read_text()) & set(FORBIDDEN[package]))
             for path in sorted((ROOT / package).rglob("*.py"))}
    assert {path: names for path, names in wrong.items() if names} == {}


def test_the_scan_sees_every_form_of_import():
    source = "import coursetools.site\nfrom coursetools import forkserver\nif True:\n    import labkit as kit\n"
    assert imported_packages(source) == {"coursetools", "labkit"}
    assert imported_packages("from . import sibling\nfrom .launch import run\n") == set()
