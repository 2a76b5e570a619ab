"""No exercise checker of any lab says the expected answer when an answer is wrong.

A learner who could read the answer off a wrong guess's message would pass without doing the exercise. Every public
``check_*`` of ``labkit.exercises.chNN`` (found by walking the modules, so a new checker without wrong answers here
fails :func:`test_every_checker_is_fed_wrong_answers`) is fed plausible wrong answers: for a number, the expected one
x 2, x 0.5, + 1 and a far value; for a function, one whose results are off in those ways; for a choice, another
choice. Each must be refused (``ExerciseWrong``), and its message must not hold the expected answer in any usual
printed form. The expected answers are computed here, by the checker's reference function where it has one (a
module's ``hidden_seconds``, ``reference_ep``, ...) or by a reference written in this file, never read from the
message.
"""

from __future__ import annotations

import fnmatch
import importlib
import math
import re
from dataclasses import dataclass, field

import pytest
import torch

from labkit.exercises import checks
from labkit.exercises.checks import ExerciseWrong

CHAPTERS = {f"ch{n:02d}": importlib.import_module(f"labkit.exercises.ch{n:02d}") for n in range(1, 15)}

# checkers that are fed no wrong answers here, and why
NOT_FED = {
    "checks.check_true": "the caller writes its message; it holds no expected answer of its own",
    "checks.check_run": "a run's own checks: its message names the checks that failed, there is no expected answer",
    "ch11.check_better_layout": "every layout within 90% of the search's best passes: the message judges the "
                                "learner's own layout (tests/unit/test_exercises_ch11_more.py)",
    "ch14.check_fix_*": "each launches the lab's job with the learner's fix and says what the run shows "
                        "(tests/unit/test_exercises_ch14*.py and tests/scripts/test_14*)",
}


def _discovered() -> list[str]:
    found = {f"checks.{name}" for name, value in vars(checks).items() if name.startswith("check_") and callable(value)}
    for chapter, module in CHAPTERS.items():
        for name, value in vars(module).items():
            if name.startswith("check_") and callable(value):
                owner = value.__module__.rsplit(".", 1)[-1]
                found.add(f"{'checks' if owner == 'checks' else chapter}.{name}")
    return sorted(found)


# ---- the usual printed forms of an answer --------------------------------------------------------------------------

def _number_forms(x: float) -> set[str]:
    """``x`` as str, with thousands commas, to 3, 4 and 6 significant digits, as a whole number, to 1-3 decimals:
    each kept only where it is still within 5% of ``x`` (0.04 printed "0" says nothing of it)."""
    forms = set()
    for form in ("{}", "{:,}", "{:.3g}", "{:.4g}", "{:.6g}", "{:,.3g}", "{:,.4g}", "{:,.6g}", "{:,.0f}", "{:.1f}",
                 "{:.2f}", "{:.3f}", "{:,.1f}", "{:,.2f}", "{:,.3f}"):
        text = form.format(x)
        if math.isclose(float(text.replace(",", "")), x, rel_tol=0.05, abs_tol=0.0):
            forms.add(text)
    if float(x).is_integer() and not isinstance(x, bool):
        forms.add(str(int(x)))
    return forms


def forms(answer) -> set[str]:
    """The usual ways an answer is printed: a number's (:func:`_number_forms`), a list's or a tuple's as Python prints
    it (and, for a tensor, each of its non-whole numbers), a string's repr, a layout's label."""
    if isinstance(answer, torch.Tensor):
        values = answer.detach().flatten().tolist()
        shown = {str(answer.tolist()), str(answer)}
        return shown | {f for v in values[:64] if not float(v).is_integer() for f in _number_forms(v)}
    if isinstance(answer, bool) or answer is None:
        return {repr(answer)}
    if isinstance(answer, (int, float)):
        return _number_forms(answer)
    if isinstance(answer, (list, tuple)):
        return {str(answer), str(list(answer)), str(tuple(answer))}
    if isinstance(answer, str):
        return {repr(answer), answer}
    if hasattr(answer, "label"):
        return {answer.label()}
    raise TypeError(f"no printed forms for {answer!r}")


def appears(text: str, message: str) -> bool:
    """``text`` in ``message`` as a whole token: 3 is not in 13, 3.5 or 1,300."""
    return re.search(r"(?<![\w.,])" + re.escape(text) + r"(?![\w]|[.,]\d)", message) is not None


# ---- the wrong answers -----------------------------------------------------------------------------------------------

@dataclass
class Attempt:
    """A call of a checker with a wrong answer, and the expected answers (filled in by the call, for a function the
    checker calls on its own cases) that its message must leave out."""
    label: str
    call: object
    expected: list = field(default_factory=list)


def _plus_one(x):
    """``x`` + 1, or 2% more where + 1 would be within rounding of a large number."""
    if isinstance(x, torch.Tensor) or abs(x) < 1e5:
        return x + 1
    return x * 1.02


def _numbers_off(x):
    """The plausible wrong numbers: x 2, x 0.5, + 1 and a far value."""
    return {"x 2": x * 2, "x 0.5": x * 0.5, "+ 1": _plus_one(x), "far": x * 1000 + 12345.678}


def _off(transform, value):
    """``value`` (a number, a tensor, or a list or tuple of them) with ``transform`` applied to each number."""
    if isinstance(value, (list, tuple)):
        return type(value)(_off(transform, v) for v in value)
    return transform(value)


TRANSFORMS = {"x 2": lambda v: v * 2, "x 0.5": lambda v: v * 0.5, "+ 1": _plus_one,
              "far": lambda v: v * 1000 + 12345.678}


def _wrong_functions(reference):
    """(label, function, the expected answers it records): ``reference``'s results off in each usual way."""
    for label, transform in TRANSFORMS.items():
        seen = []

        def wrong(*args, transform=transform, seen=seen):
            right = reference(*args)
            seen.append(right)
            return _off(transform, right)
        yield label, wrong, seen


def shared_value():
    answers = [3, 7, 12, 133, 1234567, 0.0375, 2.5e9, 100.1625, -4.25, 5.0, 48.0]
    for want in answers:
        for label, got in _numbers_off(want).items():
            yield Attempt(f"{want} {label}", lambda got=got, want=want: checks.check_value("x", got, want), [want])
    for label, transform in TRANSFORMS.items():   # a list: its first wrong value, and only its second
        want = [3.5, 1200.0]
        yield Attempt(f"{want} {label}", lambda t=transform: checks.check_value("x", [t(3.5), t(1200.0)], want),
                      [*want, want])
        yield Attempt(f"{want} second {label}", lambda t=transform: checks.check_value("x", [3.5, t(1200.0)], want),
                      [*want, want])


def shared_tensor():
    for want in (torch.tensor([[1.5, -2.25], [0.125, 3.0]]), torch.arange(6.0) + 0.37, torch.tensor([2.7183])):
        wrongs = {label: transform(want) for label, transform in TRANSFORMS.items()}
        wrongs["zeros"] = torch.zeros_like(want)
        if want.dim() == 2:
            wrongs["transposed"] = want.T.contiguous()
        for label, got in wrongs.items():
            yield Attempt(label, lambda got=got, want=want: checks.check_tensor("t", got, want), [want])


def shared_function():
    references = {"a number": (lambda x: x * x + 0.37, [((3,), 9.37), ((4,), 16.37)]),
                  "a whole number": (lambda n: 3 * n + 4, [((5,), 19), ((9,), 31)]),
                  "a tensor": (lambda t: t * 1.5 + 0.25, [((torch.arange(4.0),), torch.arange(4.0) * 1.5 + 0.25)]),
                  "a list": (lambda n: [n + 0.5, 2 * n + 0.5], [((11,), [11.5, 22.5])])}
    for what, (reference, cases) in references.items():
        for label, wrong, seen in _wrong_functions(reference):
            yield Attempt(f"{what} {label}", lambda wrong=wrong: checks.check_function("f", wrong, cases), seen)
    order = [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    wrongs = {"reversed": order[::-1], "short": order[:3], "swapped": [order[1], order[0], *order[2:]]}
    for label, got in wrongs.items():
        yield Attempt(f"a schedule {label}",
                      lambda got=got: checks.check_function("order", lambda p, m: got, [((2, 2), order)]), [order])


def ch01_step_peak():
    from labkit.exercises import ch01

    def reference(num_params, activations, batch, seq_len, vocab_size):
        from distlab import memory

        phases = memory.predict_step_peak(memory.training_state_bytes(num_params), activations, batch, seq_len,
                                          vocab_size)
        return phases.peak_phase, phases.peak

    for label, transform in TRANSFORMS.items():
        seen = []

        def wrong(*args, transform=transform, seen=seen):
            phase, peak = reference(*args)
            seen.extend([peak, peak / 2**30])
            return phase, transform(peak)
        yield Attempt(label, lambda wrong=wrong: ch01.check_step_peak(wrong), seen)

    seen = []

    def other_phase(*args):
        phase, peak = reference(*args)
        seen.append(phase)
        return next(p for p in ch01.PHASES if p != phase), peak
    yield Attempt("the other phase", lambda: ch01.check_step_peak(other_phase), seen)


def ch02_month_of_a100s():
    from labkit.exercises import ch02

    days = 6 * 3e9 * 20 * 3e9 / (0.4 * 312e12) / 86400      # 6 N D over 40% of the A100's bf16 peak, in days
    gpus = math.ceil(days / 30)
    for label, got in _numbers_off(days).items():
        yield Attempt(f"days {label}", lambda got=got: ch02.check_month_of_a100s(got, gpus), [days, gpus, days / 30])
    for label, got in {**_numbers_off(gpus), "rounded": round(days / 30), "x 0.5": gpus // 2}.items():
        yield Attempt(f"gpus {label}", lambda got=got: ch02.check_month_of_a100s(days, got), [gpus, days / 30])


def _rank_chunks(tensor, ranks):
    return list(tensor.chunk(ranks))


def ch03_collectives():
    from labkit.exercises import ch03

    def reduce_scatter(inputs):
        return _rank_chunks(torch.stack(inputs).sum(0), len(inputs))

    def all_to_all(inputs):
        return [torch.cat([_rank_chunks(x, len(inputs))[r] for x in inputs]) for r in range(len(inputs))]

    for label, wrong, seen in _wrong_functions(reduce_scatter):
        yield Attempt(f"reduce_scatter {label}", lambda wrong=wrong: ch03.check_collectives(wrong, all_to_all),
                      seen)
    for label, wrong, seen in _wrong_functions(all_to_all):
        yield Attempt(f"all_to_all {label}", lambda wrong=wrong: ch03.check_collectives(reduce_scatter, wrong), seen)


def ch05_zero1_adamw_step():
    from labkit.exercises import ch05

    def reference(weight, grad, world, lr):
        whole = torch.nn.Parameter(weight.clone())
        whole.grad = grad.clone()
        torch.optim.AdamW([whole], lr=lr).step()
        return whole.detach()

    for label, transform in TRANSFORMS.items():
        seen = []

        def wrong(weight, grad, world, lr, transform=transform, seen=seen):
            right = reference(weight, grad, world, lr)
            seen.append(right)
            return transform(right), []
        yield Attempt(label, lambda wrong=wrong: ch05.check_zero1_adamw_step(wrong), seen)


def ch05_min_gpus():
    from labkit.exercises import ch05

    case = dict(num_params=13e9, stage=3, gpu_gib=40, reserve_gib=12)
    # 16 B a parameter, sharded over N, within 40 - 12 GiB: written out here
    right = next(n for n in range(1, 1000) if 16 * 13e9 / n <= 28 * 2**30)
    for label, got in _numbers_off(right).items():
        yield Attempt(label, lambda got=got: ch05.check_min_gpus("min_gpus", got, **case), [right])


def ch05_zero3_saving():
    from labkit.exercises import ch05

    right = ch05.zero3_weights_saved_gib("a100", 4)
    for label, got in _numbers_off(right).items():
        yield Attempt(label, lambda got=got: ch05.check_zero3_saving("saved_gib", got), [right])


def ch06_parallel_linears():
    from labkit.exercises import ch06

    def column(x, shards):
        return [x @ w.T for w in shards]

    def row(x_shards, shards):
        return sum(x @ w.T for x, w in zip(x_shards, shards))

    for label, transform in TRANSFORMS.items():
        seen = []

        def wrong_column(x, shards, transform=transform, seen=seen):
            right = column(x, shards)
            seen.append(torch.cat([o.detach() for o in right], dim=-1))
            return [transform(o) for o in right]

        def wrong_row(x_shards, shards, transform=transform, seen=seen):
            right = row(x_shards, shards)
            seen.append(right.detach())
            return transform(right)
        yield Attempt(f"column {label}", lambda w=wrong_column: ch06.check_parallel_linears(w, row), seen)
        yield Attempt(f"row {label}", lambda w=wrong_row: ch06.check_parallel_linears(column, w), seen)


def ch06_bytes_per_phase():
    from labkit.exercises import ch06

    rows = [{"phase": "forward", "measured_bytes": 1_572_864}, {"phase": "forward", "measured_bytes": 524_288},
            {"phase": "backward", "measured_bytes": 3_145_728}]
    measured = {"forward": 2_097_152, "backward": 3_145_728}
    for phase in measured:
        for label, got in _numbers_off(measured[phase]).items():
            predicted = {**measured, phase: got}
            yield Attempt(f"{phase} {label}", lambda p=predicted: ch06.check_bytes_per_phase("b", p, rows),
                          list(measured.values()))


def _merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).nan_to_num(0.0)[..., None]
    weight_b = torch.exp(lse_b - lse).nan_to_num(0.0)[..., None]
    return weight_a * out_a + weight_b * out_b, lse


def ch08_merge_attention_blocks():
    from labkit.exercises import ch08

    for label, transform in TRANSFORMS.items():
        seen = []

        def wrong(*blocks, transform=transform, seen=seen):
            out, lse = _merge(*blocks)
            seen.append(out)
            return transform(out), lse
        yield Attempt(label, lambda wrong=wrong: ch08.check_merge_attention_blocks(wrong), seen)


def ch08_swap_to_heads():
    from labkit.exercises import ch08

    def swap(shards):
        c = len(shards)
        return [torch.cat([s.chunk(c, dim=1)[j] for s in shards], dim=2) for j in range(c)]

    for label, wrong, seen in _wrong_functions(swap):
        yield Attempt(label, lambda wrong=wrong: ch08.check_swap_to_heads(wrong), seen)


def _coordinates(rank, pp, dp, tp):
    return rank // (dp * tp), rank // tp % dp, rank % tp


def _groups(rank, pp, dp, tp):
    p, d, t = _coordinates(rank, pp, dp, tp)
    at = lambda p, d, t: (p * dp + d) * tp + t  # noqa: E731  DeviceMesh's layout: tp innermost
    return {"pp": [at(i, d, t) for i in range(pp)], "dp": [at(p, i, t) for i in range(dp)],
            "tp": [at(p, d, i) for i in range(tp)]}


def ch09_rank_grid():
    from labkit.exercises import ch09

    for label, wrong, seen in _wrong_functions(_coordinates):
        yield Attempt(f"coordinates {label}", lambda wrong=wrong: ch09.check_rank_grid(wrong, _groups), seen)
    for label, transform in TRANSFORMS.items():
        seen = []

        def wrong(*args, transform=transform, seen=seen):
            right = _groups(*args)
            seen.extend(right.values())
            return {dim: [transform(r) for r in members] for dim, members in right.items()}
        yield Attempt(f"groups {label}", lambda wrong=wrong: ch09.check_rank_grid(_coordinates, wrong), seen)


def ch09_layout_choice():
    from labkit.exercises import ch09

    def reference(num_params, nodes, activation_gib):
        gpus = 4 * nodes
        fits = 16 * num_params / gpus / 2**30 + activation_gib <= 40
        return (gpus // 4, 4) if fits else None

    def wrong_none(*args):   # a layout where nothing fits: the message must not tell "return None"
        return reference(*args) or (args[1], 4)

    yield Attempt("a layout where nothing fits", lambda: ch09.check_layout_choice(wrong_none), ["return None"])
    for label, transform in {"dp x 2": lambda dp, tp: (dp * 2, tp), "tp x 2": lambda dp, tp: (dp // 2 or 1, tp * 2),
                             "no layout": lambda dp, tp: None}.items():
        seen = []

        def wrong(*args, transform=transform, seen=seen):
            right = reference(*args)
            if right is not None:
                seen.append(right)
            return transform(*right) if right is not None else None
        yield Attempt(label, lambda wrong=wrong: ch09.check_layout_choice(wrong), seen)


def ch09_block_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from labkit.exercises import ch09

    right = {**{name: ColwiseParallel for name in ch09.COLWISE}, **{name: RowwiseParallel for name in ch09.ROWWISE}}
    for name, style in right.items():
        other = RowwiseParallel if style is ColwiseParallel else ColwiseParallel
        plan = {n: (other if n == name else s)() for n, s in right.items()}
        yield Attempt(f"{name} swapped", lambda plan=plan: ch09.check_block_plan(plan), [style.__name__])


def ch11_path_layout():
    from distlab import planner

    from labkit.exercises import _ch11_reference as reference
    from labkit.exercises import ch11

    right = reference._path_layout()[2]
    for wrong in (planner.Layout(dp=64, zero_stage=0), planner.Layout(dp=64, zero_stage=1),
                  planner.Layout(dp=64, zero_stage=3), planner.Layout(tp=8, pp=8, dp=1, zero_stage=1)):
        if wrong != right:
            yield Attempt(wrong.label(), lambda wrong=wrong: ch11.check_path_layout(wrong), [right])


def ch11_what_it_pays():
    from distlab import planner

    from labkit.exercises import _ch11_reference as reference
    from labkit.exercises import ch11

    path, better = reference._path_layout()[2], planner.Layout(tp=4, pp=8, dp=2, zero_stage=1)
    paid, spent = reference._costs(path), reference._costs(better)
    right = max(paid, key=lambda name: paid[name] - spent[name])
    for wrong in paid:
        if wrong != right:
            yield Attempt(wrong, lambda wrong=wrong: ch11.check_what_it_pays(wrong, path, better), [right])


def ch11_fewest_nodes():
    from distlab import planner

    from labkit.exercises import _ch11_reference as reference
    from labkit.exercises import ch11

    from labkit import planner_widgets

    # exercise 2's case: 13B at 16K-token sequences, FSDP over every GPU; the count and the GiB per GPU there
    spec, a100 = planner_widgets.with_sequence_length(planner.MODELS["13b"], 16384), planner.CLUSTERS["a100-40gb"]
    right = reference._fewest_fsdp_nodes(spec, a100)
    gib = reference._held_gib(spec, a100, right)
    for label, got in _numbers_off(right).items():
        # a wrong count with the GiB right for it (where it is a count): the message leaves out both answers
        held = reference._held_gib(spec, a100, int(got)) if got == int(got) and got >= 1 else gib
        yield Attempt(f"nodes {label}", lambda got=got, held=held: ch11.check_fewest_nodes(got, held), [right, gib])
    for label, got in _numbers_off(gib).items():
        # the right count with a wrong GiB: the count is the learner's own, the GiB must not be said
        yield Attempt(f"GiB {label}", lambda got=got: ch11.check_fewest_nodes(right, got), [gib])


def ch12_hidden_communication():
    from labkit.exercises import ch12

    for label, wrong, seen in _wrong_functions(ch12.hidden_seconds):
        yield Attempt(label, lambda wrong=wrong: ch12.check_hidden_communication(wrong), seen)


def ch12_missing_ranks():
    from labkit.exercises import ch12

    for label, transform in {"+ 1": lambda ranks: [r + 1 for r in ranks], "x 2": lambda ranks: [2 * r for r in ranks],
                             "none": lambda ranks: [], "the world": lambda ranks: [0, 1, 2, 3]}.items():
        seen = []

        def wrong(journals, label, transform=transform, seen=seen):
            right = ch12.missing_ranks(journals, label)
            seen.append(right)
            return transform(right)
        yield Attempt(label, lambda wrong=wrong: ch12.check_missing_ranks(wrong), seen)


def ch12_placement():
    from labkit.exercises import ch12

    def reference(nodefile):
        return [(host, nodefile[:rank].count(host)) for rank, host in enumerate(nodefile)]

    for label, transform in {"+ 1": lambda p: [(h, r + 1) for h, r in p], "x 2": lambda p: [(h, 2 * r) for h, r in p],
                             "reversed": lambda p: p[::-1], "the rank": lambda p: [(h, i) for i, (h, r) in enumerate(p)]
                             }.items():
        seen = []

        def wrong(nodefile, transform=transform, seen=seen):
            right = reference(nodefile)
            got = transform(right)
            first = next(r for r, (want, mine) in enumerate(zip(right, got)) if want != mine)
            seen.extend([right, right[first]])   # the whole answer, and the place of the first rank it gets wrong
            return got
        yield Attempt(label, lambda wrong=wrong: ch12.check_placement(wrong), seen)


def ch13_dispatch_bytes():
    from labkit.exercises import ch13

    def reference(tokens, top_k, hidden, element, ep):   # even routing: (ep - 1) / ep of the rows leave the rank
        return tokens * top_k * hidden * element * (ep - 1) / ep

    for label, wrong, seen in _wrong_functions(reference):
        yield Attempt(label, lambda wrong=wrong: ch13.check_dispatch_bytes(wrong), seen)


def ch13_ep_choice():
    from labkit.exercises import ch13

    for label, transform in {"x 2": lambda ep, crosses: (ep * 2, crosses), "crosses": lambda ep, crosses:
                             (ep, not crosses), "one": lambda ep, crosses: (1, False)}.items():
        seen = []

        def wrong(*case, transform=transform, seen=seen):
            right = ch13.reference_ep(*case)
            seen.append(right)
            return None if right is None else transform(*right)
        yield Attempt(label, lambda wrong=wrong: ch13.check_ep_choice(wrong), seen)


def ch13_dropless_capacity():
    from labkit.exercises import ch13

    routing = [(torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2], [0, 3], [2, 1]]), 4)]

    def reference(chosen, experts):   # the busiest expert's assignments over the mean load
        return int(torch.bincount(chosen.reshape(-1), minlength=experts).max()) * experts / chosen.numel()

    for label, wrong, seen in _wrong_functions(reference):
        yield Attempt(label, lambda wrong=wrong: ch13.check_dropless_capacity(wrong, routing), seen)


def ch14_diagnoses():
    from labkit.exercises import ch14

    right = {label: next(r.name for r in ch14.broken_runs.BROKEN_RUNS if ch14._token(r.name) == ch14._TOKENS[label])
             for label in ch14.LABELS}
    keys = list(ch14.CAUSES)
    for part, labels in ch14.PARTS.items():
        for label in labels:
            for wrong in (k for k in keys[:: max(1, len(keys) // 4)] if k != right[label]):
                answers = {**{l: right[l] for l in labels}, label: wrong}
                yield Attempt(f"{part}: {label} = {wrong}", lambda a=answers, part=part: ch14.check_diagnoses(a, part),
                              [right[label]])


SCENARIOS = {
    "checks.check_value": shared_value, "checks.check_tensor": shared_tensor, "checks.check_function": shared_function,
    "ch01.check_step_peak": ch01_step_peak, "ch02.check_month_of_a100s": ch02_month_of_a100s,
    "ch03.check_collectives": ch03_collectives,
    "ch05.check_zero1_adamw_step": ch05_zero1_adamw_step, "ch05.check_min_gpus": ch05_min_gpus,
    "ch05.check_zero3_saving": ch05_zero3_saving,
    "ch06.check_parallel_linears": ch06_parallel_linears, "ch06.check_bytes_per_phase": ch06_bytes_per_phase,
    "ch08.check_merge_attention_blocks": ch08_merge_attention_blocks, "ch08.check_swap_to_heads": ch08_swap_to_heads,
    "ch09.check_rank_grid": ch09_rank_grid, "ch09.check_layout_choice": ch09_layout_choice,
    "ch09.check_block_plan": ch09_block_plan,
    "ch11.check_path_layout": ch11_path_layout, "ch11.check_what_it_pays": ch11_what_it_pays,
    "ch11.check_fewest_nodes": ch11_fewest_nodes,
    "ch12.check_hidden_communication": ch12_hidden_communication, "ch12.check_missing_ranks": ch12_missing_ranks,
    "ch12.check_placement": ch12_placement,
    "ch13.check_dispatch_bytes": ch13_dispatch_bytes, "ch13.check_ep_choice": ch13_ep_choice,
    "ch13.check_dropless_capacity": ch13_dropless_capacity,
    "ch14.check_diagnoses": ch14_diagnoses,
}


def test_every_checker_is_fed_wrong_answers():
    unfed = [name for name in _discovered()
             if name not in SCENARIOS and not any(fnmatch.fnmatch(name, pattern) for pattern in NOT_FED)]
    assert not unfed, f"checkers with no wrong answers in this test (add them to SCENARIOS): {unfed}"
    assert set(SCENARIOS) <= set(_discovered())


@pytest.mark.parametrize("checker", sorted(SCENARIOS))
def test_a_wrong_answer_is_refused_without_the_expected_one(checker):
    leaks, passed, attempts = [], [], list(SCENARIOS[checker]())
    assert attempts, f"{checker}: no wrong answers to feed it"
    for attempt in attempts:
        try:
            attempt.call()
        except ExerciseWrong as wrong:
            message = str(wrong)
        else:
            passed.append(attempt.label)
            continue
        assert attempt.expected, f"{checker}, {attempt.label}: the wrong answer recorded no expected answer"
        shown = sorted({text for answer in attempt.expected for text in forms(answer)
                        if appears(text, message)})
        if shown:
            leaks.append(f"{attempt.label}: {shown} in {message!r}")
    assert not passed, f"{checker} passed wrong answers: {passed}"
    assert not leaks, f"{checker} says the expected answer:\n" + "\n".join(leaks)
