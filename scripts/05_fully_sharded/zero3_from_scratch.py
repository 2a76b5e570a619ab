"""ZeRO stage 3 by hand (FSDP from scratch): the parameters themselves sharded at rest, gathered unit by unit.

Stages 1 and 2 (zero_from_scratch.py) shard the optimizer state and the gradients, but every rank still holds
every parameter. Stage 3 shards those too. The model is cut into **units** (the embedding, each block, the
final norm with the output head); rank r keeps slice r of each parameter, 1/N of the model, and:

1. a forward **pre-hook** on a unit all-gathers its parameters into full tensors just before the unit runs;
2. a forward **hook** drops them right after it ran: one unit is whole at a time (and the root, below);
3. backward needs a unit's weights again (for y = x W^T, dx = dy W). Autograd would keep the full W alive
   from forward to backward; a saved-tensor hook keeps a note instead (which unit, which parameter, which
   view). A hook on the unit's output fires when backward reaches the unit and **all-gathers it again**, as
   FSDP2 does (``--backward-gather on-first-use`` waits until backward first reads one of its weights: a unit
   whose backward reads none, the embedding, is not gathered again); the notes become views of the new tensors;
4. the gather is an autograd function: its backward runs once the unit's whole gradient is complete (autograd
   waits for every use of the unit's weights) and **reduce-scatters** it, each rank keeping the mean of its own
   slice; then the gathered weights are dropped;
5. AdamW steps on the slices only.

Any model: a frozen parameter (``requires_grad=False``) is sharded and gathered like the rest but never reduced
or stepped (this sketch lets autograd compute its local gradient and throws it away; FSDP2 does not compute it);
a weight that two units use (a head tied to the embedding) belongs to the root unit, the whole model, whole for
the whole forward; every parameter is sliced on its own, so parameter groups keep their learning rate and weight
decay; a size that does not divide by N is padded. ``--any-model`` trains such a model.

``--prefetch``: each unit issues the next unit's all-gather (``async_op=True``) before it computes, in forward and in
backward, so the traffic can overlap compute; two units are whole at a time, and the bound says so.

``--mixed-precision``: the slices stay fp32 (the master weights), the gathers and the compute are bf16 (each unit's
floating-point inputs cast too), the gradients are reduced in fp32: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, which it then equals step for step; against the fp32 device, the bf16 tolerances.

Proof, as every chapter gives it: losses, step-0 gradients and parameters after training equal one device (rank
0 trains the whole model alone) and FSDP2 ``fully_shard`` on the same units (every rank); the bytes of each
collective equal the formula (per unit: all-gather twice, reduce-scatter once; distlab.comm.zero_step_bytes)
and FSDP2's own, measured; the gathered parameters alive at any moment, read off their storages (a storage is
gone only when no tensor, autograd's saved ones included, still points at it), never exceed the root plus the
largest unit. ``--planted-bug`` shows two mistakes, both without the saved-tensor hook: free the full weights'
memory after forward anyway (free-before-backward: backward reads freed memory and fails), or only drop the
unit's own references (keep-saved-weights: every answer right, but autograd keeps every unit whole from its
forward to its backward, so stage 3 saves no memory, and only the memory check sees it). A third, late-prefetch,
issues each prefetch only once the unit ahead has computed: only the prefetch's timing checks see it.

FSDP2 keeps the weights out of autograd otherwise (torch 2.13, distributed/fsdp/_fully_shard/): no saved-tensor hook,
no function around the gather. Each full parameter is a view of one all-gather output kept for the whole run; after
forward its storage is freed with ``resize_(0)`` (_fsdp_param.py:827-831, 1072-1074) and grown back before the next
all-gather writes into it (:823-825, 1066-1069), so what autograd saved is refilled in time. That is
free-before-backward plus the refill. Its reduce-scatter runs from an identity on each unit's inputs
(RegisterPostBackwardFunction, _fsdp_param_group.py:891-903, 1110-1127), as this sketch's AfterBackward does for
frozen units, on the gradients autograd accumulated in the full parameters' ``.grad``. ``--backward-weights refill``
runs that way here: no notes; the storages of the tensors autograd saved are freed after forward and refilled in
place before backward.

    torchrun --standalone --nproc_per_node=4 scripts/05_fully_sharded/zero3_from_scratch.py
    torchrun --standalone --nproc_per_node=4 scripts/05_fully_sharded/zero3_from_scratch.py --any-model
"""

import math
import sys
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from common_fully_sharded import (BF16_LOSS_TOLERANCE, GRAD_TOLERANCE, LOSS_TOLERANCE, Baseline,
                                  bf16_param_mean_tolerance, param_tolerance)
from distlab.metrics import BF16_GRAD_RELATIVE_TOLERANCE
from distlab import comm, data, metrics, models, runtime

# FSDP2 warns that the root's output (the head's addmm, viewed back to 3-D) is a view that an in-place op could
# detach from its pre-backward hook; the loss reads it out of place, so the warning does not apply here.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

PLANTED_BUGS = ("free-before-backward", "keep-saved-weights", "late-prefetch")
KEEPS_SAVED_WEIGHTS = ("free-before-backward", "keep-saved-weights")   # these two leave out the saved-tensor hook


def check_config(args, world_size):
    runtime.require(args.batch % world_size == 0, f"--batch {args.batch} does not split over {world_size} ranks")
    runtime.require(args.planted_bug != "late-prefetch" or args.prefetch,
                    "--planted-bug late-prefetch plants its bug in the prefetch: add --prefetch")
    if args.backward_weights == "refill":
        runtime.require(args.backward_gather == "on-entry", "--backward-weights refill gathers each unit when backward "
                                                            "reaches it: it needs --backward-gather on-entry")
        runtime.require(args.planted_bug in (None, "late-prefetch"),
                        f"--planted-bug {args.planted_bug} plants its bug in the notes: drop --backward-weights refill")


class GatherUnit(torch.autograd.Function):
    """Forward: all-gather a unit's slices into full parameters. Backward: reduce-scatter their gradients."""

    @staticmethod
    def forward(ctx, unit, *slices):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # a parameter this step did not use gets None, not zeros: no step
        return tuple(unit.all_gather(phase="forward"))

    @staticmethod
    def backward(ctx, *grads):
        slice_grads = ctx.unit.reduce_scatter(grads)  # autograd calls this once every use of the unit is done
        ctx.unit.drop()                              # so the weights gathered again for backward can go
        ctx.unit.on_event(f"{ctx.unit.name}: gradient reduce-scattered, dropped")
        ctx.unit.after_backward()
        return (None, *slice_grads)


class AfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the gradient has gone through the whole unit. A unit with
    no gradient to reduce (every parameter frozen) is dropped there: its gather's backward never runs."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.drop_if_frozen()
        return (None, *grads)


@dataclass
class SavedWeight:
    """What autograd keeps in place of a unit's weight: which unit, which parameter, which view of it."""
    unit: "ShardedUnit"
    index: int
    size: torch.Size
    stride: tuple
    offset: int


@dataclass(frozen=True)
class ParamSpec:
    """What a unit remembers of a parameter once it is sliced: its name, shape and trainability, not its values."""
    name: str
    shape: torch.Size
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ShardedUnit:
    """Some of the model's parameters, 1/N of each on this rank (``slices``), whole only while in use.

    The whole parameters are taken out of the modules and not kept (``specs`` remembers their shapes): the modules
    read plain attributes instead, the full tensors while the unit is whole, None at rest.
    """

    def __init__(self, name: str, params: list[nn.Parameter], names: dict, world: int, rank: int,
                 param_dtype: torch.dtype = torch.float32):
        self.name, self.world, self.param_dtype = name, world, param_dtype
        self.names = [names[id(p)] for p in params]          # each parameter's (module, attribute) pairs
        self.specs = [ParamSpec(pairs[0][2], p.shape, p.requires_grad) for p, pairs in zip(params, self.names)]
        self.slice_len = [math.ceil(p.numel() / world) for p in params]
        self.slices = [nn.Parameter(F.pad(p.detach().reshape(-1), (0, k * world - p.numel()))[rank * k:(rank + 1) * k]
                                    .clone(), requires_grad=p.requires_grad) for p, k in zip(params, self.slice_len)]
        for pairs in self.names:
            for module, attr, _ in pairs:
                del module._parameters[attr]         # the module's reference to the whole parameter goes
                setattr(module, attr, None)
        self.full: list[torch.Tensor] | None = None     # the gathered parameters, while the unit is whole
        self.storage_index: dict[int, int] = {}          # storage address -> which parameter
        self.on_event = lambda event: None               # the memory ledger's, set by Zero3
        self.on_copy_out = lambda buffer: None           # the ledger's look inside the gather, set by Zero3
        self.after_backward = lambda: None               # late-prefetch's late issue in backward, set by Zero3
        self.pending = None                              # a prefetched all-gather: (buffer, work, its timing row)
        self.refill = False                              # FSDP2's way (set by Zero3): free the storages, refill them
        self.freed: list[torch.Tensor] | None = None     # the full tensors autograd saved, storages freed, to refill
        self.refilled = 0                                # measured: storages refilled in place, the whole run
        self.gathers: list[dict] = []                    # measured: each all-gather's issue and completion
        self.prefetch_done_before_wait: list[bool] = []  # measured: was each prefetched gather done when needed

    @property
    def full_bytes(self) -> int:
        return sum(spec.numel for spec in self.specs) * self.param_dtype.itemsize

    @property
    def padded_bytes(self) -> int:
        """The all-gather's buffer: every rank's slices, padding included (what a prefetch holds until used)."""
        return sum(self.slice_len) * self.world * self.param_dtype.itemsize

    @torch.no_grad()
    def start_gather(self, clock, phase: str = "", prefetched: bool = False) -> None:
        """Issue this unit's all-gather without waiting for it (``async_op``): it runs while the caller computes."""
        mine = torch.cat([s.detach().to(self.param_dtype) for s in self.slices])  # one collective a unit, in the
        # compute dtype: bf16 mixed precision gathers half the bytes, the fp32 slices stay the master weights
        gathered = torch.empty(mine.numel() * self.world, dtype=mine.dtype, device=mine.device)
        row = {"unit": self.name, "phase": phase, "prefetched": prefetched, "issued": clock()}
        work = dist.all_gather_single(gathered, mine, async_op=True)
        self.gathers.append(row)
        self.pending = (gathered, work, row)

    @torch.no_grad()
    def all_gather(self, clock=time.perf_counter, phase: str = "") -> list[torch.Tensor]:
        if self.pending is None:
            self.start_gather(clock, phase)
        gathered, work, row = self.pending
        row["waited"], row["done_before_wait"] = clock(), work.is_completed()
        if row["prefetched"]:                        # every step's, forward and backward (gathers keeps the last's)
            self.prefetch_done_before_wait.append(row["done_before_wait"])
        work.wait()                                  # a prefetched gather may be done already: no wait at all
        row["ready"] = clock()
        self.pending = None
        by_rank = gathered.view(self.world, -1).split(self.slice_len, dim=1)   # [rank, this parameter's slice]
        parts = [part.reshape(-1)[:spec.numel].view(spec.shape) for part, spec in zip(by_rank, self.specs)]
        if phase == "backward" and self.freed is not None:   # FSDP2's way: the very storages autograd saved in
            for tensor, part in zip(self.freed, parts):      # forward, grown back and filled in place
                storage = tensor.untyped_storage()
                storage.resize_(tensor.numel() * tensor.element_size())
                # written through a new alias: the saved tensor's version counter does not move, so autograd
                # accepts it (a resize is no write to a tensor at all)
                torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
                    storage, tensor.storage_offset(), tensor.size(), tensor.stride()).copy_(part)
            self.full, self.freed = self.freed, None
            self.refilled += len(self.full)
        else:
            self.full = [part.clone() for part in parts]
        self.on_copy_out(gathered)              # the moment the buffer and the copies out of it are both alive
        gathered.untyped_storage().resize_(0)   # copied out: free the buffer at once (FSDP2 does so in backward
        # and under explicit prefetch; in forward with implicit prefetch it frees it only after the next unit's
        # copy-out, _fsdp_param_group.py:417-432); a reference gloo's worker may keep a moment longer costs nothing
        self.storage_index = {f.untyped_storage().data_ptr(): i for i, f in enumerate(self.full)}
        return self.full

    @torch.no_grad()
    def reduce_scatter(self, grads) -> list[torch.Tensor | None]:
        # every rank runs the same graph, so every rank leaves out the same parameters (frozen, or unused this step)
        reduced = [i for i, spec in enumerate(self.specs) if spec.requires_grad and grads[i] is not None]
        if not reduced:
            return [None] * len(self.specs)
        padded = [F.pad(grads[i].float().reshape(-1), (0, self.slice_len[i] * self.world - self.specs[i].numel))
                  .view(self.world, -1) for i in reduced]   # [rank, slice]; reduced in fp32 whatever the compute
        mine = torch.empty(sum(self.slice_len[i] for i in reduced), dtype=torch.float32, device=padded[0].device)
        dist.reduce_scatter_single(mine, torch.cat(padded, dim=1).reshape(-1), op=dist.ReduceOp.SUM)
        parts = dict(zip(reduced, mine.div_(self.world).split([self.slice_len[i] for i in reduced])))  # the mean
        return [parts.get(i) for i in range(len(self.specs))]

    def set_attributes(self, tensors) -> None:
        for pairs, tensor in zip(self.names, tensors):
            for module, attr, _ in pairs:
                setattr(module, attr, tensor)

    def drop(self, keep_for_refill: bool = False) -> None:
        if self.refill and self.full is not None:   # free the memory itself: autograd may still hold the tensors
            for tensor in self.full:
                tensor.untyped_storage().resize_(0)
        self.freed = self.full if self.refill and keep_for_refill else None
        self.full, self.storage_index = None, {}

    def drop_if_frozen(self) -> None:
        if self.full is not None and not any(spec.requires_grad for spec in self.specs):
            self.drop()
            self.on_event(f"{self.name}: dropped after its backward (all frozen: nothing to reduce)")

    def saved(self, tensor: torch.Tensor) -> SavedWeight | None:
        index = self.storage_index.get(tensor.untyped_storage().data_ptr()) if self.full is not None else None
        return None if index is None else SavedWeight(self, index, tensor.size(), tensor.stride(),
                                                      tensor.storage_offset())


class Zero3:
    """ZeRO-3 of ``model`` over ``units`` (``[(name, [modules])]``, in the order forward runs them).

    A parameter used only by one unit's modules belongs to that unit; one used by two units, or by a module outside
    every unit, belongs to the root unit, whole from the start of the model's forward to its end.
    """

    def __init__(self, model: nn.Module, units: list[tuple[str, list[nn.Module]]], planted_bug: str | None = None,
                 backward_gather: str = "on-entry", param_dtype: torch.dtype = torch.float32, prefetch: bool = False,
                 clock=time.perf_counter, backward_weights: str = "notes"):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.planted_bug, self.backward_gather, self.prefetch, self.clock = planted_bug, backward_gather, prefetch, clock
        self.computes: list[dict] = []               # measured: each unit's forward, from gathered to done
        self.backward_starts: dict[str, float] = {}  # measured: when each unit's backward began (weights there)
        unit_of_module = {id(m): name for name, modules in units for top in modules for m in top.modules()}
        names: dict[int, list] = {}                  # every (module, attribute, name) of a parameter: a tied one
        users: dict[int, set] = {}                   # has two; and which units use it ("root": a module outside)
        for module_name, module in model.named_modules():
            for attr, p in module._parameters.items():
                if p is not None:
                    names.setdefault(id(p), []).append((module, attr, f"{module_name}.{attr}".lstrip(".")))
                    users.setdefault(id(p), set()).add(unit_of_module.get(id(module), "root"))
        owned: dict[str, list] = {"root": []} | {name: [] for name, _ in units}
        for p in model.parameters():                 # each parameter once, tied ones included
            who = users[id(p)]
            owned[next(iter(who)) if len(who) == 1 else "root"].append(p)
        self.units = [ShardedUnit(n, owned[n], names, world, rank, param_dtype) for n in owned if owned[n]]
        self.notes = backward_weights == "notes"     # notes for autograd (this sketch), or FSDP2's free and refill
        for unit in self.units:
            unit.refill = not self.notes
        del owned, names                             # nothing here keeps a whole parameter alive
        for unit in self.units:
            unit.on_event = self._measure
            unit.on_copy_out = lambda buffer, u=unit: self._measure_copy_out(u, buffer)
            if planted_bug == "late-prefetch":       # the next unit's gather issued once this one is done: too late
                unit.after_backward = lambda u=unit: self._prefetch_after(u, -1)
        by_name = {u.name: u for u in self.units}
        for name, modules in units:
            if name in by_name:
                modules[0].register_forward_pre_hook(lambda _m, args, u=by_name[name]: self._gather(u, args))
                modules[-1].register_forward_hook(lambda _m, _a, out, u=by_name[name]: self._release(u, out))
        self.root = by_name.get("root")
        self.order = [by_name[name] for name, _ in units if name in by_name]   # forward's order; backward's reversed
        model.register_forward_pre_hook(lambda _m, args: self._start(args))
        model.register_forward_hook(lambda _m, _a, out: self._finish(out))
        self.peak_bytes = 0                          # measured: the largest total of gathered storages alive
        self.copy_out_peak_bytes = 0                 # measured: the same, inside a gather, buffer and copies alive
        self.timeline: list[dict] = []               # measured: that total after each gather and each drop
        self._alive: list[weakref.ref] = []         # the storages' Python objects (one per storage, kept by torch as
        # long as any tensor, autograd's saved ones included, points at the storage): dead means freed
        self._end_of_backward_queued = False

    def slices_by_name(self) -> dict[str, nn.Parameter]:
        """This rank's slice of each parameter, by the parameter's (first) name."""
        return {spec.name: s for unit in self.units for spec, s in zip(unit.specs, unit.slices)}

    # ---- forward: whole just in time, dropped right after; autograd keeps notes, not weights ----
    def _start(self, args):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        if self.notes and self.planted_bug not in KEEPS_SAVED_WEIGHTS:  # the two bugs (and refill) take no notes
            self._hooks.__enter__()
        if not self.root:
            return None
        args = self._gather(self.root, args)
        if self.prefetch and self.order and self.order[0].pending is None:  # the first unit's gather, ahead too
            self.order[0].start_gather(self.clock, "forward", prefetched=True)
            self._measure(f"{self.order[0].name}: prefetch issued", self.order[0])
        return args

    def _finish(self, output):
        if self.root:
            self._release(self.root, output)
        if self.notes and self.planted_bug not in KEEPS_SAVED_WEIGHTS:
            self._hooks.__exit__(None, None, None)

    def _prefetch_after(self, unit: ShardedUnit, step: int) -> None:
        """Issue the all-gather of the unit that runs after ``unit`` (``step`` +1 in forward, -1 in backward), so it
        travels while ``unit`` computes: two units' weights are then alive at once."""
        if not self.prefetch or unit not in self.order:
            return
        index = self.order.index(unit) + step
        if 0 <= index < len(self.order):
            following = self.order[index]
            if following.full is None and following.pending is None:
                following.start_gather(self.clock, "forward" if step > 0 else "backward", prefetched=True)
                self._measure(f"{following.name}: prefetch issued", following)

    def _gather(self, unit: ShardedUnit, args: tuple):
        unit.set_attributes(GatherUnit.apply(unit, *unit.slices))
        self._measure(f"{unit.name}: gathered for forward", unit)
        if self.planted_bug != "late-prefetch":
            self._prefetch_after(unit, +1)
        self.computes.append({"unit": unit.name, "phase": "forward", "start": self.clock()})
        if unit.param_dtype != torch.float32:  # as FSDP2's cast_forward_inputs: the unit's floating-point
            args = tuple(a.to(unit.param_dtype) if torch.is_tensor(a) and a.is_floating_point() else a  # inputs
                         for a in args)       # (the hidden states, RoPE's tables) rounded to the compute dtype
        if not any(spec.requires_grad for spec in unit.specs):   # all frozen: drop it when backward is through
            tracked = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
            if tracked:
                passed = AfterBackward.apply(unit, *[args[i] for i in tracked])
                passed = passed if isinstance(passed, tuple) else (passed,)
                args = tuple(dict(zip(tracked, passed)).get(i, a) for i, a in enumerate(args))
        return args

    def _release(self, unit: ShardedUnit, output):
        if self.computes and self.computes[-1]["unit"] == unit.name and "end" not in self.computes[-1]:
            self.computes[-1]["end"] = self.clock()
        if self.planted_bug == "late-prefetch":   # the next unit's gather issued only now, once this one computed
            self._prefetch_after(unit, +1)
        if self.backward_gather == "on-entry" and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._gather_for_backward(unit))  # backward reaches the unit here
        unit.set_attributes([None] * len(unit.specs))
        if self.planted_bug == "free-before-backward":  # and free their memory under autograd's feet: FSDP2's own
            # resize_(0), but nothing refills these storages before backward reads them (FSDP2 gathers into them)
            for tensor in unit.full:
                tensor.untyped_storage().resize_(0)
        unit.drop(keep_for_refill=True)           # refill: the storages freed, the tensors kept to refill
        self._measure(f"{unit.name}: dropped after forward")

    def _pack(self, tensor):
        for unit in self.units:
            note = unit.saved(tensor)
            if note is not None:
                return note
        return tensor

    def _gather_for_backward(self, unit: ShardedUnit):
        if not self._end_of_backward_queued:     # once a backward: a last look when it ends (below)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_of_backward_queued = True
        if unit.full is None:
            unit.all_gather(self.clock, "backward")
            self._measure(f"{unit.name}: gathered for backward", unit)
            if self.backward_gather == "on-entry" and self.planted_bug != "late-prefetch":  # on first use, the unit
                self._prefetch_after(unit, -1)  # ahead may never be read (the embedding): its gather would be wasted
            self.backward_starts[unit.name] = self.clock()

    def _end_of_backward(self):
        """A unit whose parameters are all frozen has no gradient, so its gather's backward never runs and never
        drops it: drop what is still whole when backward ends (FSDP2 does the same, in its root's final callback)."""
        self._end_of_backward_queued = False
        for unit in self.units:
            if unit.full is not None:
                unit.drop()
                self._measure(f"{unit.name}: dropped at the end of backward (no gradient to reduce)")
            if unit.pending is not None:            # a prefetch nobody used: never carried into the next step,
                unit.pending[1].wait()              # whose weights the optimizer is about to change
                unit.pending[0].untyped_storage().resize_(0)
                unit.pending = None
                self._measure(f"{unit.name}: unused prefetch discarded")

    def _unpack(self, saved):
        if not isinstance(saved, SavedWeight):
            return saved
        self._gather_for_backward(saved.unit)     # already whole (the hook on its output), unless on first use
        return saved.unit.full[saved.index].as_strided(saved.size, saved.stride, saved.offset)

    # ---- measured: the gathered parameters still alive, each storage watched until it is really gone ----
    def _measure_copy_out(self, unit: ShardedUnit, buffer: torch.Tensor) -> None:
        """Inside ``all_gather``, after the copy-out and before the buffer is freed: the storages alive then, the
        buffer and the new full tensors included (each storage once). The events below never see this moment."""
        storages = [ref() for ref in self._alive] + [buffer.untyped_storage()] + [f.untyped_storage()
                                                                                   for f in unit.full]
        alive = {s.data_ptr(): s.nbytes() for s in storages if s is not None and s.nbytes()}
        self.copy_out_peak_bytes = max(self.copy_out_peak_bytes, sum(alive.values()))

    def _measure(self, event: str, gathered: ShardedUnit | None = None):
        """Right after every gather and every drop. Not seen here: inside ``all_gather`` the flat buffer and the full
        tensors copied out of it live together for a moment (:meth:`_measure_copy_out` measures that), and a copy
        of a weight made inside a module (a cast, a transposed copy) is on no unit's books: only the gathered
        storages are watched."""
        if gathered is not None:   # the full tensors, or the buffer a prefetch is filling
            tensors = gathered.full if gathered.full is not None else [gathered.pending[0]]
            self._alive += [weakref.ref(f.untyped_storage()) for f in tensors]
        self._alive = list({id(ref()): ref for ref in self._alive if ref() is not None}.values())  # each once (a
        alive = sum(ref().nbytes() for ref in self._alive)     # refilled storage is watched again); a freed one: 0
        self.peak_bytes = max(self.peak_bytes, alive)
        held = sum(u.full_bytes for u in self.units if u.full is not None) + sum(   # what the units say they
            u.padded_bytes for u in self.units if u.pending is not None)               # hold, by their own books
        self.timeline.append({"event": event, "bytes": alive, "units_hold": held})


def transformer_units(model) -> list[tuple[str, list[nn.Module]]]:
    """The units: the embedding, each block, the final norm with the output head."""
    blocks = [(f"layers.{i}", [block]) for i, block in model.layers.items()]
    return [("tok_embeddings", [model.tok_embeddings]), *blocks, ("head", [model.norm, model.output])]


def apply_fsdp2(model, any_model: bool, param_dtype: torch.dtype):
    """FSDP2 on the same units, each one a ``fully_shard`` group, then the root. With ``--any-model`` the blocks
    only: FSDP2 refuses a weight shared by two groups, so the tied embedding and head stay in the root's, which is
    where the sketch's rule puts the tied weight too (its embedding unit is then empty)."""
    policy = dict(reshard_after_forward=True, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype,
                                                                             reduce_dtype=torch.float32))
    units = transformer_units(model)
    for _, modules in (units[1:-1] if any_model else units):
        fully_shard(modules if len(modules) > 1 else modules[0], **policy)
    fully_shard(model, **policy)                      # the root: what no unit owns alone
    return model


def main():
    p = runtime.parser(__doc__, presets=("tiny",), steps=4)
    p.add_argument("--batch", type=runtime.positive_int, default=8, help="global batch, sequences per step")
    p.add_argument("--any-model", action="store_true",
                   help="head tied to the embedding, the first block and every norm frozen, a head bias of 127 "
                        "(no rank count but 1 divides it), two parameter groups (weight decay, learning rate)")
    p.add_argument("--backward-gather", choices=("on-entry", "on-first-use"), default="on-entry",
                   help="gather a unit again when backward reaches it (as FSDP2 does), or when backward first reads "
                        "one of its weights (a unit whose backward reads none is not gathered again)")
    p.add_argument("--backward-weights", choices=("notes", "refill"), default="notes",
                   help="how autograd finds the weights in backward: notes (a saved-tensor hook; the gather makes new "
                        "tensors), or refill (FSDP2's way: free the saved tensors' storages after forward with "
                        "resize_(0), and gather into the same storages before backward)")
    p.add_argument("--mixed-precision", action="store_true",
                   help="gather and compute in bf16, reduce gradients in fp32, keep fp32 slices (FSDP2's "
                        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))")
    p.add_argument("--prefetch", action="store_true",
                   help="issue the next unit's all-gather (async) before this unit computes, in forward and backward: "
                        "the traffic overlaps compute, and two units are whole at a time")
    p.add_argument("--planted-bug", choices=PLANTED_BUGS, default=None, help="a mistake the checks must catch")
    runtime.add_lr_flag(p)
    args = p.parse_args()
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        cfg = models.preset(args.preset, **({"vocab_size": 127} if args.any_model else {}))
        world = rt.world_size
        report = metrics.Report(__file__, rt, config={**vars(args), "model": cfg.to_dict()})

        def build():
            model = models.build_transformer(cfg, seed=args.seed, device=rt.device)
            return models.make_any_model(model) if args.any_model else model

        model = build()
        name_of = {id(q): n for n, q in model.named_parameters()}  # a tied weight: its first name
        num_params = sum(q.numel() for q in model.parameters())
        trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
        groups = [{**g, "params": [name_of[id(q)] for q in g["params"]]}  # by name: no whole parameter kept
                  for g in models.parameter_groups(model, args.lr, any_model=args.any_model)]
        whole_storages = [weakref.ref(q.untyped_storage()) for q in model.parameters()]
        param_dtype = torch.bfloat16 if args.mixed_precision else torch.float32
        zero = Zero3(model, transformer_units(model), args.planted_bug, args.backward_gather, param_dtype,
                     prefetch=args.prefetch, backward_weights=args.backward_weights)
        report.check("the whole parameters are freed once sliced (each one's storage watched until it is gone)",
                     all(ref() is None for ref in whole_storages), sum(ref() is not None for ref in whole_storages),
                     "0 left")
        slices = zero.slices_by_name()
        optimizer = torch.optim.AdamW([{**g, "params": [slices[n] for n in g["params"]]} for g in groups],
                                      lr=args.lr)                 # AdamW on the slices: 1/N of the moments
        rt.print(f"ZeRO-3 by hand on {world} ranks: {len(zero.units)} units ({', '.join(u.name for u in zero.units)}), "
                 f"{num_params:,} parameters ({trainable:,} trainable); rank {rt.rank} keeps "
                 f"{sum(s.numel() for u in zero.units for s in u.slices):,}")

        fsdp_model = apply_fsdp2(build(), args.any_model, param_dtype)
        fsdp_optimizer = torch.optim.AdamW(models.parameter_groups(fsdp_model, args.lr, any_model=args.any_model), lr=args.lr)
        baseline = Baseline(cfg, args.seed, args.lr, rt.device, model=build(),
                            groups=lambda m: models.parameter_groups(m, args.lr, any_model=args.any_model)) if rt.rank == 0 else None

        losses_fsdp, diffs, comm_steps, fsdp_comm_steps, failure = [], {"loss": [], "fsdp_loss": []}, [], [], None
        for step in range(args.steps):
            zero.timeline.clear()                    # the last step's is kept for the chapter's figure
            zero.computes.clear()
            zero.backward_starts.clear()
            for unit in zero.units:
                unit.gathers.clear()
            tokens = data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed)
            inputs, targets = data.split_inputs_targets(data.shard_rows(tokens, rt.rank, world).to(rt.device))
            with comm.CommCounter() as counter:
                loss = models.lm_loss(model(inputs), targets)
                try:
                    loss.backward()          # each unit gathered again, then its gradient reduce-scattered
                except RuntimeError as error:
                    failure = str(error).splitlines()[0]
                    break
                optimizer.step()
            comm_steps.append(counter.by_collective())
            if step == 0:  # this rank's slice of each step-0 gradient, the mean over ranks
                grads0 = {n: s.grad.detach().clone() for n, s in slices.items() if s.grad is not None}
            optimizer.zero_grad(set_to_none=True)
            with comm.CommCounter() as fsdp_counter:
                fsdp_loss = models.lm_loss(fsdp_model(inputs), targets)
                fsdp_loss.backward()
                fsdp_optimizer.step()
            fsdp_optimizer.zero_grad(set_to_none=True)
            fsdp_comm_steps.append(fsdp_counter.by_collective())
            both = torch.stack([loss.detach(), fsdp_loss.detach()])
            dist.all_reduce(both)
            report.losses.append(both[0].item() / world)
            losses_fsdp.append(both[1].item() / world)
            diffs["fsdp_loss"].append(abs(report.losses[-1] - losses_fsdp[-1]))
            line = f"step {step}  loss {report.losses[-1]:.6f}  FSDP2 {losses_fsdp[-1]:.6f}"
            if baseline is not None:
                baseline.step(tokens.to(rt.device))
                if step == 0:
                    baseline_grads0 = dict(zip([n for n, _ in baseline.model.named_parameters()], baseline.grads))
                diffs["loss"].append(abs(report.losses[-1] - baseline.losses[-1]))
                line += f"  single-device {baseline.losses[-1]:.6f}"
            rt.print(line)

        if failure is not None:
            report.check("backward ran: the weights it needed were there", False, failure)
            rt.print(f"backward failed on rank {rt.rank}: {failure}")
            sys.exit(report.finish(args.metrics_out))

        # ---- against one device and against FSDP2, parameter by parameter (by name) ----
        whole = {spec.name: _gathered(s)[:spec.numel].view(spec.shape) for u in zero.units
                 for spec, s in zip(u.specs, u.slices)}
        fsdp = {n: q.full_tensor() for n, q in fsdp_model.named_parameters()}
        report.check_close("loss = FSDP2 fully_shard's (every step)", max(diffs["fsdp_loss"]), 0.0,
                           metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device))
        report.check_close("parameters after training = FSDP2 fully_shard's",
                           metrics.max_abs_diff([whole[n] for n in fsdp], list(fsdp.values())), 0.0,
                           param_tolerance(args.lr))
        initial = dict(build().named_parameters())
        frozen = [n for n, q in initial.items() if not q.requires_grad]
        if frozen:  # (a model without any would pass this check whatever the code did: it is left out then)
            report.check("frozen parameters untouched", all(torch.equal(whole[n], initial[n].detach()) for n in frozen),
                         f"{len(frozen)} frozen")
        if baseline is not None and not args.mixed_precision:
            base = dict(baseline.model.named_parameters())
            report.check_close("loss = single-device loss (every step)", max(diffs["loss"]), 0.0,
                               metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device))
            step0 = [(grads0[n], _slice(baseline_grads0[n], grads0[n].numel(), rt.rank)) for n in grads0]
            report.check_close("rank 0's step-0 gradient slices = the single-device gradients, sliced",
                               metrics.max_abs_diff([a for a, _ in step0], [b for _, b in step0]), 0.0,
                               metrics.fp32_tolerance(GRAD_TOLERANCE, rt.device))
            report.check_close("parameters after training = single-device parameters",
                               metrics.max_abs_diff([whole[n] for n in base], list(base.values())), 0.0,
                               param_tolerance(args.lr))
        elif baseline is not None:  # bf16 against the fp32 device: the tolerances distlab.metrics explains
            base = dict(baseline.model.named_parameters())
            report.check_close("loss = single-device fp32 loss (every step, bf16 tolerance)", max(diffs["loss"]), 0.0,
                               BF16_LOSS_TOLERANCE)
            # each tensor against its own scale (distlab.metrics.bf16_tensor_errors): a fault confined to one small
            # tensor (halved q/k gradients, norm weights that lost their AdamW state) hides under the whole model's
            metrics.check_bf16_tensors(report, grads0,
                                       {n: _slice(baseline_grads0[n], grads0[n].numel(), rt.rank) for n in grads0},
                                       kind="grad", tolerance=BF16_GRAD_RELATIVE_TOLERANCE,
                                       label="rank 0's step-0 gradient slices = the single-device gradients (each "
                                             "slice's largest difference / its own largest gradient, bf16 tolerance)")
            metrics.check_bf16_tensors(report, {n: whole[n] for n in base}, base, kind="param",
                                       tolerance=bf16_param_mean_tolerance(args.lr),
                                       label="parameters after training = single-device (each parameter's mean "
                                             "|difference|, bf16 tolerance)")

        # ---- bytes: measured = formula, and = FSDP2's measured ----
        padded = sum(k * world for u in zero.units for k in u.slice_len)
        padded_trainable = sum(k * world for u in zero.units for k, q in zip(u.slice_len, u.specs) if q.requires_grad)
        element = param_dtype.itemsize                # bytes of a gathered weight: 2 under bf16, 4 in fp32
        formula = {"all_gather": comm.zero_step_bytes(padded, 3, param_bytes=element)["all_gather"],
                   "reduce_scatter": comm.zero_step_bytes(padded_trainable, 3)["reduce_scatter"]}
        embedding = next((u for u in zero.units if u.name == "tok_embeddings"), None)
        if args.backward_gather == "on-first-use" and embedding is not None:
            # nn.Embedding's backward adds the output's gradient into the rows of the tokens seen: it reads no
            # weight, so on first use the embedding unit is never gathered for backward
            formula["all_gather"] -= element * sum(k * world for k in embedding.slice_len)
        for collective, expected in formula.items():
            per_step = [m.get(collective, {}).get("payload_bytes", 0) for m in comm_steps]
            fsdp_bytes = fsdp_comm_steps[-1].get(collective, {}).get("payload_bytes", 0)
            report.add_comm(collective, per_step[-1], expected, fsdp2_measured_bytes=fsdp_bytes,
                            calls=comm_steps[-1].get(collective, {}).get("calls", 0))
            report.check(f"{collective} bytes per step = formula (every step)",
                         all(got == expected for got in per_step), per_step[-1], f"== {expected}")
            if padded == num_params and args.backward_gather == "on-entry":  # FSDP2 pads rows, this sketch
                # pads the flat slice: equal when nothing pads, and when both gather every unit for backward
                report.check_equal(f"{collective} bytes per step = FSDP2's, measured", per_step[-1], fsdp_bytes)

        # ---- memory: the gathered parameters alive at any moment, measured ----
        root = zero.root.full_bytes if zero.root else 0
        if args.prefetch:  # a unit whole, and the next one's gather in flight (its padded buffer), side by side
            what = "largest unit with the next one's gather"
            largest = max((a.full_bytes + b.padded_bytes for a, b in
                           [*zip(zero.order, zero.order[1:]), *zip(zero.order[1:], zero.order)]),
                          default=max(u.full_bytes for u in zero.order))
        else:
            what = "largest unit"
            largest = max((u.full_bytes for u in zero.units if u is not zero.root), default=0)
        report.memory = {"gathered_peak_bytes": zero.peak_bytes, "root_bytes": root, "bound_bytes": root + largest,
                         "copy_out_peak_bytes": zero.copy_out_peak_bytes,
                         "storages_refilled_in_place": sum(u.refilled for u in zero.units),
                         "whole_model_bytes": element * num_params,
                         "slices_bytes": sum(metrics.tensor_bytes(u.slices) for u in zero.units),
                         "units": {u.name: u.full_bytes for u in zero.units}, "timeline": zero.timeline}
        rt.print(f"gathered parameters alive at most: {zero.peak_bytes:,} B at the measured events (root {root:,} B "
                 f"+ {what} {largest:,} B; the whole model is {element * num_params:,} B), beside this rank's slices "
                 f"{report.memory['slices_bytes']:,} B; {zero.copy_out_peak_bytes:,} B inside a gather's copy-out, "
                 f"buffer and copies together")
        report.check(f"gathered parameters alive at any moment <= root + {what} (measured on the storages)",
                     zero.peak_bytes <= root + largest, zero.peak_bytes, f"<= {root + largest}")
        buffer = max(u.padded_bytes for u in zero.units)   # inside a gather: its buffer beside the copies out of it
        report.check(f"inside a gather's copy-out, gathered parameters alive <= root + {what} + one gather's buffer "
                     f"(measured on the storages)", zero.copy_out_peak_bytes <= root + largest + buffer,
                     zero.copy_out_peak_bytes, f"<= {root + largest + buffer}")
        # nothing hides: at every gather and every drop, what is alive is exactly what the units say they hold
        off = [e for e in zero.timeline if e["bytes"] != e["units_hold"]]
        report.check("at every gather and drop, bytes alive = bytes the units hold (measured on the storages)",
                     not off, f"{len(off)} of {len(zero.timeline)} events off" + (
                         f", first: {off[0]['event']} {off[0]['bytes']:,} B against {off[0]['units_hold']:,} B"
                         if off else ""))
        if args.prefetch:
            _prefetch_report(zero, report, rt)
        code = report.finish(args.metrics_out)
    sys.exit(code)


def _prefetch_report(zero, report, rt) -> None:
    """The last step on this rank's host clock: each unit's compute, each all-gather from its issue to the moment the
    host had its weights. Checked, from the timestamps (a gather issued late, after the unit ahead, fails them):
    in forward every unit but the first had its gather issued before the unit ahead began computing, and waited for
    only after that unit had computed; in backward every unit but the last had its gather issued before the unit
    ahead (the one after it in forward) began its backward, and waited for after that; and over the whole run at
    least one prefetched gather was already done when it was needed (work.is_completed() at the wait: a gather
    issued and waited for at once is never done; on the CPU only). Reported, not checked: how long forward still waited and how many
    were done (on 4 CPU ranks sharing 2 cores it varies run to run). On a GPU these are the host's times (NCCL's
    wait only orders the streams), not the kernels': the lab reads them on the CPU."""
    computes = [c for c in zero.computes if "end" in c]
    started, ended = {c["unit"]: c["start"] for c in computes}, {c["unit"]: c["end"] for c in computes}
    names = [u.name for u in zero.order]
    gathers = [dict(g) for u in zero.units for g in u.gathers if "ready" in g]
    prefetched = [g for g in gathers if g["prefetched"] and g["phase"] == "forward"]
    ahead = [(g, names[names.index(g["unit"]) - 1]) for g in prefetched if names.index(g["unit"]) > 0]
    expected = len(names) - 1 + (1 if zero.root else 0)   # the root issues the first unit's too
    late = [g["unit"] for g, before in ahead if not (g["issued"] <= started[before] and g["waited"] >= ended[before])]
    report.check("forward: each unit's gather issued before the unit ahead computed, waited for after it",
                 len(prefetched) == expected and not late and len(ahead) == len(names) - 1,
                 {"prefetched": len(prefetched), "late": late}, f"{expected} prefetched, none late")
    if zero.backward_gather == "on-entry":   # on first use backward prefetches nothing (see _gather_for_backward)
        back = [g for g in gathers if g["prefetched"] and g["phase"] == "backward"]
        behind = [(g, names[names.index(g["unit"]) + 1]) for g in back if names.index(g["unit"]) + 1 < len(names)]
        late_back = [g["unit"] for g, after in behind if not (after in zero.backward_starts and
                     g["issued"] <= zero.backward_starts[after] <= g["waited"])]
        report.check("backward: each unit's gather issued before the unit ahead began its backward, waited for after",
                     len(back) == len(names) - 1 == len(behind) and not late_back,
                     {"prefetched": len(back), "late": late_back}, f"{len(names) - 1} prefetched, none late")
    history = [done for u in zero.units for done in u.prefetch_done_before_wait]
    if rt.device_type != "cuda":  # on a GPU the host runs ahead of the kernels: is_completed() at the host's wait
        # says whether the kernel has run yet, which it need not have for the streams to overlap (reported only)
        report.check("some prefetched gather was done before it was needed (work.is_completed() at the wait, every "
                     "step)", any(history), f"{sum(history)} of {len(history)}", ">= 1")
    forward = [g for g in gathers if g["phase"] == "forward" and g["unit"] in started]
    waited = sum(g["ready"] - g["waited"] for g in forward)
    origin = min([c["start"] for c in computes] + [g["issued"] for g in gathers])
    report.extra["prefetch_timeline"] = {
        "computes": [{**c, "start": c["start"] - origin, "end": c["end"] - origin} for c in computes],
        "gathers": [{**g, **{k: g[k] - origin for k in ("issued", "waited", "ready")}} for g in gathers],
        "backward_starts": {u: t - origin for u, t in zero.backward_starts.items()},
        "forward_wait_seconds_measured": waited,
        "done_before_needed": sum(g["done_before_wait"] for g in forward),
        "prefetched_done_before_needed_every_step": [sum(history), len(history)]}
    clock = "host clock" + ("; on a GPU, host times, not the kernels'" if rt.device_type == "cuda" else "")
    rt.print(f"prefetch: forward waited {waited * 1e3:.2f} ms in all for its all-gathers; "
             f"{sum(g['done_before_wait'] for g in forward)} of {len(forward)} were done before they were needed "
             f"(rank {rt.rank}'s {clock}, last step); {sum(history)} of {len(history)} prefetched gathers, "
             f"every step and both phases")


def _gathered(slice_: torch.Tensor) -> torch.Tensor:
    """Every rank's slice of one parameter, end to end (padding included): for the checks, not for training."""
    out = torch.empty(slice_.numel() * dist.get_world_size(), dtype=slice_.dtype, device=slice_.device)
    dist.all_gather_single(out, slice_.detach().contiguous())
    return out


def _slice(tensor: torch.Tensor, length: int, rank: int) -> torch.Tensor:
    """Slice ``rank`` (``length`` long, the last padded with zeros) of a whole tensor, as ZeRO-3 cuts it."""
    flat = tensor.reshape(-1)
    return F.pad(flat, (0, length * dist.get_world_size() - flat.numel()))[rank * length:(rank + 1) * length]


if __name__ == "__main__":
    main()
