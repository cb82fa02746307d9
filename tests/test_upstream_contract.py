"""What openrlhf_ess.upstream assumes about the pinned OpenRLHF. An upgrade starts here."""

import argparse

import pytest

from openrlhf_ess import upstream
from openrlhf_ess.cli import train_ppo_ray as cli


def test_pinned_version_installed():
    upstream.check_version()


def test_our_parser_accepts_every_upstream_flag():
    ours = cli.build_parser()
    theirs = upstream.build_parser()
    their_flags = {opt for a in theirs._actions for opt in a.option_strings}
    our_flags = {opt for a in ours._actions for opt in a.option_strings}
    assert len(their_flags) > 150  # the whole upstream CLI, not a stub
    assert their_flags <= our_flags
    for action in theirs._actions:  # same defaults as upstream
        if action.dest != "help":
            assert ours.get_default(action.dest) == theirs.get_default(action.dest), action.dest


def test_upstream_validation_runs(tiny_world):
    base = ["--actor.model_name_or_path", tiny_world["model"], "--data.prompt_dataset", tiny_world["prompts"]]
    base += ["--reward.remote_url", tiny_world["reward"]]
    with pytest.raises(AssertionError, match="partial_rollout_enable requires"):
        cli.parse_args(base + ["--train.partial_rollout_enable", "--ds.attn_implementation", "sdpa"])
    args, _ = cli.parse_args(base + ["--ds.attn_implementation", "sdpa", "--actor.eps_clip", "0.3"])
    # upstream's post-parse code ran: hierarchical namespace and derived defaults
    assert args.actor.eps_clip_low_high == (0.3, 0.3)
    assert args.rollout.vllm_generate_batch_size == args.rollout.batch_size


def test_rebind_does_not_touch_upstream():
    from openrlhf.trainer.ray import vllm_engine

    sentinel = object()
    rebound = upstream.rebind(vllm_engine.create_vllm_engines, {"RolloutRayActor": sentinel})
    assert rebound.__globals__["RolloutRayActor"] is sentinel
    assert vllm_engine.RolloutRayActor is not sentinel
    assert vllm_engine.create_vllm_engines.__globals__["RolloutRayActor"] is vllm_engine.RolloutRayActor


def test_rebind_import_override_is_local():
    def uses_local_import():
        from argparse import ArgumentParser

        return ArgumentParser

    sentinel = object()
    rebound = upstream.rebind(uses_local_import, import_override={"argparse": {"ArgumentParser": sentinel}})
    assert rebound() is sentinel
    assert uses_local_import() is argparse.ArgumentParser


def test_upstream_train_names_we_substitute():
    # run_train replaces these names inside upstream's train(); if upstream renames them the
    # substitution would silently do nothing, so check they are still referenced.
    code = upstream.upstream_cli_module().train.__code__
    names = set(code.co_names)
    assert {"PolicyModelActor", "ReferenceModelActor", "CriticModelActor", "RewardModelActor"} <= names
    assert "create_vllm_engines" in names
    from openrlhf.trainer.ray import ppo_actor, vllm_engine

    assert (
        "ActorPPOTrainer"
        in upstream.ray_actor_class(ppo_actor.PolicyModelActor).init_model_from_pretrained.__code__.co_names
    )
    assert "RolloutRayActor" in vllm_engine.create_vllm_engines.__code__.co_names


def _zero_arg_super_methods_inherited_from_remote_classes(cls):
    """Names whose method ``cls`` takes as it is from an upstream class that its module exposes only as a
    ``@ray.remote`` wrapper, where the method's code calls zero-argument ``super()`` (a ``__class__`` cell)."""
    import inspect
    import sys

    found = []
    for name in dir(cls):
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or not owner.__module__.startswith("openrlhf."):
            continue
        fn = vars(owner)[name]
        fn = getattr(fn, "__func__", fn)
        if not inspect.isfunction(fn) or "__class__" not in fn.__code__.co_freevars:
            continue
        if getattr(sys.modules[owner.__module__], owner.__name__, None) is not owner:  # the module name: the wrapper
            found.append(f"{cls.__name__}.{name} (upstream's {owner.__name__})")
    return found


def test_no_actor_class_of_ours_inherits_an_upstream_method_that_calls_zero_argument_super():
    """Such a method reaches the actor's worker by value, its super() bound to a copy of upstream's class, and the
    actor fails with TypeError: super(type, obj) (the async controller's eval-only training actor did, at start-up,
    before its __init__ and broadcast_to_vllm were passed through). Every Ray actor class of ours that subclasses
    one of upstream's is checked; the check itself is shown to find both on a class that inherits them."""
    import importlib
    import inspect

    from openrlhf.trainer import ppo_trainer_async as upstream_async

    modules = [
        "openrlhf_ess.trainer.ppo_trainer",
        "openrlhf_ess.trainer.ppo_trainer_async",
        "openrlhf_ess.trainer.ray.ppo_actor",
        "openrlhf_ess.trainer.ray.ref_actor",
        "openrlhf_ess.trainer.ray.vllm_engine",
        "openrlhf_ess.trainer.ray.prox_scorer",
    ]
    ours = []
    for module in map(importlib.import_module, modules):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and any(k.__module__.startswith("openrlhf.") for k in cls.__mro__):
                ours.append(cls)
    names = {cls.__name__ for cls in ours}
    assert {"TrainingActorImpl", "TrainingActorEvalImpl", "PPOTrainerImpl", "PPOTrainerEvalImpl"} <= names
    found = [hit for cls in ours for hit in _zero_arg_super_methods_inherited_from_remote_classes(cls)]
    assert found == []

    class Inherits(upstream.ray_actor_class(upstream_async.TrainingActor)):
        pass

    assert sorted(_zero_arg_super_methods_inherited_from_remote_classes(Inherits)) == [
        "Inherits.__init__ (upstream's TrainingActor)",
        "Inherits.broadcast_to_vllm (upstream's TrainingActor)",
    ]
