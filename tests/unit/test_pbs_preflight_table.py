"""The preflight job's table (distlab.metrics.runs_table): every figure read back from a run's metrics file."""

import json

from distlab.metrics import runs_table


def metrics_file(path, **fields):
    path.write_text(json.dumps({"device": "cuda:0", "checks": [], "throughput": {}, "extra": {}} | fields))
    return str(path)


def test_one_row_per_launch_with_checks_step_time_and_bus_bandwidth(tmp_path):
    bandwidth = metrics_file(tmp_path / "bw.json", checks=[{"passed": True}, {"passed": True}, {"passed": False}],
                             extra={"bandwidth": [{"collective": "all_reduce", "busbw": 2.5e9},
                                                  {"collective": "all_reduce", "busbw": 152.4e9},
                                                  {"collective": "all_gather", "busbw": 999e9}]})
    training = metrics_file(tmp_path / "ddp.json", checks=[{"passed": True}], throughput={"step_seconds": 0.01234})
    table = runs_table([("bandwidth.py", "FAILED(1)", bandwidth), ("train_ddp.py", "ok", training),
                        ("hybrid_3d.py", "missing", str(tmp_path / "never-written.json"))])
    header, *rows = [line.split() for line in table.splitlines()]
    assert header == ["script", "result", "checks", "step", "time", "all-reduce", "busbw", "device"]
    # the largest all-reduce bus bandwidth (not the all-gather's), in GB/s; a failed check counts as failed
    assert rows[0] == ["bandwidth.py", "FAILED(1)", "2/3", "-", "152", "GB/s", "cuda:0"]
    assert rows[1] == ["train_ddp.py", "ok", "1/1", "12.3", "ms", "-", "cuda:0"]
    assert rows[2] == ["hybrid_3d.py", "missing", "-", "-", "-", "-"]  # no metrics file: nothing claimed
    column = len("bandwidth.py  ")  # the longest name and two spaces: where the second column starts
    assert [line[column:].split()[0] for line in table.splitlines()] == ["result", "FAILED(1)", "ok", "missing"]
