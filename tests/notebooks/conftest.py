import pytest


def pytest_collection_modifyitems(items):
    """The learner's copies run after the full notebooks (they replay the runs those made): `make test` runs
    them in a phase of their own after the first (on two workers; nothing in them measures seconds)."""
    for item in items:
        if "tests/notebooks/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.serial)
