"""The decisive grid on the verifiable task: held-out eval accuracy of the current policy against steps and
wall-clock, sync against async, with and without corrections, several seeds.

    python -m benchmarks.rlvr_grid [--seeds 5] [--steps 200] [--configs ...] [--pin-engine-core] [--out docs/rlvr_grid]

Every run is ``examples/scripts/train_rlvr_tiny_cpu.sh`` (the task of docs/rlvr_task.md: two-digit addition,
exact-match reward, one warm-started model, 32 prompts x 32 samples per step, Adam lr 2e-4) with the run's flags
appended: the staleness level and the correction (the names of ``benchmarks/staleness.py``) and
``--train.seed 42 + seed``. The script evaluates the 1,589 held-out prompts every 25 steps at the rollout
temperature (4 samples each: ``eval/eval_default_pass1`` is the mean exact-match accuracy over 6,356 samples).
The stored grid in docs/rlvr_grid ran the earlier defaults: 197 held-out prompts (``--n-eval 100``), the warm start
to 0.27 checked every 25 steps, 32 x 8 samples at lr 1e-4 (``SAMPLES=8 LR=1e-4``).
Runs go one after another, seeds outermost, so a grid cut short still holds every configuration for the seeds it
finished. ``--n-eval``, ``--warm-target`` and ``--warm-check-every`` give the script another eval set or warm start
(its N_EVAL, WARM_TARGET, WARM_CHECK_EVERY; each run records them, with PROMPTS, SAMPLES and LR where set, as
``task_env``). ``--extra "--train.batch_size 256"`` trains each batch in 4 minibatches (AReaL's and M2PO's papers'
regime; M2PO's mask is taken once a batch, so ``--algo.m2po_tau`` refuses it): the lag table counts a version as
that many optimizer steps; give such rows their sync, run the same way, in an ``--out`` of their own. The cores are
shared by every process of a run, as a user's single machine shares them; with ``--pin-engine-core`` the engine has
core 0 to itself and everything else the other cores.

Writes into ``--out``: ``results.json`` (per run: the eval curve as [step, seconds since launch, seconds since
the first step's log, accuracy], each eval's own stamp as [step, weight version, seconds since the first step's
start] where the run logged them, the training reward per step, the mean version lag, the mean seconds per step of
each timed phase, the wall time), ``results.md`` (per configuration and seed: eval accuracy at each eval, mean eval
accuracy = AUC over steps, final accuracy, AUC against wall-clock over a common horizon, seconds to sync's final
accuracy; per configuration against sync: the gain over the start value as a multiple of sync's beside the plain
AUC's, per seed, and a frozen policy's row as the floor; where evals' stamps part from their labels; where a step's
time goes) and ``eval_steps.png`` / ``eval_wall.png`` (and, from stamped evals, ``eval_version.png`` /
``eval_time.png``: accuracy against the weight version measured and the eval's own time). The reading is written
by hand in docs/rlvr_grid.md; README's "Which to pick" and docs/staleness.md's "What to turn on" quote only figures
these files hold (tests/test_doc_figures.py checks it).

``--task target`` runs the same grid on the interior-optimum task (docs/staleness_target.md) with a held-out eval:
the random tiny model, reward 1 − |f − 0.5| / 0.5 of the response's digit fraction f, 64 training prompts x 4
samples (8 prompts per step), 4 passes (32 steps), Adam lr 1e-2 constant and 4 optimizer epochs per batch (the
regime where uncorrected async overshot), except VCPO (recipe), which takes its recipe's one step per batch. The
eval: 64 held-out prompts x 4 samples at temperature 1 every 4 steps (``eval/eval_default_pass1`` is their mean
reward). Its results go to ``--out``'s target/ and its run folders end in _target.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import scalar_events, tiny_args  # noqa: E402
from benchmarks.common import span as _span  # noqa: E402
from benchmarks.staleness import ALL_CORRECTIONS, STALENESS, config_flags, distance_stats, launch  # noqa: E402

SCRIPT = os.path.join(REPO, "examples", "scripts", "train_rlvr_tiny_cpu.sh")
EVAL = "eval/eval_default_pass1"
# The default grid: sync (no correction: every token is lag 0), and a deep async queue with each correction
DEFAULT_CONFIGS = [
    "sync | none",
    "async q8 + partial | none",
    "async q8 + partial | TIS",
    "async q8 + partial | VCPO (recipe)",
]


def parse_config(key: str):
    level, _, name = key.partition(" | ")
    if level not in STALENESS or name not in ALL_CORRECTIONS:
        raise ValueError(
            f"{key!r}: expected '<level> | <correction>' with a level of {list(STALENESS)} and a "
            f"correction of {list(ALL_CORRECTIONS)}"
        )
    return level, name


def read_run(tb_dir: str, launched: float) -> Dict:
    """One run's curves from its event files: eval as [step, s since launch, s since step 1 was logged, value] (the
    times at which the trainer logged it), and each eval's own stamp (:func:`read_eval_stamps`)."""
    reward = scalar_events(tb_dir, "train/reward")
    first = reward[0][1] if reward else launched
    evals = [[s, w - launched, w - first, v] for s, w, v in scalar_events(tb_dir, EVAL)]
    lag = read_lag(tb_dir)
    return {
        "eval": evals,
        "eval_stamps": read_eval_stamps(tb_dir),
        "reward": [[s, v] for s, _, v in reward],
        "lag_mean": statistics.mean(v for _, v in lag) if lag else None,
        "lag": lag,
        "first_step_s": first - launched,
        "timing": read_timing(tb_dir),
        "dynamics": read_dynamics(tb_dir),
        "curves": read_curves(tb_dir),
    }


def same_run(run: Dict, tb_dir: str) -> bool:
    """Whether ``tb_dir`` still holds the recorded ``run``: its training reward per step equals the record's. A run
    folder is named by configuration and seed only, so a later grid with the same workdir replaces it."""
    if not os.path.isdir(tb_dir) or not run.get("reward"):
        return False
    return [[s, v] for s, _, v in scalar_events(tb_dir, "train/reward")] == run["reward"]


def read_lag(tb_dir: str) -> List[List[float]]:
    """The measured version lag per step, [step, mean lag of its batch's tokens]: where it settles says the lag a
    row ran at (a queue fills over its first steps)."""
    return [[s, v] for s, _, v in scalar_events(tb_dir, "train/version_lag/mean")]


def read_eval_stamps(tb_dir: str) -> List[List]:
    """Each eval's own stamp, [step label, weight version, seconds], from what the eval logged itself: the weight
    version the engines held while it generated (``eval/weight_version``: the weight syncs they had received, the
    step of those weights in a run that syncs every step) and the seconds from the first step's start to the eval's
    start (``eval/wall_clock_since_step1_s``); None where the run did not log one. The step label is where the
    trainer logged the eval, which in an async run need not be the policy it measured."""
    version = {s: v for s, _, v in scalar_events(tb_dir, "eval/weight_version")}
    clock = {s: v for s, _, v in scalar_events(tb_dir, "eval/wall_clock_since_step1_s")}
    return [[s, version.get(s), clock.get(s)] for s in sorted(set(version) | set(clock))]


def stamped(run: Dict, field: int) -> List[List[float]]:
    """[x, value] of the run's evals that carry stamp ``field`` (1: weight version, 2: the eval's own seconds since
    the first step), x being that stamp; [] for a run recorded without stamps."""
    stamp = {int(s[0]): s[field] for s in run.get("eval_stamps", []) if s[field] is not None}
    return [[stamp[int(e[0])], e[3]] for e in run["eval"] if int(e[0]) in stamp]


def read_dynamics(tb_dir: str) -> Dict:
    """The training side of a run, for reading why its eval went where it did: the training batch's mean digit
    fraction per step (the interior-optimum task's reward logs it; [] otherwise), the mean share of tokens
    clipped by PPO's ratio clip and of TIS weights at the cap, and ESS-LR's mean ρ = ESS/B and LR scale (None
    where the run does not log them)."""

    def mean(tag):
        values = [v for _, _, v in scalar_events(tb_dir, tag)]
        return statistics.mean(values) if values else None

    return {
        "fraction": [[s, v] for s, _, v in scalar_events(tb_dir, "train/digit_fraction")],
        "ppo_clip": mean("train/ppo_clip_ratio"),
        "tis_clip": mean("train/tis/clip_frac"),
        "rho_ess": mean("train/rho_ess"),
        "lr_scale": mean("train/lr_scale"),
    }


# What the update did per step, for reading where a run turned: the training batch's reward and share of well-formed
# answers (samples up to the lag versions old), KL(μ‖π_prox) of its tokens (k1, the distance the weights correct),
# the TIS weight's mean, PPO's KL(π_prox‖π_θ) after the epochs and its clip share, and ESS-LR's ρ and LR scale
CURVES = {
    "reward": "train/reward",
    "well_formed": "train/well_formed",
    "k1_mu_prox": "train/mismatch/k1",
    "ess_frac": "train/mismatch/ess_frac",
    "tis_weight": "train/tis/mean_weight",
    "ppo_kl": "train/ppo_kl",
    "ppo_clip": "train/ppo_clip_ratio",
    "rho_ess": "train/rho_ess",
    "lr_scale": "train/lr_scale",
}
CURVE_WINDOW = 5  # the per-step table averages the steps (checkpoint - 5, checkpoint]: one step's batch is noisy


def read_curves(tb_dir: str) -> Dict[str, List[List[float]]]:
    """Each of :data:`CURVES` per step, [[step, value], ...] (absent where the run did not log it)."""
    out = {}
    for name, tag in CURVES.items():
        points = [[s, v] for s, _, v in scalar_events(tb_dir, tag)]
        if points:
            out[name] = points
    return out


# Upstream's per-step timing (train/timing/*). Sync: the phases run one after another and step_total is their sum.
# Async: "generation" is the generator's time for that batch, overlapping training; step_total is the trainer's
# wall-clock per step, queue wait included; "broadcast" holds the engine paused (partial rollouts) for the sync.
PHASES = ("generation", "make_experience", "ppo_train", "broadcast", "step_total")
WARMUP_STEPS = 5  # the first steps (engine and optimizer warm-up, a queue filling) are left out of the means


def read_timing(tb_dir: str) -> Dict[str, float]:
    """Mean seconds per step of each phase of :data:`PHASES`, over the steps after :data:`WARMUP_STEPS`."""
    out = {}
    for phase in PHASES:
        values = [v for s, _, v in scalar_events(tb_dir, f"train/timing/{phase}") if s > WARMUP_STEPS]
        if values:
            out[phase] = statistics.mean(values)
    return out


def run_dir_name(key: str, seed: int) -> str:
    """The run's folder under --workdir: "async q8 + partial | TIS", 0 -> "async_q8_p_partial__TIS_s0"."""
    slug = f"{key}_s{seed}".replace(" | ", "__").replace(" ", "_").replace("+", "p").replace("(", "")
    return slug.replace(")", "")


# ------------------------------------------------------------------------------------- the interior-optimum task

TARGET_PROMPTS = 64  # training prompts (8 per step) and held-out prompts
TARGET_EPISODES = 4  # passes over the training prompts: 32 steps
TARGET_EVAL_STEPS = 4
# The recorded regime of the interior-optimum task (docs/staleness_target.md): lr 1e-2, 4 optimizer epochs per batch
TARGET_FLAGS = ["--train.num_episodes", str(TARGET_EPISODES), "--actor.lr_scheduler", "constant"]
TARGET_FLAGS += ["--actor.adam.lr", "1e-2"]
TARGET_EPOCHS = ["--train.max_epochs", "4"]


def target_world(root: str) -> dict:
    """The tiny world (random model, seed 0; 64 training prompts) with the interior-optimum reward and 64 held-out
    prompts drawn with another seed, none of them a training prompt."""
    from openrlhf_ess.tiny.world import build_prompts, build_world

    world = build_world(os.path.join(root, "world"), seed=0, n_prompts=TARGET_PROMPTS)
    world["reward"] = os.path.join(REPO, "openrlhf_ess", "tiny", "reward_target.py")
    world["eval"] = os.path.join(root, "eval.jsonl")
    if not os.path.exists(world["eval"]):
        with open(world["prompts"]) as f:
            seen = {json.loads(line)["input"] for line in f}
        drawn = build_prompts(world["eval"] + ".drawn", n=2 * TARGET_PROMPTS, seed=1)
        with open(drawn) as f:
            rows = [line for line in f if json.loads(line)["input"] not in seen]
        with open(world["eval"] + ".tmp", "w") as f:
            f.writelines(rows[:TARGET_PROMPTS])
        os.replace(world["eval"] + ".tmp", world["eval"])
        os.remove(drawn)
    return world


def target_command(world: dict, run_dir: str, name: str) -> List[str]:
    """The CLI command of one interior-optimum run (before the cell's flags): the tests' tiny-run flags with the
    target reward, the recorded regime and the held-out eval. VCPO (recipe) keeps its recipe's one epoch."""
    epochs = [] if name == "VCPO (recipe)" else TARGET_EPOCHS
    return [
        sys.executable,
        "-m",
        "openrlhf_ess.cli.train_ppo_ray",
        *tiny_args(world, run_dir, steps_prompts=TARGET_PROMPTS),
        *TARGET_FLAGS,
        *epochs,
        *["--eval.dataset", world["eval"], "--eval.steps", str(TARGET_EVAL_STEPS)],
        *["--eval.temperature", "1.0", "--eval.n_samples_per_prompt", "4"],
    ]


def initial_target_reward(world: dict, samples: int = 4, seed: int = 0) -> float:
    """The random model's mean interior-optimum reward on the held-out prompts, ``samples`` each at temperature 1
    and up to 16 new tokens (fp32 torch, the gradient benchmark's sampler): step 0 of every curve (upstream
    evaluates at multiples of --eval.steps only)."""
    import torch

    from benchmarks.gradient_quality import Tiny

    torch.set_num_threads(1)
    tiny = Tiny({**world, "prompts": world["eval"]}, max_new_tokens=16, samples_per_prompt=samples, task="target")
    return tiny.sample_prompts(tiny.prompts, torch.Generator().manual_seed(seed)).rewards.mean().item()


def run_once(
    key: str,
    seed: int,
    steps: int,
    run_dir: str,
    world,
    pin_engine_core: bool = False,
    task: str = "rlvr",
    task_env: Optional[Dict[str, str]] = None,
    extra: Optional[List[str]] = None,
) -> Dict:
    """One run of the grid: ``world`` is the RLVR world's folder (task rlvr) or :func:`target_world`'s dict;
    ``task_env`` the script's task settings (N_EVAL, WARM_TARGET, WARM_CHECK_EVERY; task rlvr), kept in the run;
    ``extra`` more CLI flags after the cell's (``--extra``: e.g. more optimizer epochs, so that training is the
    slower side and the queue fills), kept in the run's ``flags``."""
    level, name = parse_config(key)
    flags = config_flags(level, name) + ["--train.seed", str(42 + seed)] + list(extra or [])
    os.makedirs(run_dir, exist_ok=True)
    if task == "target":
        cmd, tb_dir = target_command(world, run_dir, name) + flags, os.path.join(run_dir, "tb")
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_MODE": "offline"}
    else:
        cmd, tb_dir = ["bash", SCRIPT, *flags], os.path.join(run_dir, "tensorboard")
        env = {**os.environ, "SEED": "0", "STEPS": str(steps), "RUN_DIR": run_dir, "WORLD": world, **(task_env or {})}
        env["WANDB_MODE"] = "offline"
    launched = time.time()
    rc = launch(cmd, run_dir, env, pin_engine_core)
    if rc != 0:
        raise RuntimeError(f"{key} seed {seed} failed ({rc}): see {run_dir}/log.txt")
    run = read_run(tb_dir, launched)
    run["wall_s"] = time.time() - launched
    run["seed"] = seed
    run["commit"] = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    run["flags"] = flags
    run["machine"] = machine()
    run["dtype"] = run_dtypes(flags, run["machine"].get("dtype", "bf16"))
    if task == "rlvr":  # the task's settings this run had (the script's defaults where not given; N_EVAL always)
        from openrlhf_ess.tiny.rlvr import N_EVAL

        run["task_env"] = {"N_EVAL": str(N_EVAL)} | {
            k: env[k]
            for k in ("N_EVAL", "WARM_TARGET", "WARM_CHECK_EVERY", "PROMPTS", "SAMPLES", "LR", "EVAL_STEPS")
            if k in env
        }
    return run


def flag_value(flags: List[str], flag: str, default=None):
    """The value of ``flag`` in a run's ``flags`` as argparse reads them (the last occurrence wins); ``default``
    where the flag is absent."""
    found = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == flag]
    return found[-1] if found else default


def run_dtypes(flags: List[str], script_choice: str = "bf16") -> Dict[str, str]:
    """The trainer's and the engine's dtypes a run trained in: the grid's flags, which come after the script's (the
    last occurrence wins, as argparse reads them); not given, the script's CPU choice (``runtime/cpu_dtype.py``: fp32
    where the CPU emulates bf16). In fp32 on both sides staleness is the only source of μ ≠ π_prox."""

    fp32 = script_choice == "fp32"
    return {
        "trainer": flag_value(flags, "--ds.param_dtype", "fp32" if fp32 else "bf16"),
        "engine": flag_value(flags, "--vllm.dtype", "float32" if fp32 else "bfloat16"),
    }


def machine(cpuinfo: str = "/proc/cpuinfo") -> Dict:
    """The CPU a run trained on, kept in its record: seconds compare only between runs on one kind of CPU. Without
    AVX512-BF16 or AMX torch emulates bf16 matmuls (on an AVX2 machine here: 1.2 GFLOP/s against 64 in fp32 on one
    core), and the same 8-epoch bf16 run's training phase took 5x longer (18.1-18.8 s a step against 3.6 s); the
    script now trains in fp32 there (``openrlhf_ess/runtime/cpu_dtype.py``), and ``dtype`` records which the run
    computed in (runs stored before it: bf16). The training is the same computation either way; bf16 rounds it."""
    import torch

    from openrlhf_ess.runtime import cpu_dtype

    model = "unknown"
    try:
        with open(cpuinfo) as f:
            names = (v.strip() for k, _, v in (line.partition(":") for line in f) if k.strip() == "model name")
            model = next(names, model)
    except OSError:
        pass
    flags = cpu_dtype.cpu_flags(cpuinfo)
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16": "native" if cpu_dtype.native_bf16(flags or "", os.environ) else "emulated",
        "dtype": cpu_dtype.choose(flags).dtype,
    }


def machine_text(run: Dict) -> str:
    """One line for a run's machine and its dtypes; runs stored before the record kept them say so."""
    m = run.get("machine")
    if not m:
        return "not recorded"
    text = f"{m['cpu']}, {m['cores']} cores, {m['torch_cpu_capability']}, bf16 {m['bf16']}"
    d = run.get("dtype")  # each side's dtype (run_dtypes); older records kept only the script's choice, if that
    if d:
        return f"{text}; trainer {d['trainer']}, engine {d['engine']}"
    return text + (", trained in fp32" if m.get("dtype") == "fp32" else "")


def machine_table(results: Dict[str, List[Dict]]) -> List[str]:
    """Which runs ran on which machine, where a file holds more than one: every figure in seconds then spans
    machines where a row's seeds do (:func:`against_sync` leaves such rows' step and its ratio out)."""
    seen = {machine_text(r) for runs in results.values() for r in runs}
    if len(seen) < 2:
        return []
    lines = [
        "",
        "## Machines",
        "",
        "These runs ran on more than one machine: every figure in seconds in this file (start-up, run, AUC (wall), "
        "time to sync's final, an eval's logged − ran, the step's phases) spans them where a row's seeds do, so "
        "compare seconds only between runs of one machine; the step and its ratio to sync's are left out for such "
        "rows. The evals per step compare across them: the training is the same computation, bf16 native or "
        "emulated.",
        "",
        "| configuration | machine | seeds |",
        "|---|---|---|",
    ]
    for key, runs in results.items():
        for text in sorted({machine_text(r) for r in runs}):
            seeds = sorted(r["seed"] for r in runs if machine_text(r) == text)
            lines.append(f"| {key.replace(' | ', ': ')} | {text} | {', '.join(map(str, seeds))} |")
    return lines


# ------------------------------------------------------------------------------------------------ measures


def common_steps(results: Dict[str, List[Dict]]) -> List[int]:
    """The eval steps every run has (an async run can end before its last eval: upstream's async trainer stops when
    the prompts run out, before the eval of the final step)."""
    steps = [set(int(e[0]) for e in r["eval"]) for runs in results.values() for r in runs]
    return sorted(set.intersection(*steps)) if steps else []


def _at(run: Dict, steps: Optional[List[int]]) -> List[float]:
    return [e[3] for e in run["eval"] if steps is None or int(e[0]) in steps]


def auc_steps(run: Dict, steps: Optional[List[int]] = None) -> float:
    """Mean eval accuracy over the evals at ``steps`` (default: all; they are equally spaced): the area under
    accuracy-vs-step."""
    return statistics.mean(_at(run, steps))


def final_acc(run: Dict, last: int = 2, steps: Optional[List[int]] = None) -> float:
    """Mean of the last ``last`` evals among ``steps`` (one eval has a sampling error of about 0.014 at 0.2 over
    788 samples)."""
    return statistics.mean(_at(run, steps)[-last:])


def auc_wall(run: Dict, horizon: float, start_value: float, column: int = 2) -> float:
    """Mean accuracy over [0, ``horizon``] seconds (since the first step's log by default), the accuracy held at
    each eval's value until the next (``start_value`` before the first eval)."""
    points = [(e[column], e[3]) for e in run["eval"] if e[column] <= horizon]
    area, t_prev, v_prev = 0.0, 0.0, start_value
    for t, v in points:
        area += (t - t_prev) * v_prev
        t_prev, v_prev = t, v
    area += (horizon - t_prev) * v_prev
    return area / horizon


def time_to(run: Dict, threshold: float, column: int = 2) -> Optional[float]:
    """Seconds (since the first step's log) at the first eval whose accuracy reaches ``threshold``; None: never."""
    return next((e[column] for e in run["eval"] if e[3] >= threshold), None)


def gain(run: Dict, start_value: float, steps: Optional[List[int]] = None) -> float:
    """The AUC over steps less the start value: the part of the AUC the training added (0 for a policy never
    trained; negative for one that fell below where it started)."""
    return auc_steps(run, steps) - start_value


def ratio(value: float, reference: float) -> Optional[float]:
    """``value`` as a multiple of ``reference``; None where the reference is 0 (a sync that gained nothing)."""
    return value / reference if reference else None


def _times(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.2f}×".replace("-", "−")


def _range(xs: List[float]) -> str:
    """ "min–max" of per-seed ratios, as the docs quote them ("min to max" where min is negative; one value where
    they agree to two decimals)."""
    if not xs:
        return "–"
    low, high = f"{min(xs):.2f}", f"{max(xs):.2f}"
    return (low if low == high else f"{low} to {high}" if min(xs) < 0 else f"{low}–{high}").replace("-", "−")


def sooner(run: Dict, sync_run: Optional[Dict], threshold: float) -> bool:
    """Whether the run reached ``threshold`` at an earlier eval time (since its first step's log) than the sync run
    of the same seed; a run that reaches it where that sync run never does counts as sooner."""
    mine = time_to(run, threshold)
    if mine is None:
        return False
    theirs = time_to(sync_run, threshold) if sync_run is not None else None
    return theirs is None or mine < theirs


FROZEN = "frozen policy (the start, never trained)"


def stale_k_of(run: Dict) -> Optional[int]:
    """The lag a run set with --train.stale_k (the last value of its flags), None where it set none."""
    k = flag_value(run.get("flags", []), "--train.stale_k")
    return None if k is None else int(k)


def script_default(name: str, script: str = SCRIPT) -> int:
    """The default of the task script's setting ``name`` (its ``NAME=${NAME:-value}`` line)."""
    with open(script) as f:
        found = re.search(rf"^{name}=\$\{{{name}:-(\d+)\}}", f.read(), re.M)
    if found is None:
        raise ValueError(f"{script} sets no default for {name}")
    return int(found.group(1))


def steps_per_version(run: Dict) -> int:
    """Optimizer steps per weight version: the epochs a batch (--train.max_epochs, 1 unless given) times the
    minibatches a batch. The script's --train.batch_size is its whole rollout batch, PROMPTS × SAMPLES samples (one
    minibatch); a run whose flags give a smaller one (``--extra "--train.batch_size 256"``: 4 minibatches of the
    32 × 32 batch, as AReaL and M2PO train) takes that many optimizer steps a version, and each version of lag is
    as many steps. The rollout's size comes from the run's task settings, else the script's defaults."""
    flags = run.get("flags", [])
    epochs = int(flag_value(flags, "--train.max_epochs", 1))
    train_batch = flag_value(flags, "--train.batch_size")
    if train_batch is None:
        return epochs
    env = run.get("task_env") or {}

    def size(name: str, flag: str) -> int:  # the flag, else the run's task settings, else the script (read only then)
        return int(flag_value(flags, flag) or env.get(name) or script_default(name))

    prompts, samples = size("PROMPTS", "--rollout.batch_size"), size("SAMPLES", "--rollout.n_samples_per_prompt")
    if (prompts * samples) % int(train_batch):
        raise ValueError(f"--train.batch_size {train_batch} does not divide the rollout batch {prompts} x {samples}")
    return epochs * prompts * samples // int(train_batch)


def first_below(run: Dict, start_value: float) -> Optional[int]:
    """The first eval step whose value is below the start's own eval, None if none is."""
    return next((int(e[0]) for e in run["eval"] if e[3] < start_value), None)


def steps_to(run: Dict, threshold: float) -> Optional[int]:
    """The first eval step whose value reaches ``threshold``, None if none does."""
    return next((int(e[0]) for e in run["eval"] if e[3] >= threshold), None)


def curve_mean(run: Dict, name: str, first: int = 1) -> Optional[float]:
    """The mean of a recorded curve (:data:`CURVES`) over its steps from ``first`` on; None where not recorded."""
    values = [v for s, v in (run.get("curves") or {}).get(name, []) if s >= first]
    return statistics.mean(values) if values else None


def curve_at(run: Dict, name: str, step: int) -> Optional[float]:
    """A recorded curve's value at ``step``; None where not recorded."""
    return next((v for s, v in (run.get("curves") or {}).get(name, []) if s == step), None)


def delayed(run: Dict, k: int, start_value: float, steps: List[int]) -> Dict:
    """``run`` as if everything it did came ``k`` optimizer steps later: its eval curve (the start's value at step 0,
    straight lines between evals) read at each eval step less ``k`` over the run's own optimizer steps a version
    (the curve's steps are versions: a sync run of 4 minibatches a batch is 16 optimizer steps late 4 versions on),
    the start before step 0. A reference for a lag of K steps, not a run: what a pure delay of sync by K steps would
    keep of its gain."""
    points = [(0, start_value)] + [(int(e[0]), e[3]) for e in run["eval"] if int(e[0]) in steps]

    def at(step: float) -> float:
        if step <= 0:
            return start_value
        for (a, va), (b, vb) in zip(points, points[1:]):
            if a <= step <= b:
                return va + (vb - va) * (step - a) / (b - a)
        return points[-1][1]

    late = k / steps_per_version(run)
    return {**run, "eval": [[s, None, None, at(s - late)] for s, _ in points[1:]]}


def lag_table(results: Dict[str, List[Dict]], start_value: float, steps: List[int]) -> List[str]:
    """The rows run at a lag set exactly (--train.stale_k), each seed against sync's run of the same seed: the gain
    over the start as a multiple of sync's, the step where the run first fell below the start, the steps to 0.9×
    sync's final accuracy (and that over sync's own, r: the extra steps the lag costs), and the staleness the update
    saw: KL(μ‖π_prox) (k1; with one step a batch π_prox is π_θ at the step's start) and ESS/B of the per-trajectory
    weights, each the mean over the steps from K + 1 on (where every token has the lag K); and k1 at step 2, the first
    batch sampled one version behind (the first K batches come from the initial weights): how far one optimizer step
    moves the policy at the run's LR. [] where no row set one."""
    sync = {r["seed"]: r for r in results.get("sync | none", [])}
    keyed = [(k, runs) for k, runs in results.items() if runs and stale_k_of(runs[0]) is not None]
    if not sync or not keyed:
        return []
    target = 0.9 * statistics.mean(final_acc(r, steps=steps) for r in sync.values())
    sync_to = [steps_to(r, target) for r in sync.values()]
    sync_to = [x for x in sync_to if x is not None]
    sync_steps = statistics.mean(sync_to) if sync_to else None

    def cell(values, fmt):
        return ", ".join("–" if v is None else fmt(v) for v in values)

    def auc(run):
        return auc_steps(run, steps)

    def final(run):
        return final_acc(run, steps=steps)

    def gain(measure, run, reference):
        """``run``'s gain over the start by ``measure`` as a multiple of ``reference``'s."""
        return ratio(measure(run) - start_value, measure(reference) - start_value)

    def signed(g):
        return f"{g:.2f}".replace("-", "−")

    lines = [
        "",
        "## At a lag set exactly (--train.stale_k), per seed",
        "",
        "K in versions and in optimizer steps (steps a version × K). Gain: each seed's gain over the start as a "
        "multiple of sync's run of the same seed. Below start: the first eval step under the start's "
        f"{start_value:.3f} (– never). To 0.9×: the first eval step at ≥ 0.9 × sync's mean final ({target:.3f}; "
        f"sync's seeds reached it at {cell(sync_to, str) or 'never'}); r = its mean over sync's. k1 and ESS/B: means "
        "over steps K + 1 on. One step's k1: at step 2, whose batch the initial weights sampled (the first K batches "
        "come from them) and the weights after one optimizer step score: how far one step moves the policy. Final "
        "gain: (final − start) over sync's of the same seed, final = the mean of the last two evals: the anchors' "
        "measure (their tables compare final scores), blind to the K steps by which a lag delays everything, where "
        "the AUC's gain counts them. Sync delayed K steps: sync's own curve read K optimizer steps late (straight "
        "lines between its evals; K over sync's own optimizer steps a version, in versions), a reference, not a run: "
        "what a lag costs if it only delays.",
        "",
        "| configuration | K (versions / optimizer steps) | seeds | gain × sync's, per seed | final gain × sync's, "
        "per seed | below start at step | to 0.9× sync's final (steps) | r | k1(μ‖π_prox), per seed | ESS/B, per seed "
        "| one step's k1, per seed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, runs in keyed:
        runs = sorted(runs, key=lambda r: r["seed"])
        k = stale_k_of(runs[0])
        per_version = {steps_per_version(r) for r in runs}
        unit = f"{k} / {k * next(iter(per_version))}" if len(per_version) == 1 else f"{k} / mixed"
        gains = [gain(auc, r, sync[r["seed"]]) if r["seed"] in sync else None for r in runs]
        finals = [gain(final, r, sync[r["seed"]]) if r["seed"] in sync else None for r in runs]
        to = [steps_to(r, target) for r in runs]
        reached = [x for x in to if x is not None]
        r_cost = (
            ratio(statistics.mean(reached), sync_steps) if reached and sync_steps and len(reached) == len(to) else None
        )
        cells = [
            key.replace(" | ", ": "),
            unit,
            str(len(runs)),
            cell(gains, signed),
            cell(finals, signed),
            cell([first_below(r, start_value) for r in runs], str),
            cell(to, str),
            "–" if r_cost is None else f"{r_cost:.2f}",
            cell([curve_mean(r, "k1_mu_prox", k + 1) for r in runs], lambda v: f"{v:.3f}"),
            cell([curve_mean(r, "ess_frac", k + 1) for r in runs], lambda v: f"{v:.3f}"),
            cell([curve_at(r, "k1_mu_prox", 2) for r in runs], lambda v: f"{v:.3f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for k in sorted({stale_k_of(runs[0]) * steps_per_version(runs[0]) for _, runs in keyed}):
        pairs = [(delayed(r, k, start_value, steps), r) for r in sorted(sync.values(), key=lambda r: r["seed"])]
        cells = [f"sync delayed {k} steps (computed)", f"– / {k}", str(len(pairs))]
        cells += [cell([gain(measure, d, r) for d, r in pairs], signed) for measure in (auc, final)] + ["–"] * 6
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def against_sync(
    results: Dict[str, List[Dict]], start_value: float, steps: List[int], target: Optional[float], task: str = "rlvr"
) -> List[str]:
    """Every configuration against sync, the figures the docs quote: the gain over the start (AUC − start value) as a
    multiple of sync's, with the plain AUC's multiple beside it, per-seed ranges paired by seed; the mean lag with its
    per-run range; the step time and its multiple of sync's; how many paired seeds reached sync's final value sooner
    than sync did. A frozen policy's row (the start value at every eval, never trained) is the floor."""
    sync = results.get("sync | none")
    if not sync:
        return []
    text = TASK_TEXT[task]
    by_seed = {r["seed"]: r for r in sync}
    sync_auc = statistics.mean(auc_steps(r, steps) for r in sync)
    sync_gain = sync_auc - start_value
    sync_step = [r["timing"]["step_total"] for r in sync if "step_total" in r.get("timing", {})]
    sync_step = statistics.mean(sync_step) if sync_step else None
    lines = [
        "",
        "## Against sync, and the floor",
        "",
        f"Gain = AUC (steps) − {start_value:.3f} ({text['start']}'s own eval): what the training added to the AUC. "
        "× sync's = the mean over sync's mean, with the range of the per-seed ratios (each seed against sync's run "
        "of the same seed) in brackets. The frozen policy is the start never trained: its eval is the start value "
        "at every step (gain 0). Mean lag: the mean of the per-run means, each run's in brackets (versions). Step: "
        "mean seconds per step after the warm-up; × sync's: over sync's. Sooner: paired seeds whose first eval ≥ "
        "sync's mean final came earlier after the first step than sync's run of that seed.",
        "",
        "| configuration | seeds | gain over the start | × sync's gain (per seed) | AUC (steps) | × sync's AUC "
        "(per seed) | mean lag (per run) | step (s) | × sync's step | sooner than sync |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    async_steps = []
    for key, runs in results.items():
        auc = {r["seed"]: auc_steps(r, steps) for r in runs}
        paired = [s for s in auc if s in by_seed]
        sync_seed = {s: auc_steps(by_seed[s], steps) for s in paired}
        gains = [ratio(auc[s] - start_value, sync_seed[s] - start_value) for s in paired]
        aucs = [ratio(auc[s], sync_seed[s]) for s in paired]
        mean_auc = statistics.mean(auc.values())
        lags = [r["lag_mean"] for r in runs if r["lag_mean"] is not None]
        lag = f"{statistics.mean(lags):.2f} ({_range(lags)})" if lags else ("0" if key.startswith("sync") else "–")
        step = [r["timing"]["step_total"] for r in runs if "step_total" in r.get("timing", {})]
        step = statistics.mean(step) if step else None
        step_ratio = ratio(step, sync_step) if step is not None and sync_step else None
        mixed = len({machine_text(r) for r in runs + sync}) > 1  # seconds from two machines: no mean, no ratio
        if mixed:
            step = step_ratio = None
        if step_ratio is not None and not key.startswith("sync"):
            async_steps.append(step_ratio)
        reached = "–"
        if target is not None and key != "sync | none":
            reached = f"{sum(sooner(r, by_seed.get(r['seed']), target) for r in runs)} of {len(runs)}"
        cells = [
            key.replace(" | ", ": "),
            str(len(runs)),
            f"{mean_auc - start_value:.3f}".replace("-", "−"),
            f"{_times(ratio(mean_auc - start_value, sync_gain))} ({_range([g for g in gains if g is not None])})",
            f"{mean_auc:.3f}",
            f"{_times(ratio(mean_auc, sync_auc))} ({_range([a for a in aucs if a is not None])})",
            lag,
            ("mixed machines" if mixed else "–") if step is None else f"{step:.3f}",
            _times(step_ratio),
            reached,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    frozen = [ratio(start_value, auc_steps(r, steps)) for r in sync]
    floor = [FROZEN, "–", "0.000", "0.00× (0.00)", f"{start_value:.3f}"]
    floor += [
        f"{_times(ratio(start_value, sync_auc))} ({_range([f for f in frozen if f is not None])})",
        "0",
        "–",
        "–",
    ]
    floor.append("never" if target is not None and start_value < target else "–")
    lines.append("| " + " | ".join(floor) + " |")
    if async_steps:
        lines += ["", f"Every async row's step against sync's: {_range(async_steps)}×."]
    return lines


# What the tables and figures call each task's eval
TASK_TEXT = {
    "rlvr": {
        "title": "The decisive grid on the verifiable task: raw results",
        "eval": "held-out exact-match accuracy of the current weights (197 prompts x 4 samples at temperature 1)",
        "value": "accuracy",
        "start": "the warm start",
        "ylabel": "held-out accuracy (exact match, T = 1)",
        "start_key": "_warm_start_accuracy",
    },
    "target": {
        "title": "The decisive grid on the interior-optimum task: raw results",
        "eval": "held-out mean reward 1 − |f − 0.5| / 0.5 of the current weights (64 prompts x 4 samples at "
        "temperature 1)",
        "value": "reward",
        "start": "the random model",
        "ylabel": "held-out reward 1 − |f − 0.5| / 0.5 (T = 1)",
        "start_key": "_initial_eval_reward",
    },
}


def write_table(results: Dict[str, List[Dict]], path: str, command: str, start_value: float, task="rlvr") -> None:
    text = TASK_TEXT[task]
    n_evals = {r.get("task_env", {}).get("N_EVAL", "100") for runs in results.values() for r in runs}
    if task == "rlvr" and n_evals != {"100"}:  # a larger eval set than the default's 197 prompts
        from openrlhf_ess.tiny.rlvr import split_pairs

        counts = " / ".join(str(len(split_pairs(int(n))[1])) for n in sorted(n_evals, key=int))
        text = {**text, "eval": text["eval"].replace("197 prompts", f"{counts} prompts")}
    steps = common_steps(results)
    sync = results.get("sync | none", [])
    target = statistics.mean(final_acc(r, steps=steps) for r in sync) if sync else None
    horizon = min(r["eval"][-1][2] for runs in results.values() for r in runs if r["eval"])
    commands = sorted({r.get("command", command) for runs in results.values() for r in runs})
    lines = [
        f"# {text['title']}",
        "",
        f"Command{'s' if len(commands) > 1 else ''}: {', '.join(f'`{c}`' for c in commands)}. "
        f"Eval: {text['eval']}. AUC (steps) = mean of the evals at the steps every run has "
        f"({', '.join(map(str, steps))}); final = mean of the last two of them; AUC (wall) = mean "
        f"{text['value']} over the first {horizon:.0f} s after the first step's log (the shortest run's last "
        f"eval), {start_value:.3f} ({text['start']}) before a run's first eval; time to sync = seconds after the "
        f"first step's log at the first eval ≥ sync's mean final {text['value']}"
        + (f" ({target:.3f})" if target is not None else "")
        + ". Mean [min, max] over seeds; every seed below.",
        "",
        "| configuration | seeds | AUC (steps) | final | AUC (wall) | time to sync's final (s) | start-up (s) | "
        "run (s) | mean lag |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, runs in results.items():
        reach = [t for t in (time_to(r, target) for r in runs) if t is not None] if target is not None else []
        never = len(runs) - len(reach)
        lags = [r["lag_mean"] for r in runs if r["lag_mean"] is not None]
        cells = [
            key.replace(" | ", ": "),
            str(len(runs)),
            _span([auc_steps(r, steps) for r in runs]),
            _span([final_acc(r, steps=steps) for r in runs]),
            _span([auc_wall(r, horizon, start_value) for r in runs]),
            _span(reach, "{:.0f}") + (f" ({never} never)" if never else ""),
            _span([r["first_step_s"] for r in runs], "{:.0f}"),
            _span([r["wall_s"] for r in runs], "{:.0f}"),
            f"{statistics.mean(lags):.2f}" if lags else ("0" if key.startswith("sync") else "not logged"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += machine_table(results)
    lines += against_sync(results, start_value, steps, target, task)
    lines += lag_table(results, start_value, steps)
    lines += stamp_table(results)
    lines += time_table(results)
    if task == "target":
        lines += dynamics_table(results)
    lines += curves_table(results)
    lines += ["", f"## Every seed: eval {text['value']} at each eval step (seconds since the first step's log)", ""]
    for key, runs in results.items():
        lines.append(f"**{key.replace(' | ', ': ')}**")
        lines.append("")
        for r in sorted(runs, key=lambda r: r["seed"]):
            stamp = {int(x[0]): x for x in r.get("eval_stamps", [])}
            cells = ", ".join(
                f"{int(s)}: {v:.3f} ({t:.0f} s{_stamp_text(stamp.get(int(s)))})" for s, _, t, v in r["eval"]
            )
            lines.append(
                f"- seed {r['seed']}: {cells}; AUC {auc_steps(r, steps):.3f}, final {final_acc(r, steps=steps):.3f}"
            )
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _stamp_text(stamp: Optional[List]) -> str:
    if stamp is None:
        return ""
    parts = ([f"version {stamp[1]:.0f}"] if stamp[1] is not None else []) + (
        [f"ran at {stamp[2]:.0f} s"] if stamp[2] is not None else []
    )
    return "; " + ", ".join(parts) if parts else ""


def stamp_table(results: Dict[str, List[Dict]]) -> List[str]:
    """Where an eval's step label and the policy it measured part: per configuration, over every stamped eval, the
    weight version less the step label and the seconds from the eval's own start to when the trainer logged it.
    [] where no run carries stamps (runs recorded before the evals logged them)."""
    rows = []
    for key, runs in results.items():
        versions, delays, n = [], [], 0
        for r in runs:
            logged = {int(e[0]): e[2] for e in r["eval"]}
            for step, version, clock in r.get("eval_stamps", []):
                if int(step) not in logged:
                    continue
                n += 1
                if version is not None:
                    versions.append(version - step)
                if clock is not None:
                    delays.append(logged[int(step)] - clock)
        if n:
            rows.append(
                f"| {key.replace(' | ', ': ')} | {n} | {_span(versions, '{:.1f}')} | {_span(delays, '{:.1f}')} |"
            )
    if not rows:
        return []
    return [
        "",
        "## Each eval's policy and time",
        "",
        "What each eval logged itself: the weight version the engines held while it generated (`eval/weight_version`) "
        "and its start in seconds after the first step's start (`eval/wall_clock_since_step1_s`). Version − step: "
        "how many steps newer the measured weights were than the step the eval is labelled with; logged − ran: how "
        "long after its start the trainer logged it, the log counted from the first step's log and the start from "
        "the first step's start, so it understates the delay by the first step's own seconds and can fall below 0 "
        "where that step was long. Mean [min, max] over every stamped eval.",
        "",
        "| configuration | stamped evals | version − step | logged − ran (s) |",
        "|---|---|---|---|",
        *rows,
    ]


def time_table(results: Dict[str, List[Dict]]) -> List[str]:
    """Where a step's time goes: upstream's phase timings, mean [min, max] over seeds of each run's mean per step."""
    timed = {k: [r["timing"] for r in runs if r.get("timing")] for k, runs in results.items()}
    if not any(timed.values()):
        return []
    lines = [
        "",
        "## Where a step's time goes (seconds per step)",
        "",
        f"Upstream's `train/timing/*`, each run's mean over the steps after step {WARMUP_STEPS}. Sync runs the "
        "phases one after another (step = their sum). Async overlaps generation with the trainer's phases: "
        "generation is the generator's time for one batch, step is the trainer's wall-clock per step (its wait "
        "for the queue included), and broadcast is the weight sync with the engine paused (partial rollouts).",
        "",
        "| configuration | runs | generation | make experience | train | broadcast | step |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, timings in timed.items():
        if timings:
            cells = [_span([t[p] for t in timings if p in t]) for p in PHASES]
            lines.append(f"| {key.replace(' | ', ': ')} | {len(timings)} | " + " | ".join(cells) + " |")
    return lines


def dynamics_table(results: Dict[str, List[Dict]], target: float = 0.5) -> List[str]:
    """The training side of the interior-optimum runs: how far the training batch's digit fraction went past f*
    (staleness.distance_stats' overshoot), how far it ended from f* (the last 8 steps), and the clip shares."""
    runs_with = {
        k: [r["dynamics"] for r in runs if r.get("dynamics", {}).get("fraction")] for k, runs in results.items()
    }
    if not any(runs_with.values()):
        return []
    lines = [
        "",
        "## The training side (the training batch's digit fraction f, sampled up to the lag versions ago)",
        "",
        f"Overshoot = how far f went past f* = {target} after first reaching it; final |f − f*| = mean over the "
        "last 8 steps; PPO clip = the mean share of tokens whose ratio π_θ/π_prox PPO clipped; TIS at cap = the "
        "mean share of TIS weights truncated at the cap.",
        "",
        "| configuration | runs | overshoot | final \\|f − f*\\| | PPO clip | TIS at cap |",
        "|---|---|---|---|---|---|",
    ]
    for key, dyn in runs_with.items():
        if not dyn:
            continue
        stats = [distance_stats([v for _, v in d["fraction"]], target, window=8) for d in dyn]
        clip = [d["ppo_clip"] for d in dyn if d["ppo_clip"] is not None]
        tis = [d["tis_clip"] for d in dyn if d["tis_clip"] is not None]
        cells = [_span([x["overshoot"] for x in stats]), _span([x["final"] for x in stats]), _span(clip), _span(tis)]
        lines.append(f"| {key.replace(' | ', ': ')} | {len(dyn)} | " + " | ".join(cells) + " |")
    return lines


def window_mean(points: List[List[float]], step: int, window: int = CURVE_WINDOW) -> Optional[float]:
    """Mean of the values logged at steps in (step - window, step]; None where none was."""
    values = [v for s, v in points if step - window < s <= step]
    return statistics.mean(values) if values else None


def curves_table(results: Dict[str, List[Dict]]) -> List[str]:
    """The update's dynamics at five checkpoints of each run (a tenth, a quarter, half, three quarters and the end of
    its steps), every run recorded with :func:`read_curves`; [] where none was."""
    rows = []
    for key, runs in results.items():
        for r in sorted(runs, key=lambda r: r["seed"]):
            curves = r.get("curves") or {}
            if not curves.get("reward"):
                continue
            last = int(max(s for s, _ in curves["reward"]))
            marks = [max(1, round(last * f)) for f in (0.1, 0.25, 0.5, 0.75, 1.0)]
            cells = []
            for name in CURVES:
                values = [window_mean(curves.get(name, []), m) for m in marks]
                cells.append(
                    " / ".join("–" if v is None else f"{v:.3g}" for v in values)
                    if any(v is not None for v in values)
                    else "–"
                )
            rows.append(
                f"| {key.replace(' | ', ': ')} | {r['seed']} | {'/'.join(map(str, marks))} | "
                + " | ".join(cells)
                + " |"
            )
    if not rows:
        return []
    return [
        "",
        "## What the update did, per step",
        "",
        f"Each run's logged training scalars, each cell the mean over the {CURVE_WINDOW} steps up to each checkpoint "
        "(a tenth, a quarter, half, three quarters and the end of the run, in that order): the training batch's "
        "reward and share of well-formed answers (its samples up to the lag versions old), k1 = KL(μ‖π_prox) of "
        "its tokens (what the IS weights correct), ESS/B of the per-trajectory weights (`mismatch/ess_frac`), the "
        "mean TIS weight, PPO's KL(π_prox‖π_θ) after the epochs and the share of tokens its clip held, and ESS-LR's "
        "ρ and LR scale. – where the run did not log it.",
        "",
        "| configuration | seed | steps | reward | well-formed | k1 μ‖π_prox | ESS/B | TIS weight | PPO KL | PPO clip "
        "| ρ_ESS | LR scale |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def plot(results: Dict[str, List[Dict]], out: str, start_value: float, task: str = "rlvr") -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = [
        ("eval_steps.png", lambda r: [[e[0], e[3]] for e in r["eval"]], "training step (the eval's label)"),
        (
            "eval_wall.png",
            lambda r: [[e[2], e[3]] for e in r["eval"]],
            "seconds since the first training step was logged",
        ),
    ]
    if any(stamped(r, 1) for runs in results.values() for r in runs):
        figures.append(("eval_version.png", lambda r: stamped(r, 1), "weight version the eval measured (its step)"))
    if any(stamped(r, 2) for runs in results.values() for r in runs):
        figures.append(("eval_time.png", lambda r: stamped(r, 2), "seconds from the first step's start to the eval's"))
    paths = []
    for name, points, xlabel in figures:
        fig, ax = plt.subplots(figsize=(10.5, 4.8))
        for i, (key, runs) in enumerate(results.items()):
            color = f"C{i}" if len(results) <= 10 else plt.get_cmap("tab20")(i % 20)  # no colour twice
            curves = [points(r) for r in runs]
            curves = [c for c in curves if c]  # a run recorded without the stamps this figure needs: left out
            if not curves:
                continue
            for c in curves:  # every seed, thin
                ax.plot([0] + [x for x, _ in c], [start_value] + [v for _, v in c], color=color, alpha=0.25, lw=0.8)
            n = min(len(c) for c in curves)
            xs = [0] + [statistics.mean(c[j][0] for c in curves) for j in range(n)]
            ys = [start_value] + [statistics.mean(c[j][1] for c in curves) for j in range(n)]
            ax.plot(xs, ys, color=color, linewidth=2, label=f"{key.replace(' | ', ': ')} ({len(curves)} seeds)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(TASK_TEXT[task]["ylabel"])
        ax.set_title(f"Held-out {TASK_TEXT[task]['value']} of the current policy: mean (thick) and every seed (thin)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes: no curve hidden
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def warm_start_accuracy(world: str, task_env: Optional[Dict[str, str]] = None) -> float:
    """The warm start's held-out accuracy at temperature 1 (4 samples per prompt, fp32 torch): step 0 of every
    curve (upstream evaluates at multiples of --eval.steps only). ``task_env``: the eval set and warm start the
    script is given (N_EVAL, WARM_TARGET, WARM_CHECK_EVERY)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openrlhf_ess.tiny import rlvr

    task_env = task_env or {}
    n_eval = int(task_env.get("N_EVAL", rlvr.N_EVAL))
    warm = rlvr.WarmStart()
    if "WARM_TARGET" in task_env:
        warm = warm._replace(target_acc=float(task_env["WARM_TARGET"]))
    if "WARM_CHECK_EVERY" in task_env:
        warm = warm._replace(check_every=int(task_env["WARM_CHECK_EVERY"]))
    built = rlvr.build_rlvr(world, seed=0, n_eval=n_eval, warm=warm)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(built["model"], dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(built["model"])
    _, held_out = rlvr.split_pairs(n_eval)
    return statistics.mean(rlvr.accuracy(model, tokenizer, held_out, temperature=1.0, seed=k) for k in range(4))


def render(results, out, command, start_value, task="rlvr") -> List[str]:
    write_table(results, os.path.join(out, "results.md"), command, start_value, task)
    return [os.path.join(out, "results.md")] + plot(results, out, start_value, task)


def save(path: str, start_value: float, results: Dict[str, List[Dict]], task: str = "rlvr") -> None:
    with open(path, "w") as f:
        json.dump({TASK_TEXT[task]["start_key"]: start_value, **results}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0, help="resume a grid: seeds first-seed..seeds-1")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (32 prompts each; task rlvr)")
    parser.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS, help="'<staleness level> | <correction>'")
    parser.add_argument(
        "--task",
        choices=sorted(TASK_TEXT),
        default="rlvr",
        help="rlvr: two-digit addition from a warm start (docs/rlvr_task.md); target: the interior-optimum reward "
        "(docs/staleness_target.md) with a held-out eval; results go to --out's target/",
    )
    parser.add_argument(
        "--pin-engine-core",
        action="store_true",
        help="the engine on core 0, everything else on the other cores (as on separate devices); results go to "
        "--out's pinned/ and the run folders end in _pinned",
    )
    parser.add_argument(
        "--n-eval", type=int, default=None, help="task rlvr: held-out unordered pairs (the script's N_EVAL; 800)"
    )
    parser.add_argument("--warm-target", type=float, default=None, help="task rlvr: the warm start's target accuracy")
    parser.add_argument(
        "--warm-check-every", type=int, default=None, help="task rlvr: the warm start's check interval"
    )
    parser.add_argument(
        "--extra",
        default="",
        help="more CLI flags for every run, after the cell's (e.g. '--train.max_epochs 4': training the slower side, "
        "the queue fills and the measured lag reaches its depth); use its own --out",
    )
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "rlvr_grid"))
    parser.add_argument("--workdir", default=os.path.join(REPO, "runs", "rlvr_grid"))
    parser.add_argument("--from-json", action="store_true", help="only re-render from --out's results.json")
    a = parser.parse_args()
    for key in a.configs:
        try:
            parse_config(key)
        except ValueError as e:
            parser.error(f"--configs {e}")
    suffix = ""
    if a.task == "target":
        world = target_world(os.path.join(a.workdir, "target"))
        a.out, suffix = os.path.join(a.out, "target"), "_target"
    else:
        world = os.path.join(a.workdir, "world")  # one warm start, pinned or not
    if a.pin_engine_core:
        a.out, suffix = os.path.join(a.out, "pinned"), suffix + "_pinned"
    os.makedirs(a.out, exist_ok=True)
    results_path = os.path.join(a.out, "results.json")
    results: Dict[str, List[Dict]] = {}
    if os.path.exists(results_path):
        with open(results_path) as f:
            results = json.load(f)
    task_env = {
        name: str(value)
        for name, value in (
            ("N_EVAL", a.n_eval),
            ("WARM_TARGET", a.warm_target),
            ("WARM_CHECK_EVERY", a.warm_check_every),
        )
        if value is not None
    }
    start_value = results.pop(TASK_TEXT[a.task]["start_key"], None)
    if start_value is None:
        start_value = initial_target_reward(world) if a.task == "target" else warm_start_accuracy(world, task_env)
    command = "python -m benchmarks.rlvr_grid " + shlex.join(sys.argv[1:])
    backfilled = False
    tb_name = "tb" if a.task == "target" else "tensorboard"
    # Runs recorded before a field was kept: read it from the run's folder, if the folder still holds that run
    readers = {"timing": read_timing, "lag": read_lag, "eval_stamps": read_eval_stamps, "curves": read_curves}
    if a.task == "target":  # the training side's table (the digit fraction) is the interior-optimum task's
        readers["dynamics"] = read_dynamics
    for key, runs in results.items():
        for r in runs:
            missing = [field for field in readers if field not in r]
            tb_dir = os.path.join(a.workdir, run_dir_name(key, r["seed"]) + suffix, tb_name)
            if not missing or not same_run(r, tb_dir):  # the folder is gone, or a later run of its name replaced it
                continue
            for field in missing:
                r[field] = readers[field](tb_dir)
            backfilled = True
    if backfilled:
        save(results_path, start_value, results, a.task)
    if not a.from_json:
        for seed in range(a.first_seed, a.seeds):
            for key in a.configs:
                if any(r["seed"] == seed for r in results.get(key, [])):
                    continue  # already measured (a resumed grid)
                t0 = time.time()
                run_dir = os.path.join(a.workdir, run_dir_name(key, seed) + suffix)
                run = run_once(
                    key, seed, a.steps, run_dir, world, a.pin_engine_core, a.task, task_env, shlex.split(a.extra)
                )
                run["command"] = command
                results.setdefault(key, []).append(run)
                print(
                    f"[rlvr_grid] {key} seed {seed}: final {final_acc(run):.3f}, AUC {auc_steps(run):.3f} "
                    f"({time.time() - t0:.0f} s)",
                    flush=True,
                )
                save(results_path, start_value, results, a.task)  # after every run: a grid cut short keeps it
    for path in render(results, a.out, command, start_value, a.task):
        print(f"[rlvr_grid] wrote {path}")


if __name__ == "__main__":
    main()
