"""A NaN or infinite reward stops the run naming the reward source and a sample (openrlhf_ess/trainer/reward_check.py;
docs/faults.md, section 15); finite rewards pass untouched. No Ray: the generator and the maker are
driven with upstream's Experience and their upstream steps stubbed."""

from types import SimpleNamespace

import pytest
import torch
from openrlhf.trainer.ppo_utils.experience import Experience

from openrlhf_ess.trainer import reward_check

NAN, INF = float("nan"), float("inf")


def _args(remote_url=("/work/r.py",), model=None, agent=None, policy="off"):
    return SimpleNamespace(
        reward=SimpleNamespace(
            remote_url=list(remote_url) if remote_url else None, model_name_or_path=model, failure_policy=policy
        ),
        train=SimpleNamespace(agent_func_path=agent, async_enable=False),
        ckpt=SimpleNamespace(load_enable=False, save_steps=-1),
        algo=SimpleNamespace(sampling_mask="off"),
    )


def _sample(reward, prompt="ab =", label="digits"):
    """One rollout sample as upstream's generator builds it (one reward per sample)."""
    return Experience(
        sequences=torch.tensor([[5, 6, 7, 8]]),
        attention_mask=torch.ones(1, 4, dtype=torch.long),
        action_mask=torch.tensor([[0, 1, 1]]),
        prompts=[prompt],
        labels=[label],
        rewards=torch.tensor([reward]),
        info={},
    )


def test_finite_rewards_pass_and_are_not_touched():
    samples = [_sample(0.5), _sample(-3.0), _sample(0.0)]
    before = [s.rewards.clone() for s in samples]
    reward_check.check_rewards(samples, "reward_func of --reward.remote_url /work/r.py")
    assert all(torch.equal(s.rewards, b) for s, b in zip(samples, before))
    assert reward_check.nonfinite_reward_message([1.0, 2.0], ["a", "b"], [None, None], "src") is None


def test_one_nan_names_the_file_the_count_and_the_sample():
    samples = [_sample(0.5, "ab ="), _sample(NAN, "cd =", "7"), _sample(1.0), _sample(NAN, "ef =")]
    with pytest.raises(reward_check.NonFiniteRewardError) as info:
        reward_check.check_rewards(samples, *reward_check.reward_source(_args()))
    message = str(info.value)
    assert message.startswith(
        "reward_func of --reward.remote_url /work/r.py gave a non-finite reward (NaN) for 2 of the 4 samples of this "
        "rollout batch, e.g. nan for prompt 'cd =' (label '7')."
    ), message
    assert "the run stops here, before the update" in message
    assert message.endswith(
        "Fix the reward function (a 0/0, a log of 0, a failed parse), or pass --reward.failure_policy drop to train "
        "without such samples (reward 0, masked out of the loss, counted in reward_failed)."
    )
    assert "\n" not in message


def test_inf_and_a_long_prompt_in_a_micro_batch():
    """A micro-batch of the maker (rewards (B,), prompts B): the example is the right sample, its prompt cut."""
    long_prompt = "x" * 100 + " ="
    batch = Experience(
        sequences=torch.zeros(2, 4, dtype=torch.long),
        attention_mask=torch.ones(2, 4, dtype=torch.long),
        action_mask=torch.ones(2, 3, dtype=torch.long),
        prompts=["fine =", long_prompt],
        labels=[None, None],
        rewards=torch.tensor([0.25, -INF]),
        info={},
    )
    with pytest.raises(reward_check.NonFiniteRewardError) as info:
        reward_check.check_rewards([_sample(NAN), batch], "src", "Fix it.")
    message = str(info.value)
    assert "(NaN/inf) for 2 of the 3 samples" in message and message.endswith("Fix it.")
    message_inf = reward_check.nonfinite_reward_message([0.25, -INF], batch.prompts, batch.labels, "src")
    assert f"e.g. -inf for prompt '{'x' * 80}...' (label None)" in message_inf, message_inf


@pytest.mark.parametrize(
    "kwargs, source, fix",
    [
        ({}, "reward_func of --reward.remote_url /work/r.py", "Fix the reward function"),
        ({"remote_url": ("http://rm:5000/get_reward",)}, "the reward server --reward.remote_url http://rm:5000/", ""),
        ({"agent": "/work/agent.py"}, "the agent --train.agent_func_path /work/agent.py", "Fix the reward function"),
        ({"remote_url": None, "model": "/m/rm"}, "the reward model --reward.model_name_or_path /m/rm", "Check the "),
    ],
    ids=["file", "server", "agent", "reward-model"],
)
def test_the_source_is_named_in_the_flags_words(kwargs, source, fix):
    named, suggested = reward_check.reward_source(_args(**kwargs))
    assert named.startswith(source) and suggested.startswith(fix or "Fix the reward server")


def test_the_generator_stops_on_a_nan_reward_and_leaves_finite_batches_alone(monkeypatch):
    """Wired in our SamplesGenerator.generate_samples, on the rollout batch upstream's generator returns."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator as Upstream

    from openrlhf_ess.trainer.ppo_utils.samples_generator import SamplesGenerator

    batch = [_sample(1.0), _sample(0.0)]
    monkeypatch.setattr(Upstream, "generate_samples", lambda self, **kw: (batch, 1.0, 2, False))
    gen = SamplesGenerator.__new__(SamplesGenerator)
    gen.args = _args()
    out, *rest = gen.generate_samples()
    assert out is batch and [s.rewards.item() for s in out] == [1.0, 0.0] and rest == [1.0, 2, False]
    batch.append(_sample(NAN, "gh ="))
    with pytest.raises(reward_check.NonFiniteRewardError, match=r"for 1 of the 3 samples .* prompt 'gh ='"):
        gen.generate_samples()


def test_drop_keeps_its_meaning_a_failed_reward_masked_out():
    """--reward.failure_policy drop: a NaN reward is a failed reward (reward 0, masked, counted), so the batch
    check finds nothing to stop on."""
    from openrlhf_ess.trainer.ppo_utils.samples_generator import SamplesGenerator

    gen = SamplesGenerator.__new__(SamplesGenerator)
    gen.args = _args(policy="drop")
    response = {
        "observation_tokens": [5, 6, 7, 8],
        "action_ranges": [(2, 4)],
        "rollout_log_probs": None,
        "prompt": "p =",
        "label": None,
        "reward": NAN,
        "scores": NAN,
    }
    exp = gen._process_response_into_experience(response, max_len=64)
    reward_check.check_rewards([exp], "src")
    assert exp.rewards.tolist() == [0.0] and exp.info["reward_failed"].tolist() == [1.0]


def test_the_maker_stops_on_a_reward_models_nan(monkeypatch):
    """A reward model's rewards are set in upstream's make_experience: checked right after it, before anything
    else of the batch is computed."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker as Upstream

    from openrlhf_ess.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    def upstream_make_experience(self, samples_list):
        for s in samples_list:  # as upstream sets the reward model's outputs
            s.rewards = torch.tensor([NAN])
        return samples_list

    monkeypatch.setattr(Upstream, "make_experience", upstream_make_experience)
    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.args = _args(remote_url=None, model="/m/rm")
    samples = [_sample(0.0, "rm ="), _sample(0.0)]
    for s in samples:
        s.rewards = None
    with pytest.raises(reward_check.NonFiniteRewardError) as info:
        maker.make_experience(samples)
    assert str(info.value).startswith(
        "the reward model --reward.model_name_or_path /m/rm gave a non-finite reward (NaN) for 2 of the 2 samples"
    )
    assert "--reward.failure_policy does not apply to a reward model" in str(info.value)


def test_the_cli_ends_with_our_message():
    """Raised in the controller actor and wrapped by Ray: the CLI's last line is our message (exit 1)."""
    from ray.exceptions import RayTaskError

    from openrlhf_ess.cli import train_ppo_ray as cli

    with pytest.raises(reward_check.NonFiniteRewardError) as info:
        reward_check.check_rewards([_sample(NAN)], *reward_check.reward_source(_args()))
    exc = RayTaskError(
        "PPOTrainerImpl.fit", "Traceback ...", info.value, proctitle="ray::x", pid=7, ip="127.0.0.1"
    ).as_instanceof_cause()
    err = cli.classify_failure(exc, SimpleNamespace(), started=True)
    assert isinstance(err, cli.RewardFailed) and str(err) == str(info.value)
    assert str(err).startswith("reward_func of --reward.remote_url /work/r.py gave a non-finite reward (NaN)")
