"""``--algo.advantage.baseline opob`` (VCPO's off-policy optimal baseline; maths in ``models/opob.py``).

Two places, one concern:

- actor ranks (:func:`norms_captured`): during the make-experience forward at the current weights θ, a forward hook
  on the LM head computes each sample's ‖∇_W log π_θ(τ_i)‖² from the head's own inputs and outputs (ghost-norm
  identity), before upstream's ``Actor.forward`` divides the logits by the temperature in place. The norms ride
  back with the log-probs as one extra last column (:func:`with_norms` / :func:`split_norms`), so upstream's
  result plumbing is untouched and no other call is made.
- controller (:func:`replace_baseline`): the group baseline of upstream's estimator is replaced by
  b* = Σ w²‖g‖²R / Σ w²‖g‖² over each prompt's n samples (the set VCPO defines it on), w_i the IS weight the loss
  applies: min(exp(mean_t log π_prox/μ), C) with ``--algo.tis_cap C``, 1 without one (or without μ).
  RLOO, Dr. GRPO, GRPO: upstream's advantages are shifted by (b_up − b*)·s afterwards (s = 1/(std + ε) for GRPO),
  which is exact because they are not whitened. REINFORCE-baseline (whitened over the batch): R − b* goes through
  upstream's own ``reinforce`` path, i.e. the same cumulative returns and whitening without its mean baseline.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator, List, Optional

import torch

from openrlhf_ess.models import corrections, opob


@contextlib.contextmanager
def norms_captured(head: torch.nn.Module, sequences, action_mask, temperature: float) -> Iterator[List]:
    """Within the block, the LM head's next forward computes the per-sample squared gradient norms of its weight
    for the actions ``sequences[:, -A:]`` (A = ``action_mask.shape[1]``): appended to the yielded list as a (B,)
    float32 CPU tensor. The logits scoring action t are at position −A−1+t of the head's output (upstream's
    ``Actor.forward`` slicing), whatever ``logits_to_keep`` the forward used."""
    out: List[torch.Tensor] = []
    n_actions = action_mask.shape[1]

    def hook(module, inputs, logits):
        if out:  # one capture per block: later forwards (e.g. a π_prox weight swap) are not θ's
            return
        h = inputs[0][:, -n_actions - 1 : -1]
        z = logits[:, -n_actions - 1 : -1]
        tokens = sequences[:, -n_actions:].to(z.device)
        mask = action_mask.to(device=z.device)
        out.append(opob.lm_head_sq_grad_norms(h, z.detach(), tokens, mask, temperature).cpu())

    handle = head.register_forward_hook(hook)
    try:
        yield out
    finally:
        handle.remove()


def with_norms(log_probs: torch.Tensor, sq_norms: torch.Tensor) -> torch.Tensor:
    """(B, A) log-probs and (B,) norms -> (B, A + 1): what the actor's forward returns with OPOB on."""
    return torch.cat([log_probs, sq_norms.to(log_probs.dtype)[:, None]], dim=1)


def split_norms(per_actor: list, duplicate_factor: int):
    """The actor group's forward results (one list of (B, A + 1) tensors per actor) -> the same structure with the
    last column removed, and the norms of each micro-batch in upstream's flattened order (ring / TP copies once)."""
    stripped = [[t[:, :-1] for t in results] for results in per_actor]
    norms = [t[:, -1].float() for t in itertools.chain.from_iterable(per_actor[::duplicate_factor])]
    return stripped, norms


def sequence_weights(exp, algo) -> torch.Tensor:
    """(B,) the IS weight the run's estimator applies to each sample: w_i = min(exp(mean_t log π_prox/μ), C) with
    ``--algo.tis_cap C`` (``--algo.ess_lr_weight`` form; exactly the sequence-level TIS weight, a sequence summary
    of the token-level one); 1 without a TIS cap (the loss weights no sample: b* is then the on-policy optimal
    baseline of the estimator actually used) or without μ."""
    if exp.rollout_log_probs is None or algo.tis_cap is None:
        return torch.ones(exp.action_mask.shape[0], dtype=torch.float64)
    log_w, valid = corrections.sequence_log_weights(
        exp.action_log_probs, exp.rollout_log_probs, exp.action_mask, algo.ess_lr_weight
    )
    w = torch.where(valid, log_w.exp(), torch.zeros_like(log_w))
    return w.clamp(max=algo.tis_cap)


def _in_prompt_order(experiences, per_exp: List[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-experience (B,) values and put them in upstream's prompt order (``experience.index``)."""
    indices = torch.tensor(list(itertools.chain.from_iterable(exp.index for exp in experiences)))
    flat = torch.cat([v.to(torch.float64) for v in per_exp])
    out = torch.empty_like(flat)
    out[indices] = flat
    return out


def _back_to_experiences(experiences, values: torch.Tensor) -> List[torch.Tensor]:
    indices = torch.tensor(list(itertools.chain.from_iterable(exp.index for exp in experiences)))
    return list(values[indices].split([len(exp.index) for exp in experiences]))


def replace_baseline(maker, experiences, upstream_compute, sq_norms: Optional[List[torch.Tensor]]):
    """Upstream's ``compute_advantages_and_returns`` with its group baseline replaced by b* (module docstring).
    Returns the experiences and the batch's metrics."""
    args = maker.strategy.args
    algo, n = args.algo, args.rollout.n_samples_per_prompt
    if sq_norms is None or len(sq_norms) != len(experiences):
        raise RuntimeError(
            "--algo.advantage.baseline opob: the actor's forward returned no gradient norms for this batch "
            f"({0 if sq_norms is None else len(sq_norms)} of {len(experiences)} micro-batches); this is a bug."
        )
    weights = _in_prompt_order(experiences, [sequence_weights(exp, algo) for exp in experiences])
    norms = _in_prompt_order(experiences, sq_norms)
    estimator = algo.advantage.estimator
    if estimator == "reinforce_baseline":
        rewards = _in_prompt_order(experiences, [exp.rewards for exp in experiences])
        b = opob.optimal_baseline(rewards, weights, norms, n)
        # upstream's length-penalty step copies exp.rewards into info["reward"] (the logged reward): both are put
        # back afterwards, so the shift reaches the advantages only
        raw = [(exp.rewards, exp.info.get("reward")) for exp in experiences]
        for exp, shifted in zip(experiences, _back_to_experiences(experiences, rewards - b)):
            exp.rewards = shifted.to(exp.rewards.dtype)
        saved = (algo.advantage.estimator, maker.advantage_estimator)
        algo.advantage.estimator = maker.advantage_estimator = "reinforce"
        try:
            experiences = upstream_compute(experiences)
        finally:
            algo.advantage.estimator, maker.advantage_estimator = saved
        for exp, (r, logged) in zip(experiences, raw):
            exp.rewards = r
            if logged is not None:
                exp.info["reward"] = logged
        b_up = rewards.reshape(-1, n).mean(-1, keepdim=True).expand(-1, n).reshape(-1)
    else:
        experiences = upstream_compute(experiences)  # length penalties applied to exp.rewards in place
        rewards = _in_prompt_order(experiences, [exp.rewards for exp in experiences]).reshape(-1, n)
        if estimator == "rloo":
            b_up = (rewards.sum(-1, keepdim=True) - rewards) / (n - 1)
        else:  # dr_grpo, group_norm: the group mean
            b_up = rewards.mean(-1, keepdim=True).expand(-1, n)
        scale = 1.0 / (rewards.std(-1, keepdim=True) + 1e-9) if estimator == "group_norm" else None
        b_up, rewards = b_up.reshape(-1), rewards.reshape(-1)
        b = opob.optimal_baseline(rewards, weights, norms, n)
        shift = opob.opob_shift(b_up, b, None if scale is None else scale.expand(-1, n).reshape(-1))
        for exp, s in zip(experiences, _back_to_experiences(experiences, shift)):
            delta = s.to(exp.advantages.dtype)[:, None] * exp.action_mask.to(exp.advantages.dtype)
            exp.advantages = exp.advantages + delta
            exp.returns = exp.returns + delta
    spread = norms.sqrt().reshape(-1, n)
    metrics = {
        "opob/baseline": b.mean().item(),
        "opob/baseline_minus_mean": (b - rewards.reshape(-1, n).mean(-1, keepdim=True).expand(-1, n).reshape(-1))
        .abs()
        .mean()
        .item(),
        "opob/upstream_baseline": b_up.mean().item(),
        "opob/grad_norm_mean": spread.mean().item(),
        # the norms' spread within a prompt's group: 0 when OPOB equals the mean baseline (equal w and norms)
        "opob/grad_norm_rel_spread": (spread.std(-1) / spread.mean(-1).clamp(min=1e-12)).mean().item(),
        "opob/weight_mean": weights.mean().item(),
    }
    return experiences, metrics
