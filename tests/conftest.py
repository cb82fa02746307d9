"""Shared fixtures: the offline tiny world, built once per test session under pytest's temp dir."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    from openrlhf_ess.tiny.world import build_world

    return build_world(str(tmp_path_factory.mktemp("tiny_world")), seed=0, n_prompts=32)
