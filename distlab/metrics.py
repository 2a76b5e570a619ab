"""The metrics file every script writes, and the numbers it holds: checks, FLOPs, MFU, memory.

A script proves itself through a :class:`Report`::

    report = metrics.Report(__file__, rt, config=vars(args))
    report.losses.append(loss)
    report.check_close("loss equals single-device", parallel_losses, reference_losses, tolerance=1e-5)
    sys.exit(report.finish(args.metrics_out))   # prints the checks; exit 1 if one failed

The JSON written (rank 0) has the keys of DESIGN.md's script contract: script, world_size, device, config,
losses, checks [{name, passed, value, tolerance}], comm [{collective, measured_bytes, analytic_bytes}],
memory, throughput, timeline [{rank, stage, microbatch, kind, start, end}], and ``extra`` for anything else.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Dense peak FLOP/s per GPU (vendor data sheets; no sparsity). MFU is reported only where a peak is known.
PEAK_FLOPS = {
    ("A100", "bf16"): 312e12, ("A100", "fp16"): 312e12, ("A100", "tf32"): 156e12, ("A100", "fp32"): 19.5e12,
    ("H100", "bf16"): 989e12, ("H100", "fp16"): 989e12, ("H100", "tf32"): 494e12, ("H100", "fp32"): 67e12,
    ("H200", "bf16"): 989e12, ("H200", "fp16"): 989e12, ("H200", "tf32"): 494e12, ("H200", "fp32"): 67e12,
}
# The NVL boards (H100 NVL, H200 NVL: PCIe cards, up to 400 W and 600 W) run slower than the SXM modules. NVIDIA's
# tables, as read (the H100 NVL datasheet, PNY's copy; the H200 product page's NVL column, quoted in public notes):
# "FP32 60 TFLOPS", "TF32 Tensor Core 835 TFLOPS*", "BFLOAT16 Tensor Core 1,671 TFLOPS*", "FP16 Tensor Core 1,671
# TFLOPS*", * "With sparsity": the dense figures are half, 835.5 (bf16, fp16) and 417.5 (tf32); FP32 is not a
# sparse figure. The same for both boards.
NVL_PEAK_FLOPS = {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}
# AMD Instinct: THIRD-PARTY FIGURES. No AMD page held them in our searches (amd.com product pages, the CDNA 2 and
# CDNA 3 white papers, the ROCm documentation's GPU specifications and microarchitecture pages, searched 2026-12-02):
# only copies of AMD's tables. MI250X: "FP16 | bf16 (Peak) ... Up to 383.0 TF" for the OAM module (AMD's launch
# table as copied by zexron.com, "AMD MI250(X) Aldebaran as MCM with up to 47.9 TFLOP/s"; gpu.blog's MI250X page:
# "BF16 383 TFLOPS"). A module is two GCDs and PyTorch sees each as one GPU (8 a Frontier node, OLCF's Frontier user
# guide), so one device's peak is half: 191.5. MI300X: "BF16 dense 1307.4 TFLOP/s" (alpharomercoma/MI300X-vs-H200,
# METHODOLOGY.md at 6077fdc); one device in its default single-partition mode. The name "AMD Instinct MI250X / MI250"
# (libdrm's amdgpu.ids, device 0x740C rev 01) names two boards whose peaks differ (the MI250's: 362.1 TF in the
# same copied table), so it gets no peak and no MFU.
AMD_PEAK_FLOPS = {("MI250X", "bf16"): 383.0e12 / 2, ("MI250X", "fp16"): 383.0e12 / 2,
                  ("MI300X", "bf16"): 1307.4e12}


def peak_flops(device_name: str | None, dtype: str = "bf16") -> float | None:
    """Peak FLOP/s of a GPU named like ``torch.cuda.get_device_name()``; None for a CPU or an unknown GPU.

    H100 PCIe is slower than SXM (756 vs 989 TFLOP/s bf16), and the H100 and H200 NVL boards slower still
    (835.5: ``NVL_PEAK_FLOPS``): the name tells them apart (``NVIDIA H100 NVL``, ``NVIDIA H200 NVL``). AMD's
    (``AMD Instinct MI250X``, one GCD; ``AMD Instinct MI300X``) are third-party figures: ``AMD_PEAK_FLOPS``.
    """
    if not device_name:
        return None
    name = device_name.upper()
    if "NVL" in name.split() and ("H100" in name or "H200" in name):
        return NVL_PEAK_FLOPS.get(dtype)
    if "MI250X / MI250" in name:  # one name for two boards (AMD_PEAK_FLOPS): no peak claimed
        return None
    for (gpu, kind), flops in AMD_PEAK_FLOPS.items():
        if gpu in name.split() and kind == dtype:
            return flops
    for (gpu, kind), flops in PEAK_FLOPS.items():
        if gpu in name and kind == dtype:
            return flops * (756 / 989 if gpu == "H100" and "PCIE" in name else 1.0)
    return None


def transformer_flops_per_token(cfg, seq_len: int | None = None) -> float:
    """Training FLOPs per token of the shared transformer: 6 N + 12 L d T (Kaplan/PaLM accounting).

    N counts the parameters that do matrix multiplies (every one except the embedding lookup); 6 = 2
    (multiply-add) x 3 (forward, and backward for inputs and for weights). 12 L d T is attention's
    QK^T and AV products, counted over the full T x T square as PaLM does (causal masking is not subtracted).
    """
    seq_len = seq_len or cfg.seq_len
    matmul_params = cfg.num_params() - cfg.vocab_size * cfg.dim
    return 6 * matmul_params + 12 * cfg.n_layers * cfg.dim * seq_len


def mfu(tokens_per_second: float, flops_per_token: float, device_name: str | None, dtype: str = "bf16",
        num_devices: int = 1) -> float | None:
    """Model FLOPs utilisation: achieved / peak. None where no peak is known (CPUs): no MFU is claimed."""
    peak = peak_flops(device_name, dtype)
    if peak is None:
        return None
    return tokens_per_second * flops_per_token / (peak * num_devices)


def throughput(tokens_per_step: int, seconds: float, steps: int, *, cfg=None, seq_len: int | None = None,
               device=None, dtype: str = "fp32", num_devices: int = 1) -> dict:
    """The throughput block of the metrics file, from ``steps`` timed steps that took ``seconds`` in all.

    Time steps after the first: it pays one-off costs (allocator warm-up, DTensor's sharding caches). With a
    model config, adds FLOPs per token, achieved FLOP/s and MFU; MFU is None where no peak is known (CPUs).
    """
    if steps < 1 or not seconds > 0:
        return {"tokens_per_s": None, "step_seconds": None, "timed_steps": steps}
    tokens_per_s = tokens_per_step * steps / seconds
    block = {"tokens_per_s": tokens_per_s, "step_seconds": seconds / steps, "timed_steps": steps}
    if cfg is not None:
        name = device_name(device) if device is not None else "cpu"
        flops_per_token = transformer_flops_per_token(cfg, seq_len)
        block.update(flops_per_token=flops_per_token, achieved_flops_per_s=tokens_per_s * flops_per_token,
                     device_name=name, peak_dtype=dtype, peak_flops=peak_flops(name, dtype),
                     mfu=mfu(tokens_per_s, flops_per_token, name, dtype, num_devices))
    return block


class StepClock:
    """Wall-clock seconds of whole training steps: the one definition behind the tokens/s and MFU of the
    chapter's hybrids (``scripts/09_hybrid_parallel``). A step is everything a training step does: forward,
    backward, gradient synchronisation, clipping, the optimizer step; not the checks and measurements around it.
    ``sync`` (``Runtime.sync``: the device's queued kernels finished) runs before each reading of the clock, so a
    GPU is timed by the work it did, not by what was launched. The first ``skip`` steps pay one-off costs
    (shape inference, allocator warm-up, DTensor's caches) and are left out of :meth:`throughput`::

        clock = metrics.StepClock(rt.sync)
        for step in ...:
            clock.start(); ...; optimizer.step(); clock.stop()
        report.throughput = clock.throughput(tokens_per_step, cfg=cfg, device=rt.device, num_devices=world)
    """

    def __init__(self, sync=lambda: None, skip: int = 1):
        self.sync, self.skip, self.seconds, self.started = sync, skip, [], None

    def start(self) -> float:
        self.sync()
        self.started = time.perf_counter()
        return self.started

    def stop(self) -> float:
        self.sync()
        self.seconds.append(time.perf_counter() - self.started)
        return self.seconds[-1]

    def throughput(self, tokens_per_step: int, **kwargs) -> dict:
        timed = self.seconds[self.skip:]
        return {**throughput(tokens_per_step, sum(timed), len(timed), **kwargs),
                "timed": "whole steps (forward, backward, gradient sync, clipping, optimizer), device synchronised"}


# fp32 comparisons on a GPU. A CPU sums in one fixed order, so a distributed run and its single-device reference
# differ by a few ulps (the tolerances the scripts state were measured there). A GPU sums in other orders:
# cuBLAS picks its split of a matmul per shape, and some backward kernels (embedding, index_add) add with
# atomics in a nondeterministic order. Differences grow to ~1e-6 relative, about 10x the CPU's. Every fp32
# comparison of the course therefore states its CPU tolerance and widens it by this factor on a GPU (not
# measured in CI, which has no GPU: a margin from the kernels' documented behaviour, still 100x tighter
# than what a wrong result gives). TF32 is off for fp32 matmuls (PyTorch's default), so fp32 means fp32.
GPU_FP32_TOLERANCE_FACTOR = 10


# bf16 mixed precision (FSDP2's MixedPrecisionPolicy: bf16 compute, fp32 gradient reduction and fp32 sharded
# weights) against the fp32 single-device run: bf16 keeps 8 significant bits (unit roundoff 2^-8 = 0.39%), so
# no element-wise fp32 tolerance holds; these do, and still reject a wrong run:
# * losses (~4.8): measured ~2e-3 apart (chapter 05), 5e-4 (chapter 09); tolerance 2e-2 (0.4%);
# * step-0 gradients: the largest difference over the largest gradient, measured 0.6% (chapter 09); tolerance
#   5%: a gradient off by a missing 1/dp or 1/M is 50-100% off;
# * parameters: a few weights whose gradients are near zero step differently (max difference up to a few
#   lr), so the check is on the *mean* |difference| over all weights: measured ~2e-4 after 10 steps at lr 3e-3,
#   against ~8e-3 for a run fed other data. Tolerance lr / 5.
# Chapter 09's scripts hold every tensor to these on its own (bf16_tensor_errors below): a scale shared by the
# whole model (the embedding's gradient, the largest; a mean over every element) hides a fault confined to a
# few small tensors (the query and key projections' gradients halved: 0.3% of that scale; the norm weights,
# 0.26% of the elements). Measured per tensor (chapter 09's bf16 tests, 2-3 steps): the worst gradient 1.2% of
# its own largest (a norm weight's, a key projection's), the worst mean parameter difference lr / 22 (a norm
# weight's): the same tolerances hold, 4x above; tests/unit/test_bf16_checks.py plants both faults.
BF16_LOSS_TOLERANCE = 2e-2
BF16_GRAD_RELATIVE_TOLERANCE = 5e-2


def bf16_param_mean_tolerance(lr: float) -> float:
    return lr / 5


def mean_abs_diff(actual: list, expected: list) -> float:
    """Mean |actual - expected| over every element of two lists of tensors."""
    total = sum((a.detach().double().cpu() - e.detach().double().cpu()).abs().sum().item()
                for a, e in zip(actual, expected))
    return total / sum(a.numel() for a in actual)


def bf16_tensor_errors(actual: dict, expected: dict, *, kind: str) -> dict[str, float]:
    """Each tensor's own error, by name, against the fp32 single-device run's tensor of that name:

    * ``kind="grad"``: max |actual - expected| / max |expected|: the tensor's largest difference over its own
      largest gradient (a tensor whose expected gradient is all zero is held to an absolute 1e-12);
    * ``kind="param"``: the mean |actual - expected| over the tensor's elements.
    """
    errors = {}
    for name, e in expected.items():
        e = e.detach().double().cpu()
        diff = (actual[name].detach().double().cpu() - e).abs()
        if kind == "grad":
            errors[name] = diff.max().item() / max(e.abs().max().item(), 1e-12)
        elif kind == "param":
            errors[name] = diff.mean().item()
        else:
            raise ValueError(f"kind must be 'grad' or 'param', not {kind!r}")
    return errors


def check_bf16_tensors(report, actual: dict, expected: dict, *, kind: str, tolerance: float, label: str) -> bool:
    """One check over every tensor, each against its own scale (:func:`bf16_tensor_errors`): passes when the
    worst is within ``tolerance``; records the worst tensor's error and names every tensor over it."""
    return check_bf16_errors(report, bf16_tensor_errors(actual, expected, kind=kind), kind=kind,
                             tolerance=tolerance, label=label)


def check_bf16_errors(report, errors: dict, *, kind: str, tolerance: float, label: str) -> bool:
    """:func:`check_bf16_tensors` from errors already computed by :func:`bf16_tensor_errors`, tensor by tensor
    (a script that gathers one sharded tensor at a time)."""
    worst = max(errors, key=errors.get)
    over = sorted(name for name, error in errors.items() if error > tolerance)
    report.extra.setdefault("bf16_worst_tensor", {})[kind] = {"name": worst, "error": errors[worst],
                                                               "over_tolerance": over}
    return report.check(label, not over, errors[worst], tolerance)


def fp32_tolerance(cpu_tolerance: float, device) -> float:
    """The tolerance of an fp32 comparison on ``device``: the CPU's, or x GPU_FP32_TOLERANCE_FACTOR on a GPU."""
    on_gpu = getattr(device, "type", str(device)).startswith("cuda")
    return cpu_tolerance * (GPU_FP32_TOLERANCE_FACTOR if on_gpu else 1)


class DeviceClock:
    """Timestamps on the device's own timeline, read after the run: CUDA events on a GPU (when the kernels
    queued so far have run, not when they were launched), ``time.perf_counter`` on a CPU.

        clock = DeviceClock(device)          # its origin: now
        mark = clock.mark()                  # cheap; on a GPU, an event recorded on the current stream
        ...; rt.sync(); clock.seconds(mark)  # seconds since the origin (after a device sync)
    """

    def __init__(self, device):
        import torch

        self._cuda = getattr(device, "type", str(device)) == "cuda"
        self._torch = torch
        self.origin = self.mark()

    def mark(self):
        import time

        if self._cuda:
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, mark) -> float:
        if self._cuda:
            return self.origin.elapsed_time(mark) / 1e3
        return mark - self.origin


def device_name(device) -> str:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def memory_snapshot(device) -> dict:
    """Peak memory of this process: the CUDA allocator's on a GPU, resident set size on a CPU."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return {"kind": "cuda_allocator", "allocated_bytes": torch.cuda.memory_allocated(device),
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "reserved_bytes": torch.cuda.memory_reserved(device)}
    max_rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    return {"kind": "process_rss", "peak_rss_bytes": max_rss_kib * 1024}


def tensor_bytes(tensors) -> int:
    """Bytes held by a collection of tensors, counting each storage once (views share it)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        storage = local.untyped_storage()
        key = (storage.data_ptr(), local.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def worst(differences) -> float:
    """The largest of ``differences`` (0.0 for none), nan if any is nan: Python's max() skips a nan that is not
    first (nan > x is False), so a run gone nan would pass a check against one device."""
    differences = list(differences)
    if any(math.isnan(d) for d in differences):
        return math.nan
    return max(differences, default=0.0)


def max_abs_diff(actual, expected) -> float:
    """Largest |actual - expected| over numbers, sequences of numbers, tensors or sequences of tensors."""
    import torch

    if isinstance(actual, (list, tuple)):
        if len(actual) != len(expected):
            return math.inf
        return worst(max_abs_diff(a, e) for a, e in zip(actual, expected))
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
        if actual.shape != expected.shape:
            return math.inf
        if actual.numel() == 0:
            return 0.0
        return (actual.detach().double().cpu() - expected.detach().double().cpu()).abs().max().item()
    return abs(float(actual) - float(expected))


BRIEF_CHARS = 100


def brief(value, limit: int = BRIEF_CHARS) -> str:
    """``value`` as a check line shows it: whole when short; a long list as its length and first items, a long
    dict as its size and first keys, a long string cut (``== [...]`` of an equality check keeps its ``== ``)."""
    text = str(value)
    if len(text) <= limit:
        return text
    if isinstance(value, (list, tuple)):
        return f"{len(value)} items: {brief(value[0], 40)}, {brief(value[1], 40)}, ..." if len(value) > 1 \
            else f"1 item: {brief(value[0], limit - 8)}"
    if isinstance(value, dict):
        keys = ", ".join(str(k) for k in list(value)[:3])
        return f"{len(value)} entries: {{{keys}, ...}}"
    return text[:limit - 3] + "..."


@dataclass
class Report:
    """Everything a script measured and checked; written as the metrics JSON by rank 0."""

    script: str
    world_size: int = 1
    device: str = "cpu"
    config: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)
    checks: list = field(default_factory=list)
    comm: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    throughput: dict = field(default_factory=dict)
    timeline: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    rank: int = 0

    def __init__(self, script_file: str, rt=None, config: dict | None = None):
        path = Path(script_file)
        self.script = f"{path.parent.name}/{path.name}" if path.suffix == ".py" else str(script_file)
        self.world_size = rt.world_size if rt else 1
        self.device = str(rt.device) if rt else "cpu"
        self.rank = rt.rank if rt else 0
        self._runtime = rt
        self.config = {k: v for k, v in (config or {}).items() if _jsonable(v)}
        self.losses, self.checks, self.comm, self.timeline = [], [], [], []
        self.memory, self.throughput, self.extra = {}, {}, {}

    # ---- checks ---------------------------------------------------------------------------------
    def check(self, name: str, passed: bool, value=None, tolerance=None) -> bool:
        self.checks.append({"name": name, "passed": bool(passed), "value": _plain(value),
                            "tolerance": _plain(tolerance)})
        return bool(passed)

    def check_close(self, name: str, actual, expected, tolerance: float) -> bool:
        """Pass when the largest absolute difference is within ``tolerance``; records that difference."""
        diff = max_abs_diff(actual, expected)
        return self.check(name, diff <= tolerance, diff, tolerance)

    def check_equal(self, name: str, actual, expected) -> bool:
        return self.check(name, actual == expected, _plain(actual), f"== {_plain(expected)}")

    @property
    def all_passed(self) -> bool:
        return all(c["passed"] for c in self.checks)

    # ---- communication ledger -------------------------------------------------------------------
    def add_comm(self, collective: str, measured_bytes: int, analytic_bytes: int, **details) -> None:
        """One row of the ledger: the payload measured (counted at the call) and the formula's. A detail
        computed from them (the ring model's bytes per rank) is named ``..._derived``: never a measurement."""
        self.comm.append({"collective": collective, "measured_bytes": int(measured_bytes),
                          "analytic_bytes": int(analytic_bytes), **details})

    # ---- output ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"script": self.script, "world_size": self.world_size, "device": self.device,
                "config": self.config, "losses": [float(x) for x in self.losses], "checks": self.checks,
                "comm": self.comm, "memory": self.memory, "throughput": self.throughput,
                "timeline": self.timeline, "extra": _plain(self.extra)}

    def checks_table(self) -> str:
        """One line a check: its name, then a short value and tolerance (a long list or dict is summarised, and
        for a failed comparison of two lists the first item that differs is named; the metrics file keeps all)."""
        lines = []
        for c in self.checks:
            mark = "PASS" if c["passed"] else "FAIL"
            detail = ""
            if c["value"] is not None:
                value = f"{c['value']:.3g}" if isinstance(c["value"], float) else brief(c["value"])
                tol = c["tolerance"]
                tol = f"{tol:.1g}" if isinstance(tol, float) else brief(tol)
                detail = f"  ({value}" + (f", tolerance {tol})" if tol is not None else ")")
            lines.append(f"  [{mark}] {c['name']}{detail}")
        return "\n".join(lines)

    def write(self, path: str | os.PathLike | None) -> None:
        if path and self.rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    def finish(self, path: str | os.PathLike | None = None) -> int:
        """Print the checks (rank 0), write the metrics file, and return the exit code: 1 if a check failed."""
        if self.rank == 0:
            passed = sum(c["passed"] for c in self.checks)
            print(f"checks: {passed}/{len(self.checks)} passed", flush=True)
            if self.checks:
                print(self.checks_table(), flush=True)
        else:  # another rank's own checks (its memory, its shards) are not in rank 0's table: name its failures
            for line in self.checks_table().splitlines():
                if line.startswith("  [FAIL]"):
                    print(f"rank {self.rank}:{line}", flush=True)
        self.write(path)
        sys.stdout.flush()
        code = 0 if self.all_passed else 1
        if self._runtime is not None:
            self._runtime.exit_code = code  # the runtime ends the process with it (see runtime.start)
        return code


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _plain(value):
    """Turn tensors and numpy scalars into JSON-friendly Python numbers."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


# --------------------------------------------------------------------------------------------------
# Many runs in one table (the PBS preflight job's summary)
# --------------------------------------------------------------------------------------------------


def runs_table(runs) -> str:
    """One line per launch: script, result, checks passed, step time, all-reduce bus bandwidth, device.

    ``runs`` holds ``(name, status, metrics file)`` per launch, the status as pbs/common.sh records it ("ok",
    "FAILED(1)", "missing"). Every figure is read from the run's metrics file: the step time is its
    ``throughput.step_seconds``; the bus bandwidth the largest all-reduce ``busbw`` measured by a bandwidth
    benchmark (``extra.bandwidth``, NCCL on GPUs, gloo on CPUs); "-" where the run did not measure it.
    """
    header = ("script", "result", "checks", "step time", "all-reduce busbw", "device")
    lines = []
    for name, status, path in runs:
        data = {}
        if path and Path(path).is_file():
            data = json.loads(Path(path).read_text())
        checks = data.get("checks") or []
        passed = f"{sum(c['passed'] for c in checks)}/{len(checks)}" if data else "-"
        step = (data.get("throughput") or {}).get("step_seconds")
        busbw = [row["busbw"] for row in (data.get("extra") or {}).get("bandwidth", [])
                 if row.get("collective") == "all_reduce" and row.get("busbw")]
        lines.append((name, status, passed, f"{step * 1e3:.1f} ms" if step else "-",
                      f"{max(busbw) / 1e9:.3g} GB/s" if busbw else "-", data.get("device", "-")))
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in [header, *lines])
