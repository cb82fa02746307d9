"""The reward call of the single-turn executor (openrlhf_ess/utils/agent.py): bounded by
--reward.timeout_s, a BaseException inside it (sys.exit()) caught in its thread, a failure named with the file and
handled by --reward.failure_policy; never a hang. Upstream's executor runs on a fake engine and tokenizer here;
tests/test_faults.py::test_reward_sys_exit_stops_the_run_with_the_file_named runs the real stack."""

import asyncio
import logging
from types import SimpleNamespace

import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

from openrlhf_ess.utils import agent  # noqa: E402

PROMPT = "12 + 3 ="


class _Tokenizer:
    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        return {"input_ids": torch.tensor([[5, 6, 7]])}

    def decode(self, ids, skip_special_tokens=False):
        return PROMPT + " 15"


class _Engine:
    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        out = SimpleNamespace(token_ids=[8, 9], finish_reason="stop", logprobs=None, text=" 15")
        return SimpleNamespace(outputs=[out])


def _reward_file(tmp_path, body: str) -> str:
    path = tmp_path / "reward.py"
    path.write_text("import sys\nimport time\n\nimport torch\n\n\ndef reward_func(queries, prompts, labels):\n" + body)
    return str(path)


def _execute(executor, n: int = 1):
    async def run():
        params = SimpleNamespace(max_tokens=4, logprobs=None)
        calls = [executor.execute(PROMPT, "15", params, 64, _Tokenizer(), _Engine()) for _ in range(n)]
        return await asyncio.gather(*calls)

    return asyncio.run(run())


SYS_EXIT = "    sys.exit(3)\n"
BASE_EXCEPTION = "    class Stop(BaseException):\n        pass\n    raise Stop('quota')\n"
GOOD = "    return {'rewards': torch.tensor([0.5]), 'scores': torch.tensor([0.5]), 'extra_logs': {}}\n"


def test_upstream_lets_sys_exit_escape_the_event_loop(tmp_path):
    """What upstream's executor does (the hang's cause): SystemExit from reward_func, raised in its worker thread,
    is re-raised by asyncio out of the event loop, past upstream's `except Exception`; in the engine actor that
    loop serves every request, so the run waits forever."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    with pytest.raises(SystemExit):
        _execute(SingleTurnAgentExecutor(_reward_file(tmp_path, SYS_EXIT)))


@pytest.mark.parametrize("body,raised", [(SYS_EXIT, "raised SystemExit: 3"), (BASE_EXCEPTION, "raised Stop: quota")])
@pytest.mark.parametrize("policy", ["off", "stop"])
def test_a_base_exception_in_the_reward_stops_the_run_naming_the_file(tmp_path, body, raised, policy):
    path = _reward_file(tmp_path, body)
    executor = agent.SingleTurnAgentExecutor(path, timeout_s=60, failure_policy=policy)
    with pytest.raises(agent.RewardFunctionError) as info:
        _execute(executor)
    message = str(info.value)
    assert message.startswith(f"reward_func of --reward.remote_url {path} line ") and raised in message
    assert f"for prompt {PROMPT!r}" in message and f"--reward.failure_policy {policy}" in message


def test_a_base_exception_under_drop_drops_the_sample(tmp_path, caplog):
    """--reward.failure_policy drop: the reward is None (our SamplesGenerator masks the sample and counts it in
    reward_failed), a warning names the file, the other samples keep theirs."""
    bad = agent.SingleTurnAgentExecutor(_reward_file(tmp_path, SYS_EXIT), timeout_s=60, failure_policy="drop")
    with caplog.at_level(logging.WARNING, logger=agent.__name__):
        outputs = _execute(bad, n=3)
    assert [o["reward"] for o in outputs] == [None] * 3 and all(o["scores"] is None for o in outputs)
    assert "raised SystemExit" in caplog.text and "The sample is dropped" in caplog.text


def test_a_reward_that_blocks_is_bounded(tmp_path, caplog, monkeypatch):
    """A call past --reward.timeout_s is a failed reward (stop, or dropped); a slow call within it is logged once
    it has run WARN_AFTER_S, with the file's name, and its reward is kept."""
    monkeypatch.setattr(agent, "WARN_AFTER_S", 0.2)
    blocking = _reward_file(tmp_path, "    time.sleep(3)\n" + GOOD)
    executor = agent.SingleTurnAgentExecutor(blocking, timeout_s=0.5, failure_policy="off")
    with pytest.raises(agent.RewardFunctionError, match=r"did not return within --reward.timeout_s 0.5 s"):
        _execute(executor)
    dropping = agent.SingleTurnAgentExecutor(blocking, timeout_s=0.5, failure_policy="drop")
    assert _execute(dropping)[0]["reward"] is None

    slow = agent.SingleTurnAgentExecutor(
        _reward_file(tmp_path, "    time.sleep(0.5)\n" + GOOD), timeout_s=30, failure_policy="off"
    )
    with caplog.at_level(logging.WARNING, logger=agent.__name__):
        output = _execute(slow)[0]
    assert float(output["reward"]) == 0.5
    assert f"reward_func of {slow.reward_path} has been running for 0 s on one sample" in caplog.text


def test_a_reward_that_works_is_unchanged(tmp_path):
    """Same result as upstream's executor: the reward function's value, one call per sample."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    path = _reward_file(tmp_path, GOOD)
    ours = _execute(agent.SingleTurnAgentExecutor(path, timeout_s=10), n=2)
    theirs = _execute(SingleTurnAgentExecutor(path), n=2)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys() and float(a["reward"]) == float(b["reward"]) == 0.5


def test_the_engine_builds_our_executor_for_a_reward_file(tiny_world):
    """The engine actor's init is upstream's, re-bound so its single-turn executor is ours (upstream.py); the
    bound and the policy reach it through the engine kwargs, only for a reward .py file."""
    import functools

    from openrlhf_ess import upstream
    from openrlhf_ess.cli.train_ppo_ray import parse_args
    from openrlhf_ess.trainer.ray.vllm_engine import engine_kwargs

    factory = functools.partial(agent.SingleTurnAgentExecutor, timeout_s=5)
    init = upstream.rollout_actor_init_with(factory)
    assert init.__globals__["SingleTurnAgentExecutor"] is factory
    base = ["--actor.model_name_or_path", tiny_world["model"], "--data.prompt_dataset", tiny_world["prompts"]]
    base += ["--ds.attn_implementation", "sdpa", "--vllm.num_engines", "1"]
    args, _ = parse_args(base + ["--reward.remote_url", tiny_world["reward"], "--reward.timeout_s", "7"])
    assert engine_kwargs(args)["reward_timeout_s"] == 7.0 and engine_kwargs(args)["reward_failure_policy"] == "off"
    args, _ = parse_args(base + ["--reward.remote_url", "http://localhost:5000/get_reward"])
    assert "reward_timeout_s" not in engine_kwargs(args)


def test_the_cli_names_the_reward_file_under_rays_wrapping():
    from ray.exceptions import RayTaskError

    from openrlhf_ess.cli.train_ppo_ray import RewardFailed, classify_failure

    inner = agent.RewardFunctionError("reward_func of --reward.remote_url /x/reward.py raised SystemExit: 3 ...")
    engine = RayTaskError("RolloutRayActorImpl.generate_responses", "tb", inner).as_instanceof_cause()
    outer = RayTaskError("PPOTrainer.fit", "tb", engine).as_instanceof_cause()
    args = SimpleNamespace(ray=SimpleNamespace(temp_dir=None, address=None))
    ours = classify_failure(outer, args, started=True)
    assert isinstance(ours, RewardFailed) and str(ours) == str(inner)


WRONG_COUNT_FROM_3RD = (
    "    global CALLS\n"
    "    CALLS = globals().get('CALLS', 0) + 1\n"
    "    n = 1 if CALLS < 3 else 2\n"
    "    return {'rewards': torch.tensor([0.5] * n), 'scores': torch.tensor([0.5] * n), 'extra_logs': {}}\n"
)


def test_a_wrong_count_from_the_third_call_stops_the_run_naming_the_file(tmp_path):
    """The pre-flight dry call sees one good reward; from its 3rd call the function returns two
    rewards for one query. Before: a raw shape error downstream with no word of the file. Now: the file, the call,
    what it returned and the rule."""
    path = _reward_file(tmp_path, WRONG_COUNT_FROM_3RD)
    executor = agent.SingleTurnAgentExecutor(path, timeout_s=60)
    assert [out["reward"].tolist() for out in _execute(executor, n=2)] == [[0.5], [0.5]]
    with pytest.raises(agent.RewardFunctionError) as info:
        _execute(executor)
    message = str(info.value)
    assert f"reward_func of --reward.remote_url {path} returned 2 values as 'rewards' for 1 query" in message
    assert "(call 3 of this engine" in message and "exactly one number per query" in message


def test_count_problem_by_hand():
    from openrlhf_ess.utils.reward_values import count_problem

    assert count_problem({"rewards": torch.tensor([1.0])}, 1) is None
    assert count_problem({"rewards": 0.5, "scores": [0.5]}, 1) is None
    assert count_problem({"rewards": [0.5, 0.1]}, 1) == "returned 2 values as 'rewards' for 1 query"
    assert count_problem({"rewards": 1.0, "scores": torch.ones(3)}, 1) == "returned 3 values as 'scores' for 1 query"
    assert count_problem({"scores": 1.0}, 1) == "returned a dict without 'rewards'"
    assert count_problem([0.5], 1) == "returned a list, not a dict with 'rewards'"
    assert count_problem({"rewards": "x"}, 1) == "returned a str as 'rewards' for 1 query"


NAN_ON_2ND = (
    "    global CALLS\n"
    "    CALLS = globals().get('CALLS', 0) + 1\n"
    "    value = float('nan') if CALLS == 2 else 0.5\n"
    "    return {'rewards': torch.tensor([value]), 'scores': torch.tensor([value]), 'extra_logs': {}}\n"
)


@pytest.mark.parametrize("policy", ["off", "stop"])
def test_a_nan_reward_stops_the_run_naming_the_file_and_the_sample(tmp_path, policy):
    """A NaN reward in a default run (our executor serves every reward file): upstream would make the group's
    advantages NaN and learn nothing from the step without a word; here the call is a failed reward, and the run
    stops naming the file, the value, the prompt and its label."""
    path = _reward_file(tmp_path, NAN_ON_2ND)
    executor = agent.SingleTurnAgentExecutor(path, timeout_s=60, failure_policy=policy)
    assert float(_execute(executor)[0]["reward"]) == 0.5  # the first call is finite: untouched
    with pytest.raises(agent.RewardFunctionError) as info:
        _execute(executor)
    message = str(info.value)
    assert message.startswith(f"reward_func of --reward.remote_url {path} returned a non-finite reward (nan)")
    assert f"for prompt {PROMPT!r} (label '15')" in message and f"--reward.failure_policy {policy}" in message


def test_a_nan_reward_under_drop_drops_the_sample(tmp_path):
    path = _reward_file(tmp_path, "    return {'rewards': [float('inf')], 'scores': [1.0], 'extra_logs': {}}\n")
    outputs = _execute(agent.SingleTurnAgentExecutor(path, timeout_s=60, failure_policy="drop"), n=2)
    assert [o["reward"] for o in outputs] == [None, None]


def test_nonfinite_problem_by_hand():
    import numpy as np

    from openrlhf_ess.utils.reward_values import nonfinite_problem

    assert nonfinite_problem({"rewards": torch.tensor([1.0]), "scores": [0.5]}) is None
    assert nonfinite_problem({"rewards": float("nan")}) == "returned a non-finite reward (nan)"
    assert nonfinite_problem({"rewards": [0.5], "scores": np.array([np.inf])}) == "returned a non-finite score (inf)"
    assert nonfinite_problem({"rewards": torch.tensor([-float("inf")])}) == "returned a non-finite reward (-inf)"
