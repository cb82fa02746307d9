"""How long an engine replacement takes, and what it costs the run (``--vllm.max_restarts``, docs/faults.md §1c).

    python -m benchmarks.engine_restart [--repeats 3] [--out docs/engine_restart]

The tiny sync run through the real CLI (Ray + vLLM + DeepSpeed), four steps of 8 prompts, one after another:
``--repeats`` runs whose engine fails three times, each with requests in flight (its actor process SIGKILLed in
the second rollout, its vLLM engine core SIGKILLed in the third, its vLLM processes SIGSTOPped in the fourth, found
by ``--vllm.watchdog_s 10``), and as many runs with no failure. Writes ``results.json``: every replacement's
seconds (the keeper's, from the new process's start to its first call served, weights loaded), cause and calls
sent again, and each run's wall-clock from launch to exit, so that the cost of a failure to the run (the difference
of the two kinds of run, over three failures) stands beside the restart itself; and prints the table that
docs/faults.md quotes. On a GPU cluster, ``--gpu --model ...`` runs the same on a real model (docs/faults.md gives
the formula it checks).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import add_model_arguments, check_model_arguments, run_cli, world_for  # noqa: E402
from benchmarks.common import run_flags as common_flags  # noqa: E402

# A reward file for --reward.remote_url (upstream calls it inside the engine actor). It kills the engine at points
# read from the run's own progress on disk, not the clock: the audit trail's batch_v<k>.pt (step k + 1's batch made:
# the next reward calls are rollout k + 2's). Each kill happens only while
# requests are in flight in the engine's vLLM (found by the garbage collector: test-only), once (a marker file, as
# the restarted engine imports this file again). Kind "actor": SIGKILL of the engine actor's own process (this one);
# "core": SIGKILL of its vLLM engine core (the processes below it), the actor lives on; "stop": SIGSTOP of them (a
# stuck kernel or a deadlock as the engine's own processes see it: only the watchdog finds it).
KILL_ENGINE_REWARD = """
import gc
import os
import signal

import psutil
import torch

KILLS = {kills!r}  # [(the audit file that must exist, kind)]


_ENGINE = []


def _inflight():
    if not _ENGINE:  # found once, at the first call (a search of the heap takes longer than a tiny rollout)
        _ENGINE.extend(obj for obj in gc.get_objects() if type(obj).__name__ == "AsyncLLM")
    return _ENGINE[0].output_processor.get_num_unfinished_requests() if _ENGINE else 0  # 0: pre-flight's dry call


def _engine_process(p):
    # a child of the engine actor to signal: not multiprocessing's resource tracker, nor one that has exited (a
    # zombie until its parent reaps it, which has no command line)
    try:
        return p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())
    except psutil.Error:
        return False


def reward_func(queries, prompts, labels):
    _inflight()
    for n, (after, kind) in enumerate(KILLS):
        marker = os.path.join({run_dir!r}, f"killed{{n}}")
        if os.path.exists(marker) or not os.path.exists(os.path.join({audit!r}, after)):
            continue
        inflight = _inflight()
        with open(os.path.join({run_dir!r}, "looks"), "a") as f:  # what each look found, for the test's report
            f.write(f"{{n}} {{os.getpid()}} {{inflight}}\\n")
        if not inflight:
            break
        below = [p for p in psutil.Process().children() if _engine_process(p)]
        with open(marker, "w") as f:
            f.write(f"{{kind}} {{os.getpid()}} {{inflight}} " + " ".join(str(p.pid) for p in below))
        if kind == "actor":
            os.kill(os.getpid(), signal.SIGKILL)
        for p in below:
            p.send_signal(signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
        break
    rewards = torch.tensor([0.5] * len(queries))
    return {{"rewards": rewards, "scores": rewards, "extra_logs": {{}}}}
"""


KILLS = [("batch_v0.pt", "actor"), ("batch_v1.pt", "core"), ("batch_v2.pt", "stop")]
PROMPTS = 32  # four steps of 8 prompts: the three failures come in rollouts 2, 3 and 4
REPLACED = re.compile(  # engine_keeper.py::restart_line
    r"engine replaced: engine (\d+) \(pid (\d+)\): (.*); replaced by pid (\d+) at weight version (\d+) in ([0-9.]+) s"
)


def write_kill_reward(run_dir: str, audit: str, kills) -> str:
    """The reward file for ``--reward.remote_url`` that makes ``kills`` [(audit file, kind)] in ``run_dir``."""
    path = os.path.join(run_dir, "reward.py")
    with open(path, "w") as f:
        f.write(KILL_ENGINE_REWARD.format(kills=kills, run_dir=run_dir, audit=audit))
    return path


def replacements(log: str) -> List[Dict]:
    """Every ``engine replaced`` line of a run's log: engine, the old and new pids, cause, version, seconds."""
    return [
        {
            "engine": int(m[1]),
            "old_pid": int(m[2]),
            "cause": m[3],
            "new_pid": int(m[4]),
            "version": int(m[5]),
            "seconds": float(m[6]),
        }
        for m in map(REPLACED.search, log.splitlines())
        if m
    ]


def one_run(a, world: dict, root: str, name: str, failures: bool) -> Dict:
    run_dir = os.path.join(root, name)
    os.makedirs(run_dir)
    audit = os.path.join(run_dir, "audit")
    flags = common_flags(a, world, run_dir, PROMPTS)
    flags += ["--vllm.max_restarts", str(len(KILLS)), "--vllm.watchdog_s", "10", "--algo.prox_audit_dir", audit]
    if failures:
        flags[flags.index("--reward.remote_url") + 1] = write_kill_reward(run_dir, audit, KILLS)
        flags[flags.index("--rollout.max_new_tokens") + 1] = "48"  # responses still generating when one is scored
        flags[flags.index("--data.max_len") + 1] = "96"
    started = time.time()
    rc, log = run_cli(flags, run_dir, timeout=1800)
    wall = time.time() - started
    events = replacements(log)
    requeued = re.findall(r"'faults/prompts_requeued': ([0-9.]+)", log)
    return {
        "name": name,
        "failures": failures,
        "rc": rc,
        "wall_s": wall,
        "replacements": events,
        "prompts_requeued": float(requeued[-1]) if requeued else None,
        "command": "python -m openrlhf_ess.cli.train_ppo_ray " + shlex.join(flags),
    }


def summary(runs: List[Dict]) -> Dict:
    """Per failure kind, the restart seconds over the runs; the wall-clock of runs with and without failures."""
    kinds = {"actor": "its actor process died", "core": "its vLLM engine core died", "stop": "hung"}
    out: Dict = {"restart_seconds": {}}
    for kind, words in kinds.items():
        seconds = [e["seconds"] for r in runs for e in r["replacements"] if words in e["cause"]]
        out["restart_seconds"][kind] = seconds
    walls = {f: [r["wall_s"] for r in runs if r["failures"] is f] for f in (True, False)}
    out["wall_s"] = {"three failures": walls[True], "none": walls[False]}
    if walls[True] and walls[False]:
        out["cost_per_failure_s"] = (statistics.mean(walls[True]) - statistics.mean(walls[False])) / len(KILLS)
    return out


def table(s: Dict) -> str:
    def span(xs):
        return f"{min(xs):.1f}–{max(xs):.1f} s ({len(xs)})" if xs else "none"

    lines = ["| | seconds (runs) |", "|---|---|"]
    for kind, xs in s["restart_seconds"].items():
        lines.append(f"| restart after `{kind}` | {span(xs)} |")
    for kind, xs in s["wall_s"].items():
        lines.append(f"| run wall-clock, {kind} | {span(xs)} |")
    if "cost_per_failure_s" in s:
        lines.append(f"| the run's cost per failure (difference of the means / 3) | {s['cost_per_failure_s']:.1f} s |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind (default %(default)s)")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "engine_restart"))
    add_model_arguments(parser)
    a = parser.parse_args(argv)
    check_model_arguments(parser, a)
    root = tempfile.mkdtemp(prefix="engine_restart_")
    world = world_for(a, root, PROMPTS)
    runs = []
    for i in range(a.repeats):  # alternated, so that a drift of the machine falls on both kinds alike
        for failures in (True, False):
            run = one_run(a, world, root, f"{'failures' if failures else 'none'}_{i}", failures)
            print(json.dumps({k: run[k] for k in ("name", "rc", "wall_s", "replacements")}), flush=True)
            if run["rc"] != 0 or (failures and len(run["replacements"]) != len(KILLS)):
                raise SystemExit(f"run {run['name']} did not complete as planned; its log: {root}/{run['name']}")
            runs.append(run)
    s = summary(runs)
    os.makedirs(a.out, exist_ok=True)
    argv_text = " ".join(sys.argv[1:]) if argv is None else " ".join(argv)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(
            {"command": f"python -m benchmarks.engine_restart {argv_text}".strip(), "summary": s, "runs": runs},
            f,
            indent=1,
        )
    print(table(s))


if __name__ == "__main__":
    main()
