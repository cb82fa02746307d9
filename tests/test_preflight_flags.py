"""Pre-flight, flag values (openrlhf_ess/checks/preflight/flags.py): NaN refused on every float flag, inf only where it
means no bound, vLLM's temperature floor, the sync max-lag notice, the batch rule's data-parallel count.

Shared inputs (the tiny run's flags, FILES): tests/helpers/preflight_inputs.py."""

import re

import pytest

from openrlhf_ess.checks import preflight
from openrlhf_ess.cli import train_ppo_ray as cli
from openrlhf_ess.config import ConfigError
from tests.helpers.preflight_inputs import (
    _args,
    _argv,
    _offline,  # noqa: F401  (autouse: the hub offline)
)


def test_nan_is_refused_on_every_float_flag(tiny_world, tmp_path):
    """Each float flag set to NaN is refused by flag parsing (naming it) or by the pre-flight (naming it)."""
    actions = preflight.flags.float_flags()
    assert len(actions) > 40
    for action in actions:
        flag = action.option_strings[0]
        n = action.nargs if isinstance(action.nargs, int) else 1
        argv = _argv(tiny_world, tmp_path, [flag] + ["nan"] * n)
        try:
            args, _ = cli.parse_args(argv)
        except ConfigError as e:
            assert flag in str(e), (flag, str(e))
            continue
        except AssertionError:
            continue  # upstream's own check refused it
        with pytest.raises(ConfigError, match=re.escape(flag) + r" [^:]*nan: NaN is not a usable value"):
            preflight.check(args)


def test_infinity_where_it_means_no_bound(tiny_world, tmp_path):
    assert set(preflight.flags.INF_MEANS_NO_BOUND) <= {a.dest for a in preflight.flags.float_flags()}
    flags = ["--ckpt.max_mem", "inf", "--algo.tis_cap", "inf", "--reward.clip_range", "-10", "inf"]
    flags += ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0", "inf"]
    args = _args(tiny_world, tmp_path, flags)
    assert args.algo.tis_cap == float("inf")
    preflight.check(args)


def test_temperature_floor_is_vllms():
    """Below vLLM's floor the engine samples at the floor while the trainer divides by the flag's value:
    the floor pre-flight names is the installed vLLM's (vllm/sampling_params.py: _MAX_TEMP)."""
    from vllm import sampling_params

    assert preflight.flags.VLLM_MIN_TEMPERATURE == sampling_params._MAX_TEMP == 0.01
    assert sampling_params.SamplingParams(temperature=0.005).temperature == 0.01  # what the engine would do


def test_max_version_lag_with_sync_training_says_it_masks_nothing(tiny_world, tmp_path):
    notices = preflight.check(_args(tiny_world, tmp_path, ["--algo.max_version_lag", "2"]))
    assert any("--algo.max_version_lag 2 with synchronous training" in n for n in notices), notices
    flags = ["--algo.max_version_lag", "2", "--train.async_enable"]
    notices = preflight.check(_args(tiny_world, tmp_path, flags))
    assert not any("with synchronous training" in n for n in notices), notices


def test_the_batch_rule_counts_data_parallel_ranks_as_deepspeed_does():
    """upstream's DeepspeedStrategy: dp = GPUs // ring_attn_size // tensor_parallel_size (written out here)."""
    import types

    def args(nodes, gpus, ring, tp):
        return types.SimpleNamespace(
            actor=types.SimpleNamespace(num_nodes=nodes, num_gpus_per_node=gpus),
            ds=types.SimpleNamespace(ring_attn_size=ring, tensor_parallel_size=tp),
        )

    assert preflight.flags.dp_size(args(2, 8, 1, 1), "actor") == 16
    assert preflight.flags.dp_size(args(2, 8, 2, 2), "actor") == 4
    assert preflight.flags.dp_size(args(1, 4, 1, 4), "actor") == 1
