"""What the benchmark scripts share, and the tests with them: the run's flags on the tiny CPU world or on a user's
model (GPU); the tiny run's CLI flags and the real CLI run in a subprocess whose every process is tracked by PID
(:func:`tiny_args`, :func:`run_cli`, :class:`_Tree`); the real DeepSpeed actor in one process (:func:`build_actor`)
and a fixed rollout to train it on (:func:`make_rollout`). Only the standard library is imported here; torch, Ray,
DeepSpeed and psutil inside the functions that need them."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("GPU variant (default: the offline tiny world on CPU)")
    group.add_argument("--gpu", action="store_true", help="run on GPUs: flash attention instead of sdpa")
    group.add_argument("--model", default=None, help="HF model path or name (default: the offline tiny model)")
    group.add_argument("--prompts-file", default=None, help="prompt dataset with an 'input' key (with --model)")
    group.add_argument("--reward", default=None, help="reward function .py file (with --model)")
    group.add_argument(
        "--extra", default="", help="more CLI flags for every run, e.g. '--vllm.num_engines 2 --rollout.batch_size 64'"
    )


def check_model_arguments(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.model and not (a.prompts_file and a.reward):
        parser.error("--model needs --prompts-file and --reward")


def world_for(a: argparse.Namespace, root: str, n_prompts: int) -> dict:
    """The user's model, prompts and reward, or the tiny world built under ``root``."""
    if a.model:
        return {"model": a.model, "prompts": a.prompts_file, "reward": a.reward}
    from openrlhf_ess.tiny.world import build_world

    return build_world(os.path.join(root, "world"), seed=0, n_prompts=n_prompts)


def run_flags(a: argparse.Namespace, world: dict, run_dir: str, prompts: int, dtype=None) -> List[str]:
    """The tests' tiny-run flags (8 prompts x 4 samples per step, ZeRO-2), adapted to the GPU variant (bf16, the
    CLI's default there). ``dtype``: as :func:`tiny_args`' (default: this CPU's choice)."""
    flags = tiny_args(world, run_dir, steps_prompts=prompts, dtype="bf16" if a.gpu else dtype)
    if a.gpu:
        flags[flags.index("sdpa")] = "flash_attention_2"
    return flags + a.extra.split()


_SCALARS: dict = {}  # event file -> ((size, mtime_ns), {tag: [(step, wall_time, value), ...]})


def _file_scalars(path: str) -> dict:
    """Every scalar tag of one event file, read once while the file is unchanged (a run's read-back asks for some
    twenty tags; each read of the file parses all of it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    st = os.stat(path)
    stamp = (st.st_size, st.st_mtime_ns)
    cached = _SCALARS.get(path)
    if cached is None or cached[0] != stamp:
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        tags = {t: [(e.step, e.wall_time, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
        cached = _SCALARS[path] = (stamp, tags)
    return cached[1]


def scalar_events(tb_dir: str, tag: str) -> List[tuple]:
    """[(step, wall_time, value), ...] of ``tag`` from every event file under ``tb_dir``, in step order (wall_time:
    when the run logged it, Unix seconds)."""
    import glob

    events = []
    for path in glob.glob(os.path.join(tb_dir, "**", "events.out.tfevents.*"), recursive=True):
        events.extend(_file_scalars(path).get(tag, []))
    return sorted(events)


def span(values: List[float], fmt: str = "{:.3f}") -> str:
    """ "mean [min, max]" of ``values`` in ``fmt``; "–" when there are none."""
    if not values:
        return "–"
    import statistics

    return f"{fmt.format(statistics.mean(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def peak_allocated_bytes(fn) -> int:
    """The largest sum of live CPU allocations while ``fn`` runs: every allocation and free torch makes, from
    torch.profiler's memory events in time order (what was allocated before the call, e.g. weights, is not
    counted). The one memory measurement of the benchmarks and the memory tests."""
    import itertools

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    return max(itertools.accumulate(n for _, n in events), default=0)


@contextlib.contextmanager
def gradients_dropped(model):
    """Inside: each parameter's gradient dropped as soon as it accumulates, as ZeRO-3 reduces and partitions each one
    as it comes, so a backward's peak is its activations and logits, not a full set of gradients."""
    drop = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in model.parameters()]
    try:
        yield
    finally:
        for h in drop:
            h.remove()


def write_table(module: str, setting: str, lines: List[str], out) -> None:
    """Print the tables under the command that reproduces them (``python -m benchmarks.<module>`` and this run's
    arguments) and ``setting`` (threads, dtype, repetitions), and write the same to ``out`` when given."""
    import sys

    cmd = f"python -m benchmarks.{module} " + " ".join(sys.argv[1:])
    text = f"Command: `{cmd}` ({setting})\n\n" + "\n".join(lines)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)


# --- the tiny run's CLI flags, and the real CLI run in a subprocess ---

# The engine process layout GPU users get for a tensor-parallel size of 1: upstream builds the engine with vLLM's "uni"
# executor, so the worker runs inside vLLM's EngineCore process. vLLM CPU replaces "uni" by its multiprocess executor
# (a worker process of its own, talking through /dev/shm queues) unless this variable is 0 (vllm/platforms/cpu.py).
# The feature runs of run_cli take GPU's layout: one process fewer to start, ~11 s a run here (docs/tests.md). The
# fault tests (tests/helpers/faults.py) and the runs that keep what a CPU user gets pass CPU_ENGINE_LAYOUT.
GPU_ENGINE_LAYOUT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
CPU_ENGINE_LAYOUT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
TEST_KV_GB = 0.0625  # the test runs' KV cache per engine (64 MiB), as the in-process test engines have


def ray_temp_dir(run_dir: str) -> str:
    """The private Ray temp dir of a test run (short: Ray's socket paths must stay under ~107 chars)."""
    return os.path.join("/tmp", "ray_ess_" + os.path.basename(run_dir.rstrip("/"))[-20:])


def tiny_args(
    world: dict, run_dir: str, steps_prompts: int = 16, compiled: bool = False, kv_cache_gb=TEST_KV_GB, dtype=None
):
    """CLI flags for a short tiny run: ``steps_prompts`` prompts in batches of 8 (4 samples each). The engine runs
    eager (``--vllm.enforce_eager``) unless ``compiled``: torch.compile's warm-up takes 8-30 s of a 2-core machine
    per run (docs/tests.md); the runs that keep the compiled engine users get by default say so. Its KV cache is
    ``kv_cache_gb`` (``--vllm.cpu_kv_cache_gb``; ``None``: the CLI's default, 1 GiB, whose zeroing took 5-11 s of a
    run's start here); 64 MiB holds 65,536 tokens, 20x what the largest test run keeps at once.

    ``dtype`` (trainer and engine): ``None``, this CPU's choice (``openrlhf_ess/runtime/cpu_dtype.py``: fp32 where
    bf16 is emulated, ``OPENRLHF_ESS_CPU_DTYPE`` forces one); ``"bf16"``, the CLI's defaults (no flag: a test of
    bf16 numerics, or of what the CLI does with its defaults); ``"fp32"``."""
    args = [
        "--actor.model_name_or_path",
        world["model"],
        "--data.prompt_dataset",
        world["prompts"],
        "--data.max_samples",
        str(steps_prompts),
        "--data.input_key",
        "input",
        "--reward.remote_url",
        world["reward"],
        "--algo.advantage.estimator",
        "reinforce_baseline",
        "--algo.kl.init_coef",
        "0",
        "--actor.num_gpus_per_node",
        "1",
        "--vllm.num_engines",
        "1",
        "--rollout.batch_size",
        "8",
        "--rollout.n_samples_per_prompt",
        "4",
        "--rollout.micro_batch_size",
        "8",
        "--train.batch_size",
        "32",
        "--train.micro_batch_size",
        "8",
        "--rollout.max_new_tokens",
        "16",
        "--data.max_len",
        "64",
        "--actor.adam.lr",
        "1e-3",
        "--actor.lr_warmup_ratio",
        "0",
        "--ds.zero_stage",
        "2",
        "--ds.attn_implementation",
        "sdpa",
        "--ckpt.output_dir",
        os.path.join(run_dir, "ckpt"),
        "--ckpt.path",
        os.path.join(run_dir, "ckpt", "checkpoints"),
        "--logger.tensorboard_dir",
        os.path.join(run_dir, "tb"),
        "--logger.wandb.run_name",
        "e2e",
        "--ray.temp_dir",
        ray_temp_dir(run_dir),
    ]
    if not compiled:
        args.append("--vllm.enforce_eager")
    if kv_cache_gb is not None:
        args += ["--vllm.cpu_kv_cache_gb", str(kv_cache_gb)]
    if (dtype or cpu_dtype()) == "fp32":
        from openrlhf_ess.runtime.cpu_dtype import cli_flags

        args += cli_flags("fp32")
    return args


_DTYPE_SAID: list = []  # the dtype's line, once a process


def cpu_dtype() -> str:
    """The dtype of the tiny CPU runs here (``openrlhf_ess.runtime.cpu_dtype.choose``): ``bf16`` or ``fp32``; the
    first call in a process prints the one line that says which, why, and how to force the other."""
    from openrlhf_ess.runtime.cpu_dtype import choose, notice

    choice = choose()
    if not _DTYPE_SAID:
        _DTYPE_SAID.append(notice(choice, "the tiny CPU runs of the tests and benchmarks"))
        print(_DTYPE_SAID[0], flush=True)
    return choice.dtype


# What the last run_cli left: "leftovers" (processes of the run still alive 20 s after the CLI exited; then ended)
# and "shm_left" (/dev/shm files its processes used that are still there); the e2e tests read it.
LAST_RUN: dict = {}


def run_cli(args: list, run_dir: str, timeout: int = 600, launcher=None, env=None, settle: float = 20.0):
    """Run the CLI; (exit status, console log). Every process the run starts is tracked by PID (the CLI's tree,
    :class:`_Tree`) and none outlives this call: on a timeout (``subprocess.TimeoutExpired`` is
    raised, as ``subprocess.run`` did) or any exception all of them are ended; after a normal exit, those still
    there ``settle`` seconds later are recorded in :data:`LAST_RUN` and ended.

    The engine's worker runs inside vLLM's EngineCore process (:data:`GPU_ENGINE_LAYOUT`), unless ``env`` says
    otherwise."""
    cmd = (launcher or [sys.executable, "-m"]) + ["openrlhf_ess.cli.train_ppo_ray"] + args
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_DIR": run_dir}
    full_env.update({**GPU_ENGINE_LAYOUT, **(env or {})})
    LAST_RUN.clear()
    try:
        with open(os.path.join(run_dir, "log.txt"), "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=full_env)
            with _Tree(proc.pid) as tree:
                try:
                    rc = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    raise  # _Tree ends the rest of the run
        deadline = time.time() + settle
        while tree.alive() and time.time() < deadline:
            time.sleep(0.5)
        left = tree.alive()
        LAST_RUN.update(leftovers=[f"{p.pid} {tree.seen[p.pid][1]}" for p in left], shm_left=tree.shm_left())
        end_processes(left)
    finally:  # the run's private Ray folder under /tmp (sockets, ~4 MB of logs), on any exit
        if "--ray.temp_dir" in args:
            shutil.rmtree(args[args.index("--ray.temp_dir") + 1], ignore_errors=True)
    return rc, open(os.path.join(run_dir, "log.txt")).read()


class _Tree:
    """Every process seen under ``root`` so far: {pid: (create_time, command line)}; and the /dev/shm files they
    were seen using (``shm``: names, looked at every 2 s).

    Leaving the ``with`` block by an exception (a failed assertion, a timeout, Ctrl-C) ends every recorded process
    still alive, by PID: a failing test never leaves its run behind."""

    SHM_EVERY = 10  # polls (0.2 s apart) between two looks at the processes' /dev/shm files

    def __init__(self, root: int):
        self.root = root
        self.seen = {}
        self.shm = {}  # (device, inode) of a /dev/shm file the run's processes used -> when last seen
        self.shm_names = set()
        self._polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc):
        self._stop.set()
        self._thread.join()
        if exc_type is not None:
            self.sample()
            end_processes(self.alive(), grace=5)

    def _poll(self):
        while not self._stop.is_set():
            self._polls += 1
            self.sample(shm=self._polls % self.SHM_EVERY == 1)
            self._stop.wait(0.2)

    def sample(self, shm: bool = True):
        import psutil

        from openrlhf_ess.runtime.shm_cleanup import mapped_shm

        try:
            root = psutil.Process(self.root)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                created, cmd = p.create_time(), " ".join(p.cmdline())[:200]
            except psutil.Error:
                created = cmd = None
            first = self.seen.get(p.pid)
            # first sight; or the same process (same start time) read again: a child seen between its fork and its
            # exec showed its parent's command line (under load a GCS server was recorded as "python ...
            # train_ppo_ray" for good, and a test waiting for "gcs_server" saw the run end first)
            if created is not None and (first is None or (first[0] == created and cmd)):
                self.seen[p.pid] = (created, cmd)
            if shm:
                used = mapped_shm(p.pid)
                self.shm.update(dict.fromkeys(used, time.time()))
                self.shm_names.update(used.values())

    def shm_left(self):
        """The /dev/shm files the run's processes were seen using that still exist."""
        from openrlhf_ess.runtime.shm_cleanup import files_of

        return files_of(self.shm)

    def alive(self):
        """The recorded processes that still exist (same PID and same start time), as psutil objects."""
        from openrlhf_ess.runtime.shm_cleanup import alive_processes

        return alive_processes((pid, created) for pid, (created, _) in self.seen.items())


def end_processes(procs, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds, exactly these processes (psutil objects): the package's own
    routine (``openrlhf_ess.runtime.shm_cleanup.end_processes``, what a signalled run does to its processes)."""
    from openrlhf_ess.runtime.shm_cleanup import end_processes as shm_end_processes

    shm_end_processes(procs, grace)


# --- the real DeepSpeed actor in one process, and a fixed rollout ---


def free_port() -> int:
    """A port free a moment ago, drawn as the trainer roles draw their rendezvous port
    (``openrlhf_ess.trainer.ray.rendezvous.rendezvous_port``): outside the kernel's ephemeral range, which any
    outgoing connection on the machine (Ray's gRPC clients, vLLM's sockets, another test's worker) may take as its
    local port between our release and the caller's ``bind``. ``bind(("127.0.0.1", 0))`` drew from that range and
    lost the race once in CI (``EADDRINUSE`` at a one-rank gloo group's ``TCPStore``)."""
    from openrlhf_ess.trainer.ray.rendezvous import rendezvous_port

    return rendezvous_port()


def single_process_env() -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def build_actor(
    model_path, prompts, zero_stage, param_dtype, train_batch, micro_batch, lr=1e-3, extra=(), zero_overrides=None
):
    """``zero_overrides``: entries replacing upstream's ``zero_optimization`` config (e.g. a persistence
    threshold), in both the model's ZeRO-3 init and ``deepspeed.initialize``."""
    from openrlhf_ess.runtime import cpu_compat

    cpu_compat.apply()
    from openrlhf.models import Actor
    from openrlhf.utils import get_strategy

    from openrlhf_ess.cli.train_ppo_ray import parse_args

    argv = [
        "--actor.model_name_or_path",
        model_path,
        "--data.prompt_dataset",
        prompts,
        "--reward.remote_url",
        "unused.py",
        "--ds.attn_implementation",
        "sdpa",
        "--ds.zero_stage",
        str(zero_stage),
        "--ds.param_dtype",
        param_dtype,
        "--train.batch_size",
        str(train_batch),
        "--train.micro_batch_size",
        str(micro_batch),
        "--actor.num_gpus_per_node",
        "1",
        "--actor.adam.lr",
        str(lr),
        "--actor.lr_warmup_ratio",
        "0",
        "--actor.lr_scheduler",
        "constant",
        "--algo.advantage.estimator",
        "reinforce",
    ] + list(extra)
    args, _ = parse_args(argv)
    strategy = get_strategy(args)
    if zero_overrides:
        upstream_config = strategy.get_ds_train_config

        def with_overrides(*a, **k):
            config = upstream_config(*a, **k)
            config["zero_optimization"].update(zero_overrides)
            return config

        strategy.get_ds_train_config = with_overrides
    strategy.setup_distributed()
    actor = Actor(
        model_path,
        attn_implementation="sdpa",
        param_dtype=param_dtype,
        ds_config=strategy.get_ds_train_config(),
        temperature=1.0,
    )
    cfg = dict(
        optim="adam",
        muon=vars(args.actor.muon),
        adam=vars(args.actor.adam),
        lr_scheduler=args.actor.lr_scheduler,
        lr_warmup_ratio=args.actor.lr_warmup_ratio,
        min_lr_ratio=args.actor.min_lr_ratio,
        max_norm=args.actor.max_norm,
        scheduler_steps=100,
    )
    model, optim, scheduler = strategy.prepare((actor, cfg))
    return strategy, model, optim, scheduler


SEQ, ACT = 12, 6  # make_rollout's sequence and action lengths


def make_rollout(seed: int, n: int):
    """n single-sample experiences; trajectory i has mean_t(log π_prox − log μ) = 0 or log 5."""
    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(4, 60, (n, SEQ), generator=g)
    prox = -torch.rand(n, ACT, generator=g) * 3 - 0.5
    shift = torch.tensor([0.0 if i % 2 == 0 else float(torch.log(torch.tensor(5.0))) for i in range(n)])
    rollout = prox - shift[:, None]
    adv = torch.randn(n, ACT, generator=g)
    return Experience(
        sequences=seqs,
        attention_mask=torch.ones_like(seqs),
        action_mask=torch.ones(n, ACT, dtype=torch.bool),
        action_log_probs=prox,
        rollout_log_probs=rollout,
        advantages=adv,
        returns=adv.clone(),
        info={"reward": torch.zeros(n)},
    )
