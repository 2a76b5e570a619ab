"""Chapter 11's decision path (its flowchart, 11_decision_flowchart.png): each question asked once, and each worked
case routed by the planner's own answers to the outcome the planner's search confirms.

A question "asked twice" is one whose answer an earlier question already fixed: every case that reaches it gives
the same answer. The flowchart the chapter drew before asked "Does it fit on one GPU?" and then "Too big for a
replica per GPU?"; planted below, it is caught."""

from __future__ import annotations

import pytest

from distlab import planner


def questions_asked_twice(questions, start, cases) -> list[str]:
    """The questions whose answer is the same for every case that reaches them, or that a path meets twice."""
    met: dict[str, set[bool]] = {}
    for case in cases:
        route, _ = planner.decision_route(case, questions, start)
        nodes = [node for node, _ in route]
        assert len(nodes) == len(set(nodes)), f"{case.name} meets a question twice: {nodes}"
        for node, answer in route:
            met.setdefault(node, set()).add(answer)
    return [node for node, answers in met.items() if len(answers) < 2] + [n for n in questions if n not in met]


def test_the_flowchart_asks_each_question_once():
    questions, cases = planner.DECISION_QUESTIONS, planner.decision_cases()
    assert len({text for text, *_ in questions.values()}) == len(questions)
    assert questions_asked_twice(questions, planner.DECISION_START, cases) == []
    # every question and every outcome is reached: the tree has no branch a case never takes
    outcomes = {planner.decision_route(case)[1] for case in cases}
    assert outcomes == set(planner.DECISION_OUTCOMES)


def test_the_old_flowchart_is_caught_asking_twice():
    fits = planner.DECISION_QUESTIONS["replica"][1]
    old = {"fits": ("Does it fit on one GPU?", fits, "DDP", "too_big"),
           "too_big": ("Too big for a replica per GPU?", lambda case: not fits(case), "FSDP", "wide")}
    wide = planner.DECISION_QUESTIONS["long"]
    old["wide"] = ("Layers too wide, activations too big?", wide[1], "TP", "PP")
    assert questions_asked_twice(old, "fits", planner.decision_cases()) == ["too_big", "wide"]


def test_each_case_lands_where_the_search_puts_it():
    """The outcome's dimensions (TP, PP, CP) are those of the search's first choice for the case; DDP's case is one
    where DDP is within 3 % of the best."""
    for case in planner.decision_cases():
        outcome = planner.decision_route(case)[1]
        plans = planner.search(case.model, case.cluster, case.gpus)
        first = plans[0].layout
        if outcome == "DDP":
            ddp = next(p for p in plans if p.layout == planner.Layout(dp=case.gpus, zero_stage=0))
            assert ddp.fits and ddp.mfu >= 0.97 * plans[0].mfu, case.name
            continue
        tp, pp, cp = planner.OUTCOME_DIMENSIONS[outcome]
        assert first.zero_stage > 0, case.name
        assert (first.pp > 1) == pp and (first.cp > 1) == cp, (case.name, first.label())
        assert tp is None or (first.tp > 1) == tp, (case.name, first.label())


def _text() -> str:
    from coursetools import chapters

    return " ".join(chapters.text("11").split())


def test_the_case_worked_by_hand_is_the_planners():
    """Page 11.1: 7B on 16 A100-40GB, its state counted by hand (16 bytes a parameter), then DDP's and FSDP's parts,
    each by hand from the model's shape: DDP's fp32 buckets as torch's DDP holds them under autocast
    (tests/unit/test_planner_ddp.py), FSDP's buffers as FSDP2 holds them at a block's backward
    (tests/unit/test_planner_fsdp_buffers.py)."""
    text = _text()
    spec, cluster = planner.MODELS["7b"], planner.CLUSTERS["a100-40gb"]
    case = next(c for c in planner.decision_cases() if c.model is spec)
    gpus, n = case.gpus, spec.num_params()
    assert (gpus, case.cluster) == (16, cluster) and case.name == "7B on 4 nodes of 4 A100-40GB"
    by_hand = n * (2 + 2 + 12)
    assert f"{n / 1e9:.2f} B parameters" in text and "6.74 B x 16 bytes" in text
    assert f"= **{by_hand / planner.GIB:.1f} GiB**" in text
    ddp, fsdp = (planner.evaluate(spec, cluster, planner.Layout(dp=gpus, zero_stage=z)).memory_per_gpu_bytes
                 for z in (0, 3))
    gib = {k: {part: v / planner.GIB for part, v in m.items()} for k, m in (("ddp", ddp), ("fsdp", fsdp))}
    # DDP under autocast: fp32 weights (4), gradients (4), two moments (8); buckets of the gradients' dtype (4)
    assert (ddp["params"], ddp["grads"], ddp["optimizer"], ddp["temporary"]) == pytest.approx((4 * n, 4 * n, 8 * n,
                                                                                               4 * n))
    assert ddp["params"] + ddp["grads"] + ddp["optimizer"] == pytest.approx(by_hand)
    assert f"{gib['ddp']['activations']:.2f} GiB of activations" in text
    assert (f"here fp32: 6.74 B x 4 bytes = {4 * n / planner.GIB:.2f} GiB more, which makes "
            f"**{gib['ddp']['total']:.1f} GiB**") in text
    assert "a second bf16 copy" not in text
    fsdp_state = gib["fsdp"]["params"] + gib["fsdp"]["grads"] + gib["fsdp"]["optimizer"]
    assert f"divides the state by {gpus}, to {fsdp_state:.2f} GiB" in text
    # FSDP's buffers by hand: the root (embedding, final norm, output layer) and two blocks gathered in bf16, the
    # output layer's (and final norm's) and a block's bf16 gradients, a block's fp32 reduce-scatter input
    h, v = spec.hidden, spec.vocab
    block = 2 * h * h + 2 * h * spec.kv_dim + 3 * h * spec.ffn + 2 * h
    head, root = v * h + h, 2 * v * h + h
    buffers = 2 * (root + 2 * block) + 2 * (head + block) + 4 * block
    assert fsdp["temporary"] == buffers
    assert (f"Its units are each block, {block / 1e6:.0f} M parameters, and the root: the embedding, the final norm "
            f"and the output layer, {root / 1e6:.0f} M") in text
    assert (f"so {root / 1e6:.0f} M + 2 x {block / 1e6:.0f} M are gathered. The output layer's and the block's bf16 "
            f"gradients are whole, {head / 1e6:.0f} M + {block / 1e6:.0f} M. One block's fp32 gradients wait for "
            f"their reduce-scatter, {block / 1e6:.0f} M x 4 bytes. In all that is {buffers / planner.GIB:.2f} GiB"
            ) in text
    assert f"**{gib['fsdp']['total']:.1f} GiB** of 40" in text
    assert gib["fsdp"]["activations"] == gib["ddp"]["activations"] and gib["ddp"]["reserve"] == 4
    assert spec.global_batch == 1024 and spec.seq_len == 4096 and "1,024 sequences" in text
    plans = planner.search(spec, cluster, gpus)
    assert plans[0].layout == planner.Layout(dp=gpus, zero_stage=3) and plans[0].settings["checkpointing"] == "none"
    assert "its first choice is `tp=1,pp=1,dp=16,zero=3`" in text
    # on two nodes FSDP alone would keep every activation only past the GPU's memory: the search adds TP 2
    two = planner.evaluate(spec, cluster, planner.Layout(dp=8, zero_stage=3),
                           planner.Options(activation_checkpointing="none")).memory_per_gpu_bytes["total"]
    first_on_two = planner.search(spec, cluster, 8)[0]
    assert two > cluster.gpu_bytes and first_on_two.layout.tp == 2 and first_on_two.settings["checkpointing"] == "none"
    assert (f"On two nodes that would take {two / planner.GIB:.1f} GiB, and the search adds TP "
            f"{first_on_two.layout.tp} there instead") in text


def test_the_worked_cases_prose_reads_the_planner():
    text = _text()
    cases = planner.decision_cases()
    one = planner.search(cases[0].model, cases[0].cluster, 8)
    assert [p.layout.zero_stage for p in one[:3]] == [1, 3, 0] and len({round(p.mfu, 2) for p in one[:3]}) == 1
    assert f"at the same {one[0].mfu:.0%} MFU".replace("%", " %") in text
    big = cases[3]
    assert big.gpus // big.model.global_batch == 4 and "there are four GPUs for every sequence" in text
    long = cases[4]
    no_sp, sp = (planner.evaluate(long.model, long.cluster, planner.Layout(8, 8, 1, 1, 1),
                                  planner.Options(sequence_parallel=s), 64).memory_per_gpu_bytes["activations"]
                 for s in (False, True))
    assert round(no_sp / sp) == 6 and "So the whole shrinks about sixfold" in text
    assert (f"At TP 8 and PP 8, the activations take {no_sp / planner.GIB:.1f} GiB per GPU without SP and "
            f"{sp / planner.GIB:.1f} GiB with it") in text
    # not eightfold: SP divides the saved block inputs by TP, and of the block recomputed in backward only what TP
    # left whole (its norms' and regions' inputs)
    from distlab.planner.memory import block_activation_bytes
    live = {s: block_activation_bytes(long.model, 1, long.model.seq_len, 8, s, planner.Options()) for s in (False, True)}
    assert sp == pytest.approx((no_sp - live[False]) / 8 + live[True], rel=1e-9)
    assert ("SP divides the blocks' saved inputs eightfold, but the block recomputed in backward only from "
            f"{live[False] / planner.GIB:.1f} to {live[True] / planner.GIB:.1f} GiB: TP had split most of it") in text
    first = planner.search(long.model, long.cluster, 64)[0].layout
    assert (first.tp, first.cp) == (8, 4) and "The search's first choice adds CP 4 beside TP 8" in text
    longest = cases[5]
    first = planner.search(longest.model, longest.cluster, 64)[0].layout
    assert longest.model.seq_len // first.cp == 16384 and "Each GPU then keeps 16K tokens of a sequence" in text
    assert planner.MODELS["70b"].layers == 80 and "through 80 layers" in text
    trade = {p.layout: p for p in (planner.tune(planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"], layout,
                                                planner.Options(), 64)
                                   for layout in (planner.Layout(4, 4, 4, 1, 1), planner.Layout(8, 4, 2, 1, 1)))}
    best = planner.search(planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"], 64)[0]
    assert best.layout == planner.Layout(4, 4, 4, 1, 1) and "The search's first choice, `tp=4,pp=4,dp=4,zero=1`" in text
    tp4, tp8 = (trade[layout].exposed_seconds["tp"] for layout in (planner.Layout(4, 4, 4, 1, 1),
                                                                    planner.Layout(8, 4, 2, 1, 1)))
    assert tp4 < tp8 / 2 and "TP 4 keeps the exposed TP time under half of TP 8's" in text
    assert planner.LONG_SEQUENCE // 4 == planner.Options().cp_min_tokens


def test_the_step_formula_is_the_planners():
    """Page 11.3's step: (compute + exposed) x (1 + (P - 1) / (V M)) + the fill and drain sends."""
    text = _text()
    plan = planner.tune(planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"], planner.Layout(4, 4, 4, 1, 1),
                        planner.Options(), 64)
    busy = plan.step_seconds - plan.bubble["seconds"] - plan.exposed_seconds["pp"]
    assert plan.bubble["seconds"] == pytest.approx(busy * plan.bubble["of_ideal"])
    assert "step = (compute + exposed communication) x (1 + (P - 1) / (V M)) + 2 (P - 1) sends" in text


def test_question_1_is_asked_of_one_gpu_and_its_parts_are_derived():
    """Question 1 evaluates one GPU (no buckets): 106.7 GiB; DDP on 16 adds its fp32 buckets. The 2.32 GiB of
    activations taken apart as the page does by hand: the blocks' inputs written with their symbols, s x h."""
    from distlab.planner.memory import block_activation_bytes

    text = _text()
    spec, cluster, g = planner.MODELS["7b"], planner.CLUSTERS["a100-40gb"], planner.GIB
    case = next(c for c in planner.decision_cases() if c.model is spec)
    one = planner.evaluate(spec, cluster, planner.Layout(), planner.Options(), 1)
    assert not planner.DECISION_QUESTIONS["replica"][1](case) and one.memory_per_gpu_bytes["temporary"] == 0
    assert f"that is **{one.memory_per_gpu_bytes['total'] / g:.1f} GiB**, more than twice" in text
    acts = one.memory_per_gpu_bytes["activations"]
    inputs = spec.layers * spec.seq_len * spec.hidden * 2
    block = block_activation_bytes(spec, 1, spec.seq_len, 1, False, planner.Options(activation_checkpointing="full"))
    head = acts - inputs - block
    s, h, f, v = spec.seq_len, spec.hidden, spec.ffn, spec.vocab
    assert inputs == g and (f"the {spec.layers} blocks' inputs, {spec.layers} x s x h = {spec.layers} x {s:,} tokens x "
                            f"{h:,} wide, in 2 bytes (1 GiB)") in text
    assert (f"Then one block recomputed in backward ({block / g:.2f} GiB), and the output layer with its fp32 "
            f"log-softmax ({head / g:.2f} GiB)") in text
    assert f"sequences of s = {s:,} tokens, width h = {h:,}" in text
    # the two taken apart: chapter 08's per-block count (10 s h + 4 s f numbers of 2 bytes, the b s terms dropped),
    # and the head's log-softmax over the vocabulary in fp32 plus three s x h tensors: the final norm's input and
    # output (tensor_parallel.activation_bytes' 2 s h) and the output layer's input
    assert f"{(10 * s * h + 4 * s * f) * 2 / g:.2f}" == f"{block / g:.2f}"
    assert f"about 10 s h + 4 s f numbers of 2 bytes, with the feed-forward width f = {f:,}" in text
    softmax, inputs_fp32 = s * v * 4, 3 * s * h * 4
    assert f"{(softmax + inputs_fp32) / g:.2f}" == f"{head / g:.2f}"
    assert (f"the log-softmax over the {v:,}-token vocabulary, s x {v:,} x 4 bytes = {softmax / g:.2f} GiB. The rest "
            f"is three fp32 tensors of s x h: the final norm's input and output, and the output layer's input, 3 x "
            f"{s:,} x {h:,} x 4 bytes = {inputs_fp32 / g:.2f} GiB") in text
