import pytest


def pytest_collection_modifyitems(items):
    """The learner's copies run after the full notebooks (they replay the runs those made): `make test` runs
    everything marked `serial` in its second phase, alone."""
    for item in items:
        if "tests/notebooks/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.serial)
