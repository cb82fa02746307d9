"""Gradient quality: how close each off-policy correction's update direction is to the on-policy gradient.

    python -m benchmarks.gradient_quality [--quick] [--out docs/gradient_quality]

The estimator is measured directly, without training curves. On the offline tiny world (random 2-layer
Qwen2, digit reward):

1. **Policy versions** θ_0..θ_N come from N real optimizer steps (Adam, one step per on-policy batch of
   8 prompts × 4 samples, the CLI's batch shape) trained in-process on the HF model in fp32 with the
   package's ``PolicyLoss``. In-process, because it is the only route that keeps every version's exact
   weights and the PPO-EWMA average in memory at no cost; the CLI's run would need a checkpoint per step.
2. **Sampler**: by default HF ``generate`` in fp32 (temperature 1, no top-k/top-p), μ = the sampler's own
   log-probs (its output logits): engine mismatch ~0, staleness alone. ``--sampler vllm-bf16`` / ``vllm-fp32``
   samples the stale batches with the real vLLM CPU engine instead (one in-process engine, its weights set to
   θ_{N−L} through the package's sync path at each lag; μ = the engine's log-probs), so a bf16 engine's kernel
   mismatch enters μ (docs/staleness_target.md). ``--task target`` uses the interior-optimum
   reward (tiny/reward_target.py) instead of the digit fraction.
3. At θ = θ_N, for each lag L: K stale batches of B sequences from θ_{N−L}; each correction's loss on a
   batch is differentiated at θ_N, giving its update direction g. The reference g* is the same
   policy-gradient loss at ratio 1 on a large fresh batch from θ_N (advantage = reward − group mean, no
   whitening, token-level mean: ``--algo.advantage.estimator reinforce_baseline`` without its std norm).

Corrections (all through ``openrlhf_ess.models.loss.PolicyLoss`` / ``corrections`` / ``trainer.prox``):

| name                       | π_prox (``old_log_probs``)            | IS on π_prox/μ  | other              |
|----------------------------|----------------------------------------|-----------------|--------------------|
| none                       | recompute: π_θN (ratio 1)              | —               |                    |
| TIS                        | recompute: π_θN                        | min(·, 2) token |                    |
| TIS (seq)                  | recompute: π_θN                        | min(·, 2) seq   | geometric mean     |
| IS, no cap                 | recompute: π_θN                        | π_θN/μ token    | diagnostic only    |
| TIS + ESS-LR (recompute)   | recompute: π_θN                        | min(·, 2) token | × clamp(√ρ, 0.1, 1)|
| snapshot + TIS             | exact: π_θ{N−L}                        | min(·, 2) token | PPO clip 0.2       |
| snapshot + TIS + ESS-LR    | exact: π_θ{N−L}                        | min(·, 2) token | × clamp(√ρ, 0.1, 1)|
| EWMA β=0.9 + TIS           | bias-corrected EWMA of θ_1..θ_N        | min(·, 2) token | PPO clip 0.2       |
| EWMA auto + TIS            | EWMA with β = L/(1+L) (``auto``)       | min(·, 2) token | PPO clip 0.2       |
| loglinear + TIS            | log μ + L/(L+1)(log π_θN − log μ)     | min(·, 2) token | PPO clip 0.2       |

"EWMA auto" is ``--algo.prox_ewma_decay auto`` in its steady state: the trainer sets each step's β from the
observed lag, which here is L at every step (one optimizer step per version), so the EWMA runs with β = L/(1+L).

The KL term (``--algo.kl.use_loss``, π_ref = θ_0) is measured the same way against the per-token reverse-KL
gradient E_π_θN[(log π_θ − log π_ref) ∇log π_θ] of the fresh batch: k3 as a loss (upstream's default),
upstream's ``--algo.kl.unbiased_gradient`` (weight π_θ/π_old with recompute's π_old = π_θN), and our k2 with
the TIS-capped weight (``corrections.kl_loss_k2``) over recompute's and the exact π_prox.

ESS-LR scales the learning rate; for plain SGD that is the gradient scaled by the same factor, which is how
it enters here (with Adam the step is not linear in the gradient: the cosine is what carries over).

Metrics per (correction, L), over the K batches: cosine(g, g*), ‖g − g*‖/‖g*‖ (mean ± sd), the cosine of the
pooled direction (mean of the K g's) with g* (bias, with the noise of K·B samples left), and the spread
tr Cov(g) / ‖mean g‖². The same metrics for K fresh batches of size B from θ_N are the noise floor: a
correction that reaches them removes the staleness bias; one below them is biased or noisier.

The control, per lag: sync's own on-policy gradient at θ_{N−L} (the plain estimator at ratio 1, differentiated at
θ_{N−L}, on the same K stale batches and once on a fresh batch from θ_{N−L} as large as g*'s), scored against g*
the same way. It measures how far the on-policy direction itself turns in L steps of synchronous training: where
θ_{N−L} and θ_N sit on opposite sides of an optimum, it is negative with no stale sample involved, so a stale
estimator's low cosine says something about stale samples only where it falls below the control's.
Two regimes are run: the CLI's LR (1e-3) and a 10× larger one, where the policy moves more per step.

Writes ``results.json``, ``results.md`` and ``gradient_quality.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from openrlhf_ess.runtime import cpu_compat  # noqa: E402

cpu_compat.apply()  # upstream's models package imports flash_attn at module level

from openrlhf.models.loss import PolicyLoss as UpstreamPolicyLoss  # noqa: E402
from openrlhf.models.utils import compute_approx_kl  # noqa: E402

from openrlhf_ess.models import corrections  # noqa: E402
from openrlhf_ess.models.loss import PolicyLoss  # noqa: E402
from openrlhf_ess.trainer import prox  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "docs", "gradient_quality")
TIS_CAP = 2.0
UNCAPPED = 1e30  # "IS, no cap": the plain token IS weight π_θN/μ (a diagnostic: is the cap the bias?)
ESS_FLOOR = 0.1
EWMA_DECAY = 0.9
CORRECTIONS = (
    "none",
    "TIS",
    "TIS (seq)",
    "IS, no cap",
    "TIS + ESS-LR (recompute)",
    "snapshot + TIS",
    "snapshot + TIS + ESS-LR",
    "EWMA β=0.9 + TIS",
    "EWMA auto + TIS",
    "loglinear + TIS",
    # VCPO's off-policy optimal baseline (docs/opob.md) in place of the group mean, with the estimator
    # that has no IS weight (w = 1) and with VCPO's sequence-level TIS (w = min(geo-mean π_θN/μ, 2))
    "OPOB",
    "TIS (seq) + OPOB",
    # the unbiased IS estimator: every sequence weighted by its full ratio Π_t π_θN/μ (no cap), with the group
    # mean and with OPOB as its baseline: does removing the bias leave a variance that OPOB can take?
    "IS (seq product)",
    "IS (seq product) + OPOB",
    # The next question: the same unbiased estimator with a baseline that does not come from the batch it
    # corrects (the previous stale batch's, one scalar): constant with respect to the batch's samples, so it
    # cannot pull the expectation back as the in-batch OPOB did; does it still take the variance?
    "IS (seq product) + held-out mean",
    "IS (seq product) + held-out OPOB",
)
# The loss each of these corrections runs once its advantages are rewritten (Tiny.rewritten_batch)
OPOB_BASE = {
    "OPOB": "none",
    "TIS (seq) + OPOB": "TIS (seq)",
    "IS (seq product)": "none",
    "IS (seq product) + OPOB": "none",
    "IS (seq product) + held-out mean": "none",
    "IS (seq product) + held-out OPOB": "none",
}
# The control: sync's own on-policy gradient at the stale weights θ_{N−L} (the "none" loss at ratio 1, differentiated
# at θ_{N−L} on the same stale batches), scored against g* at θ_N like every estimator. Where synchronous training
# itself turns (θ_{N−L} and θ_N on opposite sides of an optimum), this cosine is low or negative with no stale sample
# involved: an estimator is biased by staleness only as far as it falls short of this row.
CONTROL = "control: on-policy at θ_{N−L}"
CONTROL_LARGE = "control: on-policy at θ_{N−L}, fresh batch as large as g*'s"
# The estimators the per-seed control table puts beside the control
MAIN = ("none", "TIS", "TIS (seq)", "snapshot + TIS", "loglinear + TIS", "OPOB", "IS (seq product)")
# Which π_prox each correction feeds the loss as ``old_log_probs`` (keys of StaleBatch.prox).
PROX_OF = {
    "none": "current",
    "TIS": "current",
    "TIS (seq)": "current",
    "IS, no cap": "current",
    "TIS + ESS-LR (recompute)": "current",
    "snapshot + TIS": "exact",
    "snapshot + TIS + ESS-LR": "exact",
    "EWMA β=0.9 + TIS": "ewma",
    "EWMA auto + TIS": "ewma_auto",
    "loglinear + TIS": "loglinear",
    "OPOB": "current",
    "TIS (seq) + OPOB": "current",
    "IS (seq product)": "current",
    "IS (seq product) + OPOB": "current",
    "IS (seq product) + held-out mean": "current",
    "IS (seq product) + held-out OPOB": "current",
}


# ---------------------------------------------------------------------------------------------------------
# The estimator: one correction's loss on one batch, differentiated at the current θ


@dataclass
class StaleBatch:
    """What the trainer holds for one batch of B sequences with A response columns.

    advantages: (B, A) A_t; action_mask: (B, A); rollout_log_probs: (B, A) log μ; lag: version lag L.
    prox: {"current": log π_θN, "exact": log π_θ(N−L), "ewma": log π_EWMA, ...}, each (B, A), detached.
    "loglinear" is derived from "current" and μ when absent.
    """

    advantages: torch.Tensor
    action_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    lag: int
    prox: Dict[str, torch.Tensor] = field(default_factory=dict)


def policy_loss(correction: str) -> torch.nn.Module:
    """The loss the CLI builds: upstream's PolicyLoss, and for TIS ours configured as ``--algo.tis_cap 2``."""
    if correction == "none":
        return PolicyLoss()
    cap = UNCAPPED if correction == "IS, no cap" else TIS_CAP
    # our PolicyLoss weights each token (or the sequence, "(seq)"); upstream's own IS correction stays off
    return PolicyLoss.from_upstream(
        UpstreamPolicyLoss(), tis_cap=cap, tis_level="seq" if "(seq)" in correction else "token"
    )


def prox_log_probs(batch: StaleBatch, correction: str) -> torch.Tensor:
    key = PROX_OF[correction]
    if key == "loglinear" and key not in batch.prox:
        lag = torch.full_like(batch.rollout_log_probs, float(batch.lag))
        return corrections.loglinear_prox_log_probs(batch.rollout_log_probs, batch.prox["current"], lag)
    return batch.prox[key]


def ess_lr_scale(batch: StaleBatch, prox_lp: torch.Tensor) -> torch.Tensor:
    """clamp(√ρ, floor, 1) of this batch, ρ = ESS/B of the geometric-mean weights π_prox/μ (docs/ess_lr.md)."""
    log_w, valid = corrections.sequence_log_weights(prox_lp, batch.rollout_log_probs, batch.action_mask)
    return corrections.lr_scale_from_rho(corrections.ess_ratio(log_w, valid), ESS_FLOOR)


def estimator_gradient(
    log_prob_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.Tensor],
    batch: StaleBatch,
    correction: str,
    stats: Optional[dict] = None,
) -> torch.Tensor:
    """The flat gradient ∇_θ L of ``correction``'s loss on ``batch``; ``log_prob_fn()`` is (B, A) log π_θ(a_t).

    ESS-LR corrections return the gradient times the batch's LR scale (the SGD step's direction and size).
    ``stats``, if given, receives the loss's PPO clip fraction (tokens whose gradient the clip zeroes).
    """
    log_probs = log_prob_fn()
    old = prox_log_probs(batch, correction)
    rollout = None if correction == "none" else batch.rollout_log_probs
    loss, clip_ratio = policy_loss(correction)(log_probs, old, batch.advantages, batch.action_mask, rollout)[:2]
    if stats is not None:
        stats["clip_frac"] = clip_ratio.item()
    grads = torch.autograd.grad(loss, list(params), allow_unused=True)
    flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)])
    if "ESS-LR" in correction:
        flat = flat * ess_lr_scale(batch, old).to(flat.dtype)
    return flat


# KL to π_ref as a loss (--algo.kl.use_loss), π_ref = θ_0. The reference direction is the per-token reverse-KL
# gradient E_{π_θN}[(log π_θ − log π_ref) ∇log π_θ] on fresh samples (``kl_loss_k2`` with w = 1).
KL_CORRECTIONS = (
    "k3 as loss (upstream default)",
    "upstream unbiased_gradient (recompute)",
    "ours k2 + TIS (recompute)",
    "ours k2 + TIS (exact π_prox)",
)


def kl_gradient(
    log_prob_fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], batch: StaleBatch, kind: str
) -> torch.Tensor:
    """The flat gradient of the token-mean KL loss ``kind`` on ``batch`` (``batch.prox["ref"]`` = log π_ref).

    ``"reference"`` is the on-policy target, k2 with weight 1. Built with upstream's ``compute_approx_kl`` and
    our ``corrections.kl_loss_k2`` (C = 2), as ``--algo.kl.*`` configures them.
    """
    log_probs, ref = log_prob_fn(), batch.prox["ref"]
    if kind == "reference":
        per_token = corrections.kl_loss_k2(log_probs, ref)
    elif kind == "k3 as loss (upstream default)":
        per_token = compute_approx_kl(log_probs, ref, kl_estimator="k3")
    elif kind == "upstream unbiased_gradient (recompute)":
        per_token = compute_approx_kl(log_probs, ref, batch.prox["current"], "k3", unbiased_gradient=True)
    else:
        prox_lp = batch.prox["exact" if "exact" in kind else "current"]
        per_token = corrections.kl_loss_k2(log_probs, ref, prox_lp, batch.rollout_log_probs, TIS_CAP)
    mask = batch.action_mask
    loss = (per_token * mask).sum() / mask.sum()
    grads = torch.autograd.grad(loss, list(params), allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def rel_error(g: torch.Tensor, ref: torch.Tensor) -> float:
    return ((g.double() - ref.double()).norm() / ref.double().norm()).item()


def quality(grads: List[torch.Tensor], ref: torch.Tensor) -> dict:
    """Per-batch cosine/relative error with ``ref`` (mean, sd), the pooled direction's, and the spread."""
    G = torch.stack([g.double() for g in grads])
    cos = torch.tensor([cosine(g, ref) for g in G])
    rel = torch.tensor([rel_error(g, ref) for g in G])
    mean = G.mean(0)
    spread = ((G - mean).square().sum(-1).mean() / mean.square().sum()).item()
    pairs = [cosine(G[i], G[j]) for i in range(len(G)) for j in range(i + 1, len(G))]
    return {
        "cos_mean": cos.mean().item(),
        "cos_sd": cos.std().item() if len(G) > 1 else 0.0,
        "rel_mean": rel.mean().item(),
        "rel_sd": rel.std().item() if len(G) > 1 else 0.0,
        "pooled_cos": cosine(mean, ref),
        "pooled_rel": rel_error(mean, ref),
        "spread": spread,
        "pairwise_cos": sum(pairs) / len(pairs) if pairs else float("nan"),
        "norm_ratio": (G.norm(dim=-1).mean() / ref.double().norm()).item(),
    }


# ---------------------------------------------------------------------------------------------------------
# EWMA decay from the version lag (the rule is openrlhf_ess.models.corrections.ewma_decay_for_age)


def ewma_decay_for_lag(lag: float) -> float:
    """``--algo.prox_ewma_decay auto`` at a constant lag of ``lag`` versions of one optimizer step each."""
    return corrections.ewma_decay_for_age(lag)


def ewma_state(states: List[Dict[str, torch.Tensor]], decay: float, module: torch.nn.Module) -> dict:
    """Bias-corrected EWMA (``trainer.prox.EwmaWeights``) after one update per optimizer step, θ_1..θ_N."""
    if decay == 0.0:
        return {k: v.clone() for k, v in states[-1].items()}
    ewma = prox.EwmaWeights(decay)
    live = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for state in states[1:]:
        module.load_state_dict(state, strict=False)
        ewma.update(module)
    module.load_state_dict(live)
    return ewma.state() if ewma.n else dict(states[0])


# ---------------------------------------------------------------------------------------------------------
# The tiny world: sampling, scoring, training


@dataclass
class Rollout:
    sequences: torch.Tensor  # (B, P + A) left-padded prompt, then the response (pad after EOS)
    attention_mask: torch.Tensor  # (B, P + A)
    action_mask: torch.Tensor  # (B, A) response tokens up to and including EOS
    rollout_log_probs: torch.Tensor  # (B, A) log μ(a_t), from the sampler's logits
    rewards: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B, A) reward − group mean, on every response token

    def chunk(self, start: int, end: int) -> "Rollout":
        return Rollout(*(getattr(self, f)[start:end] for f in self.__dataclass_fields__))


class Tiny:
    def __init__(self, world: dict, max_new_tokens: int, samples_per_prompt: int, task: str = "digits"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from openrlhf_ess.tiny.reward import digit_fraction
        from openrlhf_ess.tiny.reward_target import target_reward

        # digits: reward = digit fraction (tiny/reward.py); target: 1 − |f − 0.5| / 0.5 (tiny/reward_target.py)
        self.reward_of = digit_fraction if task == "digits" else (lambda text: target_reward(digit_fraction(text)))
        self.engine = None  # an EngineSampler: the stale batches come from the real vLLM engine
        self.tok = AutoTokenizer.from_pretrained(world["model"])
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(world["model"], dtype=torch.float32).eval()
        self.params = [p for p in self.model.parameters()]
        with open(world["prompts"]) as f:
            self.prompts = [json.loads(line)["input"] for line in f]
        self.max_new_tokens = max_new_tokens
        self.n = samples_per_prompt

    def state(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def sample(self, n_prompts: int, gen: torch.Generator) -> Rollout:
        """``n_prompts`` prompts drawn with replacement, ``samples_per_prompt`` responses each."""
        idx = torch.randint(len(self.prompts), (n_prompts,), generator=gen).tolist()
        return self.sample_prompts([self.prompts[i] for i in idx], gen)

    @torch.no_grad()
    def sample_prompts(self, prompts: List[str], gen: torch.Generator) -> Rollout:
        """``samples_per_prompt`` responses to each of ``prompts`` at temperature 1 (fp32 torch), with their μ."""
        texts = [p for p in prompts for _ in range(self.n)]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
        out = self.model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=self.max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=self.tok.pad_token_id,
            eos_token_id=self.tok.eos_token_id,
        )
        P = enc["input_ids"].shape[1]
        response = out.sequences[:, P:]
        A = response.shape[1]
        logits = torch.stack(out.logits, 1).float()[:, :A]
        mu = logits.log_softmax(-1).gather(-1, response[..., None])[..., 0]
        return self.rollout(texts, enc, response, mu)

    def rollout(self, texts: List[str], enc: dict, response: torch.Tensor, mu: torch.Tensor) -> Rollout:
        """A Rollout from left-padded prompts ``enc``, the (B, A) response tokens (pad after EOS) and their μ."""
        A = response.shape[1]
        is_eos = (response == self.tok.eos_token_id).long()
        before_eos = (is_eos.cumsum(-1) - is_eos) == 0  # up to and including the first EOS
        action_mask = before_eos.long()
        attention_mask = torch.cat([enc["attention_mask"], action_mask], 1)
        rewards = torch.tensor(
            [
                self.reward_of(self.tok.decode(r[m.bool()], skip_special_tokens=True))
                for r, m in zip(response, action_mask)
            ]
        )
        adv = rewards.view(-1, self.n) - rewards.view(-1, self.n).mean(-1, keepdim=True)
        advantages = adv.reshape(-1, 1).expand(-1, A) * action_mask
        sequences = torch.cat([enc["input_ids"], response], 1)
        return Rollout(sequences, attention_mask, action_mask, mu * action_mask, rewards, advantages)

    @torch.no_grad()
    def sample_engine(self, n_prompts: int, gen: torch.Generator) -> Rollout:
        """The same prompt draw as :meth:`sample`, generated by the real vLLM engine (its weights are whatever
        :meth:`EngineSampler.load` gave it); μ = the engine's own log-prob of each sampled token."""
        idx = torch.randint(len(self.prompts), (n_prompts,), generator=gen).tolist()
        texts = [self.prompts[i] for i in idx for _ in range(self.n)]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        seed = int(torch.randint(2**31, (1,), generator=gen))
        tokens, logprobs = self.engine.generate(texts, self.max_new_tokens, seed)
        A = max(len(t) for t in tokens)
        response = torch.full((len(texts), A), self.tok.pad_token_id, dtype=torch.long)
        mu = torch.zeros(len(texts), A)
        for i, (t, lp) in enumerate(zip(tokens, logprobs)):
            response[i, : len(t)] = torch.tensor(t)
            mu[i, : len(t)] = torch.tensor(lp)
        return self.rollout(texts, enc, response, mu)

    def log_probs(self, r: Rollout) -> torch.Tensor:
        """(B, A) log π_θ(a_t) of the response tokens, positions from the attention mask (as upstream's Actor)."""
        positions = (r.attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=r.sequences, attention_mask=r.attention_mask, position_ids=positions).logits
        A = r.action_mask.shape[1]
        lp = logits[:, -A - 1 : -1].float().log_softmax(-1).gather(-1, r.sequences[:, -A:, None])[..., 0]
        return lp * r.action_mask

    @torch.no_grad()
    def log_probs_with(self, state: dict, r: Rollout) -> torch.Tensor:
        named = dict(self.model.named_parameters())
        with prox.swapped_weights(self.model, {k: state[k] for k in named}):
            return self.log_probs(r)

    def batch(self, r: Rollout, lag: int, prox_lp: Dict[str, torch.Tensor]) -> StaleBatch:
        return StaleBatch(r.advantages, r.action_mask, r.rollout_log_probs, lag, prox_lp)

    def kl_gradient(self, r: Rollout, batch: StaleBatch, kind: str) -> torch.Tensor:
        return kl_gradient(lambda: self.log_probs(r), self.params, batch, kind)

    def gradient(self, r: Rollout, batch: StaleBatch, correction: str, stats: Optional[dict] = None) -> torch.Tensor:
        if correction in OPOB_BASE:
            batch, correction = self.rewritten_batch(r, batch, correction), OPOB_BASE[correction]
        return estimator_gradient(lambda: self.log_probs(r), self.params, batch, correction, stats)

    def rewritten_batch(self, r: Rollout, batch: StaleBatch, correction: str) -> StaleBatch:
        """``batch`` with its advantages rewritten for ``correction``: the baseline b = VCPO's optimal baseline per
        prompt group ("OPOB" in the name; LM-head per-sample gradient norms at θ_N from the package's hook and
        maths) or the group mean, and the IS weight w the estimator applies: 1 ("OPOB": the loss weights nothing),
        the sequence TIS weight min(exp(mean_t log π_θN/μ), 2) (applied by the "TIS (seq)" loss), or the full
        sequence ratio Π_t π_θN/μ ("seq product": multiplied into the advantage, the loss at ratio 1)."""
        import dataclasses

        from openrlhf_ess.models import opob as opob_maths
        from openrlhf_ess.trainer import opob

        log_ratio = (batch.prox["current"] - r.rollout_log_probs) * r.action_mask
        if "seq product" in correction:
            w = log_ratio.double().sum(-1).exp()
        elif "TIS (seq)" in correction:
            log_w, valid = corrections.sequence_log_weights(batch.prox["current"], r.rollout_log_probs, r.action_mask)
            w = torch.where(valid, log_w.exp(), torch.zeros_like(log_w)).clamp(max=TIS_CAP)
        else:
            w = torch.ones(r.rewards.shape[0], dtype=torch.float64)
        rewards = r.rewards.double()
        if "held-out" in correction:  # one scalar from the previous stale batch (Tiny.hold_out)
            held_mean, held_opob = self.held
            b = torch.full_like(rewards, held_opob if "OPOB" in correction else held_mean)
        elif "OPOB" in correction:
            with torch.no_grad(), opob.norms_captured(self.model.lm_head, r.sequences, r.action_mask, 1.0) as out:
                self.log_probs(r)
            b = opob_maths.optimal_baseline(rewards, w, out[0], self.n)
        else:
            b = rewards.view(-1, self.n).mean(-1, keepdim=True).expand(-1, self.n).reshape(-1)
        scale = w if "seq product" in correction else torch.ones_like(w)
        advantages = (scale * (rewards - b)).float()[:, None] * r.action_mask
        return dataclasses.replace(batch, advantages=advantages)

    held = None  # (mean reward, batch-level OPOB with the full sequence ratio) of the previous stale batch

    def hold_out(self, r: Rollout, current_lp: torch.Tensor) -> None:
        """Keep ``r``'s statistics as the next batch's held-out baseline (at θ_N, loaded): its mean reward and VCPO's
        b* over the whole batch as one group, with w = Π_t π_θN/μ and the LM-head gradient norms."""
        from openrlhf_ess.models import opob as opob_maths
        from openrlhf_ess.trainer import opob

        w = ((current_lp - r.rollout_log_probs) * r.action_mask).double().sum(-1).exp()
        rewards = r.rewards.double()
        with torch.no_grad(), opob.norms_captured(self.model.lm_head, r.sequences, r.action_mask, 1.0) as out:
            self.log_probs(r)
        b = opob_maths.optimal_baseline(rewards, w, out[0], rewards.numel())
        self.held = (rewards.mean().item(), b[0].item())


class EngineSampler:
    """The real vLLM CPU engine, in this process, as the sampler of the stale batches (``--sampler vllm-bf16`` /
    ``vllm-fp32``): temperature 1, full vocabulary, μ = the engine's log-prob of each sampled token. Its weights
    are loaded through the package's own sync path (``WorkerWrap.load_weights_from_safetensors``), so a bf16
    engine carries its kernel mismatch into μ, as in training."""

    def __init__(self, model_dir: str, dtype: str):
        from openrlhf_ess.tiny.engine import tiny_engine

        self.llm = tiny_engine(
            model_dir, dtype, worker_extension_cls="openrlhf_ess.trainer.ray.vllm_worker_wrap.WorkerWrap"
        )

    def load(self, state: Dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save

        blob = save({k: v.detach().contiguous() for k, v in state.items() if "rotary" not in k})
        self.llm.collective_rpc("load_weights_from_safetensors", args=(blob,))

    def generate(self, texts: List[str], max_tokens: int, seed: int):
        from vllm import SamplingParams

        params = [
            SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=seed + i)
            for i in range(len(texts))
        ]
        outputs = self.llm.generate(texts, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outputs]
        return tokens, logprobs


def on_policy_gradient(tiny: Tiny, r: Rollout, chunk: int, ref_state: Optional[dict] = None) -> torch.Tensor:
    """g*: the ratio-1 loss over a large fresh batch, in chunks; token-weighted, so equal to one big batch.
    With ``ref_state`` (π_ref's weights): the reference KL gradient instead."""
    total, n_tok = None, 0
    for s in range(0, r.sequences.shape[0], chunk):
        c = r.chunk(s, s + chunk)
        with torch.no_grad():
            current = tiny.log_probs(c)
        if ref_state is None:
            g = tiny.gradient(c, tiny.batch(c, 0, {"current": current}), "none")
        else:
            ref = tiny.log_probs_with(ref_state, c)
            g = tiny.kl_gradient(c, tiny.batch(c, 0, {"current": current, "ref": ref}), "reference")
        n = int(c.action_mask.sum())
        total = g * n if total is None else total + g * n
        n_tok += n
    return total / n_tok


def train_versions(tiny: Tiny, steps: int, lr: float, n_prompts: int, gen: torch.Generator):
    """θ_0..θ_steps: one Adam step per on-policy batch, loss = PolicyLoss at ratio 1 (REINFORCE with baseline)."""
    opt = torch.optim.Adam(tiny.params, lr=lr)
    states, rewards = [tiny.state()], []
    for _ in range(steps):
        r = tiny.sample(n_prompts, gen)
        rewards.append(r.rewards.mean().item())
        with torch.no_grad():
            current = tiny.log_probs(r)
        loss = PolicyLoss()(tiny.log_probs(r), current, r.advantages, r.action_mask)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
        states.append(tiny.state())
    return states, rewards


def run_once(tiny: Tiny, cfg: argparse.Namespace, lr: float, steps: int, seed: int) -> dict:
    """One training trajectory (seed) of one regime, and every (correction, lag) measured at its θ_N."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    tiny.model.load_state_dict(tiny.initial)
    t0 = time.time()
    states, train_rewards = train_versions(tiny, steps, lr, cfg.prompts_per_batch, gen)
    N = len(states) - 1
    tiny.model.load_state_dict(states[N])
    B = cfg.prompts_per_batch
    chunk = cfg.chunk_prompts * tiny.n

    # g* and its own reliability (cosine between the gradients of the fresh batch's two halves)
    fresh = tiny.sample(cfg.ref_prompts, gen)
    g_star = on_policy_gradient(tiny, fresh, chunk)
    half = fresh.sequences.shape[0] // 2
    g_halves = [
        on_policy_gradient(tiny, fresh.chunk(0, half), chunk),
        on_policy_gradient(tiny, fresh.chunk(half, 2 * half), chunk),
    ]

    ref_state = states[0]  # π_ref of the KL term: the initial policy
    kl_star = on_policy_gradient(tiny, fresh, chunk, ref_state)

    # noise floor: K fresh batches of the stale batches' size from θ_N, the "none" loss (lag 0, ratio 1)
    floor_grads, kl_floor = [], []
    for _ in range(cfg.batches):
        r = tiny.sample(B, gen)
        with torch.no_grad():
            cur = tiny.log_probs(r)
            ref = tiny.log_probs_with(ref_state, r)
        floor_grads.append(tiny.gradient(r, tiny.batch(r, 0, {"current": cur}), "none"))
        kl_floor.append(tiny.kl_gradient(r, tiny.batch(r, 0, {"current": cur, "ref": ref}), "reference"))

    ewma_fixed = ewma_state(states, EWMA_DECAY, tiny.model)
    out = {
        "train_reward": train_rewards,
        "reward_at_N": fresh.rewards.mean().item(),
        "g_star_norm": g_star.norm().item(),
        "g_star_half_cos": cosine(*g_halves),
        "noise_floor": quality(floor_grads, g_star),
        "lags": {},
        "kl": {"g_star_norm": kl_star.norm().item(), "noise_floor": quality(kl_floor, kl_star), "lags": {}},
    }
    for L in cfg.lags:
        stale_state = states[N - L]
        ewma_auto = ewma_state(states, ewma_decay_for_lag(L), tiny.model)
        grads = {c: [] for c in CORRECTIONS}
        kl_grads = {k: [] for k in KL_CORRECTIONS}
        clip = {c: [] for c in CORRECTIONS}
        diag = {k: [] for k in ("k1", "tis_capped", "rho_recompute", "rho_exact", "mu_err", "reward_stale")}
        if tiny.engine is not None:
            tiny.engine.load(stale_state)
        if any("held-out" in c for c in CORRECTIONS):  # one extra stale batch seeds the held-out baseline
            tiny.model.load_state_dict(stale_state)
            r = tiny.sample(B, gen) if tiny.engine is None else tiny.sample_engine(B, gen)
            tiny.model.load_state_dict(states[N])
            with torch.no_grad():
                tiny.hold_out(r, tiny.log_probs(r))
        # the control with a fresh batch as large as g*'s, from θ_{N−L} (its own generator: the stale batches below
        # are the same draws with or without it)
        tiny.model.load_state_dict(stale_state)
        control_fresh = tiny.sample(cfg.ref_prompts, torch.Generator().manual_seed(1_000_003 * (seed + 1) + L))
        control_large = on_policy_gradient(tiny, control_fresh, chunk)
        control_grads = []
        for _ in range(cfg.batches):
            tiny.model.load_state_dict(stale_state)
            r = tiny.sample(B, gen) if tiny.engine is None else tiny.sample_engine(B, gen)
            with torch.no_grad():
                exact = tiny.log_probs(r)
            # the control on this batch: sync's on-policy gradient at θ_{N−L} (ratio 1, the same advantages)
            control_grads.append(tiny.gradient(r, tiny.batch(r, 0, {"current": exact}), "none"))
            tiny.model.load_state_dict(states[N])
            with torch.no_grad():
                current = tiny.log_probs(r)
                p = {
                    "current": current,
                    "exact": exact,
                    "ewma": tiny.log_probs_with(ewma_fixed, r),
                    "ewma_auto": tiny.log_probs_with(ewma_auto, r),
                    "ref": tiny.log_probs_with(ref_state, r),
                }
            batch = tiny.batch(r, L, p)
            for c in CORRECTIONS:
                stats = {}
                grads[c].append(tiny.gradient(r, batch, c, stats))
                clip[c].append(stats["clip_frac"])
            for k in KL_CORRECTIONS:
                kl_grads[k].append(tiny.kl_gradient(r, batch, k))
            tiny.hold_out(r, current)  # this batch's baseline statistics serve the next batch only
            m = r.action_mask.bool()
            diag["mu_err"].append((exact - r.rollout_log_probs)[m].abs().max().item())
            diag["k1"].append((r.rollout_log_probs - current)[m].mean().item())
            diag["tis_capped"].append(((current - r.rollout_log_probs)[m] > math.log(TIS_CAP)).float().mean().item())
            for key, prox_lp in (("rho_recompute", current), ("rho_exact", exact)):
                lw, valid = corrections.sequence_log_weights(prox_lp, r.rollout_log_probs, r.action_mask)
                diag[key].append(corrections.ess_ratio(lw, valid).item())
            diag["reward_stale"].append(r.rewards.mean().item())
        lag_out = {
            "ewma_auto_decay": ewma_decay_for_lag(L),
            "diagnostics": {k: sum(v) / len(v) for k, v in diag.items()},
            "corrections": {c: quality(grads[c], g_star) for c in CORRECTIONS},
            "control": quality(control_grads, g_star),
        }
        lag_out["control"]["large_cos"] = cosine(control_large, g_star)
        lag_out["control"]["large_reward"] = control_fresh.rewards.mean().item()
        lag_out["diagnostics"]["mu_err"] = max(diag["mu_err"])
        for c in CORRECTIONS:
            lag_out["corrections"][c]["clip_frac"] = sum(clip[c]) / len(clip[c])
        out["lags"][str(L)] = lag_out
        out["kl"]["lags"][str(L)] = {k: quality(kl_grads[k], kl_star) for k in KL_CORRECTIONS}
    out["seconds"] = time.time() - t0
    return out


def mean_over_seeds(runs: List[dict]) -> dict:
    """The same nested structure with every number averaged over seeds (lists: elementwise), plus, for the headline
    metrics, min/max over seeds as ``<name>_min`` / ``<name>_max`` and every seed's value as ``<name>_seeds``."""

    def avg(xs):
        if isinstance(xs[0], dict):
            return {k: avg([x[k] for x in xs]) for k in xs[0]}
        if isinstance(xs[0], list):
            return [sum(v) / len(v) for v in zip(*xs)]
        return sum(xs) / len(xs)

    def spread_over_seeds(dst: dict, per_seed: List[dict], metrics: Sequence[str]) -> None:
        for metric in metrics:
            vals = [q[metric] for q in per_seed]
            dst[metric + "_min"], dst[metric + "_max"], dst[metric + "_seeds"] = min(vals), max(vals), vals

    headline = ("cos_mean", "pooled_cos", "rel_mean")
    out = avg(runs)
    for L, lag in out["lags"].items():
        for c in CORRECTIONS:
            spread_over_seeds(lag["corrections"][c], [r["lags"][L]["corrections"][c] for r in runs], headline)
        spread_over_seeds(lag["control"], [r["lags"][L]["control"] for r in runs], headline + ("large_cos",))
        for k in KL_CORRECTIONS:
            spread_over_seeds(out["kl"]["lags"][L][k], [r["kl"]["lags"][L][k] for r in runs], headline)
    spread_over_seeds(out["noise_floor"], [r["noise_floor"] for r in runs], headline)
    return out


# ---------------------------------------------------------------------------------------------------------
# Output


def _cell(q: dict, metric: str, fmt: str = "{:.3f}") -> str:
    """``mean [seed values, in the order of --seeds]``; the mean alone with one seed or no per-seed values."""
    if metric not in q:
        return "—"
    s = fmt.format(q[metric])
    seeds = q.get(metric + "_seeds")
    if seeds and len(seeds) > 1:
        s += " [" + ", ".join("{:.2f}".format(v) for v in seeds) + "]"
    return s


def _table(
    reg: dict, metric: str, fmt: str = "{:.3f}", rows: Sequence[str] = CORRECTIONS, control: bool = True
) -> List[str]:
    lags = list(reg["lags"])
    nf = reg["noise_floor"]
    lines = ["| correction | " + " | ".join(f"L={L}" for L in lags) + " |", "|---|" + "---|" * len(lags)]
    lines.append("| fresh batches (noise floor, lag 0) | " + " | ".join(_cell(nf, metric, fmt) for _ in lags) + " |")
    if control:
        ctrl = [reg["lags"][L]["control"] for L in lags]
        lines.append(f"| **{CONTROL}** | " + " | ".join(f"**{_cell(q, metric, fmt)}**" for q in ctrl) + " |")
        if metric == "pooled_cos":
            lines.append(f"| {CONTROL_LARGE} | " + " | ".join(_cell(q, "large_cos", fmt) for q in ctrl) + " |")
    for c in rows:
        cells = [_cell(reg["lags"][L]["corrections"][c], metric, fmt) for L in lags]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def _control_table(runs: List[dict], seeds: Sequence[int]) -> List[str]:
    """Per lag and seed: the control's pooled cosine (K batches; fresh batch as large as g*'s) beside the main
    estimators' pooled cosine, and each estimator minus the control (same batches: a paired difference)."""
    head = ["lag", "seed", "reward θ_{N−L} → θ_N", "control (g*-sized)", "control (K batches)"] + list(MAIN)
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for L in runs[0]["lags"]:
        for seed, run in zip(seeds, runs):
            lag = run["lags"][L]
            ctrl = lag["control"]
            cells = [
                L,
                str(seed),
                f"{ctrl['large_reward']:.2f} → {run['reward_at_N']:.2f}",
                f"{ctrl['large_cos']:.2f}",
                f"**{ctrl['pooled_cos']:.2f}**",
            ]
            for c in MAIN:
                q = lag["corrections"][c]["pooled_cos"]
                cells.append(f"{q:.2f} ({q - ctrl['pooled_cos']:+.2f})")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _seed_range(seeds: Sequence[int]) -> str:
    seeds = list(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}–{seeds[-1]}"
    return ", ".join(map(str, seeds))


def markdown(results: dict) -> str:
    cfg = results["config"]
    timing = results.get("timing", f"{results['seconds']:.0f} s")
    lines = [
        "# Gradient quality: results",
        "",
        f"Command: `{results['command']}` ({timing}). Per lag, {cfg['batches']} stale batches of "
        f"{cfg['prompts_per_batch']} prompts × {cfg['samples_per_prompt']} samples; g* from "
        f"{cfg['ref_prompts']} × {cfg['samples_per_prompt']} fresh samples; max {cfg['max_new_tokens']} new tokens; "
        f"training seeds {_seed_range(cfg['seeds'])} (numbers: mean over seeds [each seed's value, seeds "
        f"{', '.join(map(str, cfg['seeds']))} in that order]). Sampler: {results['sampler']}.",
        "",
        f"**The control** (row *{CONTROL}*): sync's own on-policy gradient at the stale weights θ_{{N−L}} (the plain "
        "estimator, ratio 1, differentiated at θ_{N−L} on the same stale batches; and once on a fresh batch from "
        "θ_{N−L} as large as g*'s), scored against g* at θ_N like every estimator. It is what the direction of "
        "synchronous training L steps ago says about the direction now: where training turns (θ_{N−L} and θ_N on "
        "opposite sides of an optimum) it is low or negative with no stale sample involved. An estimator shows a "
        "bias of stale samples only by differing from this row.",
        "",
    ]
    for name, reg in results["regimes"].items():
        nf = reg["noise_floor"]
        tr = reg["train_reward"]
        lines += [
            f"## {name}",
            "",
            f"Training reward (on-policy batches) {tr[0]:.3f} → {tr[-1]:.3f} over the {len(tr)} steps; reward of θ_N "
            f"{reg['reward_at_N']:.3f}. ‖g*‖ = {reg['g_star_norm']:.2e}; cosine between the gradients of g*'s two "
            f"halves {reg['g_star_half_cos']:.3f} (g*'s own noise). Noise floor spread tr Cov(g)/‖mean g‖² = "
            f"{nf['spread']:.2f}.",
            "",
            "Staleness per lag: drift k1 = mean over stale tokens of log μ − log π_θN; TIS capped = fraction of "
            "tokens with π_θN/μ > 2; ρ = ESS/B of the geometric-mean weights π_prox/μ (recompute, exact); reward "
            "of θ_{N−L}; max |log μ − log π_exact| checks the sampler's log-probs against a separate forward.",
            "",
            "| lag | drift k1 | TIS capped | ρ recompute | ρ exact | reward θ_{N−L} | max |μ − π_exact| |",
            "|---|---|---|---|---|---|---|",
        ]
        for L, lag in reg["lags"].items():
            d = lag["diagnostics"]
            lines.append(
                f"| {L} | {d['k1']:.4f} | {d['tis_capped']:.4f} | {d['rho_recompute']:.4f} | {d['rho_exact']:.6f} | "
                f"{d['reward_stale']:.3f} | {d['mu_err']:.1e} |"
            )
        lines += [
            "",
            "**The control per seed** (pooled cosine with g*): sync's on-policy gradient at θ_{N−L} on a fresh batch "
            "as large as g*'s and on the K stale batches, beside the main estimators on the same K batches (in "
            "parentheses: estimator − control (K batches), a paired difference). Reward θ_{N−L} → θ_N: the mean "
            "reward of the fresh batches from each.",
            "",
        ]
        lines += _control_table(results["per_seed"][name], cfg["seeds"])
        lines += ["", "**cosine(g, g*)**, per stale batch:", ""] + _table(reg, "cos_mean")
        lines += ["", "**cosine(mean of the K batches' g, g*)** (pooled: less noise, bias stays):", ""]
        lines += _table(reg, "pooled_cos")
        lines += ["", "**‖g − g*‖ / ‖g*‖**, per stale batch:", ""] + _table(reg, "rel_mean")
        lines += ["", "**spread tr Cov(g) / ‖mean g‖²** across the K batches:", ""] + _table(reg, "spread", "{:.2f}")
        lines += ["", "**PPO clip fraction** (tokens whose gradient the clip zeroes):", ""]
        lines += _table(reg, "clip_frac", control=False)
        kl = {"lags": {L: {"corrections": q} for L, q in reg["kl"]["lags"].items()}, "seeds": reg["seeds"]}
        kl["noise_floor"] = reg["kl"]["noise_floor"]
        lines += [
            "",
            f"**KL to π_ref = θ_0 as a loss**: the reference is the per-token reverse-KL gradient "
            f"E_π_θN[(log π_θ − log π_ref) ∇log π_θ] on the fresh batch (‖·‖ = {reg['kl']['g_star_norm']:.2e}). "
            "Pooled cosine:",
            "",
        ]
        lines += _table(kl, "pooled_cos", rows=KL_CORRECTIONS, control=False)
        lines += ["", "Per-batch cosine:", ""] + _table(kl, "cos_mean", rows=KL_CORRECTIONS, control=False)
        lines += ["", "Per-batch ‖g − g*‖/‖g*‖:", ""] + _table(kl, "rel_mean", rows=KL_CORRECTIONS, control=False)
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = list(results["regimes"].items())
    fig, axes = plt.subplots(len(regimes), 3, figsize=(16, 4.2 * len(regimes)), squeeze=False)
    styles = ["-", "--", "-.", ":"]
    panels = (
        ("cos_mean", "cosine(g, g*) per batch"),
        ("pooled_cos", "cosine(mean of K g, g*)"),
        ("rel_mean", "‖g − g*‖ / ‖g*‖ per batch"),
    )
    for row, (name, reg) in zip(axes, regimes):
        lags = [int(L) for L in reg["lags"]]
        for ax, (metric, title) in zip(row, panels):
            for i, c in enumerate(CORRECTIONS):
                ys = [reg["lags"][str(L)]["corrections"][c][metric] for L in lags]
                ax.plot(lags, ys, styles[i % len(styles)], marker="o", ms=3, label=c)
            ax.axhline(reg["noise_floor"][metric], color="grey", lw=1.5, alpha=0.7, label="fresh batches (lag 0)")
            ys = [reg["lags"][str(L)]["control"][metric] for L in lags]
            ax.plot(lags, ys, color="black", lw=2.5, alpha=0.6, marker="s", ms=4, label=CONTROL)
            ax.set_xscale("log", base=2)
            ax.set_xticks(lags, [str(L) for L in lags])
            ax.set_xlabel("version lag L")
            ax.set_title(f"{name}: {title}", fontsize=9)
            if metric == "rel_mean":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SAMPLERS = {
    "hf": "HF generate in fp32, temperature 1, full vocabulary (μ = its output logits' log-softmax)",
    "vllm-bf16": "stale batches from the real vLLM CPU engine in bf16 (μ = the engine's log-probs); g* and the "
    "noise floor from HF generate in fp32",
    "vllm-fp32": "stale batches from the real vLLM CPU engine in fp32 (μ = the engine's log-probs); g* and the "
    "noise floor from HF generate in fp32",
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run (tiny batches, lags 1 and 2)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument(
        "--regimes",
        nargs="+",
        default=None,
        help="LR:STEPS per regime: Adam LR and the number N of training steps (default 1e-3:16 1e-2:10)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="training seeds (default 0 1 2 3 4)")
    p.add_argument("--lags", type=int, nargs="+", default=None, help="default 1 2 4 8")
    p.add_argument("--batches", type=int, default=None, help="stale batches K per lag (default 16)")
    p.add_argument("--prompts-per-batch", type=int, default=None, help="prompts per batch, x4 samples (default 8)")
    p.add_argument("--ref-prompts", type=int, default=None, help="prompts of the fresh g* batch (default 1024)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument(
        "--sampler",
        choices=list(SAMPLERS),
        default="hf",
        help="who samples the stale batches: HF generate in fp32 (default), or the real vLLM CPU engine in bf16 "
        "or fp32, whose kernel mismatch then enters μ (the fresh g* batch and the noise floor stay HF)",
    )
    p.add_argument(
        "--task",
        choices=["digits", "target"],
        default="digits",
        help="reward: the digit fraction, or the interior optimum 1 − |f − 0.5| / 0.5 (tiny/reward_target.py)",
    )
    p.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="DIR",
        help="no run: merge the results.json of runs made with the same settings but different --regimes (e.g. "
        "one process per regime, in parallel) into one results.json / results.md / plot in --out; with one DIR, "
        "rewrite its results.md and plot from its results.json",
    )
    a = p.parse_args(argv)
    quick = dict(regimes=["1e-2:3"], seeds=[0], lags=[1, 2], batches=3, prompts_per_batch=2, ref_prompts=16)
    full = dict(regimes=["1e-3:16", "1e-2:10"], seeds=[0, 1, 2, 3, 4], lags=[1, 2, 4, 8], batches=16)
    full.update(prompts_per_batch=8, ref_prompts=1024)
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.regimes = [(float(x.split(":")[0]), int(x.split(":")[1])) for x in a.regimes]
    for lr, steps in a.regimes:
        if max(a.lags) > steps:
            p.error(f"--lags up to {max(a.lags)} need at least {max(a.lags)} training steps, got {steps}")
    a.samples_per_prompt = 4
    a.chunk_prompts = 64
    return a


def write(results: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(results))
    plot(results, os.path.join(out, "gradient_quality.png"))


def combine(dirs: Sequence[str], out: str) -> dict:
    """One results file from runs of the same settings over different regimes (``--combine``)."""
    parts = []
    for d in dirs:
        with open(os.path.join(d, "results.json")) as f:
            parts.append(json.load(f))
    results = dict(parts[0])
    results["config"] = dict(parts[0]["config"])
    for part in parts[1:]:
        same = ("seeds", "lags", "batches", "prompts_per_batch", "ref_prompts", "max_new_tokens")
        for k in same:
            if part["config"][k] != results["config"][k]:
                raise SystemExit(f"--combine: {k} differs between the runs")
        if part["sampler"] != results["sampler"] or part["task"] != results["task"]:
            raise SystemExit("--combine: the runs used different samplers or tasks")
    results["config"]["regimes"] = [r for part in parts for r in part["config"]["regimes"]]
    results["regimes"] = {k: v for part in parts for k, v in part["regimes"].items()}
    results["per_seed"] = {k: v for part in parts for k, v in part["per_seed"].items()}
    results["command"] = "`; `".join(part["command"] for part in parts)
    results["seconds"] = sum(part["seconds"] for part in parts)
    if len(parts) > 1:
        results["timing"] = ", ".join(f"{part['seconds']:.0f} s" for part in parts) + ", in parallel; merged by `"
        shown = "" if os.path.abspath(out) == DEFAULT_OUT else f" --out {out}"
        results["timing"] += "python -m benchmarks.gradient_quality --combine " + " ".join(dirs) + shown + "`"
    write(results, out)
    return results


def main(argv: Optional[List[str]] = None) -> dict:
    a = parse_args(argv)
    if a.combine:
        return combine(a.combine, a.out)
    t0 = time.time()
    from openrlhf_ess.tiny.world import build_world

    with tempfile.TemporaryDirectory(prefix="gradq_") as root:  # everything is in memory once loaded
        world = build_world(os.path.join(root, "world"), seed=0, n_prompts=64)
        tiny = Tiny(world, a.max_new_tokens, a.samples_per_prompt, a.task)
        if a.sampler != "hf":
            tiny.engine = EngineSampler(world["model"], "bfloat16" if a.sampler == "vllm-bf16" else "float32")
    tiny.initial = tiny.state()
    regimes, runs = {}, {}
    for lr, steps in a.regimes:
        name = f"Adam lr {lr:g}, {steps} steps"
        runs[name] = []
        for seed in a.seeds:
            print(f"[gradient_quality] {name}, seed {seed}: lags {a.lags}", flush=True)
            runs[name].append(run_once(tiny, a, lr, steps, seed))
        regimes[name] = mean_over_seeds(runs[name])
        regimes[name].update(lr=lr, steps=steps, seeds=len(a.seeds))
    cfg = {k: getattr(a, k) for k in ("seeds", "lags", "batches", "prompts_per_batch", "ref_prompts")}
    cfg.update(max_new_tokens=a.max_new_tokens, samples_per_prompt=a.samples_per_prompt, tis_cap=TIS_CAP)
    cfg.update(ess_floor=ESS_FLOOR, ewma_decay=EWMA_DECAY, regimes=a.regimes)
    results = {
        "command": "python -m benchmarks.gradient_quality " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": cfg,
        "sampler": SAMPLERS[a.sampler],
        "task": a.task,
        "regimes": regimes,
        "per_seed": runs,
        "seconds": time.time() - t0,
    }
    write(results, a.out)
    print(f"[gradient_quality] wrote {a.out} in {results['seconds']:.0f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
