import pytest


@pytest.fixture(autouse=True)
def _real_runs_only(monkeypatch):
    """Script tests always launch for real: the replay cache is for the learner's notebook copies only."""
    monkeypatch.delenv("DISTLAB_LAUNCH_CACHE", raising=False)
