"""The checks of chapter 13's exercises (expert parallelism), with feedback that names the usual mistake.

* :func:`check_dispatch_bytes`: the bytes one rank sends in one dispatch of a MoE layer under even routing.
* :func:`check_ep_choice`: the EP degree to pick on a cluster (the experts must fit; the all-to-all should stay
  inside a node when it can).
* :func:`check_dropless_capacity`: the capacity factor at which an expert's capacity equals the busiest expert's
  load in a given routing (the round factor that drops nothing).

Each says the answer is right and why, names the plausible wrong answer when it sees one, and (through
:func:`labkit.exercises.checks.learner_check`) lets an unwritten exercise pass over in a learner's notebook.
"""

from __future__ import annotations

import math

from distlab import moe
from labkit.exercises.checks import ExerciseWrong, call_learner, learner_check, sentence, wrong_number

# (tokens, top_k, hidden, bytes per element, ep)
DISPATCH_CASES = [(4096, 2, 4096, 2, 8), (8192, 8, 7168, 2, 64), (1024, 1, 1024, 4, 4), (512, 2, 256, 4, 1)]

# (experts, GiB per expert with its gradients and AdamW state, GiB free per GPU for experts, GPUs per node, nodes)
EP_CASES = [(8, 4.0, 20.0, 4, 4), (64, 1.0, 10.0, 4, 8), (64, 3.0, 10.0, 4, 8), (16, 1.0, 30.0, 8, 2),
            (256, 0.5, 20.0, 8, 32), (8, 50.0, 20.0, 4, 2)]


def reference_ep(experts: int, expert_gib: float, free_gib: float, gpus_per_node: int, nodes: int):
    """The smallest EP degree (a divisor of the experts, at most every GPU) whose share of experts fits, and
    whether its group crosses nodes (EP groups of consecutive ranks, as DeviceMesh lays them out); None if none
    fits. Smallest, because a larger group only adds ranks to every all-to-all."""
    for ep in range(1, min(experts, gpus_per_node * nodes) + 1):
        if experts % ep == 0 and (gpus_per_node * nodes) % ep == 0 and experts // ep * expert_gib <= free_gib:
            return ep, ep > gpus_per_node
    return None


@learner_check
def check_dispatch_bytes(dispatch_bytes) -> None:
    """``dispatch_bytes(tokens, top_k, hidden, bytes_per_element, ep)``: bytes a rank sends in one dispatch when
    routing is even (each assignment's expert on any of the ep ranks alike)."""
    for tokens, k, hidden, element, ep in DISPATCH_CASES:
        got = call_learner("dispatch_bytes", dispatch_bytes, tokens, k, hidden, element, ep)
        want = moe.dispatch_bytes(tokens, k, hidden, element, moe.uniform_leaving_share(ep))
        if got is None or not math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-9):
            everything = tokens * k * hidden * element
            if got is None:
                hint = "return a number of bytes."
            elif math.isclose(float(got), everything):
                hint = "that counts every assignment; the ones whose expert is on this rank never leave it."
            elif math.isclose(float(got), want / k):
                hint = "each token goes to top_k experts: top_k rows, not one."
            else:
                hint = sentence(wrong_number(got, want))
            raise ExerciseWrong(f"dispatch_bytes{(tokens, k, hidden, element, ep)} = {got}: {hint}")
    print("Correct: each token sends top_k rows of hidden x bytes, and (ep - 1) / ep of them leave the rank "
          "under even routing. DeepSeek-V3's 8 of 256 experts over EP 64: 8,192 tokens x 8 x 7,168 x 2 B x 63/64 "
          f"= {moe.dispatch_bytes(8192, 8, 7168, 2, 63 / 64) / 2**20:,.0f} MiB a layer, forward; as much comes "
          "back, and backward repeats both.")


@learner_check
def check_ep_choice(choose_ep) -> None:
    """``choose_ep(experts, expert_gib, free_gib, gpus_per_node, nodes) -> (ep, crosses_nodes)`` or None."""
    for case in EP_CASES:
        got = call_learner("choose_ep", choose_ep, *case)
        want = reference_ep(*case)
        if got is None and want is None:
            continue
        if want is None:
            raise ExerciseWrong(f"choose_ep{case} = {got}: no EP degree fits (even one expert a GPU needs "
                                f"{case[1]} GiB > {case[2]} GiB free); return None.")
        if got is None or tuple(got) != want:
            experts, gib, free, per_node, nodes = case
            hint = ""
            if got is not None and experts // got[0] * gib > free:
                hint = f" With EP {got[0]} a GPU holds {experts // got[0]} experts = {experts // got[0] * gib:g} GiB " \
                       f"> {free:g} GiB."
            elif got is not None and got[0] > want[0]:
                hint = (f" EP {got[0]} fits too, but every extra rank joins every all-to-all"
                        + (", and then every all-to-all crosses nodes" if got[0] > per_node >= want[0] else "")
                        + ": take the smallest degree that fits.")
            elif got is not None and got[0] == want[0]:
                hint = (" The degree is right; does its group of consecutive ranks cross a node of "
                        f"{per_node} GPUs?")
            else:
                hint = (" The degree divides the experts and the GPUs, and its share of the experts fits in the "
                        "free memory: the smallest such degree.")
            raise ExerciseWrong(f"choose_ep{case} = {got}: not the EP degree (and crossing) to pick.{hint}")
    print("Correct: the smallest EP degree whose share of the experts fits. It keeps the all-to-all inside a "
          "node where that is enough (NVLink), and goes across nodes only when the experts need more GPUs. That "
          "rule is for all-to-alls on the critical path. DeepSeek-V3 spread its 256 experts over EP 64, 8 nodes of 8 "
          "H800 (its report, section 3.2), with DualPipe hiding the all-to-alls behind compute; the report gives no "
          "rule for 64, and says its large EP is what keeps DualPipe's two copies of the parameters affordable "
          "(section 3.2.1).")


@learner_check
def check_dropless_capacity(capacity_factor, routing) -> None:
    """``capacity_factor(chosen, num_experts) -> float``: the factor with which ``factor x tokens x top_k /
    num_experts`` equals the busiest expert's count in ``chosen`` ([T, k]), before the ceil: smaller factors that the
    ceil rounds up to the same capacity are refused."""
    for chosen, experts in routing:
        got = call_learner("capacity_factor", capacity_factor, chosen, experts)
        tokens, k = chosen.shape
        busiest = int(chosen.reshape(-1).bincount(minlength=experts).max())
        want = busiest * experts / (tokens * k)
        if got is None:
            raise ExerciseWrong("capacity_factor returned None: return a number.")
        cfg = moe.MoEConfig(num_experts=experts, top_k=k, capacity_factor=float(got))
        dropped = moe.dropped_by_formula(chosen, experts, moe.capacity(tokens, cfg))
        if dropped:
            hint = " The mean load is tokens x top_k / experts; the busiest expert decides." \
                if math.isclose(float(got), 1.0) else ""
            raise ExerciseWrong(f"with a capacity factor of {float(got):.4g}, {dropped} assignments are dropped."
                                + hint)
        if float(got) > want * (1 + 1e-9):
            raise ExerciseWrong(f"{float(got):.4g} drops nothing, but a smaller factor is enough: "
                                f"{sentence(wrong_number(got, want))} Count the assignments of the busiest "
                                f"expert in `chosen`.")
        if float(got) < want * (1 - 1e-9):
            raise ExerciseWrong(f"{float(got):.4g} drops nothing, but only because the ceil rounds its capacity up. "
                                f"Return the factor at which capacity_factor x tokens x top_k / experts equals the "
                                f"busiest expert's assignments, before the ceil.")
    print("Correct: busiest expert's assignments x experts / (tokens x top_k). A factor of 1 fits only a perfectly "
          "even routing; a dropless layer needs no factor at all, at the price of uneven all-to-alls.")
