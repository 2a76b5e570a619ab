"""Expert parallelism by hand: a mixture-of-experts layer with its experts spread over the ranks.

Each of N ranks holds E/N of the layer's E experts, a replica of the router (and of the shared expert, with
--shared-expert), and its own N-th of the batch's tokens. A step of the layer (``distlab.moe.ExpertParallelMoE``):

1. route: the router scores the rank's tokens and picks top-k experts for each (softmax, or sigmoid as
   DeepSeek-V3); with --capacity-factor, each expert takes at most ceil(factor x tokens x k / E) of them;
2. exchange counts: an all-to-all of E integers tells each rank how many rows it will receive for each of its
   experts;
3. dispatch: the rows sorted by expert go to the rank of their expert, in one all-to-all with uneven splits;
4. compute: each rank runs its experts on what arrived (a grouped matrix multiply on a Hopper GPU in bf16, a
   loop elsewhere: the output says which);
5. combine: the reverse all-to-all brings every output home, where the router's weights sum them per token.

Backward runs the two all-to-alls in reverse. The experts' gradients need no all-reduce (each expert lives on one
rank and its gradient arrives through the combine's backward from every rank's tokens); the router's and the shared
expert's do (they are replicated: data parallelism).

The script proves it against a single-device reference written apart (``distlab.moe_reference``: one token at a
time, the capacity rule, the auxiliary loss and the bias update from their definitions; it calls none of
``distlab.moe``'s routing, experts or losses, and shares only a copy of the weights). Trained on the whole batch in
lockstep, it gives the same outputs, gradients (router included, through the auxiliary loss too) and losses, and the
same parameters, shared expert and router bias after training; the expert load of every step is the same; each
rank's bytes in each all-to-all = tokens x top-k x hidden x 4 bytes x the share of assignments that cross ranks,
counted from the reference's routing; with a capacity factor the dropped assignments = sum over experts of
max(0, assigned - capacity). --balance aux-loss adds Switch's auxiliary loss, --balance bias moves DeepSeek-V3's
routing bias after each step; the load of each step is printed and written to the metrics.

    torchrun --standalone --nproc_per_node=4 scripts/13_expert_parallel/ep_from_scratch.py
    torchrun --standalone --nproc_per_node=4 scripts/13_expert_parallel/ep_from_scratch.py --capacity-factor 1.0
    torchrun --standalone --nproc_per_node=4 scripts/13_expert_parallel/ep_from_scratch.py --scoring sigmoid \\
        --shared-expert --balance bias
"""

import contextlib
import copy
import sys

import torch
import torch.distributed as dist

from distlab import comm, data, metrics, moe, moe_reference, runtime

# fp32 tolerances. The EP layer computes each expert on the rows that arrived, the reference one token at a time
# (other shapes, so other blocking in the matrix multiplies), and the EP layer all-reduces the router's gradient: a
# few ulps apart, never more. Measured on 4 CPU ranks: outputs <= 1.5e-6 (outputs up to about 3: 6 ulps of fp32),
# gradients <= 1e-8, losses <= 1.2e-7.
OUTPUT_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-6
LOSS_TOLERANCE = 1e-5


def moe_config(args) -> moe.MoEConfig:
    return moe.MoEConfig(dim=args.dim, ffn_hidden=args.ffn_hidden, num_experts=args.experts, top_k=args.top_k,
                         scoring=args.scoring, shared_expert=args.shared_expert,
                         capacity_factor=args.capacity_factor)


def check_config(args, world_size):
    problems = moe.config_problems(moe_config(args), world_size)
    runtime.require(not problems, "; ".join(problems))
    runtime.require(args.batch % world_size == 0,
                    f"--batch {args.batch} sequences do not split over {world_size} ranks")


def matching_parameters(layer, reference, rank, grads=False):
    """(this rank's parameter, the reference's) pairs, or of their gradients: the router, the shared expert, and
    this rank's slice of the experts (rank r holds experts [r E/ep, (r+1) E/ep))."""
    pairs = []
    for name, param in layer.named_parameters():
        theirs = getattr(reference, moe_reference.reference_name(name))
        ours, theirs = (param.grad, theirs.grad) if grads else (param, theirs)
        if name.startswith("experts."):
            theirs = theirs[rank * layer.local:(rank + 1) * layer.local]
        pairs.append((ours, theirs))
    return pairs


def layer_loss(y, target, global_tokens, aux=None, aux_weight=0.0):
    """Mean squared error over the global batch (this rank's share of the sum), plus the weighted auxiliary loss."""
    loss = ((y - target) ** 2).sum() / (global_tokens * y.shape[-1])
    return loss if aux is None else loss + aux_weight * aux


def main():
    p = runtime.parser(__doc__, steps=4)
    p.add_argument("--experts", type=runtime.positive_int, default=8, help="routed experts (default 8)")
    p.add_argument("--top-k", type=runtime.positive_int, default=2, help="experts per token (default 2)")
    p.add_argument("--scoring", choices=moe.SCORINGS, default="softmax",
                   help="softmax top-k (Mixtral) or sigmoid top-k (DeepSeek-V3)")
    p.add_argument("--shared-expert", action="store_true", help="add one expert every token visits (DeepSeek-V3)")
    p.add_argument("--capacity-factor", type=runtime.positive_float, default=None,
                   help="drop assignments beyond ceil(factor x tokens x top-k / experts) per expert and rank "
                        "(GShard, Switch); default: dropless")
    p.add_argument("--balance", choices=["none", "aux-loss", "bias"], default="none",
                   help="aux-loss: Switch's auxiliary loss; bias: DeepSeek-V3's auxiliary-loss-free bias update")
    p.add_argument("--aux-weight", type=runtime.positive_float, default=0.01, help="weight of the auxiliary loss")
    p.add_argument("--bias-rate", type=runtime.positive_float, default=1e-2, help="bias update speed (DeepSeek: gamma)")
    p.add_argument("--batch", type=runtime.positive_int, default=8, help="global batch, sequences")
    p.add_argument("--seq-len", type=runtime.positive_int, default=16, help="tokens per sequence")
    p.add_argument("--dim", type=runtime.positive_int, default=32, help="hidden size")
    p.add_argument("--ffn-hidden", type=runtime.positive_int, default=64, help="each expert's SwiGLU width")
    p.add_argument("--planted-bug", choices=["router-not-all-reduced", "experts-not-regrouped"], default=None,
                   help="a mistake the checks must catch: the router's gradient left unsummed over the replicas, or "
                        "the arrived rows computed in arrival order instead of grouped by expert")
    runtime.add_lr_flag(p)
    args = p.parse_args()

    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        cfg = moe_config(args)
        ep, local = rt.world_size, cfg.num_experts // rt.world_size
        report = metrics.Report(__file__, rt, config={**vars(args), "moe": cfg.to_dict(), "ep": ep})
        torch.manual_seed(args.seed)
        full = moe.MoE(cfg).to(rt.device)
        layer = moe.ExpertParallelMoE(copy.deepcopy(full))
        # the single-device reference, on every rank (it is small): written apart, a copy of the same weights
        reference = moe_reference.ReferenceMoE(full)
        layer.regroup = args.planted_bug != "experts-not-regrouped"
        optimizer = torch.optim.AdamW(layer.parameters(), lr=args.lr)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)
        global_tokens, tokens = args.batch * args.seq_len, args.batch * args.seq_len // ep
        rt.print(f"MoE layer: {cfg.num_experts} experts, top-{cfg.top_k} ({cfg.scoring}), hidden {cfg.dim}, expert "
                 f"width {cfg.ffn_hidden}{', a shared expert' if cfg.shared_expert else ''}; "
                 f"{cfg.num_params():,} parameters, {cfg.active_params():,} active per token; EP over {ep} ranks, "
                 f"{local} experts each; {tokens} tokens a rank; "
                 + (f"capacity factor {cfg.capacity_factor} (capacity {moe.capacity(tokens, cfg)} a rank and expert)"
                    if cfg.capacity_factor else "dropless")
                 + f"; experts run as {'a grouped matrix multiply' if moe.grouped_mm_available(torch.zeros(1, device=rt.device)) else 'a loop of matrix multiplies'}")

        diffs = {"output": 0.0, "grad": 0.0}
        loads, reference_loads, dropped, formula_dropped, imbalance = [], [], [], [], []
        for step in range(args.steps):
            x, target = data.regression_batch(step, global_tokens, cfg.dim, cfg.dim, seed=args.seed)
            x, target = x.to(rt.device), target.to(rt.device)
            mine = slice(rt.rank * tokens, (rt.rank + 1) * tokens)
            # inside a model the layer's input is an activation: it needs a gradient, so the dispatch runs backward
            local_x, x = x[mine].clone().requires_grad_(), x.requires_grad_()
            measuring = step == 1
            layer.log = [] if measuring else None
            layer.phases = [] if step == 2 else None   # step 2's parts timed (the first steps pay one-off costs)
            if step == 2:
                timed_phases = layer.phases
            with comm.CommCounter() if measuring else contextlib.nullcontext() as counter:
                y, info = layer(local_x)
                aux = (moe.load_balancing_loss(info["scores"], info["chosen"], cfg.num_experts) / ep
                       if args.balance == "aux-loss" else None)
                loss = layer_loss(y, target[mine], global_tokens, aux, args.aux_weight)
                loss.backward()
            for param in layer.replicated_parameters():   # data parallel: the replicas' gradients summed
                if args.planted_bug != "router-not-all-reduced" or param is not layer.router.gate.weight:
                    dist.all_reduce(param.grad)

            # the reference on the whole batch, its capacity and auxiliary loss over the same groups (one a rank)
            reference_y, reference_info = reference(x, groups=ep)
            reference_aux = (moe_reference.load_balancing_loss(reference_info["scores"], reference_info["chosen"],
                                                               cfg.num_experts, groups=ep)
                             if args.balance == "aux-loss" else None)
            reference_loss = layer_loss(reference_y, target, global_tokens, reference_aux, args.aux_weight)
            reference_loss.backward()
            if step == 0:
                diffs["output"] = metrics.max_abs_diff(y, reference_y[mine])
                ours, theirs = zip(*matching_parameters(layer, reference, rt.rank, grads=True))
                diffs["grad"] = metrics.max_abs_diff(list(ours) + [local_x.grad], list(theirs) + [x.grad[mine]])
            if measuring:   # the rows each all-to-all sent to other ranks, against the single-device routing
                # from the reference's routing, independently of the splits the layer exchanged
                crossing = moe.dispatch_matrix(reference_info["chosen"], reference_info["keep"], ep, local)
                sent_rows = int(crossing[rt.rank].sum() - crossing[rt.rank, rt.rank])
                received_rows = int(crossing[:, rt.rank].sum() - crossing[rt.rank, rt.rank])
                measured_log = list(layer.log)
                sent_by_call = [sum(splits) - splits[rt.rank] for _, splits in measured_log]
                a2a_calls = counter.count("all_to_all")
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            reference_optimizer.zero_grad(set_to_none=True)

            load = info["load"].clone()
            dist.all_reduce(load)
            if args.balance == "bias":   # both move the bias by the global load of the step
                moe.update_bias(layer.router, load, args.bias_rate)
                moe_reference.update_bias(reference.bias, reference_info["load"], args.bias_rate)
            loads.append(load.tolist())
            reference_loads.append(reference_info["load"].tolist())
            counts = torch.tensor([info["dropped"], moe.dropped_by_formula(info["chosen"], cfg.num_experts,
                                                                            moe.capacity(tokens, cfg))],
                                  device=rt.device)
            dist.all_reduce(counts)
            dropped.append(int(counts[0]))
            formula_dropped.append(int(counts[1]))
            rows = [None] * ep
            dist.all_gather_object(rows, info["rows_computed"])
            imbalance.append(max(rows) / (sum(rows) / ep))
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            report.losses.append(global_loss.item())
            report.extra.setdefault("reference_losses", []).append(reference_loss.item())
            rt.print(f"step {step}  loss {global_loss.item():.6f}  single-device {reference_loss.item():.6f}  "
                     f"load {load.tolist()}  dropped {dropped[-1]}  slowest rank computes {imbalance[-1]:.2f} x the mean")

        # ---- checks ----
        for name in diffs:
            value = torch.tensor(diffs[name], device=rt.device)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            diffs[name] = value.item()
        report.check_close("step-0 outputs = single-device layer's (every rank's tokens)", diffs["output"], 0.0,
                           metrics.fp32_tolerance(OUTPUT_TOLERANCE, rt.device))
        report.check_close("step-0 gradients = single-device (router, shared expert, each rank's experts, the input)",
                           diffs["grad"], 0.0, metrics.fp32_tolerance(GRAD_TOLERANCE, rt.device))
        report.check_close("losses = single-device (every step)", report.losses, report.extra["reference_losses"],
                           metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device))
        ours, theirs = zip(*matching_parameters(layer, reference, rt.rank))
        report.check_close("parameters after training = single-device (this rank's experts, the router, the shared "
                           "expert)", metrics.max_abs_diff(list(ours), list(theirs)), 0.0, args.lr / 10)
        # the bias moves by +-rate or not at all: equal to the last bit, or a step of rate apart
        report.check_close("router bias after training = single-device (DeepSeek-V3's update, every step)",
                           metrics.max_abs_diff(layer.router.bias, reference.bias), 0.0, args.bias_rate / 10)
        report.check("expert load of every step = single-device's", loads == reference_loads,
                     f"{sum(a == b for a, b in zip(loads, reference_loads))} of {len(loads)} steps equal", "every step")
        report.check("dropped assignments = sum over experts of max(0, assigned - capacity) (every step)",
                     dropped == formula_dropped, f"{sum(dropped)} dropped in {len(dropped)} steps",
                     f"formula: {sum(formula_dropped)}")

        element = 4   # fp32 activations
        formula = {"dispatch": sent_rows, "combine": received_rows}
        # forward: dispatch, combine; backward runs the combine's gradient first, which goes where the dispatch went
        # (the shape of a dispatch), then the dispatch's, which goes back to the sources (the shape of a combine)
        kinds = ["dispatch", "combine", "dispatch", "combine"]
        phases = ["forward", "forward", "backward (of the combine)", "backward (of the dispatch)"]
        for kind, phase, rows in zip(kinds, phases, sent_by_call):
            report.add_comm("all_to_all", rows * cfg.dim * element, formula[kind] * cfg.dim * element,
                            dimension="ep", phase=phase, kind=kind)
        leaving = sent_rows / (tokens * cfg.top_k)
        report.check("bytes each rank sends in each all-to-all = formula (from the single-device routing; every rank)",
                     all(r["measured_bytes"] == r["analytic_bytes"] for r in report.comm)
                     and len(report.comm) == 4 and a2a_calls == 5,
                     [r["measured_bytes"] for r in report.comm], "4 calls of the formula's bytes, plus the counts")
        rt.print(f"\nrank 0, step 1: dispatch {sent_rows * cfg.dim * element:,} B = {tokens} tokens x top-{cfg.top_k} "
                 f"x {cfg.dim} x {element} B x {leaving:.3f} (the share of its assignments that left; uniform routing "
                 f"would give {moe.uniform_leaving_share(ep):.3f}, derived); combine {received_rows * cfg.dim * element:,} B; "
                 f"backward the same two reversed; {a2a_calls} all-to-alls in all (one of {cfg.num_experts} counts)")
        # where the dispatch went: ranks of this node (NVLink on a GPU node) or of other nodes (the network)
        per_node = runtime.launcher_env().local_world_size or ep
        splits = measured_log[0][1]
        node = rt.rank // per_node
        same_node = sum(n for j, n in enumerate(splits) if j != rt.rank and j // per_node == node)
        other_nodes = sum(n for j, n in enumerate(splits) if j // per_node != node)
        rt.print(f"rank 0's dispatch: {same_node} rows to the other ranks of its node, {other_nodes} to other nodes "
                 f"({per_node} ranks a node)")
        report.extra.update({"rows_to_same_node": same_node, "rows_to_other_nodes": other_nodes})
        report.extra.update({"load": loads, "imbalance": imbalance, "dropped": dropped,
                             "capacity": moe.capacity(tokens, cfg),
                             "experts_ran_as": "grouped_mm" if moe.grouped_mm_available(
                                 torch.zeros(1, device=rt.device)) else "loop",
                             "leaving_share": leaving, "uniform_leaving_share": moe.uniform_leaving_share(ep)})
        phases_of_rank = [None] * ep
        dist.all_gather_object(phases_of_rank, timed_phases if args.steps > 2 else [])
        report.extra["phases"] = phases_of_rank
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
