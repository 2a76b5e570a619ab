"""A transformer whose feed-forwards are mixtures of experts, trained with FSDP over dp and EP over the same ranks.

The course's transformer with every block's feed-forward a MoE layer (``distlab.moe.moe_transformer``). On N ranks,
as torchtitan lays it out when EP borrows the data-parallel dimension:

* the experts of every block are spread over the N ranks (ep = dp = N): each rank holds E / N of them whole, and
  tokens reach them by the all-to-alls of ``ep_from_scratch.py``;
* everything else (embedding, attention, norms, the router, the head) is sharded by FSDP2 over the same N ranks:
  ``fully_shard(block, mesh=mesh, ignored_params=<the block's experts>)``, since an expert that lives on one rank has
  nothing to shard or reduce;
* each rank reads its own N-th of the batch.

One gradient needs a hand: FSDP averages what it reduce-scatters over the N ranks, but an expert's gradient arrives
through the combine's backward as a *sum* over the ranks whose tokens visited it, each computed from that rank's
own mean loss. Divided by N it is the gradient of the global mean loss, as one device computes it.

The script proves it: a single-device model with the same weights, its MoE layers ``distlab.moe_reference``'s
(written apart from the code it checks, one token at a time), trained on the whole batch, gives the same losses
every step, the same step-0 gradients (every FSDP shard gathered; every rank's experts against their slice) and the
same parameters after training; the expert load of every layer and step is the same; the all-to-alls per step are 5
a layer (counts, dispatch and combine forward, both again backward), and FSDP's reduce-scatters carry the non-expert
parameters only (their bytes, with FSDP's padding, = the formula).

--ep E (a divisor of N) makes the EP groups smaller: the experts over groups of E consecutive ranks, replicated in
every group; each expert's replicas then all-reduce its gradient across the groups (their tokens differ).

--tp T puts TP beside EP on a 2-D mesh (dp = N / T, tp = T), as torchtitan does: attention's projections split over
the TP group (chapter 06's plan), FSDP over dp, the experts over all N ranks. The tokens reach the MoE layer
replicated over TP; each TP rank routes its own 1/T of them (``moe.TokensSplitOverTP``), and an all-gather over TP
makes the output whole again. The router and the shared expert then saw a share of the tokens on each TP rank:
their gradients are summed over TP (``moe.reduce_over_tp``); the experts' are divided by dp.

    torchrun --standalone --nproc_per_node=4 scripts/13_expert_parallel/moe_transformer.py
    torchrun --standalone --nproc_per_node=4 scripts/13_expert_parallel/moe_transformer.py --ep 2
    torchrun --standalone --nproc_per_node=4 scripts/13_expert_parallel/moe_transformer.py --tp 2

--preset a100 (on 4 x A100) takes the a100 model's attention and sizes (hidden 2,048, 16 heads, 1,024 tokens a
sequence) with 4 of its 24 blocks, so that the single-device model the run is checked against fits one GPU beside
the rank's shards, and experts a quarter of its feed-forward wide (1,408), fine-grained as DeepSeekMoE's.
"""

import contextlib
import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from distlab import comm, data, hybrid, memory, metrics, models, moe, moe_reference, runtime

# fp32 tolerances: FSDP reduce-scatters and the experts see other batch shapes than one device (a few ulps);
# measured on 4 CPU ranks (tiny): losses <= 1e-7, gradients <= 1e-8. The a100 preset's sums are 30x longer: chapter
# 09's a100 tolerances. On a GPU each is widened by metrics.GPU_FP32_TOLERANCE_FACTOR (other summation orders).
TOLERANCE = {"tiny": {"loss": 1e-5, "grad": 1e-5}, "a100": {"loss": 1e-4, "grad": 1e-5}}
# tokens whose expert may differ from one device's: none on the tiny preset; at the a100 preset's widths on a GPU a
# router score within an ulp of the next one can fall either way when the two runs sum in other orders
MOVED_ASSIGNMENTS = {"tiny": 0.0, "a100": 1e-3}
DEFAULT_LAYERS = {"tiny": 2, "a100": 4}
EXPERT_WIDTH = {"tiny": 64, "a100": models.preset("a100").ffn_hidden // 4}   # a100: 1,408, DeepSeekMoE-style
FLIPPED_WEIGHTS = 1e-4   # the a100 preset: the share of weights Adam may carry off by a near-zero gradient's noise


def model_config(args) -> models.TransformerConfig:
    """The preset's transformer with ``--layers`` blocks (default: 2 tiny, 4 a100)."""
    return models.preset(args.preset, n_layers=args.layers or DEFAULT_LAYERS[args.preset])


def moe_config(args) -> moe.MoEConfig:
    return moe.MoEConfig(ffn_hidden=args.expert_hidden or EXPERT_WIDTH[args.preset], num_experts=args.experts, top_k=args.top_k,
                         scoring=args.scoring, shared_expert=args.shared_expert)


def check_config(args, world_size):
    ep = args.ep or world_size
    runtime.require(world_size % args.tp == 0, f"--tp {args.tp} does not divide the {world_size} ranks")
    runtime.require(args.tp == 1 or ep == world_size, "--tp with --ep: the experts spread over every rank (leave "
                                                      "--ep out)")
    runtime.require(world_size % ep == 0, f"--ep {ep} does not divide the {world_size} ranks (EP groups are "
                                          f"slices of the data-parallel ranks)")
    cfg = model_config(args)
    runtime.require(cfg.n_heads % args.tp == 0, f"--tp {args.tp} does not divide the {cfg.n_heads} heads")
    problems = moe.config_problems(moe_config(args), ep)
    runtime.require(not problems, "; ".join(problems))
    dp = world_size // args.tp
    runtime.require(args.batch % dp == 0, f"--batch {args.batch} sequences do not split over {dp} data-parallel ranks")
    runtime.require(args.batch // dp * cfg.seq_len % args.tp == 0,
                    f"a data-parallel rank's {args.batch // dp * cfg.seq_len} tokens do not split over --tp {args.tp}")


def single_device_name(name: str) -> str:
    """The single-device model's name of a parameter (under TP, ``moe.TokensSplitOverTP`` wraps each layer; the
    reference's MoE layers name their weights as ``moe_reference.reference_name`` says)."""
    return moe_reference.reference_name(name.replace(".layer.layer.", ".layer."))


def attention_tp_plan() -> dict:
    """Chapter 06's plan for attention alone: q, k, v column-parallel (heads split), wo row-parallel (one
    all-reduce); the input enters as one replicated DTensor (one all-reduce of its gradient in backward)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    return {"layers.*.attention": PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                                     desired_input_layouts=(Replicate(), None, None)),
            **{f"layers.*.attention.{name}": ColwiseParallel() for name in ("wq", "wk", "wv")},
            "layers.*.attention.wo": RowwiseParallel()}


def parallelize(model, mesh, ep_group) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """TP over mesh["tp"] for attention (when it has 2+ ranks), EP over ``ep_group`` for the experts, FSDP2 over
    mesh["dp"] for the rest. Returns this rank's expert parameters and the rest as FSDP found them (TP shards)."""
    tp = mesh["tp"].size()
    if tp > 1:
        parallelize_module(model, mesh["tp"], attention_tp_plan())
    experts = []
    for block in model.layers.values():
        layer = moe.ExpertParallelMoE(block.feed_forward.layer, ep_group)
        experts += list(layer.experts.parameters())
        block.feed_forward.layer = layer if tp == 1 else moe.TokensSplitOverTP(layer, mesh["tp"].get_group())
    expert_ids = {id(p) for p in experts}
    rest = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters() if id(p) not in expert_ids]
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"], ignored_params=set(experts))
    fully_shard(model, mesh=mesh["dp"], ignored_params=set(experts))
    return experts, rest


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=4)
    p.add_argument("--experts", type=runtime.positive_int, default=8, help="routed experts a block (default 8)")
    p.add_argument("--top-k", type=runtime.positive_int, default=2, help="experts per token (default 2)")
    p.add_argument("--scoring", choices=moe.SCORINGS, default="softmax", help="softmax or sigmoid top-k")
    p.add_argument("--shared-expert", action="store_true", help="one more expert every token visits")
    p.add_argument("--expert-hidden", type=runtime.positive_int, default=None,
                   help="each expert's SwiGLU width (default: 64 tiny; a100: a quarter of its feed-forward, 1,408)")
    p.add_argument("--layers", type=runtime.positive_int, default=None,
                   help="transformer blocks (default: 2 tiny, 4 a100)")
    p.add_argument("--ep", type=runtime.positive_int, default=None,
                   help="EP degree: the experts spread over groups of this many consecutive ranks and replicated "
                        "across the groups (default: every rank, ep = dp)")
    p.add_argument("--tp", type=runtime.positive_int, default=1,
                   help="TP degree for attention beside EP: a (dp, tp) mesh, the experts over every rank (default 1)")
    p.add_argument("--batch", type=runtime.positive_int, default=8, help="global batch, sequences")
    p.add_argument("--planted-bug", choices=["router-not-reduced-over-tp", "experts-divided-by-world"], default=None,
                   help="with --tp: leave the router's gradients partial over TP, or divide the experts' by every "
                        "rank instead of dp; the single-device comparison must fail")
    runtime.add_lr_flag(p)
    args = p.parse_args()

    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        cfg = model_config(args)
        moe_cfg = moe_config(args)
        world, tp = rt.world_size, args.tp
        dp = world // tp
        ep = args.ep or world
        replicas = world // ep
        report = metrics.Report(__file__, rt, config={**vars(args), "model": cfg.to_dict(), "moe": moe_cfg.to_dict(),
                                                      "ep": ep, "dp": dp, "tp": tp})
        full = moe.moe_transformer(cfg, moe_cfg, seed=args.seed, device=rt.device)
        non_expert = sum(p.numel() for name, p in full.named_parameters() if ".experts." not in name)
        all_experts = sum(p.numel() for name, p in full.named_parameters() if ".experts." in name)
        model = copy.deepcopy(full)
        # the single-device reference: the same weights, every MoE layer the one written apart (moe_reference)
        reference = moe_reference.replace_moe_layers(full)
        # FSDP over dp, TP (attention) over tp; the experts over groups of ep consecutive ranks, replicated across
        # the groups
        mesh = init_device_mesh(rt.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        ep_mesh = init_device_mesh(rt.device.type, (replicas, ep), mesh_dim_names=("replica", "ep"))
        experts, rest = parallelize(model, mesh, ep_mesh.get_group("ep"))
        expert_ids = {id(p) for p in experts}
        # what each TP rank computes from its share of the tokens, to be summed over TP
        routers = [p for block in model.layers.values() if tp > 1
                   for p in block.feed_forward.layer.layer.replicated_parameters()]
        optimizer = models.adamw_for_mixed_parameters(model.parameters(), args.lr)  # DTensors beside the experts
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)
        local = moe_cfg.num_experts // ep
        ep_rank = ep_mesh.get_local_rank("ep")
        lo, hi = ep_rank * local, (ep_rank + 1) * local
        layers = cfg.n_layers
        rt.print(f"{args.preset} transformer, {layers} blocks, each feed-forward {moe_cfg.num_experts} experts top-"
                 f"{moe_cfg.top_k} ({moe_cfg.scoring}); {world} ranks: FSDP over dp = {dp}"
                 + (f", attention TP over tp = {tp} (each TP rank routes 1/{tp} of the tokens)" if tp > 1 else "")
                 + f", the experts over ep = {ep} ({local} a rank and block"
                 f"{f', {replicas} replicas of each' if replicas > 1 else ''}); global batch {args.batch} x "
                 f"{cfg.seq_len} tokens")

        grad_diff, loads, reference_loads, counted = 0.0, [], [], None
        for step in range(args.steps):
            tokens = data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed).to(rt.device)
            inputs, targets = data.split_inputs_targets(data.shard_rows(tokens, mesh.get_local_rank("dp"), dp))
            with comm.CommCounter() if step == 1 else contextlib.nullcontext() as counter:
                loss = models.lm_loss(model(inputs), targets)
                loss.backward()
                for param in experts:
                    if replicas > 1:   # the other replicas of this expert saw the other groups' tokens: add them
                        dist.all_reduce(param.grad, group=ep_mesh.get_group("replica"))
                    # a sum over every data-parallel rank's mean loss (each token once, whichever TP rank routed
                    # it): the global mean's gradient is 1/dp of it
                    param.grad /= world if args.planted_bug == "experts-divided-by-world" else dp
                if args.planted_bug != "router-not-reduced-over-tp":
                    moe.reduce_over_tp(routers, mesh["tp"].get_group() if tp > 1 else None)
            if step == 1:
                counted = counter
            reference_inputs, reference_targets = data.split_inputs_targets(tokens)
            reference_loss = models.lm_loss(reference(reference_inputs), reference_targets)
            reference_loss.backward()
            if step == 0:
                theirs = dict(reference.named_parameters())
                ours, wanted = [], []
                with hybrid.quiet_redistribution():
                    for name, param in model.named_parameters():
                        if id(param) in expert_ids:
                            ours.append(param.grad)
                            wanted.append(theirs[single_device_name(name)].grad[lo:hi])
                        else:
                            grad = param.grad
                            ours.append(grad.full_tensor() if isinstance(grad, DTensor) else grad)
                            wanted.append(theirs[single_device_name(name)].grad)
                grad_diff = metrics.max_abs_diff(ours, wanted)
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            reference_optimizer.zero_grad(set_to_none=True)
            step_loads, step_reference_loads = [], []
            for block, reference_block in zip(model.layers.values(), reference.layers.values()):
                load = block.feed_forward.last["load"].clone()
                dist.all_reduce(load)
                step_loads.append(load.tolist())
                step_reference_loads.append(reference_block.feed_forward.last["load"].tolist())
            loads.append(step_loads)
            reference_loads.append(step_reference_loads)
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            report.losses.append(global_loss.item() / world)   # TP ranks hold the same loss: the mean over dp
            report.extra.setdefault("reference_losses", []).append(reference_loss.item())
            rt.print(f"step {step}  loss {report.losses[-1]:.6f}  single-device {reference_loss.item():.6f}  "
                     f"load of block 0 {step_loads[0]}")

        # ---- checks ----
        value = torch.tensor(grad_diff, device=rt.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        report.check_close("losses = single-device (every step)", report.losses, report.extra["reference_losses"],
                           metrics.fp32_tolerance(TOLERANCE[args.preset]["loss"], rt.device))
        report.check_close("step-0 gradients = single-device (FSDP shards gathered; this rank's experts)",
                           value.item(), 0.0, metrics.fp32_tolerance(TOLERANCE[args.preset]["grad"], rt.device))
        theirs = dict(reference.named_parameters())
        # Adam turns any gradient into a step of ~lr: a weight whose gradient is near zero moves ~lr whichever way
        # the last ulps point, a wrong gradient moves every weight. The tiny preset's noise stays far below lr/10;
        # at the a100 preset's widths on a GPU a few weights in a billion flip (2 of 475 M on an H100: BENCHMARKS.md)
        beyond = metrics.fp32_tolerance(args.lr / 10, rt.device)
        largest, flipped, total = 0.0, 0, 0
        with hybrid.quiet_redistribution():
            for name, param in model.named_parameters():
                wanted = theirs[single_device_name(name)]
                ours = param.full_tensor() if isinstance(param, DTensor) else param
                diff = (ours.detach() - (wanted[lo:hi] if id(param) in expert_ids else wanted).detach()).abs()
                largest = max(largest, diff.max().item())
                flipped += int((diff > beyond).sum())
                total += diff.numel()
        if args.preset == "tiny":
            report.check_close("parameters after training = single-device", largest, 0.0, beyond)
        else:
            report.check("parameters after training = single-device (share of weights off by more than lr/10)",
                         flipped <= FLIPPED_WEIGHTS * total,
                         f"{flipped:,} of {total:,} (largest {largest:.2g})", f"<= {FLIPPED_WEIGHTS:.0e} of them")
        moved = sum(abs(a - b) for step, theirs_step in zip(loads, reference_loads)
                    for block, theirs_block in zip(step, theirs_step) for a, b in zip(block, theirs_block)) / 2
        assignments = int(sum(sum(sum(block) for block in step) for step in reference_loads))
        allowed = MOVED_ASSIGNMENTS[args.preset]
        report.check("expert load of every block and step = single-device's" + (
                         f" (up to {allowed:.1%} of the assignments moved between experts: near-ties)" if allowed
                         else ""), moved <= allowed * assignments,
                     f"{sum(a == b for a, b in zip(loads, reference_loads))} of {len(loads)} steps equal, "
                     f"{moved:.0f} of {assignments:,} assignments moved",
                     "every step" if not allowed else f"<= {allowed * assignments:.0f} moved")
        expert_numel = sum(p.numel() for p in experts)
        expert_bytes = sum(p.numel() * p.element_size() for p in experts)
        # c10d's all-reduces are the script's own (DTensor's TP collectives are functional ones, counted apart)
        reduced = sum(c.payload_bytes for c in counted.calls if c.collective == "all_reduce" and c.source == "c10d")
        router_bytes = sum(p.to_local().numel() * p.element_size() for p in routers)   # their FSDP shards
        report.add_comm("all_reduce", reduced, (expert_bytes if replicas > 1 else 0) + router_bytes,
                        dimension="replica" if tp == 1 else "tp", what="the experts' gradients across the EP groups; "
                        "the router's and shared expert's over TP")
        report.check_equal("all-reduced bytes = this rank's expert gradients when there are replicas, plus its "
                           "router and shared expert shards under TP (else none)", reduced,
                           (expert_bytes if replicas > 1 else 0) + router_bytes)
        report.check_equal("expert parameters on this rank = layers x experts / ep x 3 x hidden x expert width",
                           expert_numel, layers * local * 3 * cfg.dim * moe_cfg.ffn_hidden)
        calls = counted.by_collective()
        a2a = calls.get("all_to_all", {}).get("calls", 0)
        report.check_equal("all-to-alls per step = 5 a block (counts; dispatch, combine; both backward)", a2a,
                           5 * layers)
        # on one rank FSDP2 calls no collective at all (torch's _fsdp_param_group.py: "if world_size == 1")
        scattered = memory.fsdp_padded_bytes(rest, dp) if dp > 1 else 0
        report.add_comm("reduce_scatter", counted.total("reduce_scatter"), scattered,
                        dimension="dp", what="FSDP: every parameter but the experts")
        report.check_equal("FSDP's reduce-scatter bytes = the non-expert parameters (FSDP's padding included; "
                           "none on one rank)", counted.total("reduce_scatter"), scattered)
        rt.print(f"\nper step: {a2a} all-to-alls; FSDP reduce-scattered {counted.total('reduce_scatter'):,} B, the "
                 f"non-expert parameters ({non_expert:,}); each rank keeps {expert_numel:,} "
                 f"expert parameters of {all_experts:,}"
                 f" ({local} of {moe_cfg.num_experts} experts a block), "
                 + (f"their gradients all-reduced with the {replicas - 1} other replica(s) of them"
                    if replicas > 1 else "with no gradient collective of their own"))
        if tp > 1:
            gathered = [n for block in model.layers.values() for n in block.feed_forward.layer.gathered[-2:]]
            tokens_per_rank = args.batch // dp * cfg.seq_len
            report.check_equal("TP all-gathers per block and step = 2 (outputs forward, input gradients backward), "
                               "each the data-parallel rank's tokens x hidden x 4 B",
                               gathered, [tokens_per_rank * cfg.dim * 4] * 2 * layers)
            tp_reduces = sum(1 for c in counted.calls if c.collective == "all_reduce" and c.source == "functional")
            report.check_equal("TP all-reduces per step = 2 a block (attention's output; its input gradient)",
                               tp_reduces, 2 * layers)
        report.extra["load"] = loads
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
