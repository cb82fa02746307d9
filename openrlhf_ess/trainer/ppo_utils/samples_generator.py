"""Samples generator: upstream's ``SamplesGenerator`` keeping per-token versions and checking μ.

Mirrors ``openrlhf/trainer/ppo_utils/samples_generator.py``.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import ray
import torch
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator as _UpstreamSamplesGenerator

from openrlhf_ess import config, upstream
from openrlhf_ess.models.sampling_mask import NOT_TRUNCATED
from openrlhf_ess.trainer import eval_clock, resume, reward_check, routing_replay
from openrlhf_ess.trainer.ray.rollout_tags import EVAL_MARK, NO_VERSION


class SamplesGenerator(_UpstreamSamplesGenerator):
    # Async resume (trainer/resume.py): (prompt, label, image) of prompts dispatched but not trained at the
    # checkpoint, drawn before the data loader's saved position on the first call after a resume.
    _replay: List[tuple] = ()
    # When the first rollout batch of this launch was handed to the trainer (the start of its first step).
    first_step_start: Optional[float] = None
    # The last eval's clock metrics (eval_clock.eval_clock_metrics), merged into its eval metrics by the trainer.
    last_eval_clock: Dict[str, float] = {}
    _evaluating = False

    @torch.no_grad()
    def generate_eval_samples(self, **generate_kwargs):
        """Extends upstream's: the eval's requests are marked (``SamplingParams.extra_args``, ``EVAL_MARK``) so the
        engines keep them out of the rollouts they report for scoring at a weight sync, and ``last_eval_clock``
        records when it ran and on which weight version (``trainer/eval_clock.py``). The async trainer calls this
        under the lock that keeps weight syncs out, so the version the engines report holds for the whole eval."""
        self.last_eval_clock = eval_clock.eval_clock_metrics(
            time.time(), eval_clock.launch_time(), self.first_step_start, self.engines_version()
        )
        self._evaluating = True
        try:
            return super().generate_eval_samples(**generate_kwargs)
        finally:
            self._evaluating = False

    def engines_version(self) -> Optional[int]:
        """The weight version every engine holds, or None when the engines are not told versions (no feature tags
        rollout tokens with them: ``config.needs_versions``) or they disagree."""
        if not self.vllm_engines or not config.needs_versions(self.args):
            return None
        return eval_clock.held_version(ray.get([e.held_weight_version.remote() for e in self.vllm_engines]))

    @torch.no_grad()
    def generate_samples(self, **generate_kwargs):
        """Extends upstream's: a rollout batch with a NaN or infinite reward (``--reward.failure_policy off``; the
        other policies replaced it per sample, below) or in which every sample was dropped stops the run
        (``trainer/reward_check.py``).

        Samples are dropped one by one (below); if none is left, upstream's advantage normalisation and
        token-mean loss divide by zero tokens, and the NaN update would silently corrupt the weights.

        Async runs that checkpoint also get, on the batch's first sample, ``untrained_prompts``: the prompts
        dispatched so far whose samples are not in this or an earlier batch although the data loader position
        queued with this batch is past them (upstream's sample buffer, and replayed prompts not drawn yet).
        The trainer saves them with the checkpoint of the step that trains this batch.
        """
        if self._replay and getattr(self, "_dataloader_iter", None) is None:
            self._dataloader_iter = self._replaying(iter(self.prompts_dataloader))
            self._sample_buffer = []
        rollout_samples, *rest = super().generate_samples(**generate_kwargs)
        reward_check.check_run_rewards(rollout_samples, self.args)
        check_not_all_dropped(rollout_samples)
        if rollout_samples and self.first_step_start is None:
            self.first_step_start = time.time()  # the trainer waits for this batch: its first step starts now
        if rollout_samples and resume.applies(self.args):
            rollout_samples[0].untrained_prompts = self.untrained_prompts()
        return (rollout_samples, *rest)

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        """Extends upstream's: ``--rollout.top_k`` reaches the engines (upstream reads ``top_k`` from the
        generate kwargs but has no flag for it); an eval's requests carry ``EVAL_MARK``."""
        if self.args.rollout.top_k > 0:
            generate_kwargs.setdefault("top_k", self.args.rollout.top_k)
        if self._evaluating:
            dispatch = upstream.rebind(
                _UpstreamSamplesGenerator._dispatch_prompts_to_vllm, {"SamplingParams": eval_sampling_params}
            )
            return dispatch(self, prompts, labels, images=images, **generate_kwargs)
        return super()._dispatch_prompts_to_vllm(prompts, labels, images=images, **generate_kwargs)

    def replay_first(self, prompts: List[tuple]) -> None:
        """After a resume: draw ``prompts`` (prompt, label, image) before the data loader's next ones."""
        self._replay = list(prompts)
        self._dataloader_iter = None

    def _replaying(self, loader_iter):
        while self._replay:  # popped as drawn, so untrained_prompts() sees only those not drawn yet
            prompt, label, image = self._replay.pop(0)
            yield None, [prompt], [label], [image]
        yield from loader_iter

    def untrained_prompts(self) -> List[tuple]:
        """(prompt, label, image) per prompt in the sample buffer (its n samples are adjacent), then the
        replayed prompts not drawn yet."""
        n = self.args.rollout.n_samples_per_prompt
        buffered = getattr(self, "_sample_buffer", None) or []
        groups = [(e.prompts[0], e.labels[0], e.images[0]) for e in buffered[::n]]
        return groups + list(self._replay)

    def _process_response_into_experience(self, response, **generate_kwargs):
        """Extends upstream's conversion of one engine response.

        - ``experience.rollout_versions`` (1, A): the weight version that sampled each action token
          (NO_VERSION elsewhere), aligned with ``rollout_log_probs`` and ``action_mask``. A plain
          attribute, not an Experience field: it is consumed by the experience maker on the controller.
        - ``experience.rollout_kept_counts`` (1, A), --algo.sampling_mask keep: the engine's kept-support size
          per action token (NOT_TRUNCATED elsewhere), same alignment; a plain attribute carried to the actors'
          replay buffer (``trainer/sampling_mask.py``).
        - ``experience.rollout_routes`` [1, S, L, k], --algo.routing_replay: the engine's expert ids per token and
          layer, aligned with ``sequences`` (row i: token i; the last token: the sentinel), uint8 or int16; a plain
          attribute carried to the actors (``trainer/routing_replay.py``).
        - With --reward.failure_policy, a sample whose reward is None (the reward function raised) or not
          finite either stops the run or is masked out with reward 0, counted in ``info["reward_failed"]``.
        - A sample whose μ is NaN or ±inf on a sampled token is masked out (action_mask = 0, μ set to 0
          so nothing non-finite reaches the loss) and counted in ``info["rollout_logprob_nonfinite"]``, or
          stops the run with --algo.nonfinite_logprobs stop.
        """
        reward = response.get("reward")
        policy = self.args.reward.failure_policy
        failed = policy != "off" and not _finite_number(reward)
        if failed:
            if policy == "stop":
                raise RuntimeError(
                    f"the reward function returned {reward!r} for prompt {response.get('prompt')!r} (an exception "
                    "inside it is logged by the rollout engine as 'Failed to fetch reward'). Fix the reward "
                    "function, or pass --reward.failure_policy drop to train without such samples."
                )
            response = {**response, "reward": 0.0, "scores": 0.0}
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        if policy != "off":
            experience.info["reward_failed"] = torch.tensor([float(failed)])
            if failed:
                experience.action_mask = torch.zeros_like(experience.action_mask)
        truncate_length = generate_kwargs.get("max_len", 2048)
        versions = response.get("rollout_versions")
        if versions is not None:
            experience.rollout_versions = torch.tensor(versions[1:truncate_length], dtype=torch.long).unsqueeze(0)
        if config.sampling_mask_on(self.args):
            kept = _from_engine(response, "rollout_kept_counts", "--algo.sampling_mask keep", "kept counts")
            experience.rollout_kept_counts = torch.tensor(kept[1:truncate_length], dtype=torch.long).unsqueeze(0)
        if config.routing_replay_on(self.args):
            routes = _from_engine(response, "rollout_routes", "--algo.routing_replay", "routes (routed_experts)")
            n_tokens = len(response["observation_tokens"])
            experience.rollout_routes = routing_replay.observation_routes(routes, n_tokens, truncate_length)
        mu = experience.rollout_log_probs
        if mu is not None:
            bad = ~torch.isfinite(mu) & experience.action_mask.bool()
            nonfinite = bool(bad.any())
            if nonfinite and self.args.algo.nonfinite_logprobs == "stop":
                raise RuntimeError(
                    f"the vLLM engine returned NaN/inf sampled-token log-probs (mu) for prompt "
                    f"{response.get('prompt')!r}: check the engine's dtype (--vllm.dtype) and weights; "
                    "--algo.nonfinite_logprobs drop trains on without such samples."
                )
            if nonfinite:
                experience.rollout_log_probs = torch.where(torch.isfinite(mu), mu, torch.zeros_like(mu))
                experience.action_mask = torch.zeros_like(experience.action_mask)
            experience.info["rollout_logprob_nonfinite"] = torch.tensor([float(nonfinite)])
        return experience


def eval_sampling_params(**kwargs):
    """vLLM ``SamplingParams(**kwargs)`` marked as a held-out eval's (``extra_args[EVAL_MARK]``; vLLM's own
    samplers ignore ``extra_args``)."""
    from vllm import SamplingParams

    extra = dict(kwargs.pop("extra_args", None) or {}, **{EVAL_MARK: True})
    return SamplingParams(**kwargs, extra_args=extra)


def _from_engine(response: dict, key: str, flag: str, what: str):
    """``response[key]``, which the engine attaches to every response while ``flag`` is on; raise if missing."""
    value = response.get(key)
    if value is None:
        raise RuntimeError(
            f"{flag}: a response came back without the engine's {what}, so the trainer cannot score its tokens as "
            "the engine sampled them. An agent (--train.agent_func_path) must generate through the llm_engine it is "
            "given, with the sampling params it is given; otherwise this is a bug, please report it."
        )
    return value


def check_not_all_dropped(rollout_samples) -> None:
    """Raise if a non-empty rollout batch has no response token left in the loss (every sample dropped)."""
    if not rollout_samples or any(bool(s.action_mask.any()) for s in rollout_samples):
        return

    def count(key):
        return int(sum(float(s.info[key].sum()) for s in rollout_samples if key in s.info))

    raise RuntimeError(
        f"every one of the {len(rollout_samples)} samples of this rollout batch was dropped from the loss "
        f"({count('reward_failed')} failed rewards under --reward.failure_policy drop, "
        f"{count('rollout_logprob_nonfinite')} with non-finite rollout log-probs from the engine); an update "
        "without a single response token would be NaN (means over zero tokens: 0/0) and corrupt the weights. "
        "Fix the reward function or the engine; --reward.failure_policy stop stops at the first failed reward."
    )


def _finite_number(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(torch.isfinite(value.float()).all())
    return isinstance(value, (int, float)) and value == value and abs(value) != float("inf")


def kept_or_untruncated(experience) -> torch.Tensor:
    """The experience's (B, A) kept counts, or all NOT_TRUNCATED when the engine did not report them."""
    kept = getattr(experience, "rollout_kept_counts", None)
    if kept is None:
        return torch.full_like(experience.action_mask, NOT_TRUNCATED, dtype=torch.long)
    return kept


def versions_or_untagged(experience) -> torch.Tensor:
    """The experience's (B, A) rollout versions, or all NO_VERSION when the engine did not tag them."""
    versions = getattr(experience, "rollout_versions", None)
    if versions is None:
        return torch.full_like(experience.action_mask, NO_VERSION, dtype=torch.long)
    return versions
