"""distlab.hangs: the diagnosis of a hang from every rank's journal, on journals recorded from deadlocks.py."""

import copy
import json
from pathlib import Path

import pytest

from distlab import hangs

RECORDED = json.loads((Path(__file__).parent / "data" / "hang_journals.json").read_text())


def journals(flag):
    return {int(r): j for r, j in copy.deepcopy(RECORDED[flag]["journals"]).items()}


@pytest.mark.parametrize("flag, cause", [("none", "none"), ("mismatched-collectives", "mismatched collectives"),
                                         ("skipped-barrier", "skipped collective"), ("wrong-group", "wrong group"),
                                         ("few-microbatches", "too few messages"),
                                         ("unpaired-p2p", "unpaired point-to-point")])
def test_each_recorded_hang_gets_its_cause(flag, cause):
    finding = hangs.diagnose(journals(flag))
    assert finding["cause"] == cause, finding


def test_verdicts_name_the_ranks_and_the_call():
    assert "rank 3 never did" in hangs.diagnose(journals("skipped-barrier"))["verdict"]
    assert "rank 1 waits for message #4 from rank 0, which sent only 3" in \
        hangs.diagnose(journals("few-microbatches"))["verdict"]
    assert "ranks 0, 1 on pair0; ranks 2, 3 on world" in hangs.diagnose(journals("wrong-group"))["verdict"]
    assert "rank 0 called broadcast" in hangs.diagnose(journals("mismatched-collectives"))["verdict"]


def test_a_rank_that_went_past_a_call_is_named_by_program_order():
    # rank 3 skipped the barrier and waits in the next call, at the same position on the world group
    calls = lambda *ops: [{"label": lb, "op": op, "group": "world", "members": [0, 1, 2, 3], "peer": None,
                           "order": order, "done": False} for lb, op, order in ops]
    state = {r: {"rank": r, "state": "timed out", "calls": calls(("barrier before logging", "barrier", 2))}
             for r in range(3)}
    state[3] = {"rank": 3, "state": "timed out", "calls": calls(("end of step", "all_reduce", 5))}
    verdict = hangs.diagnose(state)
    assert verdict["cause"] == "skipped collective"
    assert "rank 3 skipped 'barrier before logging'" in verdict["verdict"]


def test_journal_mirrors_every_call_into_the_store():
    class Store(dict):
        def set(self, key, value):
            self[key] = value

        def get(self, key):
            return self[key].encode()

    store = Store()
    journal = hangs.CallJournal(store, 2, prefix="p")
    with journal.call("x", "all_reduce"):
        assert json.loads(store["p/2"])["calls"][0]["done"] is False  # written before the call
    assert json.loads(store["p/2"])["calls"][0]["done"] is True
    journal.finish("finished")
    assert json.loads(store["p/2"])["state"] == "finished"


def test_the_drills_nccl_settings_are_blocking_wait_and_the_flight_recorder(monkeypatch):
    from distlab import hangs

    for name in ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
                 "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    env = hangs.debug_env("/glade/derecho/scratch/me/run/flight_recorder")
    assert env == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": "/glade/derecho/scratch/me/run/flight_recorder/watchdog/trace_rank_"}
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")  # the user's own setting is kept
    assert hangs.debug_env("x")["TORCH_FR_BUFFER_SIZE"] == "100"


def test_each_pair_on_its_own_group_is_not_a_wrong_group():
    from distlab import hangs

    def call(label, group, members, done=True):
        return {"label": label, "op": "all_reduce", "group": group, "members": members, "peer": None, "order": 1,
                "done": done}

    journals = {r: {"rank": r, "state": "timed out",
                    "calls": [call("pair", f"pair{r // 2}", [2 * (r // 2), 2 * (r // 2) + 1]),
                              call("end", "world", [0, 1, 2, 3], done=r == 3)]} for r in range(4)}
    journals[3]["calls"].pop()  # rank 3 never reached 'end'
    assert hangs.diagnose(journals)["cause"] == "skipped collective"
    journals[2]["calls"][0] = call("pair", "world", [0, 1, 2, 3])  # group= forgotten by one pair
    journals[3]["calls"][0] = call("pair", "world", [0, 1, 2, 3])
    assert hangs.diagnose(journals)["cause"] == "wrong group"


@pytest.mark.parametrize("backend, used", [("nccl", "_dump_nccl_trace"), ("gloo", "_dump_fr_trace")])
def test_the_manual_dump_reads_the_backends_recorder_and_never_overwrites_the_watchdogs(backend, used, tmp_path,
                                                                                         monkeypatch):
    # NCCL's entries are in the CUDA recorder (_dump_nccl_trace), gloo's in the generic one (_dump_fr_trace); a
    # CPU build has no _dump_nccl_trace, so both are stood in for here
    import torch

    from distlab import hangs

    c10d = torch._C._distributed_c10d
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        monkeypatch.setattr(c10d, name, lambda name=name, **kw: name.encode(), raising=False)
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    env = hangs.debug_env(str(tmp_path))
    hangs.prepare_trace_dir(env)
    watchdog = env["TORCH_FR_DUMP_TEMP_FILE"] + "3"  # what ProcessGroupNCCL's watchdog writes for rank 3
    open(watchdog, "w").write("the watchdog's own dump")
    path = hangs.dump_flight_recorder(str(tmp_path), 3, backend)
    assert open(path, "rb").read() == used.encode()
    assert open(watchdog).read() == "the watchdog's own dump" and path != watchdog


def test_a_rank_busy_alone_before_the_call_the_others_wait_in_is_a_late_rank():
    """rank-0-evaluation's journals: every rank ends in the same all-reduce; rank 0 computed alone just before it.
    The same journals with every rank computing its share (the fix, had it still hung) are not a late rank."""
    def call(label, op, group="world", seconds=0.01, done=True):
        entry = {"label": label, "op": op, "group": group, "members": [0, 1, 2, 3] if group == "world" else [0],
                 "peer": None, "order": 1, "done": done}
        return {**entry, "seconds": seconds} if done else entry

    journals = {r: {"rank": r, "state": "timed out",
                    "calls": [call("end of step", "all_reduce"), call("next step", "all_reduce", done=False)]}
                for r in range(4)}
    journals[0]["calls"].insert(1, call("evaluate", "compute", group="rank 0", seconds=3.0))
    finding = hangs.diagnose(journals)
    assert finding["cause"] == "late rank", finding
    assert "ranks 1, 2, 3 waited in 'next step' for rank 0" in finding["verdict"] and "3.0 s" in finding["verdict"]
    for r in (1, 2, 3):
        journals[r]["calls"].insert(1, call("evaluate", "compute", group=f"rank {r}", seconds=0.75))
    assert hangs.diagnose(journals)["cause"] == "unknown"


def test_a_cancelled_journal_stays_cancelled_when_the_main_threads_call_then_raises(tmp_path):
    # scancel: the SIGTERM thread writes "cancelled"; a peer that exited sooner makes this rank's call raise, and the
    # main thread's "timed out" must not replace it in the file the job leaves
    class Store(dict):
        def set(self, key, value):
            self[key] = value

    mirror = tmp_path / "journals" / "rank_1.json"
    journal = hangs.CallJournal(Store(), 1, prefix="p", mirror=str(mirror))
    with pytest.raises(RuntimeError), journal.call("end of step", "all_reduce"):
        journal.finish("cancelled")
        raise RuntimeError("Connection closed by peer")
    journal.finish("timed out")
    assert json.loads(mirror.read_text())["state"] == "cancelled"
