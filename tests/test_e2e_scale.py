"""The CLI end to end at more than one process per role: two actor ranks under ZeRO-3 (whose final save is made to
fail), and a run with a reference model and a critic on a tied-embedding model, each with our corrections on. Every
feature's metrics reach tensorboard at every step; the ESS and TIS numbers are recomputed from the audit trail,
independently of the code under test."""

import glob
import math
import os
import re
import shutil

import pytest
import torch

from tests.helpers import fault_injection
from tests.helpers.e2e import run_cli, tiny_args
from tests.test_e2e_cli import _check_run
from tests.test_tied_lm_head_e2e import FLAGS as TIED_HEAD_FLAGS
from tests.test_tied_lm_head_e2e import check_tied_head_followed

SAMPLES = 32  # per step: 8 prompts x 4 samples, over all actor ranks
RUN_TIMEOUT = 1080  # s; 1-2 min each on 2 cores, far more when other test runs share them


def _last_step(lines: list) -> int:
    """The index of the run's last "Global step" line (past the end if there is none)."""
    return max((i for i, line in enumerate(lines) if "Global step" in line), default=len(lines))


def _without_teardown_traceback(log: str) -> str:
    """The log without Ray's teardown message, if any: after the run, Ray's worker SIGTERM handler can raise
    SystemExit inside a finalizer (``ActorHandle.__del__``) of a Ray actor being torn down, and Python prints
    "Exception ignored in ... SystemExit: 1" with a traceback (1 in ~7 runs of the first test; the process
    exits all the same). Only that block is dropped, and only after the run's last step: any other traceback
    still fails the run."""
    lines = log.splitlines(keepends=True)
    last_step = _last_step(lines)
    out, i = lines[: last_step + 1], last_step + 1
    while i < len(lines):
        if "Exception ignored in: <function ActorHandle.__del__" in lines[i]:
            prefix = lines[i].split("Exception ignored in")[0]  # the actor's "(Class pid=N)" tag
            end = next((j for j in range(i + 1, len(lines)) if "SystemExit: 1" in lines[j]), None)
            block = lines[i : end + 1] if end is not None else []
            if block and all(line.startswith(prefix) for line in block) and any("sigterm_handler" in b for b in block):
                i = end + 1
                continue
        out.append(lines[i])
        i += 1
    return "".join(out)


def _set(args: list, flag: str, value: str) -> list:
    """``args`` with ``flag``'s value (a flag tiny_args already sets) replaced."""
    args[args.index(flag) + 1] = value
    return args


def _every_step(scalars: dict, tag: str) -> list:
    """The tag's values at every step of the run (each logged exactly once), all finite."""
    steps = len(scalars["train/reward"])
    assert tag in scalars, f"{tag} never logged; logged: {sorted(scalars)}"
    assert [s for s, _ in scalars[tag]] == list(range(1, steps + 1)), (tag, scalars[tag])
    values = [v for _, v in scalars[tag]]
    assert all(math.isfinite(v) for v in values), (tag, values)
    return values


def _check_ess_lr(scalars: dict) -> list:
    """ESS-LR metrics at every step, consistent with each other: lr_scale = clamp(√ρ, floor 0.1, 1),
    B = ess / ρ is the whole rollout (all ranks' shards), the effective LR is the scheduler's times the scale."""
    scale, rho = _every_step(scalars, "train/lr_scale"), _every_step(scalars, "train/rho_ess")
    ess, lr = _every_step(scalars, "train/ess"), _every_step(scalars, "train/actor_lr")
    effective = _every_step(scalars, "train/actor_lr_effective")
    assert set(_every_step(scalars, "train/ess_lr_missing")) == {0.0}
    for s, r, e, a, eff in zip(scale, rho, ess, lr, effective):
        assert 0 < r <= 1 + 1e-6
        assert s == pytest.approx(min(1.0, max(0.1, math.sqrt(r))), rel=1e-6)
        assert e / r == pytest.approx(SAMPLES, rel=1e-5)  # global B; one rank's shard would give 16
        assert eff == pytest.approx(a * s, rel=1e-5)
    return rho


def _check_tis_and_mismatch(scalars: dict) -> None:
    for key in ("clip_frac", "mean_weight", "max_weight"):
        _every_step(scalars, f"train/tis/{key}")
    assert max(_every_step(scalars, "train/tis/max_weight")) <= 2 + 1e-5  # --algo.tis_cap 2
    _every_step(scalars, "train/is_filter_ratio")  # upstream's own metric of the IS correction we configure
    for key in ("k1", "k3", "chi2", "max_abs_log_ratio"):
        _every_step(scalars, f"train/mismatch/{key}")
    assert set(_every_step(scalars, "train/rollout_logprob_nonfinite")) == {0.0}
    assert set(_every_step(scalars, "train/actor_logprob_nonfinite")) == {0.0}


def _audit_batches(audit: str, steps: int) -> list:
    """The audit trail's batches (what the loss saw: π_prox, μ, action mask, versions), in step order."""
    paths = glob.glob(os.path.join(audit, "batch_v*.pt"))
    batches = sorted((torch.load(p) for p in paths), key=lambda b: b["weight_version"])
    assert [b["weight_version"] for b in batches] == list(range(steps)), paths
    return batches


def _recomputed(batch: dict) -> dict:
    """ρ = ESS/B with w_i = exp(Σ_t (log π_prox − log μ)) (``seq_product``) over every sample of the batch (all
    ranks), the TIS weights min(π_prox/μ, 2) of its response tokens, and its stale tokens (sampled before the
    version that consumed them); float64, from the audit alone (the formulas of README's ESS and TIS sections)."""
    log_w, tis, stale = [], [], 0
    for mb in batch["micro_batches"]:
        mask = mb["action_mask"].bool()
        log_ratio = mb["action_log_probs"].double() - mb["rollout_log_probs"].double()
        for row in range(mask.shape[0]):
            if mask[row].any():
                log_w.append(log_ratio[row][mask[row]].sum().item())
        tis.append(log_ratio[mask].exp().clamp(max=2.0))
        stale += int((mask & (mb["rollout_versions"] < batch["weight_version"])).sum())
    w = [math.exp(x) for x in log_w]
    tis = torch.cat(tis)
    return {
        "n": len(w),
        "rho": sum(w) ** 2 / (len(w) * sum(x * x for x in w)),
        "tis_mean": tis.mean().item(),
        "tis_max": tis.max().item(),
        "tis_clip_frac": (tis >= 2.0 * (1 - 1e-6)).double().mean().item(),
        "stale_tokens": stale,
    }


def _check_failed_final_save(log: str, fallback) -> None:
    """Rank 0's final save failed (ENOSPC injected): our line ends the run naming the cause and the fallback folder
    (``fallback``: its match in the log), and the model there is whole."""
    from transformers import AutoModelForCausalLM

    ours = [line for line in log.splitlines() if line.startswith("openrlhf-ess: error:")]
    assert len(ours) == 1 and "the trained model could not be written to --ckpt.output_dir" in ours[0], log[-5000:]
    assert f"(No space left on device (injected by {fault_injection.FINAL_SAVE_ENV})" in ours[0], ours
    assert fallback and fallback.group(0) in ours[0], ours
    AutoModelForCausalLM.from_pretrained(fallback.group(1))


@pytest.mark.stack
def test_two_actor_ranks_zero3_with_ess_lr_tis_and_interrupt_prox(tiny_world, tmp_path):
    """Two DeepSpeed actor ranks under ZeRO-3 (one vLLM engine, 3 logical GPUs), async + partial rollouts, ESS-LR,
    token TIS and exact π_prox scored at each sync (interrupt). Rank-dependent paths: the ESS moments
    all-gathered over both ranks' shards, the stale streams split between the ranks and scored by each with its
    kept weight partition at the sync, ZeRO-3 gathers for the weight sync and its check, the metric reduction.

    ``--rollout.top_p 0.8`` makes μ (the engine's truncated, renormalised distribution) larger than π_prox
    (README: truncation shows up as π_prox < μ; here π_prox/μ ≈ 0.8 per token, the tiny model being near-uniform),
    and ``--algo.ess_lr_weight seq_product`` turns that into sequence weights ≈ 0.8^length that vary with the
    response length: ρ is visibly below 1, so the ESS check below tells the global ρ from one rank's or from no
    scaling at all (with geo_mean and no truncation, ρ = 1 − 1e-6 here).

    3 steps, not 2: how many tokens of the next batch the engine samples before a sync is a race with the
    trainer's step (measured 1 to ~480 of ~480 at the first sync on a loaded machine); two syncs make a run
    without any stale token unlikely.

    The final save then fails on rank 0 (``ENOSPC``, injected by the test launcher tests/helpers/fault_injection.py,
    as a full disk makes it fail): under ZeRO-3 both ranks gather the weights, then rank 0 writes, and its failure
    must not leave rank 1 waiting in upstream's closing barrier or in the fallback's gather (the ranks agree after
    each attempt). The run ends with exit 1, our line names the cause and the fallback folder, which holds the whole
    trained model (it loads); no process and no /dev/shm file is left. (The sync run's failed save, with the second
    run refused and the resume from a broken checkpoint, is tests/test_outputs_e2e.py's sequence.)"""
    steps = 3
    run_dir, audit = str(tmp_path), str(tmp_path / "audit")
    args = tiny_args(tiny_world, run_dir, steps_prompts=8 * steps)
    _set(args, "--actor.num_gpus_per_node", "2")
    _set(args, "--ds.zero_stage", "3")
    flags = ["--train.async_enable", "--train.partial_rollout_enable", "--algo.prox_mode", "interrupt"]
    flags += ["--algo.ess_lr_enable", "--algo.ess_lr_weight", "seq_product", "--algo.tis_cap", "2"]
    flags += ["--rollout.top_p", "0.8", "--algo.prox_audit_dir", audit]
    env = {fault_injection.FINAL_SAVE_ENV: "ENOSPC"}
    rc, log = run_cli(args + flags, run_dir, timeout=RUN_TIMEOUT, launcher=fault_injection.LAUNCHER, env=env)
    fallback = re.search(r"it was written to (\S+) instead", log)
    try:
        _check_failed_final_save(log, fallback)
    finally:
        if fallback and os.path.basename(fallback.group(1)).startswith("openrlhf_ess_model_"):
            shutil.rmtree(fallback.group(1), ignore_errors=True)
    # quiet up to the last step (no traceback, the checks of _check_run); the failed save's error follows it
    lines = log.splitlines(keepends=True)
    scalars = _check_run(run_dir, rc, "".join(lines[: _last_step(lines) + 1]), steps=steps, rc_expected=1)
    _every_step(scalars, "train/reward")  # finite at every step

    rho = _check_ess_lr(scalars)
    _check_tis_and_mismatch(scalars)
    # the logged numbers are the whole rollout's, as recomputed from what the loss saw (both ranks' samples)
    batches = [_recomputed(b) for b in _audit_batches(audit, steps)]
    for step, (expected, r) in enumerate(zip(batches, rho), start=1):
        assert expected["n"] == SAMPLES, (step, expected)
        assert r == pytest.approx(expected["rho"], rel=1e-5, abs=1e-7), (step, expected)
        assert scalars["train/tis/mean_weight"][step - 1][1] == pytest.approx(expected["tis_mean"], rel=1e-5)
        assert scalars["train/tis/max_weight"][step - 1][1] == pytest.approx(expected["tis_max"], rel=1e-5)
        assert scalars["train/tis/clip_frac"][step - 1][1] == pytest.approx(expected["tis_clip_frac"], abs=1e-6)
    # ρ clearly below 1: the LR really was scaled (lr_scale = √ρ < 1, checked against actor_lr_effective above)
    assert min(rho) < 0.99, rho

    # interrupt π_prox: every metric at every step (the sync-time ones are of the sync ending that step)
    for key in ("sync_score_seconds", "sync_scored_streams", "sync_skipped_consumed", "store_entries"):
        _every_step(scalars, f"train/prox/{key}")
    for key in ("evicted_entries", "extra_forwards", "extra_forward_seconds", "missing_version_tokens"):
        _every_step(scalars, f"train/prox/{key}")
    assert min(_every_step(scalars, "train/prox/host_memory_mb")) > 0  # this rank's kept partition
    for key in ("mean", "max", "frac_0", "frac_1", "frac_2", "frac_3+", "stale_masked_tokens"):
        _every_step(scalars, f"train/version_lag/{key}")
    # Batch k+1 is sampled from when step k starts: its tokens before the sync ending step k are stale when
    # step k+1 consumes it, and were all scored at that sync (split over both ranks); none went unscored.
    assert set(_every_step(scalars, "train/prox/masked_missing_tokens")) == {0.0}
    scored = _every_step(scalars, "train/prox/sync_scored_tokens")
    stale = [b["stale_tokens"] for b in batches]
    assert stale[0] == 0 and sum(stale) > 0, f"no stale token in {steps} steps: the interrupt path went untested"
    assert scored[0] == stale[1]  # exactly those (the first sync check's canary, at step 2, comes later)
    assert all(scored[k - 1] >= stale[k] for k in range(2, steps))

    # the weight sync check: the sync ending step k is checked at step k + 1 (the last sync of a run is not);
    # the weights gathered from both ZeRO-3 partitions equal the engine's, every tensor of the tiny model
    compared = scalars["train/sync/checksum_tensors_compared"]
    assert [s for s, _ in compared] == list(range(2, steps + 1)) and min(v for _, v in compared) >= 17
    assert [s for s, _ in scalars["train/sync/checksum_seconds"]] == list(range(2, steps + 1))
    canary = scalars["train/sync/canary_mean_abs_diff"]  # at the first checked sync
    assert [s for s, _ in canary] == [2] and 0 <= canary[0][1] < 0.5


@pytest.mark.stack
def test_reference_model_and_critic_with_ess_lr_and_tis(tied_world, tmp_path):
    """GAE with a critic and a KL penalty against a reference model (both on their own logical GPU: upstream's
    default of 8 per node never schedules here), synchronous, with ESS-LR and token TIS. The KL goes into the
    reward (upstream's default; the KL *loss* is in test_e2e_cli's all-corrections run).

    The model is the tiny Qwen2 with tied embeddings, trained 6 steps at lr 1e-2 with every check at every sync:
    the run of tests/test_tied_lm_head_e2e.py (the engine's LM head follows the trained embedding), whose checks it
    makes (:func:`check_tied_head_followed`); one run for both, each CLI run's start-up costing ~50 busy core-s."""
    run_dir = str(tmp_path)
    args = tiny_args(tied_world, run_dir, steps_prompts=48)  # 6 steps
    _set(args, "--algo.advantage.estimator", "gae")
    _set(args, "--algo.kl.init_coef", "0.01")
    flags = ["--ref.num_gpus_per_node", "1", "--critic.num_gpus_per_node", "1"]
    flags += ["--algo.ess_lr_enable"] + TIED_HEAD_FLAGS  # token TIS (cap 2), lr 1e-2, the checks at every sync
    rc, log = run_cli(args + flags, run_dir, timeout=RUN_TIMEOUT)
    scalars = _check_run(run_dir, rc, _without_teardown_traceback(log), steps=6)
    check_tied_head_followed(scalars, steps=6)
    reward = _every_step(scalars, "train/reward")

    # the critic trained at every step
    assert min(_every_step(scalars, "train/critic_loss")) >= 0
    for key in ("values", "critic_lr", "critic_grad_norm"):
        _every_step(scalars, f"train/{key}")
    # the reference model: KL(π‖π_ref) is 0 before the first update (both are the initial weights), not after,
    # and the penalty went into the GAE rewards (return = reward − 0.01·Σ_t kl_t per sample): the return equals
    # the reward at step 1 only. (Its size is not checked: per-sample KL means of ~3e-4 of either sign, times
    # the lengths, put the mean 0.27x-1x off 0.01·kl·length in two runs.)
    kl, ret = _every_step(scalars, "train/kl"), _every_step(scalars, "train/return")
    _every_step(scalars, "train/logprobs_diff")
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and ret[0] == pytest.approx(reward[0], abs=1e-6)
    assert kl[1] != 0 and ret[1] != pytest.approx(reward[1], abs=1e-7)

    _check_ess_lr(scalars)
    _check_tis_and_mismatch(scalars)
    assert set(_every_step(scalars, "train/version_lag/max")) == {0.0}  # synchronous
