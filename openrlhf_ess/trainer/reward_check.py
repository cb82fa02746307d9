"""A NaN or infinite reward is never silent: the run stops naming the reward source and a sample.

Upstream turns each sample's reward into a tensor and computes advantages from the rewards of the whole group
(GRPO, RLOO, REINFORCE++-baseline: the group's mean and std) or batch (advantage whitening). One NaN reward makes
every advantage it touches NaN; the loss is NaN, the update is skipped or zero (grad norm 0), and the run goes on
to exit 0 without a line. Nothing of such a step is worth keeping.

The policy, by ``--reward.failure_policy``:

- ``off`` (the default): the first rollout batch with a non-finite reward stops the run with
  :class:`NonFiniteRewardError`, naming the reward source (the reward file, agent, server or reward model), how
  many samples of the batch and one of them (the prompt's start, its label, the value). A NaN reward is a bug in
  the user's reward function (a 0/0, a log of 0, a parse that failed), not a property of the sample: stopping at
  once, before any update, is the only choice that neither trains on it nor hides it. A batch whose rewards are
  all finite is not touched: the check only reads them, so results are upstream's.
- ``drop`` / ``stop``: a non-finite reward is a failed reward, as one the function raised for (the samples
  generator masks the sample out with reward 0 and counts it in ``reward_failed``, or stops at the first).

The check runs where the rewards are first tensors on the controller: our samples generator for rewards from the
rollout (a reward file, an agent, a reward server), our experience maker for a reward model's. Both are our
controllers', which a run uses when one of our features is on (``config.needs_our_controllers``). A reward file's
values are also checked in every run by the reward call itself (``utils/agent.py``), so the default path stops on
them too; a reward server or model in a run with none of our features on is not checked.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

from openrlhf_ess.utils.agent import RewardFunctionError

PROMPT_CHARS = 80  # of the example sample's prompt shown in the message


class NonFiniteRewardError(RewardFunctionError):
    """A reward was NaN or infinite (``--reward.failure_policy off``); the message names the source and a sample.
    A ``RewardFunctionError``, so the CLI ends with this message as its last line (``reward_failure``)."""


FUNCTION_FIX = (
    "Fix the reward function (a 0/0, a log of 0, a failed parse), or pass --reward.failure_policy drop to train "
    "without such samples (reward 0, masked out of the loss, counted in reward_failed)."
)
MODEL_FIX = (
    "Check the reward model: its weights, and its numerics in --ds.param_dtype (a score that overflows bf16 is "
    "inf); --reward.failure_policy does not apply to a reward model."
)


def reward_source(args):
    """(the reward source a user would fix, in the flag's words; the fix to suggest)."""
    reward = args.reward
    agent = getattr(args.train, "agent_func_path", None)
    if agent:
        return f"the agent --train.agent_func_path {agent}", FUNCTION_FIX
    urls = reward.remote_url
    if urls:
        url = urls[0] if isinstance(urls, (list, tuple)) else urls
        if str(url).endswith(".py"):
            return f"reward_func of --reward.remote_url {url}", FUNCTION_FIX
        return f"the reward server --reward.remote_url {url}", FUNCTION_FIX.replace("reward function", "reward server")
    return f"the reward model --reward.model_name_or_path {reward.model_name_or_path}", MODEL_FIX


def _values(rewards) -> List[float]:
    """One float per sample of a reward tensor (any shape), a list, or a number."""
    if rewards is None:
        return []
    if hasattr(rewards, "detach"):
        return [float(v) for v in rewards.detach().float().reshape(-1).tolist()]
    if isinstance(rewards, (list, tuple)):
        return [float(v) for v in rewards]
    return [float(rewards)]


def nonfinite_reward_message(
    rewards: Sequence[float], prompts: Sequence, labels: Sequence, source: str, fix: str = FUNCTION_FIX
) -> Optional[str]:
    """Our message for the non-finite values among ``rewards`` (one per sample, aligned with ``prompts`` and
    ``labels``; ``source`` and ``fix`` from :func:`reward_source`), or None when all are finite."""
    bad = [i for i, value in enumerate(rewards) if not math.isfinite(value)]
    if not bad:
        return None
    first = bad[0]
    prompt = str(prompts[first]) if first < len(prompts) else "?"
    label = labels[first] if first < len(labels) else None
    shown = prompt[:PROMPT_CHARS] + ("..." if len(prompt) > PROMPT_CHARS else "")
    if isinstance(label, str) and len(label) > PROMPT_CHARS:
        label = label[:PROMPT_CHARS] + "..."
    kinds = sorted({"NaN" if math.isnan(rewards[i]) else "inf" for i in bad})
    return (
        f"{source} gave a non-finite reward ({'/'.join(kinds)}) for {len(bad)} of the {len(rewards)} samples of this "
        f"rollout batch, e.g. {rewards[first]} for prompt {shown!r} (label {label!r}). A NaN reward makes the "
        "advantages of its group (and, whitened, of the whole batch) NaN, and the update learns nothing from them "
        f"(grad norm 0), so the run stops here, before the update. {fix}"
    )


def _aligned(values: Optional[Sequence], n: int) -> List:
    values = list(values or [])[:n]
    return values + [None] * (n - len(values))


def check_rewards(experiences, source: str, fix: str = FUNCTION_FIX) -> None:
    """Raise :class:`NonFiniteRewardError` if any sample of ``experiences`` (upstream's Experience: ``rewards`` one
    per sample, ``prompts``, ``labels``) has a NaN or infinite reward; read only, so finite batches are untouched."""
    rewards: List[float] = []
    prompts: List = []
    labels: List = []
    for exp in experiences:
        values = _values(getattr(exp, "rewards", None))
        rewards += values
        prompts += _aligned(getattr(exp, "prompts", None), len(values))
        labels += _aligned(getattr(exp, "labels", None), len(values))
    message = nonfinite_reward_message(rewards, prompts, labels, source, fix)
    if message:
        raise NonFiniteRewardError(message)


def check_run_rewards(experiences, args) -> None:
    """:func:`check_rewards` with the run's reward source and fix (:func:`reward_source`), which are read from ``args``
    only when a reward is not finite: a finite batch costs one pass over its rewards."""
    if all(math.isfinite(v) for exp in experiences for v in _values(getattr(exp, "rewards", None))):
        return
    check_rewards(experiences, *reward_source(args))
