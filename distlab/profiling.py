"""Read a ``torch.profiler`` Chrome trace and measure from it: time per kind, communication, overlap.

A trace (``prof.export_chrome_trace(path)``, opens in https://ui.perfetto.dev or chrome://tracing) is JSON with
``traceEvents``; the ones that matter here are complete events (``"ph": "X"``): a name, a thread (``tid``),
a start ``ts`` and a duration ``dur``, both in microseconds. Everything below is pure functions on those
events, so it is unit-tested on hand-made traces and used on real ones by
``scripts/12_hpc_operations/profile_step.py``.

What is what (measured with torch 2.13):

* **steps**: ``ProfilerStep#N`` spans, one per active step of the profiler's schedule (``prof.step()``);
* **communication on a CPU (gloo)**: one ``gloo:<collective>`` event per collective, on one of gloo's worker
  threads, lasting while the collective runs. The main thread only records a short ``c10d::allreduce_``
  (the enqueue). FSDP2's reduce-scatters appear as ``gloo:all_reduce``: gloo has no reduce-scatter of one
  flat tensor, so its ``_reduce_scatter_base`` all-reduces the buffer and keeps this rank's slice;
* **communication on a GPU (NCCL)**: the NCCL kernels (``ncclDevKernel_AllReduce...``, category ``kernel``)
  on the GPU's streams; ``nccl:all_reduce`` on the CPU is only the launch;
* **compute on a CPU**: the ``aten::`` operators of the main thread (backward's too: the autograd engine runs
  CPU work on the thread that called ``backward()``); on a GPU: every kernel that is not NCCL's, and the
  memory copies and memsets (``gpu_memcpy``, ``gpu_memset``): the GPU is busy, not idle;
* **backward**: the spans a script labels ``record_function("backward")``.

Time per kind partitions the steps' wall time: at each instant the rank computes only, communicates only,
does both (overlapped), or neither (idle: Python between operators, the data loader, a sleep). Waiting for a
late peer counts as communication, not idle: a gloo event lasts until the slowest rank has arrived, and an
NCCL kernel spins on the GPU until then. So a straggler's peers show its delay as communication, and the
straggler itself shows it wherever it spent it.
"""

from __future__ import annotations

import json
from pathlib import Path

STEP_PREFIX = "ProfilerStep#"
BACKWARD_LABEL = "backward"
CPU_COMMUNICATION_PREFIXES = ("gloo:",)
KINDS = ("compute", "communication", "overlapped", "idle")  # exposed communication = "communication"


# --------------------------------------------------------------------------------------------------
# Intervals: (start, end) pairs in microseconds
# --------------------------------------------------------------------------------------------------


def merge(intervals) -> list[tuple[float, float]]:
    """Sorted, non-overlapping intervals covering the same time as ``intervals``."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals) -> float:
    """Time covered by ``intervals`` (overlaps counted once)."""
    return sum(end - start for start, end in merge(intervals))


def intersect(a, b) -> list[tuple[float, float]]:
    """The time covered by both ``a`` and ``b``."""
    a, b = merge(a), merge(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[tuple[float, float]]:
    """The time covered by ``a`` and not by ``b``."""
    out = []
    b = merge(b)
    for start, end in merge(a):
        cursor = start
        for b_start, b_end in b:
            if b_end <= cursor or b_start >= end:
                continue
            if b_start > cursor:
                out.append((cursor, b_start))
            cursor = max(cursor, b_end)
        if cursor < end:
            out.append((cursor, end))
    return out


# --------------------------------------------------------------------------------------------------
# Events of a trace
# --------------------------------------------------------------------------------------------------


def load_trace(path) -> dict:
    """The trace as exported by ``torch.profiler`` (raises if the file is not JSON with ``traceEvents``)."""
    trace = json.loads(Path(path).read_text())
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return trace


def complete_events(trace: dict) -> list[dict]:
    """The events with a duration (``"ph": "X"``)."""
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def span(event: dict) -> tuple[float, float]:
    return float(event["ts"]), float(event["ts"]) + float(event["dur"])


def is_communication(event: dict, device_type: str = "cpu") -> bool:
    """A collective running: gloo's worker-thread events on a CPU, NCCL's kernels on a GPU."""
    name = event.get("name", "")
    if device_type == "cuda":
        return event.get("cat") == "kernel" and "nccl" in name.lower()
    return name.startswith(CPU_COMMUNICATION_PREFIXES)


def collective_name(event: dict) -> str:
    """``gloo:all_reduce`` -> ``all_reduce``; ``ncclDevKernel_AllGather_RING_LL(...)`` -> ``all_gather``."""
    name = event["name"]
    if ":" in name and not name.lower().startswith("nccl"):
        return name.split(":", 1)[1]
    lowered = name.lower()
    for key, collective in (("allreduce", "all_reduce"), ("allgather", "all_gather"),
                            ("reducescatter", "reduce_scatter"), ("broadcast", "broadcast"),
                            ("sendrecv", "send_recv"), ("alltoall", "all_to_all")):
        if key in lowered:
            return collective
    return name


def is_step(event: dict) -> bool:
    """A ``ProfilerStep#N`` span on the CPU. On a GPU Kineto writes each step twice: the CPU span and a
    ``gpu_user_annotation`` copy on the GPU's stream (seen on an H200, torch 2.11: 4 spans for 2 steps)."""
    return event["name"].startswith(STEP_PREFIX) and event.get("cat") != "gpu_user_annotation"


def main_thread(events: list[dict]) -> object:
    """The thread that ran the steps (the one with the ``ProfilerStep#`` spans)."""
    for e in events:
        if is_step(e):
            return e["tid"]
    raise ValueError("no ProfilerStep# event: was prof.step() called inside the profiler's active steps?")


# What keeps a GPU busy besides kernels: Kineto's copies (host-device, device-device) and memsets. Left out, a
# step's cudaMemcpy would count as idle GPU time.
GPU_BUSY_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def is_compute(event: dict, device_type: str, thread) -> bool:
    if device_type == "cuda":
        return event.get("cat") in GPU_BUSY_CATEGORIES and not is_communication(event, "cuda")
    return event["tid"] == thread and event["name"].startswith("aten::")


def step_spans(events: list[dict]) -> list[tuple[float, float]]:
    return sorted(span(e) for e in events if is_step(e))


def labelled_spans(events: list[dict], label: str, device_type: str = "cpu") -> list[tuple[float, float]]:
    """Spans of ``record_function(label)``; on a GPU, where the GPU ran them (``gpu_user_annotation``)."""
    category = "gpu_user_annotation" if device_type == "cuda" else "user_annotation"
    return sorted(span(e) for e in events if e["name"] == label and e.get("cat") == category)


# --------------------------------------------------------------------------------------------------
# What a trace says
# --------------------------------------------------------------------------------------------------


def communication_events(trace: dict, device_type: str = "cpu") -> list[dict]:
    """Every collective that ran inside the profiled steps: ``{collective, start, end}`` in microseconds."""
    out = []
    for e in events_in_steps(trace):
        if is_communication(e, device_type):
            start, end = span(e)
            # the shapes of its inputs (recorded with record_shapes=True): a flat buffer (FSDP's) or not
            out.append({"collective": collective_name(e), "start": start, "end": end,
                        "input_dims": e.get("args", {}).get("Input Dims")})
    return sorted(out, key=lambda c: c["start"])


def events_in_steps(trace: dict) -> list[dict]:
    """The events with a duration that start inside the profiled steps (``ProfilerStep#`` spans)."""
    events = complete_events(trace)
    steps = merge(step_spans(events))
    return [e for e in events if any(s <= span(e)[0] < t for s, t in steps)]


# What the process group records for each collective it runs ("gloo:all_reduce", "nccl:all_reduce"): a CPU-side
# event with the collective's input tensors, whatever called it (eager c10d, DTensor, compiled code).
BACKEND_PREFIXES = ("gloo:", "nccl:")
ELEMENT_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4}


def collective_calls(trace: dict, collectives: tuple = ("all_reduce", "broadcast")) -> list[dict]:
    """The collectives a profiled step ran, each ``{collective, payload_bytes}`` (its input's bytes: distlab.comm's
    payload for an all-reduce or a broadcast) inside the profiled steps, read off the process group's own events; the
    profiler must record shapes (``one_step`` does).

    Unlike :class:`distlab.comm.CommCounter` it needs no Python dispatch mode, so it also counts what compiled code
    issues (a dispatch mode turns dynamo off: torch 2.13 ``_dynamo/convert_frame.py`` 2538-2557). It knows nothing
    of modules or phases: a step's totals only. Read on gloo; NCCL names its events the same way (torch's
    ProcessGroupNCCL.hpp: ``allreduce_impl``'s ``profilingTitle = "nccl:all_reduce"``), not yet read on a GPU."""
    import math

    calls = []
    for event in sorted(events_in_steps(trace), key=lambda e: e["ts"]):
        name = event["name"]
        if not name.startswith(BACKEND_PREFIXES) or name.split(":", 1)[1] not in collectives:
            continue
        args = event.get("args", {})
        dims, types = args.get("Input Dims"), args.get("Input type")
        if not dims or not types:
            raise ValueError(f"{name} has no input shapes: profile with record_shapes=True")
        calls.append({"collective": name.split(":", 1)[1],
                      "payload_bytes": math.prod(dims[0]) * ELEMENT_BYTES[types[0]]})
    return calls


def time_per_kind(trace: dict, device_type: str = "cpu") -> dict:
    """Seconds of the profiled steps spent computing only, communicating only, both, or neither.

    The four kinds partition the steps' spans, so they add up to ``window_seconds`` (the trace's own wall
    time of the active steps); the script compares that with the wall time it measured with its own clock.
    Also: ``compute_seconds`` and ``communication_seconds`` in all (overlapped time in both).
    """
    events = complete_events(trace)
    thread = main_thread(events)
    window = merge(step_spans(events))
    compute = intersect([span(e) for e in events if is_compute(e, device_type, thread)], window)
    communication = intersect([span(e) for e in events if is_communication(e, device_type)], window)
    both = intersect(compute, communication)
    busy = merge(compute + communication)
    seconds = {
        "compute": length(subtract(compute, communication)) / 1e6,
        "communication": length(subtract(communication, compute)) / 1e6,
        "overlapped": length(both) / 1e6,
        "idle": length(subtract(window, busy)) / 1e6,
    }
    return {**seconds, "window_seconds": length(window) / 1e6, "steps": len(step_spans(events)),
            "compute_seconds": length(compute) / 1e6, "communication_seconds": length(communication) / 1e6}


def backward_overlap(trace: dict, device_type: str = "cpu") -> dict:
    """How much communication ran while backward was computing, from the trace's intervals.

    ``hidden_fraction``: the share of communication time that overlapped backward's own compute (the time
    that communication cost nothing); ``during_backward_fraction``: the share that fell inside the backward
    spans at all (computing or not); ``after_backward_fraction``: the share outside them (forward's
    all-gathers under FSDP, or an all-reduce left waiting for the step's end).
    """
    events = complete_events(trace)
    thread = main_thread(events)
    window = merge(step_spans(events))
    backward = intersect(labelled_spans(events, BACKWARD_LABEL, device_type), window)
    if not backward:
        raise ValueError(f"no record_function({BACKWARD_LABEL!r}) span in the profiled steps")
    compute = [span(e) for e in events if is_compute(e, device_type, thread)]
    communication = intersect([span(e) for e in events if is_communication(e, device_type)], window)
    total = length(communication)
    hidden = length(intersect(communication, intersect(compute, backward)))
    inside = length(intersect(communication, backward))
    share = (lambda x: x / total) if total > 0 else (lambda x: 0.0)
    return {"communication_seconds": total / 1e6, "hidden_seconds": hidden / 1e6,
            "backward_seconds": length(backward) / 1e6, "hidden_fraction": share(hidden),
            "during_backward_fraction": share(inside), "after_backward_fraction": share(total - inside)}


def timeline(trace: dict, device_type: str = "cpu", first_step_only: bool = True) -> list[dict]:
    """Rows for ``distlab.gantt``: backward spans, merged compute and each collective, in seconds from the
    first profiled step's start (only that step by default, so a picture stays readable)."""
    events = complete_events(trace)
    thread = main_thread(events)
    steps = step_spans(events)
    window = [steps[0]] if first_step_only else merge(steps)
    origin = window[0][0]
    rows = [{"lane": "compute", "kind": "compute", "start": s, "end": e}
            for s, e in intersect([span(ev) for ev in events if is_compute(ev, device_type, thread)], window)]
    rows += [{"lane": "backward", "kind": "backward", "start": s, "end": e}
             for s, e in intersect(labelled_spans(events, BACKWARD_LABEL, device_type), window)]
    for c in communication_events(trace, device_type):
        if any(s <= c["start"] < e for s, e in window):
            rows.append({"lane": "communication", "kind": c["collective"], "start": c["start"], "end": c["end"],
                         "input_dims": c["input_dims"]})
    return [{**r, "start": (r["start"] - origin) / 1e6, "end": (r["end"] - origin) / 1e6} for r in rows]


def flat_buffer(row: dict) -> bool:
    """A collective on one flat (1-D) buffer, as FSDP2 packs a unit's parameters or gradients; DTensor's
    collectives in a TP plan run on activations (B x S x H) or loss statistics (B x S). Under sequence
    parallelism the norm weights' gradient all-reduces are 1-D too: this rule is for plans without it."""
    dims = row.get("input_dims") or [[]]
    first = dims[0]
    while first and isinstance(first[0], list):   # a TensorList input: its first tensor
        first = first[0]
    return len(first) == 1


def one_step(device):
    """A profiler for one step: ``with profiling.one_step(device) as prof: ...; prof.step()``; then
    :func:`trace_of` reads it. Input shapes recorded (``flat_buffer`` needs them)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if getattr(device, "type", "") == "cuda" else [])
    # repeat=1: one cycle. The default (0) starts recording again after prof.step(), and the trace exported
    # after the block would be that empty next step.
    return profile(activities=activities, record_shapes=True,
                   schedule=schedule(wait=0, warmup=0, active=1, repeat=1))


def trace_of(prof) -> dict:
    """The Chrome trace of a finished profiler, as :func:`load_trace` returns it (through a temporary file)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return load_trace(path)


# --------------------------------------------------------------------------------------------------
# Where a GPU step's time goes (chapter 01's ladder): the device's kernels by kind, and the time it sat idle
# --------------------------------------------------------------------------------------------------

# In order: the first pattern a kernel's name matches names its kind. Attention first: the memory-efficient kernel's
# name carries "cutlass" too (fmha_cutlassF_...), which would read as a matrix multiply.
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("optimizer", ("adam", "multi_tensor_apply")),
    ("matrix multiplies", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "sm90_", "sm80_")),
)
OTHER_KERNELS = "other kernels (norms, RoPE, SwiGLU, loss, casts)"
DEVICE_IDLE = "device idle (launch gaps, host work)"


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel, from its name (``KERNEL_KINDS``); anything else is ``OTHER_KERNELS``."""
    lowered = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return OTHER_KERNELS


def device_time_by_kind(trace: dict) -> dict:
    """Seconds of one profiled GPU step by kind of kernel, and the time the device ran nothing.

    The window runs from the first kernel or copy to the last one's end. Kernels on one stream do not overlap, so
    their sum per kind is the device's busy time (``busy_seconds``); ``DEVICE_IDLE`` is the window less the union
    of every kernel and copy: where the device waited for the host (launches, Python, the allocator).
    ``kernels`` counts the launches: a step of hundreds of small kernels is what ``torch.compile`` fuses."""
    events = [e for e in complete_events(trace) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        raise ValueError("no GPU kernel in the trace: profile with ProfilerActivity.CUDA on a GPU")
    seconds: dict[str, float] = {}
    for e in events:
        kind = kernel_kind(e["name"]) if e["cat"] == "kernel" else "memory copies and sets"
        seconds[kind] = seconds.get(kind, 0.0) + e["dur"] / 1e6
    spans = [span(e) for e in events]
    window = (min(s for s, _ in spans), max(e for _, e in spans))
    busy = length(merge(spans))
    seconds[DEVICE_IDLE] = (window[1] - window[0] - busy) / 1e6
    return {"seconds": seconds, "window_seconds": (window[1] - window[0]) / 1e6, "busy_seconds": busy / 1e6,
            "kernels": sum(e["cat"] == "kernel" for e in events),
            "attention_kernels": sorted({e["name"] for e in events if kernel_kind(e["name"]) == "attention"})}
