"""Interior-optimum reward for the tiny world: the digit fraction scored by its distance to a target.

    reward = 1 − |f − f*| / max(f*, 1 − f*),   f = digit fraction of the response,   f* = 0.5

so the best response has half its characters digits, and both "too few" and "too many" lose reward; the
normalisation puts every reward in [0, 1] (0 at the far end of [0, 1] from f*, 1 at f*).

Why this reward exists: with the monotone digit reward (``reward.py``) every sample, however stale,
points the same way ("more digits"), so staleness only slows learning. Here the optimum is inside the policy's
range. A policy with too few digits (f < f*) is pushed up by its samples. In async training the update at step t
uses samples drawn by a policy L versions old; when the current policy has already passed f*, stale samples from
before the crossing still say "more digits", so an uncorrected learner keeps moving past the optimum. Feedback
that arrives late with enough gain overshoots and oscillates (delayed-feedback control). A correction that
weights or clips stale samples by their distance to the sampling policy should damp the overshoot.

The same file form as ``reward.py`` (``--reward.remote_url <this file>``). ``extra_logs`` carries the digit
fraction itself (``train/digit_fraction``), so the distance |f − f*| can be followed over steps.
"""

import torch

from openrlhf_ess.tiny.reward import digit_fraction, response_text

TARGET = 0.5


def target_reward(fraction: float, target: float = TARGET) -> float:
    """1 − |f − f*| / max(f*, 1 − f*): 1 at the target, 0 at the end of [0, 1] furthest from it."""
    return 1.0 - abs(fraction - target) / max(target, 1.0 - target)


def reward_func(queries, prompts, labels):
    """OpenRLHF's custom reward hook: one reward per query."""
    fractions = [digit_fraction(response_text(q, p)) for q, p in zip(queries, prompts)]
    rewards = torch.tensor([target_reward(f) for f in fractions])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"digit_fraction": torch.tensor(fractions)}}
