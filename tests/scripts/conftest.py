import pytest


@pytest.fixture(autouse=True)
def _real_runs_only(monkeypatch, request):
    """Script tests launch for real: the replay cache is for the notebooks. One exception: a module that declares
    ``SHARES_RUNS_WITH_THE_LAB`` (chapter 14's, whose lab launches the very same commands in the same folders)
    keeps the cache, so each command runs once per make test, by whichever of the two comes first, and the other
    replays that real run; its timing-sensitive tests (marked serial) still launch for real."""
    if getattr(request.module, "SHARES_RUNS_WITH_THE_LAB", False) and not request.node.get_closest_marker("serial"):
        return
    monkeypatch.delenv("DISTLAB_LAUNCH_CACHE", raising=False)
