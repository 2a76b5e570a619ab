"""Checks of chapter 12's exercises: read a profiler timeline, find a hang from the ranks' call journals, place
each rank from a PBS node file.

Each check calls the learner's function on several cases (hand-made ones that tell the plausible wrong
answers apart, and, when given, the notebook's own run) and compares with what ``distlab.profiling`` and
``distlab.hangs`` compute. tests/unit/test_profiling.py feeds each check the wrong answers it must reject
(tests/unit/test_exercises_ch12_more.py for the placement, whose expected answers are written out as data).
"""

from __future__ import annotations

from distlab import profiling
from labkit.exercises.checks import ExerciseWrong, _not_done, _ok, learner_check, sentence, wrong_number


def hidden_seconds(rows: list[dict]) -> float:
    """Communication time that overlapped backward's compute, from ``profiling.timeline`` rows: the union of
    the collectives (two may run at once on two gloo threads), intersected with compute and backward."""
    lane = lambda name: [(r["start"], r["end"]) for r in rows if r["lane"] == name]  # noqa: E731
    return profiling.length(profiling.intersect(lane("communication"),
                                                profiling.intersect(lane("compute"), lane("backward"))))


def _hidden_slips(rows: list[dict]) -> list[tuple[float, str]]:
    """(what a usual slip gives, what it counted): the wrong answers a learner plausibly returns."""
    lane = lambda name: [(r["start"], r["end"]) for r in rows if r["lane"] == name]  # noqa: E731
    communication, busy = lane("communication"), profiling.intersect(lane("compute"), lane("backward"))
    return [
        (profiling.length(profiling.merge(communication)), "that is all the communication time, hidden or not"),
        (profiling.length(profiling.intersect(communication, lane("backward"))),
         "that counts communication inside backward's span whether or not backward was computing then"),
        (sum(profiling.length(profiling.intersect([span], busy)) for span in communication),
         "that counts twice the time where two collectives run together"),
        (profiling.length(profiling.intersect(communication, lane("compute"))),
         "that counts compute outside backward (the forward's) as hiding communication too"),
    ]


def _rows(compute, backward, communication):
    return ([{"lane": "compute", "kind": "compute", "start": s, "end": e} for s, e in compute]
            + [{"lane": "backward", "kind": "backward", "start": s, "end": e} for s, e in backward]
            + [{"lane": "communication", "kind": "all_reduce", "start": s, "end": e} for s, e in communication])


# Each case tells one wrong answer apart: all communication time; communication inside backward's span,
# computing or not; the overlaps of each collective summed (two collectives at once counted twice); compute
# during forward counted as hiding communication.
TIMELINE_CASES = (
    _rows(compute=[(0, 3), (4, 6), (7, 10)], backward=[(4, 10)], communication=[(5, 8)]),
    _rows(compute=[(0, 2), (3, 9)], backward=[(3, 9)], communication=[(4, 6), (5, 7), (10, 11)]),
    _rows(compute=[(0, 5), (6, 8)], backward=[(6, 8)], communication=[(1, 3), (6.5, 7)]),
)
# What each case holds, in words, for a wrong answer's message: its numbers would name the answer, so the message
# says where to read its rows instead
TIMELINE_SHAPES = (
    "one collective across a gap in backward's compute",
    "two collectives at once, and one after backward",
    "a collective during the forward, and one in backward",
)


@learner_check
def check_hidden_communication(function, run_rows: list[dict] | None = None, *, hint: str = "") -> None:
    """``function(rows)`` must return the seconds of communication that ran while backward computed."""
    cases = [list(rows) for rows in TIMELINE_CASES] + ([run_rows] if run_rows else [])
    for index, rows in enumerate(cases):
        try:
            got = function(rows)
        except NotImplementedError:
            raise _not_done("hidden_communication", hint) from None
        if got is None:
            raise _not_done("hidden_communication", hint)
        want = hidden_seconds(rows)
        close = lambda a, b: abs(float(a) - b) <= 1e-9 + 1e-6 * abs(b)  # noqa: E731
        if not close(got, want):
            which = ("the notebook's run" if index == len(TIMELINE_CASES) else
                     f"hand-made timeline #{index + 1} ({TIMELINE_SHAPES[index]}; its rows: "
                     f"`from labkit.exercises.ch12 import TIMELINE_CASES; TIMELINE_CASES[{index}]`)")
            slip = next((words for wrong, words in _hidden_slips(rows) if close(got, wrong)), None)
            raise ExerciseWrong(
                f"hidden_communication on {which}: {float(got):.6g} s: "
                f"{sentence(slip or wrong_number(got, want))} Count time once where two "
                f"collectives run together, and only where backward is computing. {hint}".strip())
    _ok(f"hidden_communication agrees on {len(cases)} timeline(s)")


def _journals(calls_by_rank: dict[int, list[tuple]], stuck: dict[int, bool]) -> dict[int, dict]:
    """Journals as distlab.hangs writes them, from (label, op, group, members) tuples; the last call of a rank
    in ``stuck`` is not done."""
    journals = {}
    for rank, calls in calls_by_rank.items():
        entries = [{"label": label, "op": op, "group": group, "members": members, "peer": None, "order": i,
                    "done": True} for i, (label, op, group, members) in enumerate(calls)]
        if stuck.get(rank) and entries:
            entries[-1]["done"] = False
        journals[rank] = {"rank": rank, "state": "timed out" if stuck.get(rank) else "finished", "calls": entries}
    return journals


WORLD, PAIR1 = [0, 1, 2, 3], [2, 3]
# (journals, label of the call some ranks are stuck in, the ranks of its group that never made it)
JOURNAL_CASES = (
    (_journals({0: [("sync", "all_reduce", "world", WORLD), ("barrier", "barrier", "world", WORLD)],
                1: [("sync", "all_reduce", "world", WORLD), ("barrier", "barrier", "world", WORLD)],
                2: [("sync", "all_reduce", "world", WORLD), ("barrier", "barrier", "world", WORLD)],
                3: [("sync", "all_reduce", "world", WORLD), ("end", "all_reduce", "world", WORLD)]},
               {0: True, 1: True, 2: True, 3: True}), "barrier", [3]),
    # a pair's collective: ranks 0 and 1 are not members, so they are not "missing" from it
    (_journals({0: [("sync", "all_reduce", "world", WORLD)], 1: [("sync", "all_reduce", "world", WORLD)],
                2: [("sync", "all_reduce", "world", WORLD), ("pair", "all_reduce", "pair1", PAIR1)],
                3: [("sync", "all_reduce", "world", WORLD)]},
               {2: True}), "pair", [3]),
    (_journals({0: [("barrier", "barrier", "world", WORLD)], 1: [("end", "all_reduce", "world", WORLD)],
                2: [("barrier", "barrier", "world", WORLD)], 3: [("end", "all_reduce", "world", WORLD)]},
               {0: True, 1: True, 2: True, 3: True}), "barrier", [1, 3]),
)


def missing_ranks(journals: dict, label: str) -> list[int]:
    """The members of the group of the call ``label`` (as the stuck ranks recorded it) that never made it."""
    journals = {int(r): j for r, j in journals.items()}
    made = {r for r, j in journals.items() if any(c["label"] == label for c in j["calls"])}
    call = next(c for j in journals.values() for c in j["calls"] if c["label"] == label and not c["done"])
    members = call["members"] or sorted(journals)
    return sorted(r for r in members if r not in made)


def _calls_made(journals: dict) -> str:
    """Each rank's calls by label, a call still waiting starred: a hand-made case shown without its answer."""
    return "; ".join(f"rank {int(r)}: " + ", ".join(c["label"] + ("" if c["done"] else "*") for c in j["calls"])
                     for r, j in sorted(journals.items(), key=lambda item: int(item[0])))


@learner_check
def check_missing_ranks(function, run: tuple | None = None, *, hint: str = "") -> None:
    """``function(journals, label)`` must return the ranks of the call's group that never made the call."""
    cases = list(JOURNAL_CASES) + ([(run[0], run[1], missing_ranks(*run))] if run else [])
    for index, (journals, label, want) in enumerate(cases):
        try:
            got = function(journals, label)
        except NotImplementedError:
            raise _not_done("missing_ranks", hint) from None
        if got is None:
            raise _not_done("missing_ranks", hint)
        mine = sorted(int(r) for r in got)
        if mine != want:
            which = ("the notebook's run" if index == len(JOURNAL_CASES) else
                     f"journal set #{index + 1} ({_calls_made(journals)}; * waiting)")
            waiting = sorted(int(r) for r, j in journals.items()
                             if any(c["label"] == label and not c["done"] for c in j["calls"]))
            absent = sorted(int(r) for r, j in journals.items() if not any(c["label"] == label for c in j["calls"]))
            slip = ("those are the ranks waiting in it, the victims" if mine == waiting else
                    "that counts ranks outside the call's group, which never make it" if mine == absent else
                    "those are not the culprits")
            raise ExerciseWrong(
                f"missing_ranks on {which}, call {label!r}: {mine}: {slip}. The culprits are the members of that "
                f"call's group that never recorded it, not the ranks waiting in it. {hint}".strip())
    _ok(f"missing_ranks finds the culprits in {len(cases)} journal set(s)")


# ---- exercise 3: place each rank from the node file (page 12.1) --------------------------------------------------

# (a PBS_NODEFILE as mpiexec --ppn reads it: one line per rank, in the scheduler's order;
#  the (host, local rank) of each rank, written out by hand). Each case tells wrong answers apart: the local rank
# taken to be the rank; the file read as one line a node; the hosts sorted by name; ranks dealt round robin over
# the nodes; the node count taken for the ranks a node.
PLACEMENT_CASES = (
    (["n1"] * 4 + ["n2"] * 4,
     [("n1", 0), ("n1", 1), ("n1", 2), ("n1", 3), ("n2", 0), ("n2", 1), ("n2", 2), ("n2", 3)]),
    (["dec0107"] * 2 + ["dec0012"] * 2 + ["dec0055"] * 2,
     [("dec0107", 0), ("dec0107", 1), ("dec0012", 0), ("dec0012", 1), ("dec0055", 0), ("dec0055", 1)]),
    (["n7"] * 4, [("n7", 0), ("n7", 1), ("n7", 2), ("n7", 3)]),
)


@learner_check
def check_placement(function, *, hint: str = "") -> None:
    """``function(nodefile)`` must return, for each rank in order, its host and its local rank (its GPU)."""
    for index, (nodefile, want) in enumerate(PLACEMENT_CASES):
        try:
            got = function(list(nodefile))
        except NotImplementedError:
            raise _not_done("placement", hint) from None
        if got is None:
            raise _not_done("placement", hint)
        got = [(str(host), int(local)) for host, local in got]
        if got != want:
            wrong = next((r for r, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            shown = got[wrong] if wrong < len(got) else "nothing"
            # the message names the first wrong rank, never the expected answer (a wrong guess must not read it)
            raise ExerciseWrong(
                f"placement of node file #{index + 1} ({len(nodefile)} lines: {' '.join(nodefile)}): rank {wrong} got "
                f"{shown}, which is "
                f"not its place. The file lists a host once a rank, in the scheduler's order; the local rank counts "
                f"the earlier ranks on the same host. {hint}".strip())
    _ok(f"placement agrees on {len(PLACEMENT_CASES)} node files; rank 0's host is MASTER_ADDR")
