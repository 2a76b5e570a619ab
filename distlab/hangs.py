"""Finding a hang: a journal of every rank's calls, kept outside the process group, and a diagnosis from it.

A distributed hang is silent: each rank waits in a call for peers that will never join it. What tells you
why is a record, per rank, of the calls it made on each process group and of the one it is stuck in.
NCCL's flight recorder keeps exactly that (``TORCH_NCCL_TRACE_BUFFER_SIZE``; dumped on a timeout); this module
is the same idea in a few dozen lines, so it can be watched working on CPU:

* :class:`CallJournal` writes each call (its label in the program, the operation, the group, the peer) into
  the job's key-value store before the call and marks it done after; the store outlives a broken group;
* :func:`diagnose` reads all ranks' journals and names the cause: the same program line on different groups
  (wrong group), different operations at the same position on one group (mismatched collectives), a call some
  members of a group never made (a skipped collective), a receive with no matching send (too few messages),
  ranks all receiving from each other (unpaired point-to-point), or ranks waiting in a collective that one of
  them reached only after work of its own, alone (``op="compute"``: a late rank, a straggler the timeout turned
  into a hang).

It is a pure function of the journals, so it is unit-tested on recorded examples.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter, defaultdict

P2P = ("send", "recv")
LOCAL = ("compute",)   # work a rank does alone (an evaluation, a save): journaled to show where it was, not a collective


class CallJournal:
    """This rank's calls, mirrored into ``store`` under ``{prefix}/{rank}`` as JSON after every change."""

    def __init__(self, store, rank: int, prefix: str = "journal", mirror: str | None = None):
        self.store, self.rank, self.key = store, rank, f"{prefix}/{rank}"
        self.mirror = mirror  # a file that holds the same JSON: what is left when the job is cancelled mid-hang
        self.calls: list[dict] = []
        self.state = "running"
        self._finishing = threading.Lock()   # finish() runs in the main thread and in the SIGTERM thread

    def as_json(self) -> str:
        return json.dumps({"rank": self.rank, "state": self.state, "calls": self.calls})

    def _save(self) -> None:
        self.store.set(self.key, self.as_json())
        self.save_file()

    def save_file(self) -> None:
        if self.mirror:
            os.makedirs(os.path.dirname(self.mirror) or ".", exist_ok=True)
            with open(self.mirror + ".tmp", "w") as f:
                f.write(self.as_json())
            os.replace(self.mirror + ".tmp", self.mirror)  # never a half-written journal

    @contextlib.contextmanager
    def call(self, label: str, op: str, group: str = "world", members=None, peer: int | None = None,
             order: int = 0):
        """Record ``op`` (on ``group``, whose ranks are ``members``; or to/from ``peer``) around the block.

        ``order``: where the call sits in the program's text (any increasing number), for the diagnosis."""
        entry = {"label": label, "op": op, "group": group, "members": list(members or []), "peer": peer,
                 "order": order, "done": False}
        self.calls.append(entry)
        self._save()
        started = time.perf_counter()
        yield
        entry["done"] = True
        entry["seconds"] = round(time.perf_counter() - started, 3)   # how long the call took: a late rank's work
        self._save()

    def finish(self, state: str) -> None:
        """``finished`` (the program ran to its end), ``timed out`` (a call raised after the timeout) or
        ``cancelled`` (the job was ended while the rank waited: only the file is written, the store may be gone).

        A cancellation is final. The SIGTERM thread writes ``cancelled`` and then, before it ends the process, writes
        the flight recorder; meanwhile a peer that got its SIGTERM sooner may have exited, the main thread's call then
        raises, and its ``timed out`` overwrote the file (seen once in make test's Slurm tier). The lock orders the
        two file writes; the store is written outside it, so that a store gone with a peer never holds up the SIGTERM
        thread."""
        with self._finishing:
            if self.state == "cancelled":
                return
            self.state = state
            if state == "cancelled":
                self.save_file()
                return
        self.store.set(self.key, self.as_json())
        with self._finishing:
            if self.state == state:   # not cancelled meanwhile
                self.save_file()


def on_sigterm_leave_evidence(leave) -> None:
    """Call ``leave()`` when the process gets SIGTERM (qdel, PBS's walltime, Slurm's ``scancel --signal=TERM``, a
    plain ``scancel`` or the time limit, each with a KILL some seconds later), even while the main thread
    waits inside a collective, where no Python signal handler runs until the call returns: SIGTERM is blocked in
    every thread (call this first, before the process group starts its threads, which inherit the mask) and one
    helper thread waits for it with sigwait. ``leave`` writes what tells the hang apart and ends the process."""
    import signal
    import threading

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        signal.sigwait({signal.SIGTERM})
        leave()

    threading.Thread(target=wait, name="sigterm-evidence", daemon=True).start()


# Two dumps of each rank, in two folders of the drill's trace folder, so that neither can overwrite the other: the
# watchdog's own (ProcessGroupNCCL writes <TORCH_FR_DUMP_TEMP_FILE><rank> on a timeout) and the one the drill asks
# for by hand once it has its diagnosis. Each folder is what torch's analyzer reads:
#     python -m torch.distributed.flight_recorder.fr_trace <trace_dir>/manual      (or .../watchdog)
WATCHDOG_DUMPS, MANUAL_DUMPS, DUMP_PREFIX = "watchdog", "manual", "trace_rank_"


def debug_env(trace_dir: str) -> dict:
    """What a hang drill sets before its process group exists (ProcessGroupNCCL reads these in its constructor):

    * ``TORCH_NCCL_BLOCKING_WAIT=1``: a collective that times out raises in the rank's own thread, so its
      ``except`` runs. Without it NCCL's collectives return once queued, and the watchdog's default
      (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) tears the process down first; with it, torch 2.12 and later start no
      watchdog at all ("TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is created.", ProcessGroupNCCL.cpp),
      so nothing tears the process down, and nothing dumps on a timeout either (the drills dump by hand);
    * ``TORCH_FR_BUFFER_SIZE``: PyTorch's flight recorder keeps each rank's last collectives, with their state;
    * ``TORCH_FR_DUMP_TEMP_FILE``: where the watchdog's dump goes, ``<trace_dir>/watchdog/trace_rank_<rank>`` in
      the run folder on scratch. Left unset, torch 2.13 writes ``$XDG_CACHE_HOME/torch/comm_lib_trace_rank_<rank>``,
      else ``~/.cache/torch/comm_lib_trace_rank_<rank>`` (DebugInfoWriter::getWriter in
      torch/csrc/distributed/c10d/FlightRecorder.cpp; declared in the wheel's
      include/torch/csrc/distributed/c10d/FlightRecorder.hpp:73, and libtorch_cpu.so carries the strings
      XDG_CACHE_HOME, /.cache and comm_lib_trace_rank_): a home folder, small on a cluster and shared by every job;
      ``TORCH_NCCL_DUMP_ON_TIMEOUT`` (on by default): NCCL's watchdog dumps when it sees a timeout (set for a
      script that runs without blocking wait; under it there is no watchdog to dump).
    Variables already set are kept. The watchdog does not create its folder: :func:`prepare_trace_dir` does."""
    wanted = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_FR_DUMP_TEMP_FILE": os.path.join(trace_dir, WATCHDOG_DUMPS, DUMP_PREFIX)}
    return {name: os.environ.get(name, value) for name, value in wanted.items()}


def prepare_trace_dir(env: dict) -> None:
    """Create the folder the watchdog's dump goes to (the file is opened as is, its folder must exist)."""
    os.makedirs(os.path.dirname(env["TORCH_FR_DUMP_TEMP_FILE"]) or ".", exist_ok=True)


def dump_flight_recorder(trace_dir: str, rank: int, backend: str = "gloo") -> str | None:
    """This rank's flight-recorder buffer, written as ``<trace_dir>/manual/trace_rank_<rank>`` (what torch's analyzer
    reads); None when nothing was recorded. Under NCCL the entries are in the CUDA recorder, which
    ``_dump_nccl_trace`` dumps; every other backend's are in the generic one, ``_dump_fr_trace`` (both bound in
    torch/csrc/distributed/c10d/init.cpp, same arguments; ``_dump_nccl_trace`` exists only in CUDA builds)."""
    import torch

    c10d = torch._C._distributed_c10d
    name = "_dump_nccl_trace" if backend == "nccl" else "_dump_fr_trace"
    try:
        data = getattr(c10d, name)(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    except Exception:  # noqa: BLE001 - a build without the recorder: the journal still tells
        return None
    if not data:
        return None
    folder = os.path.join(trace_dir, MANUAL_DUMPS)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{DUMP_PREFIX}{rank}")
    with open(path, "wb") as f:
        f.write(data)
    return path


def flight_recorder_summary(trace_dir: str, world_size: int) -> dict[int, str]:
    """Each rank's dump read back, one line a rank: per process group how much work the rank enqueued (its
    ``pg_status``: collectives and point-to-point messages, numbered) and the last collective recorded there.
    Ranks that enqueued different counts on one group went different ways: the one with fewer skipped a call,
    the others' last entry is the call they wait in (the journal's ``*``). Whether a timed-out call counts as
    completed depends on when the backend gave up, so the counts enqueued are what to compare. torch's analyzer
    (``fr_trace``) matches ranks through the NCCL groups' configuration, which a gloo dump does not carry, so on
    a CPU the course reads the buffers itself; the fields are the same."""
    import pickle

    lines = {}
    for rank in range(world_size):
        path = os.path.join(trace_dir, MANUAL_DUMPS, f"{DUMP_PREFIX}{rank}")
        if not os.path.exists(path):
            lines[rank] = "no dump"
            continue
        with open(path, "rb") as f:
            dump = pickle.load(f)
        parts = []
        for pg, status in sorted(dump.get("pg_status", {}).items()):
            last = [e["profiling_name"] for e in dump["entries"] if e["process_group"][0] == pg]
            parts.append(f"group {pg}: {status['last_enqueued_collective']} enqueued"
                         + (f", the last collective {last[-1]}" if last else ""))
        lines[rank] = "; ".join(parts)
    return lines


def read_journals(store, world_size: int, prefix: str = "journal") -> dict[int, dict]:
    return {r: json.loads(store.get(f"{prefix}/{r}")) for r in range(world_size)}


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def diagnose(journals: dict[int, dict]) -> dict:
    """``{"cause": short name, "verdict": one sentence, "stuck": {rank: call}}`` from every rank's journal.

    Each call may carry ``order``, its position in the program's text, so that of two different calls at the
    same position on a group the diagnosis can tell which ranks went past a call the others wait in.
    """
    stuck = {r: j["calls"][-1] for r, j in journals.items() if j["calls"] and not j["calls"][-1]["done"]}
    if not stuck:
        return {"cause": "none", "verdict": "no rank is stuck in a call: no hang", "stuck": {}}

    # 1. Point-to-point: ranks receiving from each other, or a receive that no send matches.
    sent, posted = Counter(), Counter()
    for r, j in journals.items():
        for c in j["calls"]:
            if c["op"] == "send":
                sent[(r, c["peer"])] += 1
            elif c["op"] == "recv":
                posted[(c["peer"], r)] += 1
    receiving = {r: c["peer"] for r, c in stuck.items() if c["op"] == "recv"}
    cycles = sorted({tuple(sorted((r, p))) for r, p in receiving.items() if receiving.get(p) == r})
    if cycles:
        pairs = ", ".join(f"{a} and {b}" for a, b in cycles)
        return {"cause": "unpaired point-to-point", "stuck": stuck,
                "verdict": f"ranks {pairs} each wait to receive from the other and neither sends: order the pair "
                           "(one sends first) or post both with batch_isend_irecv (on NCCL two unpaired sends "
                           "deadlock the same way)"}
    for r, peer in sorted(receiving.items()):
        if posted[(peer, r)] > sent[(peer, r)]:
            return {"cause": "too few messages", "stuck": stuck,
                    "verdict": f"rank {r} waits for message #{posted[(peer, r)]} from rank {peer}, which sent only "
                               f"{sent[(peer, r)]} and moved on: sender and receiver count the messages (the "
                               "microbatches) differently"}

    collectives = {r: [c for c in j["calls"] if c["op"] not in P2P + LOCAL] for r, j in journals.items()}

    # 2. One line of the program, run on different groups by different ranks, and on some group by only part of
    # its members (each pair on its own pair group is right; two ranks on the world group is not).
    groups_by_label = defaultdict(lambda: defaultdict(set))
    members_of_group = {}
    for r, calls in collectives.items():
        for c in calls:
            groups_by_label[c["label"]][c["group"]].add(r)
            members_of_group[c["group"]] = set(c["members"] or journals)
    for label, groups in groups_by_label.items():
        if len(groups) > 1 and any(callers != members_of_group[g] for g, callers in groups.items()):
            parts = "; ".join(f"{_ranks(rs)} on {g}" for g, rs in sorted(groups.items(), key=lambda kv: min(kv[1])))
            return {"cause": "wrong group", "stuck": stuck,
                    "verdict": f"'{label}' ran on different process groups ({parts}): a collective on the wrong "
                               "group pairs up with another call of that group, then the ranks wait in different places"}

    # 3. Each group's collectives, position by position, over its members.
    per_group, members_of = defaultdict(dict), {}
    for r, calls in collectives.items():
        for c in calls:
            per_group[c["group"]].setdefault(r, []).append(c)
            members_of[c["group"]] = c["members"] or sorted(journals)
    for group, by_rank in per_group.items():
        longest = max(len(calls) for calls in by_rank.values())
        for position in range(longest):
            at = {r: by_rank.get(r, [])[position] if position < len(by_rank.get(r, [])) else None
                  for r in members_of[group]}
            made = {r: c for r, c in at.items() if c is not None}
            labels = {c["label"] for c in made.values()}
            if len(labels) == 1:
                label, ops = next(iter(labels)), sorted({c["op"] for c in made.values()})
                if len(ops) > 1:
                    parts = "; ".join(f"{_ranks([r for r, c in made.items() if c['op'] == op])} called {op}"
                                      for op in ops)
                    return {"cause": "mismatched collectives", "stuck": stuck,
                            "verdict": f"at '{label}', call #{position + 1} on {group}, the ranks called different "
                                       f"collectives ({parts}): every rank must issue the same collectives on a "
                                       "group, in the same order"}
                missing = sorted(r for r, c in at.items() if c is None)
                if missing:
                    return {"cause": "skipped collective", "stuck": stuck,
                            "verdict": f"{_ranks(made)} called '{label}' ({ops[0]} on {group}); {_ranks(missing)} "
                                       "never did: a collective under a condition that is not the same on every rank"}
                continue
            behind = min(made.values(), key=lambda c: c.get("order", 0))
            waiting = sorted(r for r, c in made.items() if c["label"] == behind["label"])
            ahead = sorted(r for r in made if r not in waiting)
            return {"cause": "skipped collective", "stuck": stuck,
                    "verdict": f"{_ranks(ahead)} skipped '{behind['label']}' ({behind['op']} on {group}) and went on "
                               f"to '{made[ahead[0]]['label']}', while {_ranks(waiting)} wait in it: a collective "
                               "under a condition that is not the same on every rank"}

    # 4. Every rank reached the same collective, but some only after work of their own that the others did not do:
    # the others waited there for them until the timeout (a straggler that became a hang).
    if len({(c["label"], c["group"]) for c in stuck.values()}) == 1 and len(stuck) == len(journals):
        def alone_before(j):   # the local calls a rank made since its last collective before the stuck one
            local = []
            for c in reversed(j["calls"][:-1]):
                if c["op"] not in LOCAL:
                    break
                local.append(c)
            return local
        late = {r: alone_before(j) for r, j in journals.items() if alone_before(j)}
        if late and len(late) < len(journals):
            label, waited = next(iter(stuck.values()))["label"], sorted(set(journals) - set(late))
            work = "; ".join(f"rank {r}: '{c['label']}' {c.get('seconds', 0):.1f} s" for r, calls in sorted(late.items())
                             for c in calls)
            return {"cause": "late rank", "stuck": stuck,
                    "verdict": f"{_ranks(waited)} waited in '{label}' for {_ranks(late)}, busy alone first ({work}) "
                               "until the process group's timeout ended the wait: a rank's own work must be shorter "
                               "than the timeout, or shared by every rank"}

    where = "; ".join(f"rank {r} in {c['op']} ('{c['label']}')" for r, c in sorted(stuck.items()))
    return {"cause": "unknown", "stuck": stuck, "verdict": f"stuck: {where}"}
