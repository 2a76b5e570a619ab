"""Communication: what a collective costs (the ring model) and what a step actually sent (measured).

Two sizes matter and the course keeps them apart:

* **payload bytes** ``S``: the size of the buffer a collective is about, the full tensor for all-reduce,
  the gathered output for all-gather, the input for reduce-scatter;
* **bytes each rank sends** in a ring of ``n`` ranks: ``2 (n-1)/n S`` for all-reduce (a reduce-scatter then
  an all-gather), ``(n-1)/n S`` for all-gather, reduce-scatter and all-to-all, ``S`` for broadcast
  (pipelined ring) and for a point-to-point send.

Bus bandwidth (what nccl-tests reports, comparable across collectives and ``n``) is algorithm bandwidth
``S / t`` times that same factor.

What is measured and what is derived: :class:`CommCounter` measures payloads (the bytes handed to each
collective). The bytes each rank sends on the wire are the ring model applied to them; wherever the course
stores that number its key ends in ``_derived`` (``sent_bytes_per_rank_derived``): a formula, never a
measurement. Checks compare measured payloads with formulas, not a formula with itself.

:class:`CommCounter` records every collective issued inside it, from ``torch.distributed`` calls (DDP's
hand-written cousins, FSDP2) and from DTensor's functional collectives (tensor parallelism).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from dataclasses import dataclass

# ring factor: bytes each rank sends = factor(n) * payload bytes
_RING_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
    "reduce": lambda n: 1.0 if n > 1 else 0.0,
    "send": lambda n: 1.0,
}


def ring_factor(collective: str, world_size: int) -> float:
    if collective not in _RING_FACTORS:
        raise KeyError(f"no ring model for {collective!r}; known: {sorted(_RING_FACTORS)}")
    return _RING_FACTORS[collective](world_size)


def bytes_sent_per_rank(collective: str, payload_bytes: int, world_size: int) -> float:
    """Bytes one rank puts on the wire for ``collective`` on a ring of ``world_size`` ranks."""
    return ring_factor(collective, world_size) * payload_bytes


# NCCL's own latency model for a ring (NVIDIA/nccl src/graph/tuning.cc, NCCL 2.30.7 at commit 5067397c): the
# latency of one ring step, "hwLatencies" (line 159 over NVLink, line 171 over the network), and the fixed latency of
# one ring call whatever its steps, "baseLatencies" (line 151), per protocol, in seconds. NCCL's tuner uses them to
# choose an algorithm and a protocol for each call; they are its model of the hardware, not a measurement.
# "network" is a ring whose every step crosses the network (one GPU a node, as the alpha-beta model's 2(n-1) equal
# steps assume): NCCL then charges each step line 171's *tree* figures (5.0/8.5/14; tuning.cc:386-387, "With ppn=1
# latencies are fully exposed, use the Tree network latency"), plus the network plugin's own latency (0 for NCCL's
# IB and socket transports). Its ring figures on line 171 (2.7/4.0/14) serve the inter-node steps of nodes with
# several GPUs, 2(nodes-1) of an all-reduce's 2(n-1).
NCCL_RING_STEP_LATENCY_S = {"nvlink": {"LL": 0.6e-6, "LL128": 1.9e-6, "Simple": 3.4e-6},
                            "network": {"LL": 5.0e-6, "LL128": 8.5e-6, "Simple": 14.0e-6}}
NCCL_RING_CALL_LATENCY_S = {"LL": 6.6e-6, "LL128": 14.0e-6, "Simple": 8.4e-6}


def ring_steps(collective: str, world_size: int) -> int:
    return {"all_reduce": 2 * (world_size - 1), "broadcast": world_size - 1, "send": 1}.get(
        collective, world_size - 1)


def ring_latency(collective: str, world_size: int, nodes: int, intra_node_latency: float,
                 inter_node_latency: float) -> float:
    """The step latencies of one ring call over ``nodes`` nodes, as NCCL's tuner splits them (tuning.cc:411-412):
    the steps that leave a node, 2 (nodes - 1) for an all-reduce and nodes - 1 otherwise, pay the network's latency;
    the other steps pay NVLink's."""
    steps = ring_steps(collective, world_size)
    crossing = 0 if nodes <= 1 else (2 if collective == "all_reduce" else 1) * (nodes - 1)
    return (steps - crossing) * intra_node_latency + crossing * inter_node_latency


# NCCL's tree all-reduce (tuning.cc:414-416): latency 2 ((ranks a node - 1) x NVLink's + log2(nodes) x the network's),
# with the tree's own step latencies (tuning.cc:159 and 171, Simple: 4.0 us over NVLink, 14 us across nodes); its
# algorithm bandwidth is 0.92 (tuning.cc:331) x 0.5 (tuning.cc:380) of the bus bandwidth, where a ring's is
# n / (2 (n - 1)) of it (tuning.cc:379): a tree sends 2 / (0.92 x 2 (n - 1) / n) times a ring's bytes' time.
NCCL_TREE_STEP_LATENCY_S = {"nvlink": {"LL": 0.6e-6, "LL128": 1.25e-6, "Simple": 4.0e-6},
                            "network": {"LL": 5.0e-6, "LL128": 8.5e-6, "Simple": 14.0e-6}}
NCCL_TREE_BANDWIDTH_SHARE = 0.92 * 0.5


def tree_all_reduce_latency(world_size: int, nodes: int, protocol: str = "Simple") -> float:
    """NCCL's latency of one tree all-reduce over ``nodes`` nodes of ``world_size / nodes`` ranks each
    (log2 rounded down, as NCCL's log2i)."""
    per_node = world_size // max(nodes, 1)
    return 2 * ((per_node - 1) * NCCL_TREE_STEP_LATENCY_S["nvlink"][protocol]
                + int(math.log2(max(nodes, 1))) * NCCL_TREE_STEP_LATENCY_S["network"][protocol])


def tree_all_reduce_bandwidth_ratio(world_size: int) -> float:
    """A tree all-reduce's bandwidth time over a ring's for the same payload and links (NCCL's model)."""
    return (world_size / (2 * (world_size - 1))) / NCCL_TREE_BANDWIDTH_SHARE


def ring_time(collective: str, payload_bytes: int, world_size: int, bandwidth: float, latency: float,
              call_latency: float = 0.0) -> float:
    """The alpha-beta ring model: a fixed cost per call + steps x latency per step + bytes sent per rank / link
    bandwidth (bytes/s)."""
    return (call_latency + ring_steps(collective, world_size) * latency
            + bytes_sent_per_rank(collective, payload_bytes, world_size) / bandwidth)


def latency_bound_below(collective: str, world_size: int, bandwidth: float, latency: float,
                        call_latency: float = 0.0) -> float:
    """The payload at which the ring model's latency terms equal its bandwidth term: smaller messages are
    latency-bound. Without a fixed cost per call, for an all-reduce: n x latency x bandwidth."""
    return ((call_latency + ring_steps(collective, world_size) * latency) * bandwidth
            / ring_factor(collective, world_size))


_NCCL_CHOICE = re.compile(r"(\w+): (\d+) Bytes -> Algo (\w+) proto (\w+)")


def nccl_tuning_choices(log_text: str) -> list[tuple[str, int, str, str]]:
    """(NCCL's collective name, bytes, algorithm, protocol) of every call in NCCL's debug output, in order.

    With ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING`` (NCCL 2.24 and later), rank 0 of a communicator logs each
    collective as it enqueues it: ``INFO(NCCL_TUNING, "%s: %ld Bytes -> Algo %s proto %s channel{Lo..Hi}={%d..%d}",
    ...)`` (NVIDIA/nccl src/enqueue.cc). Its bytes are NCCL's count times the type size: the whole buffer for an
    all-reduce, one rank's share for an all-gather or a reduce-scatter.
    """
    return [(m[1], int(m[2]), m[3], m[4]) for m in _NCCL_CHOICE.finditer(log_text)]


def bus_bandwidth(collective: str, payload_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in bytes/s, with nccl-tests' factors."""
    algorithm = payload_bytes / seconds
    factor = {"all_reduce": 2 * (world_size - 1) / world_size}.get(
        collective, (world_size - 1) / world_size if collective in ("all_gather", "reduce_scatter", "all_to_all")
        else 1.0)
    return algorithm, algorithm * factor


# ------------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------------


@dataclass
class CollectiveCall:
    collective: str
    payload_bytes: int
    group_size: int
    source: str  # "c10d" (torch.distributed call) or "functional" (DTensor / functional collectives)

    @property
    def bytes_sent_per_rank(self) -> float:
        return bytes_sent_per_rank(self.collective, self.payload_bytes, self.group_size)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _group_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


# payload of each torch.distributed collective, from its arguments
def _c10d_payload(name, args, kwargs):
    first = args[0] if args else next(iter(kwargs.values()))
    if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single"):
        # FSDP2 passes these by keyword (output=..., input=...)
        out = args[0] if len(args) > 0 else kwargs.get("output", kwargs.get("output_tensor"))
        inp = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor"))
        return _nbytes(out) if name.startswith("all_gather") else _nbytes(inp)
    if name == "all_gather":  # (tensor_list, tensor)
        return sum(_nbytes(t) for t in args[0])
    if name == "reduce_scatter":  # (output, input_list)
        return sum(_nbytes(t) for t in args[1])
    if name == "all_to_all_single":
        return _nbytes(args[1])
    if name == "all_to_all":
        return sum(_nbytes(t) for t in args[1])
    return _nbytes(first)


_C10D_FUNCTIONS = {
    "all_reduce": "all_reduce", "broadcast": "broadcast", "reduce": "reduce",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    # torch 2.13 names (the *_tensor ones are deprecated aliases of these; FSDP2 calls these)
    "all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "send": "send", "isend": "send",
}

# functional collectives (what DTensor issues): op name -> (collective, payload from args)
_FUNCTIONAL_OPS = {
    "all_reduce": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "all_reduce_": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "all_gather_into_tensor": ("all_gather", lambda a, n: _nbytes(a[0]) * n),
    "all_gather_into_tensor_out": ("all_gather", lambda a, n: _nbytes(a[0]) * n),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, n: _nbytes(a[0])),
    "all_to_all_single": ("all_to_all", lambda a, n: _nbytes(a[0])),
    "broadcast": ("broadcast", lambda a, n: _nbytes(a[0])),
    "broadcast_": ("broadcast", lambda a, n: _nbytes(a[0])),
}


class CommCounter(contextlib.AbstractContextManager):
    """Record the collectives issued inside ``with CommCounter() as counter:``.

    ``counter.calls`` lists them; ``counter.total(collective)`` sums payload bytes. Both routes are seen:
    ``torch.distributed.<collective>`` calls (patched for the duration) and functional collectives
    (a TorchDispatchMode). Collectives called from inside another recorded one are not counted twice.

    ``functional=False`` leaves the dispatch mode out: ``torch.compile`` runs nothing compiled while a Python
    dispatch mode is on the stack (dynamo skips the frame: torch 2.13, ``_dynamo/convert_frame.py`` 2538-2557,
    ``should_skip_for_dispatch_mode``), so a compiled model whose collectives are all ``torch.distributed`` calls
    (FSDP2's) is counted that way.
    """

    def __init__(self, functional: bool = True):
        self.calls: list[CollectiveCall] = []
        self._saved = {}
        self._mode = None
        self._functional = functional
        self._depth = 0

    # -- torch.distributed functions -------------------------------------------------------------
    def _wrap(self, name, fn):
        collective = _C10D_FUNCTIONS[name]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self._depth == 0:
                group = kwargs.get("group")
                size = 2 if collective == "send" else _group_size(group)
                self.calls.append(CollectiveCall(collective, _c10d_payload(name, args, kwargs), size, "c10d"))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return wrapper

    def __enter__(self):
        import torch.distributed as dist

        from torch.distributed import distributed_c10d

        for name in _C10D_FUNCTIONS:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._saved[name]))
        # P2POp and batch_isend_irecv (used by torch.distributed.pipelining) compare ``op is isend`` with
        # distributed_c10d's own global: it must be the same wrapper, or a P2POp(dist.isend, ...) is refused.
        self._saved_c10d_isend = distributed_c10d.isend
        distributed_c10d.isend = dist.isend
        if self._functional:
            self._mode = _functional_mode(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        from torch.distributed import distributed_c10d

        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        distributed_c10d.isend = self._saved_c10d_isend
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
        return False

    # -- summaries ---------------------------------------------------------------------------------
    def total(self, collective: str | None = None) -> int:
        return sum(c.payload_bytes for c in self.calls if collective in (None, c.collective))

    def count(self, collective: str | None = None) -> int:
        return sum(1 for c in self.calls if collective in (None, c.collective))

    def by_collective(self) -> dict[str, dict]:
        """Per collective: calls and payload bytes (measured), and the bytes each rank sends on a ring
        (``sent_bytes_per_rank_derived``: the ring model applied to the measured payloads, not a measurement)."""
        summary: dict[str, dict] = {}
        for c in self.calls:
            entry = summary.setdefault(c.collective, {"calls": 0, "payload_bytes": 0,
                                                      "sent_bytes_per_rank_derived": 0.0})
            entry["calls"] += 1
            entry["payload_bytes"] += c.payload_bytes
            entry["sent_bytes_per_rank_derived"] += c.bytes_sent_per_rank
        return summary


def _functional_mode(counter: CommCounter):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    def group_size_of(args) -> int:
        # functional ops take the group as its name string: the last str argument
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        for a in reversed(args):
            if isinstance(a, str):
                try:
                    return dist.get_world_size(_resolve_process_group(a))
                except Exception:  # noqa: BLE001 - not a group name
                    continue
        return dist.get_world_size()

    class FunctionalCollectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            # DTensor dispatches once as DTensor and once on local tensors: count the local one only.
            if any(getattr(t, "__name__", "") == "DTensor" for t in types):
                return NotImplemented
            namespace = getattr(func, "namespace", "")
            op_name = func._schema.name.split("::")[-1]
            if namespace in ("_c10d_functional", "c10d_functional") and op_name in _FUNCTIONAL_OPS \
                    and counter._depth == 0:
                collective, payload = _FUNCTIONAL_OPS[op_name]
                size = group_size_of(args)
                counter.calls.append(CollectiveCall(collective, payload(args, size), size, "functional"))
            return func(*args, **kwargs)

    del torch  # only needed for the import side effect
    return FunctionalCollectives()


class ModuleCommCounter(CommCounter):
    """A :class:`CommCounter` that also notes, for each collective, which module issued it and in which
    phase: ``call.module`` (the innermost module running, e.g. ``"Transformer.layers.0.attention"``, or
    ``"Global"`` outside every module) and ``call.phase`` (``"forward"`` or ``"backward"``).

    It follows modules with torch's ``ModTracker`` (forward and backward hooks on every module). A hook
    that runs after its module has returned (an output redistribution) is credited to the parent module.
    """

    def __enter__(self):
        from torch.distributed._tools.mod_tracker import ModTracker

        self._tracker = ModTracker()
        self._tracker.__enter__()
        self.calls = _TaggedCalls(self._tracker)
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._tracker.__exit__(*exc)
        return False


class _TaggedCalls(list):
    def __init__(self, tracker):
        super().__init__()
        self._tracker = tracker

    def append(self, call):
        parents = [name for name in self._tracker.parents if name != "Global"]
        call.module = max(parents, key=lambda name: name.count("."), default="Global")
        call.phase = "backward" if self._tracker.is_bw else "forward"
        super().append(call)


# ------------------------------------------------------------------------------------------------
# Analytic bytes per training step: data parallelism and ZeRO / FSDP (chapters 04 and 05)
# ------------------------------------------------------------------------------------------------


def zero_step_bytes(num_params: int, stage: int, *, param_bytes: int = 4, grad_bytes: int = 4,
                    reshard_after_forward: bool = True) -> dict[str, int]:
    """Payload bytes of each collective in one optimizer step, under ZeRO stage 0 (DDP) to 3 (FSDP).

    * stage 0, DDP: all-reduce every gradient once (whatever the buckets, whatever the accumulation);
    * stage 1, as chapter 05 writes it: all-reduce the gradients, then all-gather the updated parameter slices;
    * stage 2: reduce-scatter the gradients, then all-gather the parameters: the two halves of an
      all-reduce, so each rank sends exactly what DDP sends;
    * stage 3, FSDP: all-gather the parameters before forward and again before backward (once when they
      are kept after forward: ``reshard_after_forward=False``), and reduce-scatter the gradients.

    ``param_bytes`` is the size of an all-gathered parameter (2 under bf16 mixed precision), ``grad_bytes``
    that of a reduced gradient. Bytes each rank sends on a ring: :func:`bytes_sent_per_rank` of each entry.
    Sharded collectives pad every tensor to a multiple of N; the formula assumes nothing needs padding.
    """
    params, grads = num_params * param_bytes, num_params * grad_bytes
    if stage == 0:
        return {"all_reduce": grads}
    if stage == 1:
        return {"all_reduce": grads, "all_gather": params}
    if stage == 2:
        return {"reduce_scatter": grads, "all_gather": params}
    if stage == 3:
        return {"all_gather": (2 if reshard_after_forward else 1) * params, "reduce_scatter": grads}
    raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage}")


MIB = 2**20  # DDP's bucket_cap_mb counts MiB: the cap is int(bucket_cap_mb * 2**20) bytes


def ddp_bucket_sizes(gradient_bytes, bucket_cap_mb: float) -> list[int]:
    """Bytes of each bucket DDP all-reduces, in order, by DDP's rule: walk the gradients in the order backward
    produces them and close a bucket as soon as it holds at least ``bucket_cap_mb`` MiB (so a bucket can pass
    the cap by up to one gradient).

    ``gradient_bytes``: each gradient's bytes in that order; for a model whose layers run in the order they are
    defined, the reverse of ``model.parameters()``. DDP's first step uses one bucket for everything; it then
    rebuilds the buckets this way in the order the gradients became ready. (One dtype and device, and a
    ``bucket_cap_mb`` passed explicitly: left at its default, DDP caps the first bucket at 1 MiB.)
    """
    cap = int(bucket_cap_mb * MIB)
    if cap <= 0:
        raise ValueError(f"bucket_cap_mb must hold at least a byte, got {bucket_cap_mb!r}")
    sizes, current = [], 0
    for nbytes in gradient_bytes:
        current += nbytes
        if current >= cap:
            sizes.append(current)
            current = 0
    return sizes + ([current] if current else [])


def step_bytes_sent_per_rank(step_bytes: dict[str, int], world_size: int) -> float:
    """Bytes one rank sends in a step of ``zero_step_bytes`` (ring model, every collective summed)."""
    return sum(bytes_sent_per_rank(collective, payload, world_size) for collective, payload in step_bytes.items())


# ------------------------------------------------------------------------------------------------
# Point-to-point on NCCL: which orders of sends and receives can deadlock (chapters 03, 07, 08)
# ------------------------------------------------------------------------------------------------
#
# gloo forgives what NCCL does not. On NCCL, PyTorch runs every point-to-point operation between two ranks
# on one communicator and one stream, in the order the rank issued them, and an operation that is not part
# of a group (``batch_isend_irecv``) holds that stream until its partner is posted. Two ranks that each send
# to the other before receiving therefore wait forever, while gloo (which buffers sends) lets them pass.
# NCCL also ignores tags: the k-th send from a to b meets the k-th receive on b from a.
#
# ``P2PRecorder`` notes every point-to-point operation a rank issues; ``nccl_p2p_deadlocks`` replays the
# notes of all ranks under that model and names each pair of ranks that would wait forever.


@dataclass(frozen=True)
class P2PNote:
    kind: str             # "send" or "recv"
    peer: int             # the other rank (global)
    batch: int | None     # the batch_isend_irecv call it belongs to; None: issued on its own


class P2PRecorder(contextlib.AbstractContextManager):
    """Record, in order, the point-to-point operations issued inside it (``dist.send/recv/isend/irecv`` and
    the operations of ``dist.batch_isend_irecv``). ``sink(note)``, if given, sees each note as it happens."""

    def __init__(self, sink=None):
        self.notes: list[P2PNote] = []
        self._sink = sink
        self._saved = {}
        self._batches = 0
        self._inside = False

    def _note(self, kind, peer, batch):
        note = P2PNote(kind, int(peer), batch)
        self.notes.append(note)
        if self._sink is not None:
            self._sink(note)

    def _wrap_single(self, name, fn):
        kind = "send" if "send" in name else "recv"

        @functools.wraps(fn)
        def wrapper(tensor, *args, **kwargs):
            if self._inside:             # recv calls irecv, batch_isend_irecv calls isend: noted once
                return fn(tensor, *args, **kwargs)
            import torch.distributed as dist

            peer = args[0] if args else kwargs.get("dst" if kind == "send" else "src")
            if peer is None:  # given as a rank of the group
                group_peer = kwargs.get("group_dst" if kind == "send" else "group_src")
                peer = dist.get_global_rank(kwargs.get("group") or dist.group.WORLD, group_peer)
            self._note(kind, peer, None)
            self._inside = True
            try:
                return fn(tensor, *args, **kwargs)
            finally:
                self._inside = False

        return wrapper

    def _wrap_batch(self, fn):
        @functools.wraps(fn)
        def wrapper(p2p_op_list):
            self._batches += 1
            for op in p2p_op_list:
                self._note("send" if "send" in getattr(op.op, "__name__", "") else "recv", op.peer, self._batches)
            self._inside = True
            try:
                return fn(p2p_op_list)
            finally:
                self._inside = False

        return wrapper

    def __enter__(self):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        for name in ("send", "recv", "isend", "irecv"):
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap_single(name, self._saved[name]))
        self._saved["batch_isend_irecv"] = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._wrap_batch(dist.batch_isend_irecv)
        # P2POp accepts only its module's own isend/irecv, and batch_isend_irecv tells sends from receives
        # by ``op.op is isend``: they must be the same objects as ours.
        self._saved_c10d = {name: getattr(distributed_c10d, name) for name in ("isend", "irecv")}
        distributed_c10d.isend, distributed_c10d.irecv = dist.isend, dist.irecv
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        for name, fn in self._saved_c10d.items():
            setattr(distributed_c10d, name, fn)
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
        return False


def nccl_p2p_deadlocks(notes_of_rank: dict[int, list]) -> list[str]:
    """Replay every rank's point-to-point notes (``P2PNote`` or ``(kind, peer, batch)``) under NCCL's rules
    (above) and return one line per pair of ranks that would wait forever or leave a message unmatched.

    Per pair (a, b): each rank's operations with the other, in issue order, form units (one batch, or one
    operation on its own); a unit starts when the previous one has finished and finishes when each of its
    operations has met its partner (the k-th send a -> b meets the k-th receive b <- a) in a started unit.
    """
    problems = []
    ranks = sorted(notes_of_rank)
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            units = {r: _units([P2PNote(*n) if not isinstance(n, P2PNote) else n for n in notes_of_rank[r]], peer)
                     for r, peer in ((a, b), (b, a))}
            if not units[a] and not units[b]:
                continue
            problem = _replay_pair(a, b, units)
            if problem:
                problems.append(problem)
    return problems


def _units(notes, peer):
    """This rank's operations with ``peer``, numbered per direction, grouped into units."""
    units, counters, last_batch = [], {"send": 0, "recv": 0}, object()
    for note in notes:
        if note.peer != peer:
            continue
        op = (note.kind, counters[note.kind])
        counters[note.kind] += 1
        if note.batch is not None and note.batch == last_batch:
            units[-1].append(op)
        else:
            units.append([op])
        last_batch = note.batch
    return units


def _replay_pair(a, b, units) -> str | None:
    position = {a: 0, b: 0}
    matched = {a: set(), b: set()}
    while True:
        started = {r: set(units[r][position[r]]) if position[r] < len(units[r]) else set() for r in (a, b)}
        for r, other in ((a, b), (b, a)):
            for kind, k in started[r]:
                partner = ("recv" if kind == "send" else "send", k)
                if partner in started[other]:
                    matched[r].add((kind, k))
        progressed = False
        for r in (a, b):
            if position[r] < len(units[r]) and set(units[r][position[r]]) <= matched[r]:
                position[r] += 1
                progressed = True
        if not progressed:
            break
    if position[a] == len(units[a]) and position[b] == len(units[b]):
        return None
    waiting = {r: units[r][position[r]] if position[r] < len(units[r]) else [] for r in (a, b)}
    describe = lambda r, other: ", ".join(f"{kind} #{k} {'to' if kind == 'send' else 'from'} {other}"  # noqa: E731
                                         for kind, k in waiting[r]) or "nothing left"
    return (f"ranks {a} and {b} would wait forever on NCCL: rank {a} is stuck at [{describe(a, b)}], "
            f"rank {b} at [{describe(b, a)}]")
