"""A tied-embedding model (tiny Qwen2, ``tie_word_embeddings``) through the real CLI: the engine's LM head follows the
trained embedding at every sync, and a head left stale is named at the first one.

Before the fix the reload sync never re-processed a tied head, so vLLM's CPU engine kept computing the logits with
the pretrained embedding: ``mismatch/k3`` grew step after step, the per-tensor check left the head out, and the run
exited 0. ``tests/test_tied_lm_head.py`` holds the engine-level arithmetic; here the whole run.
"""

import pytest

from tests.helpers import fault_injection
from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args

# a synchronous run with μ returned (TIS on), a high LR and every check at every sync (on tests/conftest.py's
# tied_world; tests/test_e2e_scale.py's run with a reference model and a critic takes them too)
FLAGS = ["--algo.tis_cap", "2", "--actor.adam.lr", "1e-2", "--vllm.sync_check_canary_every", "1"]


def check_tied_head_followed(scalars: dict, steps: int) -> None:
    """A synchronous run of the tied world at a high LR with checksums and canary after every sync passed them all,
    and the engine-vs-trainer mismatch stayed at rounding (bf16's, or fp32's: the tests' CPU dtype) instead of growing
    with the updates (before the fix it grew from the first sync on: the head the engine sampled from was the
    pretrained one)."""
    k3 = [v for _, v in sorted(scalars["train/mismatch/k3"])]
    canary = [v for _, v in sorted(scalars["train/sync/canary_mean_abs_diff"])]
    compared = [v for _, v in sorted(scalars["train/sync/checksum_tensors_compared"])]
    assert len(k3) == steps and len(canary) == steps - 1 and len(compared) == steps - 1, (k3, canary, compared)
    # 24 parameters sent (the shared embedding once) + the head by what it computes
    assert set(compared) == {25.0}, compared
    assert max(k3[1:]) <= max(3 * k3[0], 1e-3), k3  # flat: the last steps no farther than the first
    assert max(canary) < 0.05, canary  # rounding, ~0.01 in bf16 (the stale head read ~0.2 nats after a few steps)


# slow: its checks run in the gate on the stack tier's run with a reference model and a critic
# (tests/test_e2e_scale.py::test_reference_model_and_critic_with_ess_lr_and_tis: this world, these flags)
@pytest.mark.real_stack
@pytest.mark.slow
def test_a_tied_head_follows_the_trained_embedding_at_every_sync(tied_world, tmp_path):
    """6 steps at lr 1e-2, checksums and canary after every sync, the head compared by what it computes
    (:func:`check_tied_head_followed`)."""
    run_dir = str(tmp_path)
    rc, log = run_cli(tiny_args(tied_world, run_dir, steps_prompts=48) + FLAGS, run_dir, timeout=900)
    assert rc == 0, log[-3000:]
    check_tied_head_followed(read_tensorboard(run_dir), steps=6)


@pytest.mark.real_stack
@pytest.mark.slow
def test_a_stale_tied_head_is_named_at_the_first_sync(tied_world, tmp_path):
    """The head left unprocessed after each reload (injected): the shared parameter holds the trained embedding, so
    its own sums match, but the head's logits do not; the run stops at version 1 naming the head."""
    run_dir = str(tmp_path)
    env = {fault_injection.STALE_TIED_HEAD_ENV: "1"}
    args = tiny_args(tied_world, run_dir, steps_prompts=48) + FLAGS
    rc, log = run_cli(args, run_dir, env=env, timeout=900, launcher=fault_injection.LAUNCHER)
    assert rc != 0
    assert "weight sync check failed after version 1" in log, log[-3000:]
    assert "1 of 25 tensors differ (lm_head.weight[applied])" in log, log[-3000:]
    assert "tied LM head" in log and "--vllm.sync_backend reload" not in log.split("weight sync check failed")[-1]
    assert "Global step 2" not in log
