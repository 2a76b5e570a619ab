"""Every broken run of chapter 14 names the public reports it comes from, each with a quote (labkit.diagnosis_sources)."""

import pytest

from labkit import diagnosis_sources


def broken_runs():
    registry = pytest.importorskip("labkit.broken_runs", reason="helper A's registry of broken runs is not here yet")
    return registry.BROKEN_RUNS


def test_every_broken_run_has_a_source():
    names = [case.name for case in broken_runs()]
    missing = [name for name in names if not diagnosis_sources.sources_for(name)]
    assert not missing, f"broken runs without a public source in labkit/diagnosis_sources.py: {missing}"
    stray = sorted(set(diagnosis_sources.SOURCES) - set(names))
    assert not stray, f"sources kept for cases the registry does not have: {stray}"


def test_each_source_says_where_and_quotes_it():
    seen = set()
    for case, sources in [*diagnosis_sources.SOURCES.items(), *diagnosis_sources.LEFT_OUT.items(),
                          *(("torch: " + name, changes) for name, changes in diagnosis_sources.TORCH_CHANGES.items())]:
        assert sources, case
        for source in sources:
            assert set(source) == {"url", "title", "quote"}, (case, source)
            assert source["url"].startswith("https://"), (case, source["url"])
            assert source["title"].strip() and len(source["quote"].strip()) >= 20, (case, source["url"])
            assert (case, source["url"]) not in seen, f"{case} lists {source['url']} twice"
            seen.add((case, source["url"]))


def test_a_case_without_sources_is_reported_and_the_left_out_case_keeps_its_own():
    assert diagnosis_sources.sources_for("no-such-case") == []
    names = {case.name for case in broken_runs()}
    assert not set(diagnosis_sources.LEFT_OUT) & names, "a case the registry has is listed as left out"
    assert all(diagnosis_sources.sources_for(name) for name in diagnosis_sources.LEFT_OUT)
