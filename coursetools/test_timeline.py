"""Where ``make test``'s time goes, and how much of the machine each test leaves idle.

A pytest plugin, on when ``DISTLAB_TEST_TIMELINE`` names a folder (``make test PYTEST_ARGS="-p
coursetools.test_timeline"`` with the variable set): every worker writes each test's start and end
(``tests-<worker>.jsonl``), and the controller samples the machine's busy cores from ``/proc/stat`` every half second
(``cpu.jsonl``). ``python -m coursetools.test_timeline FOLDER`` then prints, per test file, its wall time, the busy
cores while it ran, and the idle core-seconds it is charged: in each half second, the cores left idle are shared
among the tests running then. A file that waits (a timeout, a sleep, a scheduler's poll) shows many idle
core-seconds; a file that computes shows few. That tells which tests to shorten by design and which to overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

ENV = "DISTLAB_TEST_TIMELINE"
PERIOD_S = 0.5


def _folder() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def _busy_and_total() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]           # idle + iowait
    return sum(fields) - idle, sum(fields)


def _sample(path: Path, stop: threading.Event) -> None:
    cores = os.cpu_count() or 1
    busy, total = _busy_and_total()
    with path.open("a") as out:
        while not stop.wait(PERIOD_S):
            now_busy, now_total = _busy_and_total()
            share = (now_busy - busy) / max(1, now_total - total)
            out.write(json.dumps({"t": time.time(), "busy_cores": round(share * cores, 3)}) + "\n")
            out.flush()
            busy, total = now_busy, now_total


_STOP = threading.Event()


def pytest_configure(config):
    folder = _folder()
    if folder is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    folder.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_sample, args=(folder / "cpu.jsonl", _STOP), daemon=True).start()


def pytest_unconfigure(config):
    _STOP.set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's start and end (its set-up and teardown included), one line a test."""
    start, cpu = time.time(), _own_cpu()
    yield
    folder = _folder()
    if folder is not None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with (folder / f"tests-{worker}-{os.getpid()}.jsonl").open("a") as out:
            out.write(json.dumps({"test": item.nodeid, "worker": worker, "start": start, "end": time.time(),
                                  "cpu": round(_own_cpu() - cpu, 3)}) + "\n")


def _own_cpu() -> float:
    """This process's CPU seconds and its waited children's (a subprocess a test ran and waited for)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def account(folder: Path) -> list[dict]:
    """Per test file: wall seconds, mean busy cores while it ran, idle core-seconds charged to it."""
    tests = [json.loads(line) for path in folder.glob("tests-*.jsonl") for line in path.read_text().splitlines()]
    samples = [json.loads(line) for line in (folder / "cpu.jsonl").read_text().splitlines()]
    cores = os.cpu_count() or 1
    by_file = defaultdict(lambda: {"wall": 0.0, "idle": 0.0, "busy": 0.0, "tests": 0})
    for test in tests:
        entry = by_file[test["test"].split("::")[0]]
        entry["wall"] += test["end"] - test["start"]
        entry["tests"] += 1
    starts = sorted(tests, key=lambda t: t["start"])
    for sample in samples:
        t0, t1 = sample["t"] - PERIOD_S, sample["t"]
        running = [t for t in starts if t["start"] < t1 and t["end"] > t0]
        if not running:
            continue
        idle = max(0.0, cores - sample["busy_cores"]) * PERIOD_S / len(running)
        busy = sample["busy_cores"] * PERIOD_S / len(running)
        for test in running:
            entry = by_file[test["test"].split("::")[0]]
            entry["idle"] += idle
            entry["busy"] += busy
    rows = [{"file": name, **values} for name, values in by_file.items()]
    return sorted(rows, key=lambda r: -r["idle"])


def launches(folder: Path) -> dict:
    """What labkit.launch noted of each launch (launches.jsonl): the runs started, the replays, and the runs started
    more than once with the same key (two tests, or a test and a lab, asking for one run before either stored it)."""
    path = folder / "launches.jsonl"
    notes = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    ran = [n for n in notes if not n["replayed"]]
    runs_of_key = defaultdict(list)
    for note in ran:
        if note["key"]:
            runs_of_key[note["key"]].append(note)
    again = [run for runs in runs_of_key.values() for run in sorted(runs, key=lambda n: n["start"])[1:]]
    by_script = defaultdict(float)
    for note in ran:
        by_script[note["script"]] += note["seconds"]
    return {"ran": len(ran), "ran_seconds": sum(n["seconds"] for n in ran),
            "replayed": len(notes) - len(ran), "again": len(again), "again_seconds": sum(n["seconds"] for n in again),
            "again_runs": again, "by_script": sorted(by_script.items(), key=lambda item: -item[1])}


def cpu_account(folder: Path) -> dict:
    """CPU seconds, whatever else ran at the time: each test's worker (and the subprocesses it waited for), and each
    program the fork server ran (labkit.forkserver.note_cpu: a forkrun with its ranks, a kernel, a scheduler's rank),
    charged to the test that started it, or, when no test is known (a notebook kernel's runs, a batch job's ranks),
    to its script."""
    tests = [json.loads(line) for path in folder.glob("tests-*.jsonl") for line in path.read_text().splitlines()]
    path = folder / "programs.jsonl"
    programs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    by_file, by_script = defaultdict(float), defaultdict(float)
    for test in tests:
        by_file[test["test"].split("::")[0]] += test.get("cpu", 0.0)
    for program in programs:
        argv = program["argv"]
        script = next((a for a in argv if a.endswith(".py")), argv[0] if argv else "?")
        script = "/".join(Path(script).parts[-2:])
        by_script[script] += program["cpu"]
        owner = program["test"].split("::")[0] if program["test"] else f"(no test) {Path(program['cwd'] or '').name}/"
        by_file[owner] += program["cpu"]
    return {"by_file": sorted(by_file.items(), key=lambda item: -item[1]),
            "by_script": sorted(by_script.items(), key=lambda item: -item[1]),
            "tests": sum(t.get("cpu", 0.0) for t in tests), "programs": sum(p["cpu"] for p in programs)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    rows = account(args.folder)
    print(f"{'test file':62} {'tests':>5} {'wall s':>8} {'busy core-s':>11} {'idle core-s':>11}")
    for row in rows[:args.top]:
        print(f"{row['file'][:62]:62} {row['tests']:5d} {row['wall']:8.1f} {row['busy']:11.1f} {row['idle']:11.1f}")
    print(f"{'all':62} {sum(r['tests'] for r in rows):5d} {sum(r['wall'] for r in rows):8.1f} "
          f"{sum(r['busy'] for r in rows):11.1f} {sum(r['idle'] for r in rows):11.1f}")
    seen = launches(args.folder)
    if seen["ran"] or seen["replayed"]:
        print(f"\nlaunches: {seen['ran']} run ({seen['ran_seconds']:.0f} s of wall time), {seen['replayed']} replayed; "
              f"{seen['again']} run again with a key already run ({seen['again_seconds']:.0f} s)")
        for note in seen["again_runs"][:args.top]:
            print(f"  again: {note['script']:45} {note['seconds']:6.1f} s  {note['test'] or '(a notebook kernel)'}")
        for script, seconds in seen["by_script"][:args.top]:
            print(f"  {script:55} {seconds:7.1f} s")
    cpu = cpu_account(args.folder)
    if cpu["programs"] or cpu["tests"]:
        print(f"\nCPU seconds: {cpu['tests']:.0f} in the test processes, {cpu['programs']:.0f} in forked programs")
        for name, seconds in cpu["by_file"][:args.top]:
            print(f"  {name[:62]:62} {seconds:8.1f}")
        print("CPU seconds by script (forked programs)")
        for name, seconds in cpu["by_script"][:args.top]:
            print(f"  {name[:62]:62} {seconds:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
