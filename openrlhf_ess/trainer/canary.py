"""The start-up engine contract's statistics: what separates each fault the canary claims to
catch from bf16 noise, measured in ``benchmarks/canary_faults.py`` (docs/canary_faults.md).

One absolute bound, ``--vllm.sync_check_tol`` (mean |Δ log p| ≤ 0.5 nats), cannot do it: a random or flat model's
log-probs barely move under any fault (every token near −log V), while a trained model's bf16 noise is larger in
nats than a flat model's faults. Two statistics that do not depend on the scale:

* **relative error** of the canary, r = mean |Δ log p| / mean |log p − mean log p|: bf16 rounding is relative to
  the logits, so it stays a small fraction of the log-probs' own spread whatever their scale; an engine that
  computes another function (another LM head, another positional kernel) moves them by a large fraction of it;
* **which distribution μ is**: for the run's sampled tokens, μ against the trainer's log softmax(z/t) for t = T
  (correct), t = 1 (raw log-probs, or a temperature the engine ignored) and t = T² (temperature applied twice).
  An engine that returns another distribution's log-probs is closer to that hypothesis than to the correct one;
  this needs no threshold at all, only that the hypotheses differ by more than the noise (reported).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch

# Measured on the tiny dense model, flat and peaked (benchmarks/canary_faults.py, docs/canary_faults.md): the canary's
# relative error from rounding alone, with any bf16 side and with both sides fp32.
BF16_NOISE_REL = 0.007
FP32_NOISE_REL = 3e-7
# The default bounds (--vllm.sync_check_rel_tol unset): 14x the bf16 noise, where another LM head measured 1.9-3.5;
# with engine and trainer both in fp32, 1e-3 (3,000x the noise), where rope_theta x 100 measured 0.004 and a layer
# one update behind 0.035. In bf16 those two stay within 5x the noise: only the checksums see a stale layer.
REL_TOL_16BIT = 0.1
REL_TOL_FP32 = 1e-3
# The smallest spread a relative error divides by, in nats. A confident model's sampled tokens all have log p near 0,
# so their spread tends to 0 and any rounding would look like a fault; the tiny flat model's canary spread is ~0.1
# (its faults measured at 1.9-3.5 of it with this floor or without), so 0.05 changes no verdict measured there.
SPREAD_FLOOR = 0.05
# Another hypothesis is named only when it differs from the correct one by this many times μ's distance to it: at
# T = 0.95 log softmax(z) and log softmax(z/T) are nearly one distribution, and the rounding would decide.
SEPARATION = 4.0


def default_rel_tol(engine_dtype: str, trainer_dtype: str) -> float:
    """The canary's relative bound when --vllm.sync_check_rel_tol is not given: :data:`REL_TOL_FP32` when the engine
    (``--vllm.dtype``) and the trainer (``--ds.param_dtype``) both compute in fp32, else :data:`REL_TOL_16BIT`."""
    fp32 = engine_dtype in ("float32", "fp32") and trainer_dtype in ("float32", "fp32")
    return REL_TOL_FP32 if fp32 else REL_TOL_16BIT


def spread(log_probs: torch.Tensor) -> float:
    """mean |log p − mean log p| of a 1-D tensor: the scale the canary's relative error is measured against."""
    x = log_probs.double()
    return (x - x.mean()).abs().mean().item()


def relative_error(engine: torch.Tensor, trainer: torch.Tensor) -> float:
    """r = mean |engine − trainer| / max(spread(trainer), :data:`SPREAD_FLOOR`); NaN when either side is not finite.
    The floor keeps a confident model's tokens (log p ≈ 0 for all, spread ≈ 0) from turning rounding into a fault:
    below it the bound acts as an absolute one, ``rel_tol`` × 0.05 nats."""
    return distance(engine, trainer)[1]


def distance(engine: torch.Tensor, trainer: torch.Tensor) -> Tuple[float, float]:
    """(mean |engine − trainer| in nats, :func:`relative_error`): the two numbers :func:`within_bounds` judges."""
    diff = (engine.double() - trainer.double()).abs().mean().item()
    return diff, diff / max(spread(trainer), SPREAD_FLOOR)


def temperature_hypotheses(
    log_probs_at: Callable[[float], torch.Tensor], temperature: float
) -> Dict[str, torch.Tensor]:
    """The three distributions an engine's μ can be, from ``log_probs_at(t)`` (the trainer's log-probs of the sampled
    tokens at temperature t: log softmax(z/t), over the kept support with the sampling mask): ``"at T"`` (the one it
    sampled from), ``"raw"`` (t = 1: raw log-probs, or the temperature ignored) and ``"T twice"`` (t = T²). At T = 1
    the three are one distribution and only ``"at T"`` is returned."""
    if temperature == 1.0:
        return {"at T": log_probs_at(1.0)}
    return {"at T": log_probs_at(temperature), "raw": log_probs_at(1.0), "T twice": log_probs_at(temperature**2)}


HYPOTHESIS_NAMES = {
    "at T": "log softmax(z/T)",
    "raw": "log softmax(z) (raw log-probs, temperature 1)",
    "T twice": "log softmax(z/T^2) (temperature applied twice)",
}
HYPOTHESIS_FIXES = {
    "raw": "The engine returns raw log-probs (vLLM logprobs_mode raw_logprobs) or ignores the temperature: it must "
    "return processed_logprobs (the distribution after temperature, top-k and top-p), as our engines set it.",
    "T twice": "The temperature is applied twice (once by the caller, once by the engine's sampler): pass the "
    "logits unscaled to the sampler.",
}


def closest_distribution(mu: torch.Tensor, hypotheses: Dict[str, torch.Tensor]) -> Dict[str, object]:
    """Which hypothesis μ is (mean |μ − h| per hypothesis, the closest, and the gap between the correct one and the
    nearest other, in units of μ's distance to the correct one: > 1 means the other is farther than the noise)."""
    dist = {name: (mu.double() - h.double()).abs().mean().item() for name, h in hypotheses.items()}
    closest = min(dist, key=dist.get)
    others = [d for name, d in dist.items() if name != "at T"]
    separation: Optional[float] = None
    if others:
        nearest_other = min(others)
        separation = float("inf") if dist["at T"] == 0 else nearest_other / dist["at T"]
    return {"distances": dist, "closest": closest, "separation": separation}


def within_bounds(diff: float, rel: float, tol: float, rel_tol: float) -> bool:
    """The canary's verdict: mean |Δ| ``diff`` ≤ ``tol`` (``--vllm.sync_check_tol``) and, unless ``rel_tol`` is 0,
    the relative error ``rel`` ≤ ``rel_tol``. NaN compares False with everything: NaN weights on either side fail."""
    return math.isfinite(diff) and diff <= tol and (rel_tol <= 0 or rel <= rel_tol)


def other_distribution(mu: torch.Tensor, hypotheses: Dict[str, torch.Tensor], rel_tol: float) -> Optional[str]:
    """The hypothesis other than ``"at T"`` that μ is, or None. Named only when μ is that hypothesis up to rounding
    (its relative error to it within max(``rel_tol``, :data:`REL_TOL_16BIT`)) **and** the hypothesis is told apart
    from the correct one: they differ by at least :data:`SEPARATION` times μ's distance to it (near T = 1 they are
    one distribution and the noise would pick). μ merely closer to another one is another function, left to the
    bounds."""
    found = closest_distribution(mu, hypotheses)
    closest = found["closest"]
    if closest == "at T":
        return None
    apart = (hypotheses[closest].double() - hypotheses["at T"].double()).abs().mean().item()
    if apart < SEPARATION * found["distances"][closest]:
        return None
    if relative_error(mu, hypotheses[closest]) <= max(rel_tol, REL_TOL_16BIT):
        return closest
    return None
