"""The logic of the course's batch jobs (pbs/, slurm/, jobs/common.sh), in Python where a test can reach it.

The jobs' bash keeps what sets up the environment (modules, conda, NCCL's variables, the launch); what is a rule
lives here, one subcommand each, called by jobs/common.sh as ``"$DISTLAB_PYTHON" -m coursetools.jobs NAME ...``.
Standard library only: a job may call it before its own environment is ready.

    submit [OPTIONS] JOB [ARGS]      check a submission, then sbatch or qsub it (the course's way to submit)
    seconds DURATION                 PBS's [[HH:]MM:]SS -> seconds
    transport LOG...                 the network NCCL chose, from its NCCL_DEBUG=INFO lines
    details LOG...                   GPUDirect RDMA and the net plugin, from the same lines
    warnings FOLDER                  NCCL's WARN lines of the job's per-rank files
    complete METRICS                 exit 0 when a run is complete (its checks passed, not stopped early)
    chain-vars NAME=VALUE...         one -v / --export list for a chain's next job, lists carried with ':'
    pbs-kill-delay [SECONDS]         when PBS's SIGKILL follows its TERM, for the queue's kill_delay (default 10)

``submit`` refuses, with one line ``distlab: error: ...`` and exit 2, before anything is queued: an unknown
partition (``sinfo -h -p NAME``) or queue (``qstat -Q NAME``); no account where the site needs one (Slurm:
``scontrol show config``'s AccountingStorageEnforce, then ``sacctmgr``'s associations; PBS has no such query:
always, unless DISTLAB_REQUIRE_ACCOUNT=0); an account not yours (``sacctmgr``, where associations are enforced); tasks a node that
do not match its GPUs (one task, or one MPI rank, a GPU; a torchrun agent a node is exempt).

    python -m coursetools.jobs submit -A proj1 -N 2 slurm/04_data_parallel.sbatch
    python -m coursetools.jobs submit -A UABC0001 pbs/04_data_parallel.pbs
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

# json and subprocess are imported where they are used: a job calls this module several times, and most calls
# (the NCCL reports, a duration) need neither, so each starts sooner


class BadInput(Exception):
    """What the user must change: one line, exit 2."""


# ---------------------------------------------------------------------------------------------------------------
# Submission: read what the job asks for, as the scheduler will (header, then environment, then command line)
# ---------------------------------------------------------------------------------------------------------------
# the options whose value the checks need, by every spelling: (short, long)
SLURM_OPTIONS = {"partition": ("-p", "--partition"), "account": ("-A", "--account"),
                 "gpus-per-node": (None, "--gpus-per-node"), "ntasks-per-node": (None, "--ntasks-per-node"),
                 "nodes": ("-N", "--nodes"), "export": (None, "--export")}
# sbatch's input environment (its manual, "INPUT ENVIRONMENT VARIABLES": they override the script's #SBATCH
# lines, and the command line overrides them)
SLURM_ENV = {"partition": "SBATCH_PARTITION", "account": "SBATCH_ACCOUNT", "gpus-per-node": "SBATCH_GPUS_PER_NODE",
             "export": "SBATCH_EXPORT"}
PBS_OPTIONS = {"queue": ("-q", None), "account": ("-A", None), "select": ("-l", None), "variables": ("-v", None)}
# how long a scheduler's query may take before the submission is refused (a controller that does not answer)
COMMAND_TIMEOUT_S = 60


def header_words(job: Path, prefix: str) -> list[str]:
    """The directives before the job's first command (sbatch and qsub stop reading there), split into words as
    the scheduler splits them: quotes group words and are removed, an unquoted # ends the line (sbatch's
    get_argument, src/sbatch/opt.c). sbatch reads "#SBATCH" only at a line's start (an indented one is a comment);
    qsub also after blanks (OpenPBS pbs_ispbsdir, src/lib/Libcmds/check_job_script.c)."""
    import shlex

    words: list[str] = []
    for line in job.read_text().splitlines():
        stripped = line.strip()
        directive = line if prefix == "#SBATCH" else stripped
        if directive.startswith(prefix):
            try:
                words += shlex.split(directive[len(prefix):], comments=True)
            except ValueError:
                raise BadInput(f"{job}: an unmatched quote in its header line '{stripped}'") from None
        elif stripped and not stripped.startswith("#"):
            break
    return words


def read_options(words: list[str], spellings: dict[str, tuple[str | None, str | None]]) -> dict[str, list[str]]:
    """Every value given to the options named in ``spellings``, in order (the last one wins)."""
    found: dict[str, list[str]] = {}
    i = 0
    while i < len(words):
        word = words[i]
        for name, (short, long) in spellings.items():
            value = None
            if long and word.startswith(long + "="):
                value = word[len(long) + 1:]
            elif word in (short, long) and i + 1 < len(words):
                value = words[i + 1]
                i += 1
            elif short and word.startswith(short) and len(word) > len(short) and not word.startswith("--"):
                value = word[len(short):]
            if value is not None:
                found.setdefault(name, []).append(value)
                break
        i += 1
    return found


def split_command_line(argv: list[str]) -> tuple[list[str], Path, list[str]]:
    """(scheduler options, the job file, the job's own arguments): the job file is the first .sbatch or .pbs word."""
    for i, word in enumerate(argv):
        if word.endswith((".sbatch", ".pbs")) and not word.startswith("-"):
            return argv[:i], Path(word), argv[i + 1:]
    raise BadInput("name a job file: python -m coursetools.jobs submit [options] slurm/NN_name.sbatch (or pbs/NN_name.pbs)")


def run(argv: list[str]):
    """argv's finished process (output captured); BadInput when the command is not there."""
    import subprocess

    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise BadInput(f"{argv[0]} not found: submit from a login node of the cluster, where {argv[0]} is on PATH") from None
    except subprocess.TimeoutExpired:
        raise BadInput(f"{argv[0]} did not answer in {COMMAND_TIMEOUT_S} s (is the scheduler's controller up?): "
                       f"nothing was submitted; try again, or submit with plain {'sbatch' if argv[0] in SLURM_QUERIES else 'qsub'}") from None


SLURM_QUERIES = ("sinfo", "scontrol", "sacctmgr")


def exported(lists: list[str]) -> dict[str, str]:
    """NAME=value items of comma lists (qsub -v, sbatch --export), the last one of a name winning."""
    values: dict[str, str] = {}
    for item in ",".join(lists).split(","):
        name, sep, value = item.strip().strip("'\"").partition("=")
        if sep:
            values[name] = value.strip("'\"")
    return values


def count(value: str | None) -> int | None:
    """A per-node count as the scheduler spells it: "4", "gpu:4", "a100:4" -> 4; None when not a count."""
    if value is None:
        return None
    match = re.fullmatch(r"(?:[\w-]+:)*(\d+)", value)
    return int(match.group(1)) if match else None


def slurm_config() -> dict[str, str]:
    """``scontrol show config``'s "Name = value" lines."""
    done = run(["scontrol", "show", "config"])
    config = {}
    for line in done.stdout.splitlines():
        name, sep, value = line.partition("=")
        if sep:
            config[name.strip()] = value.strip()
    return config


def enforces_associations(enforce: str) -> bool:
    # slurm.conf(5), AccountingStorageEnforce: limits, qos and wckeys set associations; safe sets limits and
    # associations; all is every one of them. With associations, "no new job is allowed to run unless a
    # corresponding association exists"
    words = {w.strip().lower() for w in enforce.split(",")}
    return bool(words & {"associations", "limits", "qos", "wckeys", "safe", "all"})


def check_slurm(options: list[str], job: Path, env: dict[str, str]) -> None:
    given: dict[str, list[str]] = read_options(header_words(job, "#SBATCH"), SLURM_OPTIONS)
    for name, variable in SLURM_ENV.items():  # the environment overrides the header
        if env.get(variable):
            given[name] = [env[variable]]
    for name, values in read_options(options, SLURM_OPTIONS).items():  # the command line overrides both
        given[name] = values
    last = {name: values[-1] for name, values in given.items()}

    partition = last.get("partition")
    if partition:
        for name in partition.split(","):  # sbatch takes a list: the job runs in whichever starts it first
            # -p lists a hidden partition too (src/sinfo/opts.c: -p sets all_flag; -a with -p is refused as
            # "Conflicting options")
            done = run(["sinfo", "-h", "-p", name, "-o", "%P"])
            if done.returncode != 0 or not done.stdout.strip():
                raise BadInput(f"partition '{name}' does not exist on this cluster (sinfo -s lists them): "
                               f"pass -p <partition>, or export SBATCH_PARTITION=<partition>")

    user = env.get("USER") or env.get("LOGNAME") or ""
    account = last.get("account")
    config = slurm_config()
    has_accounting = config.get("AccountingStorageType", "accounting_storage/none") != "accounting_storage/none"
    enforced = enforces_associations(config.get("AccountingStorageEnforce", "none"))
    # an account without an association is refused only where associations are enforced: elsewhere slurmctld takes
    # the job and charges the user's default account (src/slurmctld/job_mgr.c, "has no association ... using
    # default account")
    if account and has_accounting and enforced:
        done = run(["sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", f"account={account}", "format=Account"])
        if done.returncode == 0 and not done.stdout.strip():
            raise BadInput(f"account '{account}' is not one of yours here (sacctmgr -n show assoc user={user} "
                           f"format=account lists them): pass -A <account>, or export SBATCH_ACCOUNT=<account>")
    if not account and enforced:
        done = run(["sacctmgr", "-n", "-P", "show", "user", user, "format=DefaultAccount"])
        if done.returncode == 0 and not done.stdout.strip():  # sacctmgr failing (slurmdbd down) refuses nothing
            raise BadInput(f"this cluster charges every job to an account and {user or 'you'} has no default one: "
                           f"pass -A <account>, or export SBATCH_ACCOUNT=<account> (sacctmgr -n show assoc "
                           f"user={user} format=account lists yours)")

    # the launcher the job will see: --export's values, and the submitting shell's unless --export leaves out ALL
    # (sbatch's default is ALL; NONE or a list without ALL hands on only what it names)
    export = last.get("export")
    items = [w.strip().upper() for w in export.split(",")] if export else ["ALL"]
    launcher = exported([export or ""]).get("DISTLAB_LAUNCHER") or (
        env.get("DISTLAB_LAUNCHER") if "ALL" in items else None) or "srun"
    gpus, tasks = count(last.get("gpus-per-node")), count(last.get("ntasks-per-node"))
    if launcher == "srun" and gpus and tasks and gpus != tasks:
        raise BadInput(f"--ntasks-per-node={tasks} but --gpus-per-node={gpus}: one task a GPU, ask "
                       f"--ntasks-per-node={gpus} (or DISTLAB_LAUNCHER=torchrun: one agent a node)")


def select_fields(select: str) -> dict[str, str]:
    """``-l select=2:ncpus=64:ngpus=4:mpiprocs=4``'s first chunk, as name -> value (the count as "count")."""
    chunk = select.split("+")[0].split(":")
    fields = {"count": chunk[0]} if chunk and chunk[0].isdigit() else {}
    fields.update(part.split("=", 1) for part in chunk if "=" in part)
    return fields


def check_pbs(options: list[str], job: Path, env: dict[str, str]) -> None:
    header = header_words(job, "#PBS")
    given = read_options(header, PBS_OPTIONS)
    for name, values in read_options(options, PBS_OPTIONS).items():
        given[name] = given.get(name, []) + values  # -l adds resources: the command line's come last and win
    # -l takes a comma list of resources (select=...,place=scatter): each one on its own
    given["select"] = [r for value in given.get("select", []) for r in value.split(",")]
    queue = (given.get("queue") or [None])[-1]
    if queue:
        name = queue.split("@")[0]
        if name:
            done = run(["qstat", "-Q", name])
            if done.returncode != 0:
                raise BadInput(f"queue '{name}' does not exist here (qstat -Q lists them): pass -q <queue>")
    if not given.get("account") and env.get("DISTLAB_REQUIRE_ACCOUNT", "1") != "0":
        raise BadInput("no account: pass -A <project> (qsub -A $PBS_ACCOUNT; the jobs carry none), or "
                       "DISTLAB_REQUIRE_ACCOUNT=0 where your site charges no project")
    selects = [v[len("select="):] for v in given.get("select", []) if v.startswith("select=")]
    # the launcher the job will see: qsub hands the job -v's variables, and the submitting shell's only with -V
    launcher = exported(given.get("variables", [])).get("DISTLAB_LAUNCHER") or (
        env.get("DISTLAB_LAUNCHER") if "-V" in header + options else None) or "mpiexec"
    if selects and launcher == "mpiexec":
        fields = select_fields(selects[-1])
        gpus, ranks = count(fields.get("ngpus")), count(fields.get("mpiprocs"))
        if gpus and ranks and gpus != ranks:
            raise BadInput(f"select={selects[-1]}: mpiprocs={ranks} but ngpus={gpus}: one rank a GPU, ask "
                           f"mpiprocs={gpus} (or -v DISTLAB_LAUNCHER=torchrun: one agent a node)")


def submit(argv: list[str], env: dict[str, str] | None = None) -> int:
    """Check the submission; then sbatch or qsub it with the same words. The scheduler's exit code."""
    env = dict(os.environ if env is None else env)
    options, job, _ = split_command_line(argv)
    if not job.is_file():
        raise BadInput(f"{job}: no such job file (run from the repository's root: slurm/NN_name.sbatch, pbs/NN_name.pbs)")
    if job.suffix == ".sbatch":
        check_slurm(options, job, env)
        command = "sbatch"
    else:
        check_pbs(options, job, env)
        command = "qsub"
    import subprocess

    try:
        return subprocess.run([command, *argv]).returncode
    except FileNotFoundError:
        raise BadInput(f"{command} not found: submit from a login node of the cluster, where {command} is on PATH") from None


# ---------------------------------------------------------------------------------------------------------------
# What a job reads after its launches: walltimes, NCCL's lines, a run's metrics
# ---------------------------------------------------------------------------------------------------------------
def seconds(duration: str) -> int:
    """PBS's durations, [[HH:]MM:]SS -> seconds; ValueError for anything else."""
    parts = duration.split(":")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() and p.isascii() for p in parts):
        raise ValueError(f"not a duration: {duration!r}")
    total = 0
    for part in parts:
        total = total * 60 + int(part)
    return total


def read_lines(paths: list[str]) -> list[str]:
    lines: list[str] = []
    for path in paths:
        try:
            lines += Path(path).read_text(errors="replace").splitlines()
        except OSError:
            pass  # a rank that wrote no file
    return lines


def last_match(pattern: str, lines: list[str], flags: int = 0) -> str:
    found = ""
    for line in lines:
        for match in re.finditer(pattern, line, flags):
            found = match.group(1)
    return found


def nccl_transport(lines: list[str]) -> str:
    """The network NCCL (or RCCL, which keeps NCCL's "NCCL INFO" lines) chose, from its NCCL_DEBUG=INFO lines:
    "OFI (aws-ofi-nccl, provider cxi)", "Socket (TCP on [0]hsn0:10.1.2.3<0>)", "IB", or "none reported". The OFI
    plugin is named as it names itself: aws-ofi-nccl's "NET/OFI Initializing aws-ofi-nccl 1.6.0", aws-ofi-rccl's
    "NET/OFI Using aws-ofi-rccl 1.4.0" ("Using " PACKAGE_STRING, ROCm/aws-ofi-rccl 17d41cb src/nccl_ofi_net.c:1120)."""
    net = last_match(r"NCCL INFO Using network (.*)", lines)
    provider = last_match(r"NET/OFI Selected provider is ([A-Za-z0-9_;+-]*)", lines, re.I)
    sockets = last_match(r"NET/Socket : Using (.*)", lines).lstrip()
    ofi = last_match(r"NET/OFI (?:Initializing|Using) (aws-ofi-[a-z]+) ", lines) or "aws-ofi-nccl"
    if "Libfabric" in net or net == "OFI":
        return f"OFI ({ofi}{', provider ' + provider if provider else ''})"
    if net == "Socket":
        return f"Socket (TCP{' on ' + sockets if sockets else ''})"
    if net:
        return net
    # a log cut short before "Using network": the plugin's own lines still tell
    if provider:
        return f"OFI ({ofi}, provider {provider})"
    if sockets:
        return f"Socket (TCP on {sockets})"
    return "none reported (NCCL_DEBUG=INFO not set, or no NCCL communicator: CPU/gloo runs)"


def nccl_details(lines: list[str]) -> list[str]:
    """Whether the network channels use GPUDirect RDMA (NCCL's src/transport/net.cc logs "Channel %02d/%d : ...
    [send] via NET/%s/%d%s..." with "/GDRDMA" when the NIC reads GPU memory directly), and which net plugin NCCL
    loaded ("NET/Plugin: Loaded net plugin %s (v%d)", src/plugin/net/net_v*.cc). A plugin NCCL cannot use is said
    two ways: up to 2.28.2 one "NET/Plugin: Failed to find ncclNetPlugin_v%d symbol." for each interface the
    library lacks (v2.27.3-1 src/plugin/net/net_v10.cc:20); from 2.28.3 one line "External network plugin %s is
    unsupported" (v2.28.3-1 src/plugin/net.cc:100). Both are recognised. RCCL loads aws-ofi-rccl's librccl-net.so and
    logs the same "Loaded net plugin" line with the name the plugin gives itself ("AWS Libfabric", v5: ROCm/rccl at
    0cbce2a7 src/net.cc:447, ROCm/aws-ofi-rccl 17d41cb src/nccl_ofi_net.c:3123, include/nccl_net.h:88), after
    "NET/Plugin: Failed to find ncclNetPlugin_v8 symbol." (net.cc:429); a library it cannot open, "NET/Plugin: No
    plugin found (librccl-net.so)" or "NET/Plugin: Plugin load returned %d : %s when loading librccl-net.so", then
    "NET/Plugin: Using internal network plugin." (net.cc:350, 352, 423)."""
    sends = sum(1 for ln in lines if re.search(r"\[send\] via NET/", ln))
    gdr = sum(1 for ln in lines if re.search(r"\[send\] via NET/.*/GDRDMA", ln))
    if sends == 0:
        out = ["GPUDirect RDMA: not reported (no network channel in the logs: one node, or NCCL_DEBUG_SUBSYS without NET)"]
    elif gdr:
        out = [f"GPUDirect RDMA: yes ({gdr} of {sends} network send channels)"]
    else:
        out = [f"GPUDirect RDMA: no (0 of {sends} network send channels: the NIC reaches GPU memory through host buffers)"]
    plugin = last_match(r"NET/Plugin: Loaded net plugin (.*)", lines)
    missing = next((m.group(0) for ln in lines for m in [re.search(
        r"NET/Plugin: Failed to find ncclNetPlugin_v[0-9]+ symbol|External network plugin .* is unsupported", ln)] if m), "")
    unopened = last_match(r"NET/Plugin: (No plugin found \(.*\)|Plugin load returned .* when loading \S+)", lines)
    if plugin:
        out.append(f"net plugin: {plugin}")
    elif unopened:
        out.append(f"net plugin: none loaded ({unopened}: the library is not on LD_LIBRARY_PATH, or cannot be "
                   "opened; the internal network plugin is used)")
    elif missing:
        out.append(f"net plugin: none loaded ({missing.removeprefix('NET/Plugin: ')}: a plugin older than this "
                   "NCCL's interface, or not a net plugin; NCCL falls back to its own sockets)")
    else:
        out.append("net plugin: none reported")
    return out


def nccl_warnings(folder: str) -> list[str]:
    """NCCL's WARN lines of the job, which go only to the per-rank NCCL_DEBUG_FILE files in the run folder (not the
    job's output): the first five, each with its file, and how many there are in all. Nothing when there are none."""
    files = sorted(p for p in Path(folder).glob("*")) if Path(folder).is_dir() else []
    found = [(p.name, ln) for p in files for ln in read_lines([str(p)]) if " NCCL WARN " in ln]
    if not found:
        return []
    return [f"NCCL WARN lines: {len(found)}, in {folder}/ (one file a rank); the first:",
            *(f"    {name}:{line}" for name, line in found[:5])]


def run_complete(metrics: str) -> bool:
    """A run is complete when its metrics say so: checks, all passed, and not stopped early (deadline, signal)."""
    import json

    try:
        m = json.loads(Path(metrics).read_text())
    except (OSError, ValueError):
        return False
    checks = m.get("checks")
    return not m.get("extra", {}).get("stopped_by") and bool(checks) and all(c["passed"] for c in checks)


# PBS's SIGKILL after its TERM, in OpenPBS's MoM (cd7ab5eda). The MoM polls a job's resources every MIN_CHECK_POLL_TIME
# to MAX_CHECK_POLL_TIME s (src/include/mom_func.h:413-414); each poll lengthens the next by INC_CHECK_POLL
# (src/resmom/mom_main.c:4114). tests/unit/test_chapter_text_12.py transcribes the same loop on its own and compares.
MIN_CHECK_POLL_TIME, MAX_CHECK_POLL_TIME = 10, 120
INC_CHECK_POLL = (MAX_CHECK_POLL_TIME - MIN_CHECK_POLL_TIME + 19) // 20
PBS_DEFAULT_KILL_DELAY = 10  # a queue without kill_delay (src/server/req_runjob.c:948, 991-994)


def mom_sigkill_after(last_poll_before: int, kill_delay: int) -> int:
    """Seconds from a TERM to the MoM's SIGKILL, whole seconds. terminate_job sends the TERM, sets the kill time to
    now + kill_delay (src/resmom/requests.c:1863) and the next poll's interval to MIN_CHECK_POLL_TIME (:1876-1881).
    The loop polls once the last poll + the interval has passed (mom_main.c:8628; one already due runs at once),
    lengthens the interval (:8636-8639), and sends SIGKILL at the first poll at or after the kill time (:8685-8688).
    last_poll_before: seconds from the last poll to the TERM; 0 for the walltime's TERM, sent during a poll (:8654,
    :8865); anything for a qdel's (src/server/req_delete.c:1092)."""
    poll, interval = -last_poll_before, MIN_CHECK_POLL_TIME
    while True:
        poll = max(poll + interval, 0)
        interval = min(interval + INC_CHECK_POLL, MAX_CHECK_POLL_TIME)
        if poll >= kill_delay:
            return poll


def pbs_kill_delay(kill_delay: str = "") -> str:
    """When PBS's SIGKILL follows its TERM, in the words of the jobs' TERM trap (jobs/common.sh, distlab_on_sigterm):
    after the walltime's TERM (sent at a poll) and after a qdel's (between two polls), for the queue's kill_delay,
    or PBS's 10 s where the queue sets none ("")."""
    if kill_delay and not kill_delay.isdigit():
        raise BadInput(f"pbs-kill-delay: {kill_delay!r} is not a number of seconds")
    delay = int(kill_delay) if kill_delay else PBS_DEFAULT_KILL_DELAY
    walltime = mom_sigkill_after(0, delay)
    qdel = [mom_sigkill_after(last, delay) for last in range(MAX_CHECK_POLL_TIME)]
    whose = f"the queue's kill_delay, {delay} s" if kill_delay else "kill_delay, 10 s unless the queue sets another"
    return (f"about {walltime} s after the walltime's TERM, {min(qdel)} to {max(qdel)} s after a qdel's ({whose}, at "
            "the MoM's next poll; none after qsig -s TERM)")


def chain_vars(pairs: list[str]) -> str:
    """NAME=VALUE words -> one list for ``qsub -v`` or ``sbatch --export``, which both split at every comma outside
    quotes (qsub(1B), -v: "the value must be enclosed in single or double quotes"; Slurm's env.c find_quote_token): a
    value's commas (a list, such as DISTLAB_ONLY=a.py,b.py) become colons, which the jobs read as the same list, and
    no quoting has to survive the shell."""
    out = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.isidentifier():
            raise BadInput(f"chain-vars: {pair!r} is not NAME=VALUE")
        out.append(f"{name}={value.replace(',', ':')}")
    return ",".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "submit":
            return submit(rest)
        if command == "seconds":
            try:
                print(seconds(rest[0] if rest else ""))
            except ValueError:
                return 1
        elif command == "transport":
            print(nccl_transport(read_lines(rest)))
        elif command == "details":
            print("\n".join(nccl_details(read_lines(rest))))
        elif command == "warnings":
            lines = nccl_warnings(rest[0] if rest else "")
            if lines:
                print("\n".join(lines))
        elif command == "complete":
            return 0 if rest and run_complete(rest[0]) else 1
        elif command == "chain-vars":
            print(chain_vars(rest))
        elif command == "pbs-kill-delay":
            print(pbs_kill_delay(rest[0] if rest else ""))
        else:
            raise BadInput(f"unknown subcommand {command!r}: python -m coursetools.jobs --help lists them")
    except BadInput as exc:
        print(f"distlab: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
