"""The reward call of upstream's single-turn executor, bounded in time and guarded against BaseException.

Mirrors ``openrlhf/utils/agent.py``. Upstream's ``SingleTurnAgentExecutor._fetch_rewards_via_func`` runs the
user's ``reward_func`` (``--reward.remote_url file.py``) in a worker thread, one query per call, and awaits it
with no bound; ``execute`` catches ``Exception`` around it. So:

- a ``reward_func`` that calls ``sys.exit()`` (or raises another ``BaseException``) sends ``SystemExit`` through
  asyncio, which re-raises it out of the engine actor's event loop: every pending request is lost and the run
  hangs forever with no line at all;
- a ``reward_func`` that blocks stalls the sample's rollout with no word.

Here each call runs in the same worker thread pool, a ``BaseException`` raised inside it is caught in its thread
(it never reaches asyncio), and the call is bounded by ``--reward.timeout_s`` (a warning names the file once a
call has run :data:`WARN_AFTER_S`). A call that raised a ``BaseException`` or timed out is a failed reward: with
``--reward.failure_policy drop`` the sample's reward is None (our generator drops it and counts it), otherwise
the rollout raises :class:`RewardFunctionError`, which names the file and ends the run. A timed-out call's thread
cannot be stopped (Python has no thread kill); it finishes in the background, or dies with the run.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import traceback
from typing import Any, List, Optional

from openrlhf.utils.agent import SingleTurnAgentExecutor as _UpstreamSingleTurnAgentExecutor

from openrlhf_ess.utils.reward_values import count_problem, nonfinite_problem

logger = logging.getLogger(__name__)

WARN_AFTER_S = 30.0  # a reward call still running after this (or the bound, if smaller) is logged once
# The failures of the reward calls made by the current execute() (one list per sample): upstream's execute()
# swallows every Exception from the reward fetch, so ours learns of them through this.
_FAILURES: contextvars.ContextVar[Optional[List[str]]] = contextvars.ContextVar("openrlhf_ess_reward_failures")


class RewardFunctionError(RuntimeError):
    """The reward function could not give a reward for a sample (a BaseException inside it, or a timeout) and
    --reward.failure_policy is not drop: the run stops with this message."""


class _Raised:
    """A BaseException raised inside reward_func, caught in its worker thread (never re-raised through asyncio)."""

    def __init__(self, exc: BaseException):
        self.kind = type(exc).__name__
        self.text = str(exc)
        frames = traceback.extract_tb(exc.__traceback__)
        self.line = frames[-1].lineno if frames else None
        self.filename = frames[-1].filename if frames else None


def _guarded(func, *args) -> Any:
    try:
        return func(*args)
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt too: they would kill the event loop
        return _Raised(e)


class SingleTurnAgentExecutor(_UpstreamSingleTurnAgentExecutor):
    """Upstream's single-turn executor with each ``reward_func`` call bounded and guarded (module docstring)."""

    def __init__(self, remote_rm_url=None, *, timeout_s: float = math.inf, failure_policy: str = "off"):
        super().__init__(remote_rm_url)
        self.timeout_s, self.failure_policy = float(timeout_s), failure_policy
        self.reward_path = self.reward_endpoints[0] if self.reward_func is not None else None
        self.calls = 0  # reward_func calls that returned, for the message of a wrong one

    async def execute(self, *args, **kwargs):
        """Extends upstream's: a failed reward call (timeout, BaseException) follows --reward.failure_policy."""
        failures: List[str] = []
        token = _FAILURES.set(failures)
        try:
            output = await super().execute(*args, **kwargs)
        finally:
            _FAILURES.reset(token)
        if failures:
            if self.failure_policy != "drop":
                raise RewardFunctionError(
                    f"{failures[0]} The run stops here (--reward.failure_policy {self.failure_policy}); fix the "
                    "function, raise --reward.timeout_s if it is merely slow, or pass --reward.failure_policy drop "
                    "to train without such samples."
                )
            logger.warning("%s The sample is dropped (--reward.failure_policy drop).", failures[0])
            output.update(reward=None, scores=None)
        return output

    async def _fetch_rewards_via_func(self, queries_list, prompts_list, labels_list):
        """Overrides upstream's: the same calls (one query per ``reward_func`` call, in worker threads, gathered),
        each bounded by --reward.timeout_s and guarded against BaseException."""
        calls = [self._call_reward([q], [p], [label]) for q, p, label in zip(queries_list, prompts_list, labels_list)]
        return await asyncio.gather(*calls)

    async def _call_reward(self, queries, prompts, labels):
        task = asyncio.ensure_future(asyncio.to_thread(_guarded, self.reward_func, queries, prompts, labels))
        warn_after = min(WARN_AFTER_S, self.timeout_s)
        done, _ = await asyncio.wait({task}, timeout=warn_after)
        if not done and self.timeout_s > warn_after:
            logger.warning(
                "reward_func of %s has been running for %.0f s on one sample (bound: --reward.timeout_s %g); the "
                "sample's rollout waits for it.",
                self.reward_path,
                warn_after,
                self.timeout_s,
            )
            rest = None if math.isinf(self.timeout_s) else self.timeout_s - warn_after
            done, _ = await asyncio.wait({task}, timeout=rest)
        if not done:
            return self._failed(
                f"reward_func of --reward.remote_url {self.reward_path} did not return within --reward.timeout_s "
                f"{self.timeout_s:g} s for prompt {prompts[0][:80]!r} (its thread cannot be stopped and finishes in "
                "the background)."
            )
        result = task.result()
        self.calls += 1
        problem = None if isinstance(result, _Raised) else count_problem(result, len(queries))
        if problem:  # upstream would fail later on the tensor's shape, with no word of the reward file
            return self._failed(
                f"reward_func of --reward.remote_url {self.reward_path} {problem} (call {self.calls} of this engine, "
                f"prompt {prompts[0][:80]!r}); it must return {{'rewards': ...}} with exactly one number per query "
                "on every call (upstream calls it with one query at a time)."
            )
        problem = None if isinstance(result, _Raised) else nonfinite_problem(result)
        if problem:  # upstream would make the group's advantages NaN and learn nothing from the step, silently
            return self._failed(
                f"reward_func of --reward.remote_url {self.reward_path} {problem} for prompt {prompts[0][:80]!r} "
                f"(label {labels[0]!r}); a NaN reward makes its group's advantages NaN and the step learns nothing "
                "from them (a 0/0, a log of 0, a failed parse in the function?)."
            )
        if isinstance(result, _Raised):
            where = f" line {result.line}" if result.line and result.filename == self.reward_path else ""
            return self._failed(
                f"reward_func of --reward.remote_url {self.reward_path}{where} raised {result.kind}"
                f"{': ' + result.text if result.text else ''} for prompt {prompts[0][:80]!r}; a reward function "
                "reports a failure by raising an Exception, not with sys.exit() or another BaseException (they "
                "would kill the engine's event loop)."
            )
        return result

    def _failed(self, message: str):
        failures = _FAILURES.get(None)
        if failures is not None:
            failures.append(message)
        raise RuntimeError(message)  # upstream's execute() catches it and leaves the reward None
