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
import math
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


def sequence_log_weights(exp, algo) -> torch.Tensor:
    """(B,) float64 log of each sample's weight in b* (``--algo.advantage.opob_weight``):

    - ``tis``: w_i = the weight the loss applies, a sequence summary of it at the token level: min(w_i, C) with
      ``--algo.tis_cap C``, w_i = exp(Σ_t log π_prox/μ) at ``--algo.tis_level seq_product``, else the
      ``--algo.ess_lr_weight`` form (geometric mean by default); 0 (w = 1) without a TIS cap (the loss weights no
      sample: b* is then the optimal baseline of the estimator actually used) or without μ.
    - ``seq_product``: as VCPO's reference code (``use_is_weights=True, use_clipped_is_ratios=False``): the
      untruncated trajectory ratio exp(Σ_t log π_prox/μ) times the sequence weight d_i the loss applies
      (``--algo.tis_level seq``/``seq_product``; 1 otherwise). The reference's ‖g_i‖ is the norm of trajectory i's
      gradient of the IS-weighted loss, d_i·‖∇ log π(τ_i)‖, and its b* weighs that by the ratio² again; ours is the
      unweighted norm, so d_i enters here.
    - ``seq_product_truncated``: the same with the ratio truncated at C (``use_clipped_is_ratios=True``).

    In log space: a product over thousands of tokens overflows float64's exp, while b* only needs the weights'
    ratios within a group (:func:`opob.optimal_baseline_log`). A sample without a response token gets −inf (w = 0).
    """
    kind = algo.advantage.opob_weight
    if exp.rollout_log_probs is None or (kind == "tis" and algo.tis_cap is None):
        return torch.zeros(exp.action_mask.shape[0], dtype=torch.float64)
    args = (exp.action_log_probs, exp.rollout_log_probs, exp.action_mask)
    sequence_loss_weight = algo.tis_level in corrections.SEQUENCE_TIS_LEVELS and algo.tis_cap is not None
    if kind == "tis":
        form = "seq_product" if algo.tis_level == "seq_product" else algo.ess_lr_weight
        log_w, valid = corrections.sequence_log_weights(*args, form)
        log_w = log_w.clamp(max=math.log(algo.tis_cap))
    else:
        log_w, valid = corrections.sequence_log_weights(*args, "seq_product")
        if kind == "seq_product_truncated":
            log_w = log_w.clamp(max=math.log(algo.tis_cap))
        if sequence_loss_weight:  # d_i, the loss's own weight of the sequence
            form = "seq_product" if algo.tis_level == "seq_product" else "geo_mean"
            log_d, _ = corrections.sequence_log_weights(*args, form)
            log_w = log_w + log_d.clamp(max=math.log(algo.tis_cap))
    return torch.where(valid, log_w, torch.full_like(log_w, -math.inf))


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
    log_weights = _in_prompt_order(experiences, [sequence_log_weights(exp, algo) for exp in experiences])
    weights = log_weights.exp()  # for the metrics only: b* is computed from the logs
    norms = _in_prompt_order(experiences, sq_norms)
    estimator = algo.advantage.estimator
    if estimator == "reinforce_baseline":
        rewards = _in_prompt_order(experiences, [exp.rewards for exp in experiences])
        b = opob.optimal_baseline_log(rewards, log_weights, norms, n)
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
        b = opob.optimal_baseline_log(rewards, log_weights, norms, n)
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
