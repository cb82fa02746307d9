"""π_prox modes on a real DeepSpeed actor (fp32): each token scored with the weights of its version.

The helper keeps its own copy of the weights at versions 0, 1, 2 (the actor keeps snapshots through
the code under test); the reference here recomputes every token with HF from those copies.
"""

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tiny_world, tmp_path, ranks=1, **kw):
    """The helper in one process, or under torchrun with ``ranks`` ranks (gloo on 127.0.0.1): one result per rank."""
    from tests.helpers.ports import free_port

    out = tmp_path / "prox.pt"
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1"]
        launcher += ["--master_port", str(free_port())]
    cmd = launcher + ["-m", "tests.helpers.prox_snapshot", tiny_world["model"], tiny_world["prompts"], str(out)]
    for k, v in kw.items():
        cmd += [f"--{k}", str(v)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    if "configs" in kw:
        return None  # one result per configuration and rank: the caller reads them
    if ranks == 1:
        return torch.load(out)
    return [torch.load(f"{out}.rank{r}") for r in range(ranks)]


# The three ZeRO-3 scenarios over two ranks, in one launch of the helper (one torchrun and its ranks' imports, ~20 busy
# core-s each, instead of three): each test below reads its own.
ZERO3_CONFIGS = {"snapshot": "snapshot", "ewma-batch": "ewma:batch", "ewma-hilton": "ewma:hilton"}


@pytest.fixture(scope="module")
def zero3_two_ranks(tiny_world, tmp_path_factory):
    """{scenario: [rank 0's result, rank 1's]} of the helper under ZeRO-3, two ranks, persistence threshold 100."""
    tmp = tmp_path_factory.mktemp("zero3_two_ranks")
    configs = ",".join(ZERO3_CONFIGS.values())
    _run(tiny_world, tmp, ranks=2, zero_stage=3, persistence_threshold=100, configs=configs)
    return {name: [torch.load(tmp / f"prox.pt.{i}.rank{r}") for r in range(2)] for i, name in enumerate(ZERO3_CONFIGS)}


def _hf_log_probs(model_dir, state, sequences, n_actions):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        lp = model(sequences).logits.float().log_softmax(-1)[:, :-1]
    return lp.gather(-1, sequences[:, 1:, None])[..., 0][:, -n_actions:]


def audit_exactness(audit: str, model_dir: str, n_batches: int):
    """Recompute, with HF and the audit trail's weights of each version, every token's log-prob and compare
    with the π_prox the loss used. Returns (tokens checked, stale tokens checked, responses spanning a sync,
    worst |difference|, largest gap between the used value and the current weights' on stale tokens)."""
    import glob

    from safetensors.torch import load_file

    weights = {int(p.rsplit("_v", 1)[1].split(".")[0]): load_file(p) for p in glob.glob(f"{audit}/weights_v*")}
    batches = [torch.load(p) for p in sorted(glob.glob(f"{audit}/batch_v*.pt"))]
    assert len(batches) == n_batches and len(weights) >= n_batches, (len(batches), sorted(weights))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    checked = stale_checked = mixed_responses = 0
    worst = recompute_gap = 0.0
    for batch in batches:
        current = batch["weight_version"]
        for mb in batch["micro_batches"]:
            seqs, mask, versions, used = mb["sequences"], mb["action_mask"].bool(), mb["rollout_versions"], None
            used = mb["action_log_probs"]
            n = mask.shape[1]
            hf = {}
            for v in sorted(set(versions[mask].tolist())):
                model.load_state_dict(weights[v])
                with torch.no_grad():
                    lp = model(seqs, attention_mask=mb["attention_mask"]).logits.float().log_softmax(-1)[:, :-1]
                hf[v] = lp.gather(-1, seqs[:, 1:, None])[..., 0][:, -n:]
                sel = mask & (versions == v)
                worst = max(worst, (used[sel] - hf[v][sel]).abs().max().item())
                checked += int(sel.sum())
            if current not in hf:
                model.load_state_dict(weights[current])
                with torch.no_grad():
                    lp = model(seqs, attention_mask=mb["attention_mask"]).logits.float().log_softmax(-1)[:, :-1]
                hf[current] = lp.gather(-1, seqs[:, 1:, None])[..., 0][:, -n:]
            stale = mask & (versions >= 0) & (versions < current)
            if stale.any():  # what upstream's recompute would have used: the current weights
                recompute_gap = max(recompute_gap, (used[stale] - hf[current][stale]).abs().max().item())
                stale_checked += int(stale.sum())
            for row in range(seqs.shape[0]):
                mixed_responses += len(set(versions[row][mask[row]].tolist())) > 1
    return checked, stale_checked, mixed_responses, worst, recompute_gap


@pytest.mark.engine
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_snapshot_scores_each_token_with_its_version(tiny_world, tmp_path, zero_stage):
    res = _run(tiny_world, tmp_path, zero_stage=zero_stage, mode="snapshot")
    seqs, n, versions = res["sequences"], res["n_actions"], res["versions"]
    hf = {v: _hf_log_probs(tiny_world["model"], res["states"][v], seqs, n) for v in (0, 1, 2)}
    expected = res["current"].clone()  # untagged tokens (-1) keep the live weights' log-prob
    for v in (0, 1, 2):
        expected[versions == v] = hf[v][versions == v]
    assert (res["prox"] - expected).abs().max().item() < 1e-5
    # recompute (upstream) differs on the stale tokens: the versions really are distinguishable
    stale = (versions == 0) | (versions == 1)
    assert (res["current"][stale] - res["prox"][stale]).abs().min().item() > 1e-4
    assert (res["current"] - hf[2]).abs().max().item() < 1e-5  # the live weights are version 2
    m = res["metrics"]
    assert m["prox/extra_forwards"] == 2.0  # versions 0 and 1; version 2 is the live forward
    assert m["prox/host_memory_mb"] > 0 and m["prox/missing_version_tokens"] == 0
    # the rows as two micro-batches grouped by version (the actor's make-experience path): same values, and
    # versions 0 and 1 swapped in once each for both (fp32: 4 bytes per parameter), forwards in both
    assert (res["grouped"] - expected).abs().max().item() < 1e-5
    g = res["grouped_metrics"]
    assert g["prox/swap_bytes"] == 2 * 4 * sum(res["numels"]) and g["prox/extra_forwards"] == 4.0


@pytest.mark.engine
def test_zero3_snapshots_are_partitions_swapped_on_every_rank(tiny_world, zero3_two_ranks):
    """ZeRO-3, two ranks: each rank keeps only its partition of every version (host memory halves), the swap
    reaches both gathered-on-demand and persistent parameters, every token still gets its version's
    weights, and rank 1 — which has no stale token — joins rank 0's swapped forwards (else the gathers hang)."""
    results = zero3_two_ranks["snapshot"]
    for rank, res in enumerate(results):
        seqs, n, versions = res["sequences"], res["n_actions"], res["versions"]
        hf = {v: _hf_log_probs(tiny_world["model"], res["states"][v], seqs, n) for v in (0, 1, 2)}
        expected = res["current"].clone()
        for v in (0, 1, 2):
            expected[versions == v] = hf[v][versions == v]
        assert (res["prox"] - expected).abs().max().item() < 1e-5, rank
        assert (res["current"] - hf[2]).abs().max().item() < 1e-5, rank  # the live weights are version 2
        # the live weights are back, bit for bit, and in the very tensors the optimizer updates
        assert torch.equal(res["after"], res["current"]) and res["storage_moved"] == [], rank
        assert res["metrics"]["prox/extra_forwards"] == 2.0, rank  # versions 0 and 1, on both ranks
        # a real mix: every parameter partitioned, some also kept gathered (ZeRO-3 "persistent" ones)
        assert res["partitioned"] == len(res["numels"]) and 0 < res["persistent"] < len(res["numels"])
        shard_bytes = sum(-(-numel // 2) * 4 for numel in res["numels"])  # fp32, half of each, rounded up
        assert res["metrics"]["prox/host_memory_mb"] * 2**20 == 3 * shard_bytes  # versions 0, 1, 2
        # two micro-batches grouped by version: each stale partition moved once; rank 1 (nothing stale) pads to
        # rank 0's two forwards per version
        assert (res["grouped"] - expected).abs().max().item() < 1e-5, rank
        g = res["grouped_metrics"]
        assert g["prox/swap_bytes"] == 2 * shard_bytes and g["prox/extra_forwards"] == 4.0, rank
    # the gathered weights agree across ranks (on CPU this needs cpu_compat's "ZeRO-3 all-gathers" patch:
    # without it some gathers were read before they arrived, and the reference itself was garbage)
    for v in (0, 1, 2):
        assert all(torch.equal(t, results[1]["states"][v][k]) for k, t in results[0]["states"][v].items())
    stale = (results[0]["versions"] == 0) | (results[0]["versions"] == 1)
    assert (results[0]["current"][stale] - results[0]["prox"][stale]).abs().min().item() > 1e-4
    assert not ((results[1]["versions"] == 0) | (results[1]["versions"] == 1)).any()


def _independent_ewma(steps, beta=0.9):  # --algo.prox_ewma_decay default
    """PPO-EWMA from the full weights after each optimizer step: avg_n = beta avg_{n-1} + (1 - beta) theta_n,
    avg_0 = 0; theta_hat = avg_n / (1 - beta^n)."""
    avg = {k: torch.zeros_like(v) for k, v in steps[0].items()}
    for state in steps:
        avg = {k: beta * avg[k] + (1 - beta) * state[k] for k in avg}
    return {k: v / (1 - beta ** len(steps)) for k, v in avg.items()}


@pytest.mark.engine
def test_zero3_ewma_averages_partitions(tiny_world, zero3_two_ranks):
    """ZeRO-3, two ranks: each rank averages its own partition; swapped in together they are the EWMA of the
    full weights, computed here from the gathered weights after every optimizer step."""
    results = zero3_two_ranks["ewma-batch"]
    for res in results:
        assert len(res["step_states"]) == 4  # 2 rollouts x 2 optimizer steps
        hf = _hf_log_probs(
            tiny_world["model"], _independent_ewma(res["step_states"]), res["sequences"], res["n_actions"]
        )
        assert (res["prox"] - hf).abs().max().item() < 1e-5
        assert (res["prox"] - res["current"]).abs().max().item() > 1e-4  # not the live weights
        assert torch.equal(res["after"], res["current"]) and res["storage_moved"] == []


@pytest.mark.engine
def test_ewma_scores_with_bias_corrected_average(tiny_world, tmp_path):
    res = _run(tiny_world, tmp_path, zero_stage=0, mode="ewma", ewma_style="batch")  # the default is hilton
    steps = res["step_states"]
    assert len(steps) == 4  # 2 rollouts x 2 optimizer steps
    hf = _hf_log_probs(tiny_world["model"], _independent_ewma(steps), res["sequences"], res["n_actions"])
    assert (res["prox"] - hf).abs().max().item() < 1e-5
    assert (res["prox"] - res["current"]).abs().max().item() > 1e-4  # not the live weights
    assert res["metrics"]["prox/extra_forwards"] == 1.0


def _independent_hilton_ewma(theta0, steps, beta=0.9):
    """PPO-EWMA as Hilton et al. published it: the weights β^(n-k) / Σ_j β^(n-j) over θ_0..θ_n (θ_0 included
    with weight β^n, no bias correction), written as that explicit weighted sum."""
    states = [theta0] + list(steps)
    n = len(states) - 1
    weights = [beta ** (n - k) for k in range(n + 1)]
    total = sum(weights)
    return {key: sum(w * s[key] for w, s in zip(weights, states)) / total for key in theta0}


@pytest.mark.engine
@pytest.mark.parametrize("ranks,zero_stage", [(1, 0), (2, 3)])
def test_hilton_ewma_recomputes_prox_for_every_minibatch(tiny_world, tmp_path, zero3_two_ranks, ranks, zero_stage):
    """--algo.prox_ewma_style hilton: the π_prox each minibatch's loss uses is a forward of the EWMA of θ_0..θ_m as
    it stands after the m optimizer steps before that minibatch, computed here from the gathered weights (HF), not
    the rollout batch's once-per-batch value; under ZeRO-3 each rank averages its partition."""
    if ranks == 2:  # ZeRO-3, persistence threshold 100: the launch shared with the two tests above
        results = zero3_two_ranks["ewma-hilton"]
    else:
        results = _run(tiny_world, tmp_path, ranks=ranks, zero_stage=zero_stage, mode="ewma", ewma_style="hilton")
    for res in results if ranks > 1 else [results]:
        theta0 = res["states"][0]
        assert len(res["minibatch_prox"]) == 4 and len(res["step_states"]) == 4
        seen_steps = []
        for before, used, sequences in res["minibatch_prox"]:
            expected_state = _independent_hilton_ewma(theta0, res["step_states"][:before])
            n_actions = used.shape[1]
            hf = _hf_log_probs(tiny_world["model"], expected_state, sequences, n_actions)
            assert (used - hf).abs().max().item() < 1e-5, before
            seen_steps.append(before)
        assert seen_steps == [0, 1, 2, 3]  # recomputed between every two optimizer steps
        # the make-experience scoring (proximal_log_probs) also used the published average, after 4 steps
        hf = _hf_log_probs(
            tiny_world["model"],
            _independent_hilton_ewma(theta0, res["step_states"]),
            res["sequences"],
            res["n_actions"],
        )
        assert (res["prox"] - hf).abs().max().item() < 1e-5
        assert torch.equal(res["after"], res["current"]) and res["storage_moved"] == []


@pytest.mark.real_stack
@pytest.mark.parametrize(
    "mode, extra",
    [
        # slow: every check of this run runs in the gate on the resumed run of tests/test_resume.py's snapshot
        # kill-and-resume case (the same flags, held at the span gate)
        pytest.param("snapshot", [], marks=pytest.mark.slow, id="snapshot-extra0"),
        # slow: every check of this run runs in the gate twice, on the kill-and-resume case's resumed interrupt
        # run (the reload sync) and on tests/test_broadcast_sync.py::test_broadcast_interrupt_zero3_exact
        # (upstream's broadcast, ZeRO-3, stack tier), both held at the span gate
        pytest.param("interrupt", [], marks=pytest.mark.slow, id="interrupt-extra1"),
        # the stack tier (pytest.ini), which CI runs beside the default suite (scripts/test.sh)
        pytest.param("dedicated", [], marks=pytest.mark.stack, id="dedicated-extra2"),
        # ZeRO-3 shards the actor: the dedicated model gets the gathered weights at every sync
        pytest.param("dedicated", ["--ds.zero_stage", "3"], marks=pytest.mark.slow, id="dedicated-zero3"),
        # two actor ranks: stale streams are split between them, each scores with its kept copy
        pytest.param("interrupt", ["--actor.num_gpus_per_node", "2"], marks=pytest.mark.slow, id="interrupt-2ranks"),
        pytest.param("snapshot", ["--actor.num_gpus_per_node", "2"], marks=pytest.mark.slow, id="snapshot-2ranks"),
        # ZeRO-3 over two ranks: the kept copies are each rank's partitions, swapped in on both ranks at once
        pytest.param(
            "snapshot",
            ["--ds.zero_stage", "3", "--actor.num_gpus_per_node", "2"],
            marks=pytest.mark.slow,
            id="snapshot-zero3-2ranks",
        ),
        pytest.param(
            "interrupt",
            ["--ds.zero_stage", "3", "--actor.num_gpus_per_node", "2"],
            marks=pytest.mark.slow,
            id="interrupt-zero3-2ranks",
        ),
    ],
)
def test_exact_modes_through_the_whole_async_partial_pipeline(tiny_world, tmp_path, mode, extra):
    """Async + partial rollouts on the real stack (vLLM CPU + DeepSpeed, fp32): the π_prox the loss used
    equals, for every token, HF's log-prob under the weights of that token's version, kept aside by the
    audit trail (the weights as synced to the engines). Recompute (the current weights) does not.

    snapshot scores stale tokens when the batch is consumed; interrupt (the actor's one kept copy) and
    dedicated (a separate old-log-prob model) score them at the weight sync that retires their version,
    in-flight prefixes included."""
    from tests.helpers import span_gate
    from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args

    run_dir, audit = str(tmp_path), str(tmp_path / "audit")
    args = tiny_args(tiny_world, run_dir, steps_prompts=24)
    for flag, value in (("--rollout.max_new_tokens", "160"), ("--data.max_len", "192")):
        # long responses, held at the span gate after their first tokens until the sync (from the second sync
        # on: tests/helpers/span_gate.py), so responses in flight span it by the run's progress
        args[args.index(flag) + 1] = value
    flags = ["--train.async_enable", "--train.partial_rollout_enable", "--ds.param_dtype", "fp32"]
    flags += ["--vllm.dtype", "float32", "--algo.prox_mode", mode, "--algo.prox_audit_dir", audit]
    if mode == "snapshot":
        flags += ["--algo.prox_snapshots", "3"]
    gate = str(tmp_path / "span_gate")
    rc, log = run_cli(args + flags + extra, run_dir, launcher=span_gate.LAUNCHER, env={span_gate.ENV: gate})
    assert rc == 0, log[-5000:]
    assert span_gate.held(gate), "the span gate never held a step: no sync was made to land inside a batch"
    tb = read_tensorboard(run_dir)
    assert sum(v for _, v in tb["train/prox/masked_missing_tokens"]) == 0  # every stale token was scored
    if mode != "snapshot":
        assert sum(v for _, v in tb["train/prox/sync_scored_tokens"]) > 0

    checked, stale_checked, mixed_responses, worst, recompute_gap = audit_exactness(audit, tiny_world["model"], 3)
    print(
        f"[exactness] {mode} {extra}: {checked} tokens, {stale_checked} stale, {mixed_responses} spanning a sync, "
        f"worst {worst:.1e}, recompute off by {recompute_gap:.2e}"
    )
    assert checked > 200 and stale_checked > 0
    assert mixed_responses > 0, "no response spanned a weight sync: the partial-rollout case went untested"
    assert worst < 1e-4, f"pi_prox differs from its version's weights by {worst:.2e}"
    assert recompute_gap > 1e-3, "recompute would have been indistinguishable: the test could not fail"


@pytest.mark.real_stack
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", [[], ["--ds.zero_stage", "3", "--actor.num_gpus_per_node", "2"]], ids=["zero2", "zero3-2ranks"]
)
def test_ewma_state_survives_checkpoint_and_resume(tiny_world, tmp_path, layout):
    """Stop after 2 steps (checkpoint each step), restart with --ckpt.load_enable: the PPO-EWMA average
    continues (one optimizer step per global step here, so its update count equals the global step).
    Under ZeRO-3 each rank saves and restores its own partition of the average (DeepSpeed writes one
    client state per rank), checked against the parameters' layout at load."""
    from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args

    def run(name, extra):
        run_dir = str(tmp_path / name)
        os.makedirs(run_dir)
        args = tiny_args(tiny_world, run_dir)
        ckpt = str(tmp_path / "ckpt")  # shared by both runs
        args[args.index("--ckpt.path") + 1] = ckpt
        flags = ["--algo.prox_mode", "ewma", "--ckpt.save_steps", "1"] + layout + extra
        rc, log = run_cli(args + flags, run_dir)
        assert rc == 0, log[-5000:]
        return {s: v for s, v in read_tensorboard(run_dir)["train/prox/ewma_updates"]}

    first = run("first", [])
    assert first == {1: 1.0, 2: 2.0}
    # default off (sync run): upstream's checkpoint only, none of our async-resume sidecars (trainer/resume.py)
    import glob

    assert glob.glob(f"{tmp_path}/ckpt/_actor/global_step2/*")
    assert not glob.glob(f"{tmp_path}/ckpt/**/*.pkl", recursive=True)
    resumed = run("resumed", ["--ckpt.load_enable", "--train.num_episodes", "2"])
    assert resumed and min(resumed) >= 3, resumed  # it did resume from the checkpoint
    for step, updates in resumed.items():
        assert updates == float(step), resumed  # restored count; a fresh EWMA would restart at 1


@pytest.mark.real_stack
@pytest.mark.slow
def test_killed_between_steps_resumes_exactly(tiny_world, tmp_path):
    """The job is killed (SIGKILL, whole process group) after its step-2 checkpoint; the same command run
    again resumes from that checkpoint, and with an exact π_prox mode (interrupt) every token of the
    resumed run is scored with its version's weights (audit trail, HF recomputation)."""
    import glob
    import shutil
    import signal
    import time

    from tests.helpers.e2e import REPO as E2E_REPO
    from tests.helpers.e2e import read_tensorboard, tiny_args
    from tests.helpers.faults import _Tree, end_processes, run_cli_tracked

    run_dir, audit = str(tmp_path), str(tmp_path / "audit")
    args = tiny_args(tiny_world, run_dir, steps_prompts=32)  # tiny_world's 32 prompts: 4 steps
    for flag, value in (("--rollout.max_new_tokens", "48"), ("--data.max_len", "96")):
        args[args.index(flag) + 1] = value
    args += ["--train.async_enable", "--train.partial_rollout_enable", "--ds.param_dtype", "fp32"]
    args += ["--vllm.dtype", "float32", "--algo.prox_mode", "interrupt", "--algo.prox_audit_dir", audit]
    args += ["--ckpt.save_steps", "1", "--ckpt.load_enable"]
    ckpt = args[args.index("--ckpt.path") + 1]
    ray_dir = args[args.index("--ray.temp_dir") + 1]
    cmd = [sys.executable, "-m", "openrlhf_ess.cli.train_ppo_ray", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_DIR": run_dir}

    with open(os.path.join(run_dir, "first.txt"), "w") as log:
        first = subprocess.Popen(
            cmd, cwd=E2E_REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def saved_step():  # DeepSpeed writes `latest` (the tag) once a checkpoint is complete
        tags = [open(f).read().strip() for f in glob.glob(f"{ckpt}/**/latest", recursive=True)]
        return max([int(t[len("global_step") :]) for t in tags if t.startswith("global_step")], default=0)

    with _Tree(first.pid) as tree:
        deadline = time.time() + 600
        while saved_step() < 2:
            assert first.poll() is None, open(os.path.join(run_dir, "first.txt")).read()[-4000:]
            assert time.time() < deadline, "no step-2 checkpoint within 10 minutes"
            time.sleep(0.2)
        tree.sample()
        os.killpg(first.pid, signal.SIGKILL)  # the job, its Ray head and workers started in its session
        first.wait(timeout=60)
    # Processes of the run outside its process group (Ray workers: a worker lives on until it sees its raylet
    # gone, and may still finish a checkpoint meanwhile): ended by PID, as recorded, before the state is read
    end_processes(tree.alive(), grace=5)
    shutil.rmtree(ray_dir, ignore_errors=True)
    killed_after = saved_step()
    assert killed_after < 4  # it really stopped early
    if not glob.glob(f"{ckpt}/_actor/global_step{killed_after}/openrlhf_ess_resume.pkl"):
        killed_after -= 1  # killed during that save (after DeepSpeed's `latest`): the resume loads the one before
    shutil.move(audit, audit + "_first")  # the audit trail restarts with the run's versions

    second = run_cli_tracked(args, run_dir, timeout=900)  # the same command; its processes ended on any exit
    assert second.rc == 0 and not second.timed_out and not second.leftovers, second.log[-5000:]
    steps = sorted({s for s, _ in read_tensorboard(run_dir)["train/reward"]})
    batches = len(glob.glob(f"{audit}/batch_v*.pt"))
    # resumed from the last complete checkpoint: the steps after it, one batch each, to the end of the epoch
    # (the batches queued or in flight at the checkpoint are generated again; tests/test_resume.py counts prompts)
    assert steps[-1] == 4 and batches == 4 - killed_after, (steps, batches, killed_after)
    checked, stale, mixed, worst, gap = audit_exactness(audit, tiny_world["model"], batches)
    assert checked > 100 and worst < 1e-4, (checked, worst)
