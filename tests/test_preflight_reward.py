"""Pre-flight, the reward file (openrlhf_ess/checks/preflight/reward.py): the dry call is isolated, its failures are
notices, it sees the first prompt and label, and values training can use pass.

Shared inputs (the tiny run's flags, FILES): tests/helpers/preflight_inputs.py."""

import json
import time

import pytest

from openrlhf_ess.checks import preflight
from tests.helpers.preflight_inputs import (
    _args,
    _offline,  # noqa: F401  (autouse: the hub offline)
)


@pytest.mark.parametrize(
    "body,notice",
    [
        ("    raise ValueError('service down')", "raised ValueError: service down"),
        ("    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)", "ended its process (exit code -9)"),
        ("    import time\n    time.sleep(60)", "did not return within 1 s"),
    ],
    ids=["raises", "kills-its-process", "hangs"],
)
def test_reward_dry_call_failures_are_notices(tiny_world, tmp_path, monkeypatch, body, notice):
    """The dry call runs in a forked child: an exception, a hang or even killing its own process there is reported
    (it may depend on the made-up response) and the pre-flight itself carries on."""
    monkeypatch.setattr(preflight.reward, "REWARD_CALL_TIMEOUT_S", 1.0)
    reward = tmp_path / "reward.py"
    reward.write_text(f"def reward_func(queries, prompts, labels):\n{body}\n")
    start = time.perf_counter()
    notices = preflight.check(_args(tiny_world, tmp_path, ["--reward.remote_url", str(reward)]))
    assert time.perf_counter() - start < 10
    assert any(notice in n for n in notices), notices
    assert notices[-1].startswith("pre-flight checks passed")


def test_reward_dry_call_sees_the_first_prompt_and_label(tiny_world, tmp_path):
    seen = tmp_path / "seen.json"
    reward = tmp_path / "reward.py"
    reward.write_text(
        "import json\n\n\ndef reward_func(queries, prompts, labels):\n"
        f"    json.dump([queries, prompts, labels], open({str(seen)!r}, 'w'))\n"
        "    return {'rewards': 0.5}\n"  # a bare number is one value: upstream wraps it in torch.tensor([...])
    )
    flags = ["--reward.remote_url", str(reward), "--data.label_key", "label", "--data.input_template", "Q: {}"]
    preflight.check(_args(tiny_world, tmp_path, flags))
    queries, prompts, labels = json.load(open(seen))
    first = json.loads(open(tiny_world["prompts"]).readline())
    assert prompts == ["Q: " + first["input"]] and labels == [first["label"]]
    assert queries[0].startswith(prompts[0]) and queries[0].endswith("</s>")


@pytest.mark.parametrize(
    "value",
    ["0.5", "torch.tensor([0.5])", "torch.tensor(0.5)", "[0.5]", "[torch.tensor(0.5)]", "1"],
)
def test_reward_values_training_can_use_pass(tiny_world, tmp_path, value):
    """One number per query in any form upstream's torch.tensor([value]) accepts; scores None falls back
    to rewards, as upstream does."""
    reward = tmp_path / "reward.py"
    reward.write_text(
        "import torch\n\n\ndef reward_func(queries, prompts, labels):\n"
        f"    return {{'rewards': {value}, 'scores': None, 'extra_logs': {{'n': torch.tensor([2.0]), 'm': 1}}}}\n"
    )
    notices = preflight.check(_args(tiny_world, tmp_path, ["--reward.remote_url", str(reward)]))
    assert "reward_func dry call returned 1 reward for 1 query" in notices[-1]


def test_a_reward_function_that_exits_is_told_how_to_report_a_failure(tiny_world, tmp_path):
    """sys.exit() in reward_func: the notice names SystemExit and says to raise an Exception instead (it did raise:
    it is not told that it "must raise")."""
    reward = tmp_path / "reward.py"
    reward.write_text("import sys\n\n\ndef reward_func(queries, prompts, labels):\n    sys.exit(3)\n")
    notices = preflight.check(_args(tiny_world, tmp_path, ["--reward.remote_url", str(reward)]))
    (notice,) = [n for n in notices if "dry call of reward_func" in n]
    assert f"{reward} line 5: a dry call of reward_func on the first prompt with a made-up response raised " in notice
    assert (
        "raised SystemExit: 3. A reward function reports a failure by raising an Exception, not with sys.exit()"
        in (notice)
    )
    assert notice.endswith(
        "stops the run naming this file (--reward.failure_policy drop would drop the sample "
        "instead): raise an Exception or return the dict."
    ), notice
