"""Engine replacement on a GPU cluster (``--vllm.max_restarts``; docs/gpu_check.md, "Engine replacement on your
cluster"): the one check a user runs on their own machine before relying on it, where the CPU suite cannot go:
two vLLM engines of tensor-parallel size 2 on CUDA, the weight sync over NCCL, one engine's GPU worker SIGKILLed
and the other engine's vLLM processes SIGSTOPped, each mid-rollout with requests in flight.

    OPENRLHF_ESS_CLUSTER_MODEL=/path/to/Qwen2.5-0.5B-Instruct python -m pytest -m cluster \\
        tests/cluster/test_replacement_on_cluster.py -v

It runs the real CLI (``tests/helpers/faults.py::run_cli_tracked``, every process of the run tracked by PID) on the
model the variable names, five steps of 8 prompts with the reward file ``tests/cluster/kill_reward.py``, which
makes the faults at points of the run's own progress (the audit trail's batch files), never by the clock, and
finds the engine's processes by PID (its EngineCore child, and the Ray actors that EngineCore created: vLLM's
tensor-parallel workers), never by name. Skipped, saying why, unless the variable is set, Ray and vLLM are
installed, torch sees :data:`GPUS_NEEDED` CUDA GPUs and vLLM is its CUDA build (:func:`skip_reason`). The
command is checked on any machine by ``tests/cluster/test_replacement_command.py`` (parsed and validated as on a
GPU machine, pre-flight passed on the tiny model). Not run on a GPU cluster yet.
"""

from __future__ import annotations

import collections
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

import pytest

MODEL_ENV = "OPENRLHF_ESS_CLUSTER_MODEL"
ENGINES, TP = 2, 2
POLICY_GPUS = 1  # --actor.num_gpus_per_node 1: the engines cannot share it (--train.colocate_all is refused)
GPUS_NEEDED = ENGINES * TP + POLICY_GPUS
STEPS, PROMPTS_PER_STEP, SAMPLES = 5, 8, 4
N_PROMPTS = STEPS * PROMPTS_PER_STEP
WATCHDOG_S = 60  # a healthy GPU engine with requests in flight streams a token every few milliseconds
MAX_RESTARTS = 2
# Kill 0 in rollout 2 or later (after step 1's batch), kill 1 in rollout 3 or later on the other engine; five steps
# leave syncs after both, so the NCCL group is formed again with each replacement in it.
KILLS = [("batch_v0.pt", "worker"), ("batch_v1.pt", "stop")]
MEMORY_MARGIN_MIB = 512  # free memory per GPU after the run, against before it (the GPUs to this test alone)
MEMORY_SETTLE_S = 60  # the driver frees an ended process's memory within seconds; looked at every 5 s up to this
RUN_TIMEOUT_S = 2400
# vLLM's EngineCore a child process of the engine actor (vLLM's default; set, so that a shell's 0 cannot change the
# layout the reward file finds the engine's processes in)
RUN_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}

HERE = os.path.dirname(os.path.abspath(__file__))
REWARD_SOURCE = os.path.join(HERE, "kill_reward.py")

# Ten topics and four lengths of answer, interleaved, so that every rollout batch (and each engine's share of it)
# mixes one-word answers with long ones: the short ones' rewards are called while the long ones are still generating.
TOPICS = [
    "the sky",
    "the ocean",
    "a forest",
    "a desert",
    "a city at night",
    "a mountain",
    "a river",
    "a library",
    "a volcano",
    "a garden",
]
STYLES = [
    "Answer with one word only: name a colour you associate with {topic}.",
    "In one short sentence, describe {topic}.",
    "Describe {topic} in three sentences.",
    "Write a detailed paragraph of about 200 words about {topic}.",
]
TAG = re.compile(r"\[q(\d{2})\]")  # each prompt's tag, first in its text: found again in the trained sequences

# replacement_sync.py::ReplacementSync.regroup_if_replaced
REGROUP = re.compile(
    r"weight sync group formed again with every vLLM engine after (\d+) engine restart\(s\) "
    r"\(--vllm\.sync_backend nccl\)"
)
# replacement_sync.py::ReplacementSync.startup_regroup_probe, in the start-up self-check's passing line
STARTUP_REGROUP = (
    f"replacement: the weight sync group formed a second time with {ENGINES} engine(s) and a probe broadcast through "
    "it arrived intact in every worker"
)
# ppo_trainer.py: the check of the replaced engines before their samples are trained
CHECKED = re.compile(
    r"replaced vLLM engine\(s\) \[([0-9, ]+)\]: the weight sync check \(checksums now, canary\) passed on every "
    r"engine at version (\d+)"
)


# ---------------------------------------------------------------- when it runs


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()  # no CUDA context is created


def vllm_device() -> str:
    """vLLM's platform here ("cuda" for its CUDA build), asked in a child process (vLLM's import is heavy and sets
    process-wide state); a vLLM that does not import says so."""
    code = "from vllm.platforms import current_platform as p; print(p.device_type)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return f"none (vLLM does not import: {last})"
    return out.stdout.strip().splitlines()[-1]


def skip_reason(environ=None) -> Optional[str]:
    """Why this machine cannot run the check (None: it can), cheapest question first."""
    environ = os.environ if environ is None else environ
    if not environ.get(MODEL_ENV):
        return (
            f"{MODEL_ENV} is not set: name a small instruct model with a chat template (a local HF folder, e.g. "
            "Qwen2.5-0.5B-Instruct) to run this cluster check (docs/gpu_check.md)"
        )
    missing = [name for name in ("ray", "vllm") if importlib.util.find_spec(name) is None]
    if missing:
        return f"needs {' and '.join(missing)} installed (a GPU cluster with vLLM's CUDA build and Ray)"
    found = gpu_count()
    if found < GPUS_NEEDED:
        return (
            f"needs {GPUS_NEEDED} CUDA GPUs on this machine ({ENGINES} engines x tensor-parallel {TP} + "
            f"{POLICY_GPUS} for the policy); torch sees {found}"
        )
    device = vllm_device()
    if device != "cuda":
        return f"needs vLLM's CUDA build; this vLLM's platform is {device!r}"
    return None


# ---------------------------------------------------------------- the run


def prompts() -> List[str]:
    return [
        f"[q{i:02d}] " + STYLES[i % len(STYLES)].format(topic=TOPICS[i // len(STYLES) % len(TOPICS)])
        for i in range(N_PROMPTS)
    ]


def write_inputs(run_dir: str) -> Dict[str, str]:
    """The run's inputs in ``run_dir/inputs`` (outside every output folder): the prompts, the reward file and its
    plan (``tests/cluster/kill_reward.py``)."""
    folder = os.path.join(run_dir, "inputs")
    os.makedirs(folder, exist_ok=True)
    paths = {
        "prompts": os.path.join(folder, "prompts.jsonl"),
        "reward": os.path.join(folder, "reward.py"),
        "audit": os.path.join(run_dir, "audit"),
    }
    with open(paths["prompts"], "w") as f:
        for text in prompts():
            f.write(json.dumps({"input": text}) + "\n")
    shutil.copyfile(REWARD_SOURCE, paths["reward"])
    with open(os.path.join(folder, "plan.json"), "w") as f:
        json.dump({"run_dir": run_dir, "audit": paths["audit"], "tp": TP, "kills": KILLS}, f)
    return paths


def cluster_args(model: str, inputs: Dict[str, str], run_dir: str) -> List[str]:
    """The CLI's flags: the policy on one GPU, two engines of tensor-parallel size 2 on four more, NCCL weight sync,
    two replacements allowed, a hang found within :data:`WATCHDOG_S`; five steps of 8 prompts x 4 samples. The
    engine runs as users run it (CUDA graphs, the default memory share); the trainer uses sdpa attention, so that
    the check does not need flash-attn."""
    from benchmarks.common import ray_temp_dir

    return [
        "--ray.accelerator",
        "cuda",
        "--actor.model_name_or_path",
        model,
        "--data.prompt_dataset",
        inputs["prompts"],
        "--data.input_key",
        "input",
        "--data.apply_chat_template",
        "--data.max_samples",
        str(N_PROMPTS),
        "--reward.remote_url",
        inputs["reward"],
        "--algo.advantage.estimator",
        "reinforce_baseline",
        "--algo.kl.init_coef",
        "0",
        "--actor.num_nodes",
        "1",
        "--actor.num_gpus_per_node",
        str(POLICY_GPUS),
        "--vllm.num_engines",
        str(ENGINES),
        "--vllm.tensor_parallel_size",
        str(TP),
        "--vllm.sync_backend",
        "nccl",
        "--vllm.max_restarts",
        str(MAX_RESTARTS),
        "--vllm.watchdog_s",
        str(WATCHDOG_S),
        "--rollout.batch_size",
        str(PROMPTS_PER_STEP),
        "--rollout.n_samples_per_prompt",
        str(SAMPLES),
        "--rollout.micro_batch_size",
        "8",
        "--train.batch_size",
        str(PROMPTS_PER_STEP * SAMPLES),
        "--train.micro_batch_size",
        "8",
        "--rollout.max_new_tokens",
        "256",
        "--data.max_len",
        "512",
        "--actor.adam.lr",
        "1e-6",
        "--ds.zero_stage",
        "2",
        "--ds.attn_implementation",
        "sdpa",
        "--algo.prox_audit_dir",
        inputs["audit"],
        "--ckpt.output_dir",
        os.path.join(run_dir, "ckpt"),
        "--logger.tensorboard_dir",
        os.path.join(run_dir, "tb"),
        "--ray.temp_dir",
        ray_temp_dir(run_dir),
    ]


# ---------------------------------------------------------------- what it left


MEASURE = (
    "import json, torch; c = torch.cuda; print(json.dumps([c.mem_get_info(i)[0] for i in range(c.device_count())]))"
)


def free_memory() -> List[int]:
    """Free bytes on every GPU, read by a child process (its CUDA contexts end with it: none is held across the run;
    the before and after readings each include the same one)."""
    out = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_not_back(before: List[int], after: List[int]) -> List[str]:
    """The GPUs whose free memory after the run is more than :data:`MEMORY_MARGIN_MIB` below what it was before."""
    margin = MEMORY_MARGIN_MIB << 20
    return [
        f"GPU {i}: {b / 2**20:,.0f} MiB free before, {a / 2**20:,.0f} MiB after"
        for i, (b, a) in enumerate(zip(before, after))
        if a < b - margin
    ]


def trained_by_tag(audit: str, tokenizer) -> collections.Counter:
    """Prompt tag -> samples trained, from the audit trail's batches (the chat template around each prompt, the
    response after it: the tag is the first in the sequence)."""
    import torch

    count = collections.Counter()
    for path in sorted(glob.glob(os.path.join(audit, "batch_v*.pt"))):
        for mb in torch.load(path, map_location="cpu")["micro_batches"]:
            for seq, mask in zip(mb["sequences"], mb["attention_mask"]):
                text = tokenizer.decode(seq[mask.bool()], skip_special_tokens=True)
                tag = TAG.search(text)
                count[tag.group(0) if tag else f"(no tag) {text[:80]!r}"] += 1
    return count


def replacements(log: str) -> List[Dict]:
    """Every ``engine replaced`` line (``benchmarks/engine_restart.py::replacements``, which the CPU benchmark reads
    too): engine, old and new pid, cause, version, seconds."""
    from benchmarks.engine_restart import replacements as read

    return read(log)


def read_kill(run_dir: str, n: int) -> Optional[dict]:
    """Kill ``n``'s record, or None if the reward never made it."""
    marker = os.path.join(run_dir, f"killed{n}")
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        return json.load(f)


def looks(run_dir: str) -> str:
    path = os.path.join(run_dir, "looks")
    return open(path).read()[-6000:] if os.path.exists(path) else "(no look: no kill was ever due)"


# ---------------------------------------------------------------- the check


@pytest.mark.cluster
@pytest.mark.real_stack
@pytest.mark.timeout(RUN_TIMEOUT_S + 600)
def test_two_tp2_engines_one_worker_killed_one_hung_are_replaced_over_nccl(tmp_path):
    """Two engines x TP 2, NCCL sync, --vllm.max_restarts 2 --vllm.watchdog_s 60: one tensor-parallel worker of one
    engine SIGKILLed in rollout 2 or later, every vLLM process of the other engine SIGSTOPped in rollout 3 or later,
    each with requests in flight. The run completes (exit 0); two ``engine replaced`` lines name the two engines by
    the pids of the engine actors the reward ran in (the stopped one as hung, found by the watchdog; the killed one
    as a dead engine core, or as hung if vLLM did not notice its dead worker); the start-up probe formed the NCCL
    group a second time, and after the replacements the group was formed again with both in it (``after 2 engine
    restart(s)``); the sync check passed on the replaced engines before their samples were trained; the run counted
    2 restarts, none failed, calls sent again; every prompt was trained exactly 4 times (the audit trail); the
    signalled processes were the run's own and no process of the run is left, nor a /dev/shm file; and the free
    memory of every GPU came back to within 512 MiB of what it was before the run."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    from transformers import AutoTokenizer

    from tests.helpers.faults import run_cli_tracked
    from tests.test_engine_replacement import _step_metrics

    model = os.environ[MODEL_ENV]
    run_dir = str(tmp_path)
    inputs = write_inputs(run_dir)
    before = free_memory()
    trees = []
    run = run_cli_tracked(
        cluster_args(model, inputs, run_dir),
        run_dir,
        timeout=RUN_TIMEOUT_S,
        env=RUN_ENV,
        during=lambda proc, tree: trees.append(tree),
    )
    log = run.log
    # Every check is made and every failure reported at once (one run on a cluster is expensive)
    problems: List[str] = []

    def expect(ok, what) -> bool:
        if not ok:
            problems.append(str(what))
        return bool(ok)

    expect(not run.timed_out and run.rc == 0, f"the run did not complete: exit {run.rc}, timed out: {run.timed_out}")

    # the faults were made as planned: on two engines, with requests in flight, on the processes the reward found
    worker, stop = (read_kill(run_dir, n) for n in range(len(KILLS)))
    if expect(worker and stop, f"kills made: {[worker, stop]}; the reward's looks:\n{looks(run_dir)}"):
        expect(worker["actor_id"] != stop["actor_id"], f"both kills on one engine: {worker}, {stop}")
        expect(worker["inflight"] > 0 and stop["inflight"] > 0, f"a kill without requests in flight: {worker}, {stop}")
        expect(len(worker["workers"]) == TP and worker["signalled"] == worker["workers"][-1:], worker)
        expect(stop["signalled"] == stop["core"] + stop["workers"] and len(stop["workers"]) == TP, stop)

    # both engines replaced, each named by the pid of the engine actor the fault hit
    replaced = replacements(log)
    by_pid = {r["old_pid"]: r for r in replaced}
    killed, hung = (by_pid.get(k["pid"]) if k else None for k in (worker, stop))
    if expect(
        len(replaced) == 2 and killed and hung and killed["engine"] != hung["engine"],
        f"replacements {replaced}, the engines signalled {[k and k['pid'] for k in (worker, stop)]}",
    ):
        found_hung = f"the vLLM engine {hung['engine']} (RolloutRayActorImpl, pid {stop['pid']}) hung: "
        expect(hung["cause"].startswith(found_hung) and f"past --vllm.watchdog_s {WATCHDOG_S}" in hung["cause"], hung)
        # a dead worker: its EngineCore fails and the actor ends itself (vllm_engine.py::_exit_if_engine_dead); had
        # vLLM not noticed, the watchdog would have found the engine hung
        core_died = "its vLLM engine core died ("
        also_hung = f"the vLLM engine {killed['engine']} (RolloutRayActorImpl, pid {worker['pid']}) hung: "
        expect(killed["cause"].startswith((core_died, also_hung)), killed)

    # the NCCL group: formed a second time at start-up (the probe), and again after the replacements
    expect(STARTUP_REGROUP in log, "no start-up probe of a re-formed weight sync group in the log")
    regroups = [int(m[1]) for m in REGROUP.finditer(log)]
    expect(
        regroups and regroups == sorted(set(regroups)) and regroups[-1] == MAX_RESTARTS,
        f"the weight sync group formed again after {regroups} restart(s), not last after {MAX_RESTARTS}",
    )

    # the replaced engines checked before their samples were trained; the run's counts
    checked = {int(i) for m in CHECKED.finditer(log) for i in m[1].split(",")}
    expect(len(checked) == 2 and checked == {r["engine"] for r in replaced}, f"engines checked {checked}")
    faults = {}
    if expect("Global step" in log, "no training step logged"):
        faults = _step_metrics(log)
        expect(faults.get("faults/engine_restarts") == 2 and faults.get("faults/restarts_failed") == 0, faults)
        expect(faults.get("faults/prompts_requeued", 0) >= 2, faults)

    # no worker left: the signalled processes were the run's own (tracked by PID), and none of the run is alive
    (tree,) = trees
    signalled = [pid for k in (worker, stop) if k for pid in k["signalled"] + [k["pid"]]]
    expect(all(pid in tree.seen for pid in signalled), f"signalled {signalled}, not all among the run's processes")
    expect(not run.leftovers, f"processes of the run left (then ended by the test): {run.leftovers}")
    expect(not run.shm_left, f"/dev/shm files of the run left behind: {run.shm_left}")

    # free GPU memory back (read before anything else of this test could touch a GPU)
    deadline = time.monotonic() + MEMORY_SETTLE_S
    after = free_memory()
    while memory_not_back(before, after) and time.monotonic() < deadline:
        time.sleep(5)
        after = free_memory()
    not_back = memory_not_back(before, after)
    expect(not not_back, f"free GPU memory not back within {MEMORY_MARGIN_MIB} MiB: " + "; ".join(not_back))

    # every prompt trained exactly once (its 4 samples)
    if glob.glob(os.path.join(inputs["audit"], "batch_v*.pt")):
        trained = trained_by_tag(inputs["audit"], AutoTokenizer.from_pretrained(model))
        expected = collections.Counter({f"[q{i:02d}]": SAMPLES for i in range(N_PROMPTS)})
        expect(trained == expected, f"samples trained per prompt (4 each expected): {dict(trained)}")
    else:
        expect(False, "no batch in the audit trail")

    print(
        json.dumps(
            {
                "replaced": replaced,
                "regroups": regroups,
                "faults": faults,
                "free_mib_before": [b >> 20 for b in before],
                "free_mib_after": [a >> 20 for a in after],
            }
        )
    )
    assert not problems, "\n".join(problems) + "\n--- the run's log, last lines ---\n" + log[-8000:]
