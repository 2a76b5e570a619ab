"""Chapter 14's picture of the diagnosis path: what you see, what to look at, the cause, for every broken run.

Drawn from the registry of broken runs (``labkit.broken_runs.BROKEN_RUNS``), not from a run: each case lands in
the group of what a user sees by :func:`seen` (read from the case's own fields: a run that resumes, a hang or an
error, a run judged by its throughput, else wrong numbers), and :data:`PATHS` gives the few words the picture and the
chapter's recap table print for it, in the order the chapter teaches the cases. A case added to the registry without its words here fails the chapter's test.
"""

from __future__ import annotations

# What a user sees, in the order the chapter teaches them.
GROUPS = ("Wrong numbers", "Hangs, timeouts and errors", "Slow steps", "Resumes")

# The question of the chapter's three (stuck or slow? do the ranks agree? does the run agree with one device?) that
# sends a run to each group: the picture prints it beside the group's name.
QUESTIONS = {
    "Wrong numbers": "questions 2 and 3: rows naming the ranks are question 2's, the rest differ from one device",
    "Hangs, timeouts and errors": "question 1: it stops",
    "Slow steps": "question 1: it is slow",
    "Resumes": "question 3: the resumed run differs from the uninterrupted one",
}

# case -> (what you see, what to look at, the cause), a few words each: the picture's boxes, the recap's cells. In
# the order the chapter's pages teach the cases (their "### ... (`name`)" sections): the picture and the recap list
# each group's cases in it.
PATHS = {
    "same-samples-every-rank": ("every rank prints the same loss", "the losses per rank",
                                "every rank reads the same samples"),
    "no-set-epoch": ("off one device from the second epoch", "the step where the gap starts",
                     "the sampler's epoch is never set"),
    "accumulation-never-syncs": ("replicas differ, further off every step", "the bytes all-reduced per step",
                                 "accumulation never synchronises"),
    "loss-averaged-twice": ("the loss looks right, the gradients small", "the gradients against one device",
                            "the loss is averaged twice"),
    "per-rank-init": ("replicas differ before any update", "the replicas' weights before step 0",
                      "each rank's own initial weights"),
    "local-grad-norm": ("ranks log different norms, wrong update", "the gradient norm each rank logs",
                        "gradients clipped by local norms"),
    "nan-from-one-rank": ("one rank's loss nan, then every rank's", "each rank's own loss, step by step",
                          "one rank's nan, all-reduced"),
    "bf16-gradient-reduction": ("gradients far beyond fp32 rounding", "the reduce-scatter's bytes",
                                "gradients reduced in bf16"),
    "optimizer-before-sharding": ("the loss does not fall", "the optimizer's state",
                                  "the optimizer built before sharding"),
    "data-by-global-rank": ("off one device from the first step", "the rows each TP rank reads",
                            "data chosen by the global rank"),
    "loss-on-wrong-stage": ("the printed loss is nan", "the last stage's losses",
                            "the loss read on the first stage"),
    "stage-grad-norm": ("stages log different norms, wrong update", "the gradient norm each stage logs",
                        "gradients clipped per stage"),
    "global-batch-grows": ("below one device, most in its 2nd epoch", "the sequences per step",
                           "a global batch grown with the world"),
    "token-mean-per-micro-batch": ("off one device from the first step", "the same run with equal lengths",
                                   "a mean of micro-batch means"),
    "uneven-inputs": ("a hang at the end of an epoch", "the journals: one rank finished",
                      "a rank has fewer batches"),
    "fsdp-before-tp": ("an error before the first step", "the error's two meshes",
                       "FSDP applied before the TP plan"),
    "mismatched-collectives": ("a hang at the first collective", "the journals: all stuck, different calls",
                               "collectives differ between ranks"),
    "full-state-on-rank-0": ("a hang after the last step", "the journals: one rank waits alone",
                             "the full state gathered on rank 0"),
    "rank-0-evaluation": ("a hang between two steps", "what the last rank did before",
                          "one rank's long work alone"),
    "unused-parameter": ("an error at the second step", "the error's line of indices",
                         "a parameter the forward never uses"),
    "token-out-of-vocabulary": ("one rank's error, the others lost or stopped", "torchrun's first observed failure",
                                "a token id outside the vocabulary"),
    "too-few-microbatches": ("every rank idle most of the step", "the idle share against the formula",
                             "too few microbatches"),
    "slow-rank": ("every step slower, on every rank", "each rank's time before its collective",
                  "one slow rank"),
    "checkpoint-one-shard": ("the loss jumps at the resume", "the reloaded weights against the saved",
                             "a checkpoint of one shard"),
    "resume-without-rng": ("a step trained twice, two losses", "reloaded weights equal, the loss differs",
                           "random state and data position lost"),
}


def seen(case) -> str:
    """The group of what a user sees for a broken run, read from its registry entry: a run that resumes from a
    checkpoint (``prepare_args``), a hang (``hang_cause``) or an exception named in its symptom, a run whose
    evidence is its throughput, and otherwise wrong numbers (the run trains, its checks against one device fail)."""
    if case.prepare_args:
        return "Resumes"
    if case.hang or "Error:" in case.symptom:
        return "Hangs, timeouts and errors"
    if "throughput" in case.evidence:
        return "Slow steps"
    return "Wrong numbers"


def grouped(cases=None) -> list[tuple[str, list]]:
    """The registry's cases by what a user sees, in the order of ``GROUPS``, each group in the order the chapter
    teaches its cases (:data:`PATHS`'s)."""
    if cases is None:
        from labkit import broken_runs

        cases = broken_runs.BROKEN_RUNS
    taught = sorted(cases, key=lambda case: list(PATHS).index(case.name))
    return [(group, [case for case in taught if seen(case) == group]) for group in GROUPS]


def recap_markdown(cases=None) -> str:
    """The chapter's recap: one row a case, by what you see, then what to look at, then the cause."""
    lines = ["| what you see | what to look at | the cause |", "|---|---|---|"]
    for group, members in grouped(cases):
        lines.append(f"| **{group}** | | |")
        for case in members:
            symptom, look, cause = PATHS[case.name]
            lines.append(f"| {symptom} | {look} | {cause} (`{case.name}`) |")
    return "\n".join(lines)


def draw_diagnosis_paths(fig) -> None:
    """Every broken run as a path of three boxes, what you see -> what to look at -> the cause, grouped by what a
    user sees (a coloured band a group, named with the question of the chapter's three that sends a run there)."""
    from matplotlib.patches import FancyBboxPatch

    from coursetools.figures import RANK_COLOURS   # here, not above: coursetools.figures imports this module

    colours = dict(zip(GROUPS, RANK_COLOURS))
    groups = grouped()
    rows = sum(len(members) for _, members in groups)
    ax = fig.subplots()
    ax.set_xlim(0, 12.4)
    ax.set_ylim(-0.2, rows + len(groups) * 0.35 + 0.9)
    ax.axis("off")
    columns = ((0.15, "what you see"), (4.35, "what to look at"), (8.35, "the cause"))
    width = 3.7
    top = rows + len(groups) * 0.35 + 0.4
    for x, title in columns:
        ax.text(x + width / 2, top + 0.15, title, ha="center", va="center", fontsize=9, weight="bold")
    y = top - 0.25
    for group, members in groups:
        colour = colours[group]
        band = len(members) + 0.3
        ax.add_patch(FancyBboxPatch((0.02, y - band + 0.05), 12.3, band - 0.1, boxstyle="round,pad=0.02",
                                    facecolor=colour, alpha=0.08, edgecolor=colour, linewidth=0.6))
        label = ax.text(0.12, y - 0.12, group, fontsize=7.5, color=colour, weight="bold", va="center")
        ax.annotate(f"  ({QUESTIONS[group]})", xycoords=label, xy=(1, 0.5), va="center", fontsize=7,
                    color=colour, style="italic")
        y -= 0.3
        for case in members:
            y -= 1
            for (x, _), text in zip(columns, PATHS[case.name]):
                ax.add_patch(FancyBboxPatch((x, y + 0.2), width, 0.6, boxstyle="round,pad=0.02",
                                            facecolor="white", edgecolor=colour, linewidth=0.8))
                ax.text(x + width / 2, y + 0.5, text, ha="center", va="center", fontsize=7.5)
            for x, _ in columns[1:]:
                ax.annotate("", xy=(x - 0.02, y + 0.5), xytext=(x - 0.48, y + 0.5),
                            arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 0.8})
        y -= 0.05


FIGURES = {"14_diagnosis_paths.png": (draw_diagnosis_paths, (10, 7.6))}
