"""Every exercise of notebooks 01-08 rejects plausible wrong answers.

For each exercise the test runs the notebook's own check cell, read from the .ipynb (so a check weakened in
the notebook fails here), in a namespace built from the notebook's import cell and the cells the check needs.
First with the notebook's solution: it must pass (so the namespace is right and a rejection below is the
check's doing, not a NameError). Then with each wrong answer put in place of the solution block, written as a
learner would write it: the check must raise ExerciseWrong, not pass and not fail some other way.

Stand-ins where a check reads a script run (notebook 04's DDP and ring runs, notebook 06's ledger): the
counted bytes of the run as the formula gives them, so the tests stay fast; the notebooks themselves run under
nbval against the real runs. Everything else is the notebooks' own code.
"""

from __future__ import annotations

import math
import types
from pathlib import Path

import nbformat
import pytest

from coursetools import student
from labkit.exercises import checks as exercises
from labkit.exercises import ch05, ch06

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"


def _cells(notebook: str) -> list:
    return nbformat.read(NOTEBOOKS / f"{notebook}.ipynb", as_version=4).cells


def exercise_and_check_cells(notebook: str) -> list[tuple[str, str]]:
    """(exercise cell, the first check cell after it) for every exercise of the notebook, in order (a cell
    between the two, such as a run the check reads, is the test's to stand in for)."""
    cells = [c for c in _cells(notebook) if c.cell_type == "code"]
    pairs = []
    for index, cell in enumerate(cells):
        if student.has_solution(cell.source):
            check = next((c for c in cells[index + 1:] if "check" in c.metadata.get("tags", [])), None)
            assert check is not None and not student.has_solution(check.source), \
                f"{notebook}: an exercise with no check cell before the next exercise"
            pairs.append((cell.source, check.source))
    return pairs


def _python(source: str) -> str:
    return "\n".join(line for line in source.split("\n") if not line.lstrip().startswith("%"))


def with_solution(cell: str, replacements) -> str:
    """The exercise cell with its solution blocks replaced, in order, by ``replacements`` (one string per
    block, or one string for a cell with one block), indented like each block; ``{solution}`` in a
    replacement stands for the notebook's own solution of that block."""
    replacements = [replacements] if isinstance(replacements, str) else list(replacements)
    lines = cell.split("\n")
    for replacement in replacements:
        begin = next(i for i, line in enumerate(lines) if line.strip() == student.BEGIN)
        end = next(i for i, line in enumerate(lines) if line.strip() == student.END)
        indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
        solution = "\n".join(line[len(indent):] for line in lines[begin + 1:end])
        body = replacement.strip("\n").replace("{solution}", solution)
        lines = lines[:begin] + [indent + line if line else line for line in body.split("\n")] + lines[end + 1:]
    assert not student.has_solution("\n".join(lines)), "fewer replacements than solution blocks"
    return "\n".join(lines)


def namespace(notebook: str, needs: tuple[str, ...] = ()) -> dict:
    """The notebook's first code cell (imports), then each code cell containing one of ``needs``. Built afresh
    for every run: the notebooks' functions look up names (the learner's function) in this very dict."""
    code = [c.source for c in _cells(notebook) if c.cell_type == "code"]
    scope: dict = {}
    exec(_python(code[0]), scope)
    for marker in needs:
        exec(_python(next(source for source in code if marker in source)), scope)
    return scope


# --------------------------------------------------------------------------------------------------
# Stand-ins for the script runs two checks read
# --------------------------------------------------------------------------------------------------


def fake_ddp_run(scope: dict) -> None:
    """Notebook 04's DDP run (the payload it counted) and chapter 03's ring run (the bytes a rank sent)."""
    payload = scope["models"].preset("tiny").num_params() * 4
    scope["ddp"] = types.SimpleNamespace(metrics={"comm": [{"measured_bytes": payload}]})
    sent = 2 * (scope["world"] - 1) / scope["world"] * payload
    scope["ring"] = types.SimpleNamespace(metrics={"comm": [{"measured_bytes": sent}]})


def fake_tp_run(scope: dict) -> None:
    from distlab import models, tensor_parallel

    rows = tensor_parallel.tp_comm_formula(models.preset("tiny"), 4, models.preset("tiny").seq_len, 4)
    scope["result"] = types.SimpleNamespace(metrics={"comm": [
        {"phase": r["phase"], "where": r["where"], "measured_bytes": r["payload_bytes"]} for r in rows]})


# --------------------------------------------------------------------------------------------------
# The exercises and their wrong answers: (notebook, exercise number) -> needs, stand-in, {slip: solution}
# --------------------------------------------------------------------------------------------------

EXERCISES = {
    ("01_single_device_baseline", 1): dict(wrong={
        "embedding counted once (as if tied)": """
exercise_params = V * d + L * (4 * d * d + 3 * d * F + 2 * d) + d
exercise_state_bytes = 16 * exercise_params""",
        "the norms' weights forgotten": """
exercise_params = 2 * V * d + L * (4 * d * d + 3 * d * F) + d
exercise_state_bytes = 16 * exercise_params""",
        "the gradients left out of the state (12 B)": """
{solution}
exercise_state_bytes = 12 * exercise_params""",
    }),
    ("01_single_device_baseline", 2): dict(wrong={
        "every consumer added up": """
return "forward/backward", 20 * num_params + activation_bytes + 8 * batch * seq_len * vocab_size""",
        "the loss gradients left out": """
fb, step = 12 * num_params + activation_bytes, 20 * num_params
return ("forward/backward", fb) if fb >= step else ("optimizer step", step)""",
        "the foreach temporary forgotten (16 B at the step)": """
fb, step = 12 * num_params + activation_bytes + 8 * batch * seq_len * vocab_size, 16 * num_params
return ("forward/backward", fb) if fb >= step else ("optimizer step", step)""",
        "the phase always forward/backward": """
fb, step = 12 * num_params + activation_bytes + 8 * batch * seq_len * vocab_size, 20 * num_params
return "forward/backward", max(fb, step)""",
    }),
    ("02_why_distributed", 2): dict(wrong={
        "2 N D (forward only)": """
a100_days = 2 * num_params * 20 * num_params / (0.4 * 312e12) / 86400
a100s_for_a_month = math.ceil(a100_days / 30)""",
        "the MFU forgotten": """
a100_days = 6 * num_params * 20 * num_params / 312e12 / 86400
a100s_for_a_month = math.ceil(a100_days / 30)""",
        "rounded to the nearest": """
{solution}
a100s_for_a_month = round(a100_days / 30)""",
    }),
    ("02_why_distributed", 1): dict(wrong={
        "nothing kept for activations": """
largest_ddp = 40 * 2**30 / 16
largest_fsdp = 4 * 40 * 2**30 / 16""",
        "GB and GiB mixed (the other unit)": """
{solution}
largest_ddp, largest_fsdp = largest_ddp * 1e9 / 2**30, largest_fsdp * 1e9 / 2**30""",
        "DDP shares the state too": """
{solution}
largest_ddp = largest_fsdp""",
        "FSDP not multiplied by the GPUs": """
{solution}
largest_fsdp = largest_ddp""",
    }),
    ("03_communication", 1): dict(wrong={
        "reduce-scatter gives the whole sum (all-reduce)": ("""
total = torch.stack(inputs).sum(0)
return [total for _ in range(n)]""", "{solution}"),
        "all-to-all keeps each rank's own tensor": ("{solution}", """
return [x.clone() for x in inputs]"""),
    }),
    ("03_communication", 2): dict(needs=("class SimulatedRing", "ring_cases = []"), wrong={
        "reduce-scatter only": """
for step in range(n - 1):
    outgoing = {r: ((r - step) % n, chunks[r][(r - step) % n]) for r in range(n)}
    for r, (i, data) in network.step(outgoing).items():
        chunks[r][i] = chunks[r][i] + data""",
        "all-gather sends the wrong chunk": """
for step in range(n - 1):
    outgoing = {r: ((r - step) % n, chunks[r][(r - step) % n]) for r in range(n)}
    for r, (i, data) in network.step(outgoing).items():
        chunks[r][i] = chunks[r][i] + data
for step in range(n - 1):
    outgoing = {r: ((r - step) % n, chunks[r][(r - step) % n]) for r in range(n)}
    for r, (i, data) in network.step(outgoing).items():
        chunks[r][i] = data""",
        "the sum taken without the network": """
total = [sum(parts) for parts in zip(*chunks)]
chunks = [list(total) for _ in range(n)]""",
    }),
    ("04_data_parallel", 1): dict(needs=("whole_batch = gradients(",), wrong={
        "summed, not averaged": """
return {name: sum(grads[name] for grads in per_rank) for name in per_rank[0]}""",
        "rank 0's gradient only": """
return dict(per_rank[0])""",
    }),
    ("04_data_parallel", 2): dict(needs=("world = ",), fake=fake_ddp_run, wrong={
        "bf16 gradients (2 B)": """
predicted_payload = models.preset("tiny").num_params() * 2
predicted_sent = 2 * (world - 1) / world * predicted_payload""",
        "each rank sends the whole payload twice": """
{solution}
predicted_sent = 2 * predicted_payload""",
        "only the reduce-scatter half": """
{solution}
predicted_sent = (world - 1) / world * predicted_payload""",
    }),
    ("05_fully_sharded", 1): dict(wrong={
        "one unsharded optimizer": """
whole = torch.nn.Parameter(weight.clone())
whole.grad = grad.clone()
optimizer = torch.optim.AdamW([whole], lr=lr)
optimizer.step()
return whole.detach(), [optimizer] * world_size""",
        "every rank keeps moments for the whole weight": """
new_slices, optimizers = [], []
for rank in range(world_size):
    whole = torch.nn.Parameter(weight.clone())
    whole.grad = grad.clone()
    optimizer = torch.optim.AdamW([whole], lr=lr)
    optimizer.step()
    new_slices.append(whole.detach().chunk(world_size)[rank])
    optimizers.append(optimizer)
return torch.cat(new_slices), optimizers""",
        "gradients summed over the ranks, not averaged (the weights do not show it)": """
new_slices, optimizers = [], []
for weight_slice, grad_slice in zip(weight.chunk(world_size), grad.chunk(world_size)):
    mine = torch.nn.Parameter(weight_slice.clone())
    mine.grad = grad_slice.clone() * world_size
    optimizer = torch.optim.AdamW([mine], lr=lr)
    optimizer.step()
    new_slices.append(mine.detach())
    optimizers.append(optimizer)
return torch.cat(new_slices), optimizers""",
        "the optimizers listed in the wrong rank order": """
new_slices, optimizers = [], []
for weight_slice, grad_slice in zip(weight.chunk(world_size), grad.chunk(world_size)):
    mine = torch.nn.Parameter(weight_slice.clone())
    mine.grad = grad_slice.clone()
    optimizer = torch.optim.AdamW([mine], lr=lr)
    optimizer.step()
    new_slices.append(mine.detach())
    optimizers.append(optimizer)
return torch.cat(new_slices), optimizers[::-1]""",
        "only the new weight returned": """
new_slices = []
for weight_slice, grad_slice in zip(weight.chunk(world_size), grad.chunk(world_size)):
    mine = torch.nn.Parameter(weight_slice.clone())
    mine.grad = grad_slice.clone()
    torch.optim.AdamW([mine], lr=lr).step()
    new_slices.append(mine.detach())
return torch.cat(new_slices)""",
    }),
    ("05_fully_sharded", 2): dict(wrong={
        "a block taken for the largest unit (the head is larger)": """
{solution}
saved_gib = 4 * (whole - whole / 4 - block) / 2**30""",
        "the unit whole at the peak forgotten": """
{solution}
saved_gib = 4 * (whole - whole / 4) / 2**30""",
        "bf16 weights (2 B) where the sketch keeps fp32": """
{solution}
saved_gib = 2 * (whole - whole / 4 - max(embedding, block, head)) / 2**30""",
        "GB, not GiB": """
{solution}
saved_gib = 4 * (whole - whole / 4 - max(embedding, block, head)) / 1e9""",
        "the embedding without the norm taken for the head, and the slices forgotten": """
{solution}
saved_gib = 4 * (whole - embedding) / 2**30""",
    }),
    ("05_fully_sharded", 3): dict(wrong={
        "ZeRO-2 state: the weights sharded too (ZeRO-3)": """
{solution}
zero2_gib_on_8 = 16 / 8 * 13e9 / 2**30""",
        "ZeRO-2 state in GB, not GiB": """
{solution}
zero2_gib_on_8 = (2 + (2 + 12) / 8) * 13e9 / 1e9""",
        "min GPUs: nothing kept for activations": """
{solution}
min_gpus_zero3 = next(n for n in range(1, 1000) if 16 * 13e9 / n / 2**30 <= 40)""",
        "min GPUs: GB counted against GiB": """
{solution}
min_gpus_zero3 = next(n for n in range(1, 1000) if 16 * 13e9 / n / 1e9 <= 40 - 12)""",
        "min GPUs: a power of two": """
{solution}
min_gpus_zero3 = next(n for n in (1, 2, 4, 8, 16, 32) if 16 * 13e9 / n / 2**30 <= 40 - 12)""",
        "min GPUs: rounded down": """
{solution}
import math
min_gpus_zero3 = math.floor(16 * 13e9 / 2**30 / (40 - 12))""",
        "min GPUs: the ZeRO-2 state": """
{solution}
min_gpus_zero3 = next(n for n in range(1, 1000) if (2 + 14 / n) * 13e9 / 2**30 <= 40 - 12)""",
    }),
    ("06_tensor_parallel", 1): dict(wrong={
        "row parallel concatenates the partial outputs": (
            "{solution}",
            "return torch.cat([x_r @ w_r.T for x_r, w_r in zip(x_shards, weight_shards)], dim=-1)"),
        "column parallel pairs rank r with the last rank's shard": (
            "return [x @ w.T for w in weight_shards[::-1]]",
            "{solution}"),
        "row parallel averages the partial outputs": (
            "{solution}",
            "return torch.stack([x_r @ w_r.T for x_r, w_r in zip(x_shards, weight_shards)]).mean(0)"),
        "row parallel detaches the partial outputs (no weight gradient)": (
            "{solution}",
            "return torch.stack([(x_r @ w_r.T).detach() for x_r, w_r in zip(x_shards, weight_shards)]).sum(0)"),
    }),
    ("06_tensor_parallel", 2): dict(fake=fake_tp_run, wrong={
        "the loss statistics counted in backward (the right total)": """
activation = B * S * H * 4
forward = (2 * L + 1) * activation
backward = (2 * L + 1) * activation + 3 * B * S * 4""",
        "the loss statistics forgotten": """
activation = B * S * H * 4
forward = (2 * L + 1) * activation
backward = (2 * L + 1) * activation""",
        "the ring's bytes sent, not the payload": """
{solution}
forward, backward = forward * 2 * 3 / 4, backward * 2 * 3 / 4""",
        "five backward all-reduces per block (the per-linear plan)": """
{solution}
backward = (5 * L + 1) * activation""",
        "bf16 activations": """
activation = B * S * H * 2
forward = (2 * L + 1) * activation + 3 * B * S * 4
backward = (2 * L + 1) * activation""",
    }),
    ("07_pipeline_parallel", 1): dict(wrong={
        "GPipe's order (all forwards, then all backwards)": """
return {r: [f"{r}F{m}" for m in range(microbatches)] + [f"{r}B{m}" for m in range(microbatches)]
        for r in range(ranks)}""",
        "warm-up one forward too long": """
order = {}
for r in range(ranks):
    warmup = min(ranks - r, microbatches)
    actions = [f"{r}F{m}" for m in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [f"{r}F{warmup + i}", f"{r}B{i}"]
    actions += [f"{r}B{m}" for m in range(microbatches - warmup, microbatches)]
    order[r] = actions
return order""",
        "every rank warms up P - 1 forwards": """
order = {}
for r in range(ranks):
    warmup = min(ranks - 1, microbatches)
    actions = [f"{r}F{m}" for m in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [f"{r}F{warmup + i}", f"{r}B{i}"]
    actions += [f"{r}B{m}" for m in range(microbatches - warmup, microbatches)]
    order[r] = actions
return order""",
    }),
    ("07_pipeline_parallel", 2): dict(wrong={
        "the other convention, (P - 1) / (V M)": "bubble = (8 - 1) / (4 * 32)",
        "V ignored": "bubble = (8 - 1) / (32 + 8 - 1)",
        "V divides the plain bubble": "bubble = (8 - 1) / (32 + 8 - 1) / 4",
    }),
    ("07_pipeline_parallel", 3): dict(wrong={
        "the other convention, (P - 1) / M <= 0.05": """
import math
microbatches_needed = math.ceil((8 - 1) / 0.05)""",
        "P in place of P - 1": """
import math
microbatches_needed = math.ceil(8 * (1 / 0.05 - 1))""",
    }),
    ("08_sequence_parallel", 1): dict(wrong={
        "the textbook formula, no guard for rows that saw no key (nan)": """
lse = torch.logaddexp(lse_a, lse_b)
out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
return out, lse""",
        "lse_a + log1p(exp(lse_b - lse_a)): nan when lse_a is -inf": """
lse = lse_a + torch.log1p(torch.exp(lse_b - lse_a))
weight_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
weight_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
return weight_a * out_a + weight_b * out_b, lse""",
        "the outputs averaged": """
return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)""",
        "lse = the larger of the two": """
lse = torch.maximum(lse_a, lse_b)
out = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1) * out_b
return out, lse""",
        "the outputs weighted by exp(lse), not normalised": """
return (torch.exp(lse_a).unsqueeze(-1) * out_a + torch.exp(lse_b).unsqueeze(-1) * out_b,
        torch.logaddexp(lse_a, lse_b))""",
    }),
    ("08_sequence_parallel", 2): dict(wrong={
        "every P-th head, not a contiguous group": """
return [torch.cat([shard[:, j::ranks] for shard in shards], dim=2) for j in range(ranks)]""",
        "blocks put together in reverse rank order": """
sent = [shard.chunk(ranks, dim=1) for shard in shards]
return [torch.cat([sent[i][j] for i in reversed(range(ranks))], dim=2) for j in range(ranks)]""",
        "reshaped, not swapped": """
return [s.reshape(s.shape[0], s.shape[1] // ranks, s.shape[2] * ranks, s.shape[-1]) for s in shards]""",
    }),
}


# --------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------


def _run(notebook: str, number: int, solution_replacements=None) -> None:
    spec = EXERCISES[(notebook, number)]
    exercise, check = exercise_and_check_cells(notebook)[number - 1]
    scope = namespace(notebook, spec.get("needs", ()))
    if "fake" in spec:
        spec["fake"](scope)
    exec(_python(exercise if solution_replacements is None else with_solution(exercise, solution_replacements)), scope)
    exec(_python(check), scope)


def test_every_exercise_of_notebooks_01_to_08_is_listed_here():
    found = {(path.stem, number + 1) for path in sorted(NOTEBOOKS.glob("0[1-8]_*.ipynb"))
             for number in range(len(exercise_and_check_cells(path.stem)))}
    assert found == set(EXERCISES), f"exercises without wrong answers here: {sorted(found - set(EXERCISES))}"


CASES = [(notebook, number, slip) for (notebook, number), spec in EXERCISES.items() for slip in spec["wrong"]]


@pytest.mark.parametrize("notebook,number", list(EXERCISES), ids=[f"{n}-{k}" for n, k in EXERCISES])
def test_the_notebook_solution_passes_its_check(notebook, number, capsys):
    _run(notebook, number)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("notebook,number,slip", CASES, ids=[f"{n}-{k}-{slip}" for n, k, slip in CASES])
def test_a_plausible_wrong_answer_is_rejected(notebook, number, slip):
    with pytest.raises(exercises.ExerciseWrong):
        _run(notebook, number, EXERCISES[(notebook, number)]["wrong"][slip])


# --------------------------------------------------------------------------------------------------
# The numbers of two exercises were chosen so that the slips give other answers: shown by hand
# --------------------------------------------------------------------------------------------------


def test_min_gpus_each_slip_gives_another_answer_than_the_right_one():
    state_gib, state_gb = 16 * 13e9 / 2**30, 16 * 13e9 / 1e9       # 193.7 GiB, 208 GB of state in all
    right = math.ceil(state_gib / (40 - 12))                        # 6.92 -> 7
    slips = {"no reserve": math.ceil(state_gib / 40),               # 4.84 -> 5
             "GB against GiB": math.ceil(state_gb / (40 - 12)),     # 7.43 -> 8
             "both": math.ceil(state_gb / 40),                      # 5.2 -> 6
             "rounded down": math.floor(state_gib / (40 - 12)),     # 6
             "power of two": 2 ** math.ceil(math.log2(right)),      # 8
             "ZeRO-2 state": math.ceil(14 * 13e9 / ((40 - 12) * 2**30 - 2 * 13e9))}  # 45
    assert right == 7 and ch05.smallest_world_size(13e9, 3, 40, 12) == right
    assert slips == {"no reserve": 5, "GB against GiB": 8, "both": 6, "rounded down": 6, "power of two": 8,
                     "ZeRO-2 state": 45}
    for slip, value in slips.items():
        with pytest.raises(exercises.ExerciseWrong):
            ch05.check_min_gpus("min_gpus_zero3", value, num_params=13e9, stage=3, gpu_gib=40, reserve_gib=12)
    # The numbers the exercise had (10 GiB kept, powers of two): the right answer and both slips were all 8.
    old = lambda budget, unit: next(n for n in (1, 2, 4, 8, 16, 32) if 16 * 13e9 / n / unit <= budget)
    assert old(30, 2**30) == old(40, 2**30) == old(30, 1e9) == 8


def test_min_gpus_names_the_slip():
    kwargs = dict(num_params=13e9, stage=3, gpu_gib=40, reserve_gib=12)
    with pytest.raises(exercises.ExerciseWrong, match="nothing for activations"):
        ch05.check_min_gpus("m", 5, **kwargs)
    with pytest.raises(exercises.ExerciseWrong, match="GB .* GiB.* or .*power of two"):
        ch05.check_min_gpus("m", 8, **kwargs)
    with pytest.raises(exercises.ExerciseIncomplete):
        ch05.check_min_gpus("m", None, **kwargs)


def test_bytes_per_phase_a_swap_between_phases_keeps_the_total():
    """The slip the per-phase check exists for: the loss statistics counted in backward."""
    rows = [{"phase": "forward", "measured_bytes": 100}, {"phase": "forward", "measured_bytes": 12},
            {"phase": "backward", "measured_bytes": 100}]
    ch06.check_bytes_per_phase("b", {"forward": 112, "backward": 100}, rows)
    with pytest.raises(exercises.ExerciseWrong, match="total is right, but some bytes are counted in the wrong phase.*forward: predicted 100 B"):
        ch06.check_bytes_per_phase("b", {"forward": 100, "backward": 112}, rows)
    with pytest.raises(exercises.ExerciseWrong, match="one number per phase"):
        ch06.check_bytes_per_phase("b", {"total": 212}, rows)
    with pytest.raises(exercises.ExerciseIncomplete):
        ch06.check_bytes_per_phase("b", {"forward": None, "backward": None}, rows)
