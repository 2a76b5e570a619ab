"""distlab.profiling on hand-made traces: interval maths, time per kind, counting, overlap with backward."""

import json

import pytest

from distlab import profiling

MAIN, GLOO = 1, 2


def event(name, ts, dur, tid=MAIN, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}


def hand_made_trace():
    """One step of 100 us: forward computes 0-30, backward 40-90 (computing 40-60 and 70-90), an all-reduce
    on gloo's thread 50-80 (10 us hidden under compute at 50-60, 10 us at 70-80, 10 us exposed at 60-70)."""
    return {"traceEvents": [
        event("ProfilerStep#2", 0, 100, cat="user_annotation"),
        event("aten::linear", 0, 30), event("aten::mm", 5, 10),          # nested: counted once
        event("backward", 40, 50, cat="user_annotation"),
        event("aten::mm", 40, 20), event("aten::mul", 70, 20),
        event("c10d::allreduce_", 50, 1),                                 # the enqueue: not communication
        event("gloo:all_reduce", 50, 30, tid=GLOO),
        event("gloo:all_gather", 150, 10, tid=GLOO),                      # outside the step: not counted
        {"ph": "M", "name": "thread_name", "tid": GLOO},
    ]}


def test_interval_maths():
    assert profiling.merge([(5, 8), (0, 3), (2, 4)]) == [(0, 4), (5, 8)]
    assert profiling.length([(0, 10), (5, 15)]) == 15
    assert profiling.intersect([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]
    assert profiling.subtract([(0, 10)], [(2, 3), (5, 20)]) == [(0, 2), (3, 5)]


def test_time_per_kind_partitions_the_step():
    kinds = profiling.time_per_kind(hand_made_trace())
    assert kinds["compute"] == pytest.approx(50e-6)        # 0-30, 40-50, 80-90
    assert kinds["communication"] == pytest.approx(10e-6)  # 60-70
    assert kinds["overlapped"] == pytest.approx(20e-6)     # 50-60, 70-80
    assert kinds["idle"] == pytest.approx(20e-6)           # 30-40, 90-100
    assert sum(kinds[k] for k in profiling.KINDS) == pytest.approx(kinds["window_seconds"]) == pytest.approx(100e-6)


def test_communication_events_count_only_the_profiled_steps():
    events = profiling.communication_events(hand_made_trace())
    assert [e["collective"] for e in events] == ["all_reduce"]


def test_backward_overlap_from_intervals():
    overlap = profiling.backward_overlap(hand_made_trace())
    assert overlap["hidden_fraction"] == pytest.approx(20 / 30)
    assert overlap["during_backward_fraction"] == pytest.approx(1.0)
    assert overlap["after_backward_fraction"] == pytest.approx(0.0)


def test_gpu_trace_uses_kernels():
    trace = {"traceEvents": [
        event("ProfilerStep#1", 0, 100, cat="user_annotation"),
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 20, 40, tid=7, cat="kernel"),
        event("ampere_sgemm_128x64", 10, 30, tid=7, cat="kernel"),
        event("nccl:all_reduce", 19, 1),                                  # the CPU-side launch
        event("backward", 10, 60, tid=7, cat="gpu_user_annotation"),
        event("ProfilerStep#1", 5, 90, tid=7, cat="gpu_user_annotation"),  # Kineto's GPU-side copy of the step
    ]}
    assert profiling.step_spans(trace["traceEvents"]) == [(0, 100)]      # one step, not two
    assert profiling.main_thread(trace["traceEvents"]) == MAIN
    kinds = profiling.time_per_kind(trace, "cuda")
    assert kinds["overlapped"] == pytest.approx(20e-6) and kinds["communication"] == pytest.approx(20e-6)
    assert [e["collective"] for e in profiling.communication_events(trace, "cuda")] == ["all_reduce"]
    assert profiling.backward_overlap(trace, "cuda")["hidden_fraction"] == pytest.approx(0.5)


def test_gpu_copies_and_memsets_keep_the_gpu_busy():
    # Kineto's categories for cudaMemcpy and cudaMemset on the GPU: busy time, not idle
    trace = {"traceEvents": [
        event("ProfilerStep#1", 0, 100, cat="user_annotation"),
        event("Memcpy HtoD (Pageable -> Device)", 0, 20, tid=7, cat="gpu_memcpy"),
        event("Memset (Device)", 20, 10, tid=7, cat="gpu_memset"),
        event("ampere_sgemm_128x64", 30, 30, tid=7, cat="kernel"),
    ]}
    kinds = profiling.time_per_kind(trace, "cuda")
    assert kinds["compute"] == pytest.approx(60e-6) and kinds["idle"] == pytest.approx(40e-6)


def test_timeline_rows_start_at_the_step():
    rows = profiling.timeline(hand_made_trace())
    lanes = {(r["lane"], r["kind"]) for r in rows}
    assert lanes == {("compute", "compute"), ("backward", "backward"), ("communication", "all_reduce")}
    assert min(r["start"] for r in rows) == 0.0


def test_a_file_without_events_is_refused(tmp_path):
    path = tmp_path / "not_a_trace.json"
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a Chrome trace"):
        profiling.load_trace(path)
    with pytest.raises(ValueError, match="ProfilerStep"):
        profiling.time_per_kind({"traceEvents": [event("aten::mm", 0, 1)]})


# ---- chapter 12's exercises: the solutions pass, plausible wrong answers are rejected -----------------------

from labkit.exercises import ch12  # noqa: E402
from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong  # noqa: E402


def lanes(rows, name):
    return [(r["start"], r["end"]) for r in rows if r["lane"] == name]


def wrong_all_communication(rows):
    return profiling.length(lanes(rows, "communication"))


def wrong_inside_backward_span(rows):
    return profiling.length(profiling.intersect(lanes(rows, "communication"), lanes(rows, "backward")))


def wrong_summed_per_collective(rows):
    hidden = profiling.intersect(lanes(rows, "compute"), lanes(rows, "backward"))
    return sum(profiling.length(profiling.intersect([c], hidden)) for c in lanes(rows, "communication"))


def wrong_any_compute(rows):
    return profiling.length(profiling.intersect(lanes(rows, "communication"), lanes(rows, "compute")))


def test_hidden_communication_check():
    ch12.check_hidden_communication(ch12.hidden_seconds)
    for wrong in (wrong_all_communication, wrong_inside_backward_span, wrong_summed_per_collective,
                  wrong_any_compute):
        with pytest.raises(ExerciseWrong):
            ch12.check_hidden_communication(wrong)
    with pytest.raises(ExerciseIncomplete):
        ch12.check_hidden_communication(lambda rows: None)


def wrong_stuck_ranks(journals, label):
    return sorted(r for r, j in journals.items() if j["calls"] and j["calls"][-1]["label"] == label
                  and not j["calls"][-1]["done"])


def wrong_everyone_without_the_call(journals, label):
    return sorted(r for r, j in journals.items() if all(c["label"] != label for c in j["calls"]))


def wrong_not_finished(journals, label):
    return sorted(r for r, j in journals.items() if j["state"] != "finished")


def test_missing_ranks_check():
    ch12.check_missing_ranks(ch12.missing_ranks)
    for wrong in (wrong_stuck_ranks, wrong_everyone_without_the_call, wrong_not_finished):
        with pytest.raises(ExerciseWrong):
            ch12.check_missing_ranks(wrong)
    with pytest.raises(ExerciseIncomplete):
        ch12.check_missing_ranks(lambda journals, label: None)


def shaped(name, ts, dims, dtype="float", tid=GLOO):
    return {**event(name, ts, 5, tid=tid), "args": {"Input Dims": [dims], "Input type": [dtype]}}


def test_collective_calls_reads_the_process_groups_own_events():
    """What compiled code issues is counted off the profiler (no dispatch mode): the process group's events with
    their input's shape and type; the dispatcher's and the functional layer's events of the same call are not
    counted again, nor what ran outside the profiled step."""
    trace = {"traceEvents": [
        event("ProfilerStep#0", 0, 100, cat="user_annotation"),
        shaped("gloo:all_reduce", 10, [4, 32, 64]),                        # 4*32*64 fp32: 32,768 bytes
        shaped("nccl:all_reduce", 20, [4, 32, 64], "c10::BFloat16"),       # half of it
        shaped("gloo:broadcast", 30, [10]),
        shaped("gloo:all_gather", 40, [8]),                                # not asked for
        shaped("_c10d_functional::all_reduce", 50, [4, 32, 64], tid=MAIN),  # the same call, one layer up
        {**event("c10d::allreduce_", 50, 1), "args": {"Input Dims": [[[4, 32, 64]]], "Input type": ["TensorList"]}},
        shaped("gloo:all_reduce", 150, [4, 32, 64]),                       # after the step
    ]}
    assert profiling.collective_calls(trace) == [
        {"collective": "all_reduce", "payload_bytes": 32_768}, {"collective": "all_reduce", "payload_bytes": 16_384},
        {"collective": "broadcast", "payload_bytes": 40}]
    assert [c["collective"] for c in profiling.collective_calls(trace, ("all_gather",))] == ["all_gather"]
    unshaped = {"traceEvents": [event("ProfilerStep#0", 0, 100, cat="user_annotation"),
                                event("gloo:all_reduce", 10, 5, tid=GLOO)]}
    with pytest.raises(ValueError, match="record_shapes"):
        profiling.collective_calls(unshaped)
