"""What the run asks Ray for, per role, checked against the cluster before anything is placed.

The unit tests need no Ray: ``resources.requests`` is compared with what upstream's own ``train()`` reserves when
run against recording stand-ins for Ray, across colocation flags; the check and the watchdog's message run on
canned clusters and placement-group tables. One CLI test runs the measured hang (a reference model left at
upstream's default of 8 GPUs per node) and asserts it now fails within seconds with our message.
"""

import time
from types import SimpleNamespace

import pytest

from openrlhf_ess import config
from openrlhf_ess.checks import resources
from openrlhf_ess.cli import train_ppo_ray as cli


def _args(*extra):
    base = ["--actor.model_name_or_path", "M", "--data.prompt_dataset", "p.jsonl", "--reward.remote_url", "r.py"]
    base += ["--ds.attn_implementation", "sdpa", "--algo.advantage.estimator", "reinforce"]
    base += ["--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--algo.kl.init_coef", "0"]
    args, _ = cli.parse_args(base + list(extra))
    return args


REF8 = ("--algo.kl.use_loss", "--algo.kl.init_coef", "0.01")  # the measured hang: ref at upstream's 8 per node


def _upstream_reservations(args):
    """Run upstream's ``train()`` against stand-ins for Ray that record what it reserves.

    Every placement group's bundles are held; an actor placed inside a placement group takes nothing more;
    an actor placed outside one holds its ``num_gpus``/``num_cpus``. Returns {"GPU", "CPU", "groups"}.
    """
    from openrlhf.cli import train_ppo_ray as up
    from openrlhf.trainer.ray import launcher, vllm_engine

    from openrlhf_ess import upstream

    held = {"GPU": 0.0, "CPU": 0.0, "groups": []}

    class PG:
        def __init__(self, bundles, strategy="PACK"):
            held["groups"].append(len(bundles))
            for bundle in bundles:
                for key in ("GPU", "CPU"):
                    held[key] += bundle.get(key, 0)

        def ready(self):
            return None

    class Call:
        def remote(self, *a, **k):
            return None

    class Handle:
        def __getattr__(self, name):
            return Call()

    class ActorClass:
        def options(self, num_cpus=None, num_gpus=None, scheduling_strategy=None, **kwargs):
            if scheduling_strategy is None:
                held["GPU"] += num_gpus or 0
                held["CPU"] += num_cpus or 0
            return self

        def remote(self, *a, **k):
            return Handle()

    fake_ray = SimpleNamespace(is_initialized=lambda: True, get=lambda *a, **k: ("127.0.0.1", 1))
    placement = {"placement_group": PG, "ray": fake_ray, "PlacementGroupSchedulingStrategy": lambda **k: k}

    class Group(launcher.RayActorGroup):
        _initiate_actors = upstream.rebind(launcher.RayActorGroup._initiate_actors, placement)

    engines = upstream.rebind(
        vllm_engine.create_vllm_engines,
        {
            **placement,
            "RolloutRayActor": ActorClass(),
            "get_bundle_indices": lambda pg, i, n: list(range(i * n, i * n + n)),
        },
    )
    train = upstream.rebind(
        up.train,
        {
            **placement,
            "create_vllm_engines": engines,
            "RayActorGroup": Group,
            "PolicyModelActor": ActorClass(),
            "ReferenceModelActor": ActorClass(),
            "CriticModelActor": ActorClass(),
            "RewardModelActor": ActorClass(),
            "get_strategy": lambda a: SimpleNamespace(print=lambda *x: None),
        },
        {
            "openrlhf.trainer.ppo_trainer": {"PPOTrainer": ActorClass()},  # a controller: holds nothing
            "openrlhf.trainer.ppo_trainer_async": {"PPOTrainerAsync": ActorClass()},
        },
    )
    train(args)
    return held


MIRROR_CASES = {
    "tiny": (),
    "ref at upstream's default": REF8,
    "ref, 2 engines tp 2": REF8 + (
        "--ref.num_gpus_per_node", "2", "--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "2",
    ),
    "colocate actor+ref": REF8 + (
        "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2", "--train.colocate_actor_ref",
    ),
    "colocate all, sync": REF8 + ("--ref.num_gpus_per_node", "1", "--train.colocate_all"),
    "colocate all, async": REF8 + ("--ref.num_gpus_per_node", "1", "--train.colocate_all", "--train.async_enable"),
    "critic (gae)": ("--algo.advantage.estimator", "gae", "--critic.num_gpus_per_node", "2"),
    "critic at upstream's default": ("--algo.advantage.estimator", "gae"),
    "critic + reward model colocated": (
        "--algo.advantage.estimator", "gae", "--critic.num_gpus_per_node", "2", "--reward.num_gpus_per_node", "2",
        "--reward.remote_url=", "--reward.model_name_or_path", "RM", "--train.colocate_critic_reward",
    ),
    "reward model, colocate all": (
        "--reward.remote_url=", "--reward.model_name_or_path", "RM", "--reward.num_gpus_per_node", "1",
        "--train.colocate_all",
    ),
    "two actor nodes": ("--actor.num_nodes", "2", "--actor.num_gpus_per_node", "1"),
}  # fmt: skip


@pytest.mark.parametrize("extra", list(MIRROR_CASES.values()), ids=list(MIRROR_CASES))
def test_requests_mirror_upstream_train(extra):
    """Per role, our count equals what upstream's train() reserves (its placement code, run on stand-ins)."""
    args = _args(*extra)
    seen = _upstream_reservations(args)
    reqs = resources.requests(args)
    need = resources.totals(reqs)
    assert need["GPU"] == seen["GPU"], (reqs, seen)
    assert need["CPU"] == seen["CPU"] + resources.CONTROLLER_CPU, (reqs, seen)
    assert sorted(r.bundles for r in reqs if r.bundles) == sorted(seen["groups"]), (reqs, seen)
    # what the CLI declares on a machine without CUDA covers every GPU asked for
    assert config.logical_gpus_needed(args) >= need["GPU"]


def test_upstream_default_gpus_per_node_is_eight():
    parser = cli.build_parser()
    for role in ("actor", "ref", "critic", "reward"):
        assert parser.get_default(f"{role}.num_gpus_per_node") == resources.UPSTREAM_GPUS_PER_NODE


def test_the_measured_hang_is_rejected_on_this_cpu_machine():
    """The CPU-only cluster the CLI declares: enough logical GPUs, but max(8, cores) CPU slots, while the
    reference model's 8 bundles, the policy and the engine hold 10 and the controller needs 1 more to start."""
    args = _args(*REF8)
    cluster = {"GPU": config.logical_gpus_needed(args), "CPU": 8}
    with pytest.raises(resources.ResourceError) as info:
        resources.check(args, cluster, [cluster])
    msg = str(info.value)
    assert "never be placed" in msg
    assert "the run needs 10 GPU and 11 CPU slots" in msg and "10 GPU and 8 CPU in total" in msg
    assert "reference model: 8 GPU + 8 CPU (--ref.num_nodes 1 x --ref.num_gpus_per_node 8 (upstream's default" in msg
    assert "policy (actor) model: 1 GPU + 1 CPU" in msg and "vLLM engines: 1 GPU + 1 CPU" in msg
    assert "Change: for the reference model, --ref.num_gpus_per_node" in msg and "--algo.kl.init_coef 0" in msg
    resources.check(_args(*REF8, "--ref.num_gpus_per_node", "1"), cluster, [cluster])  # the fix works


def test_a_three_gpu_cluster():
    args = _args(*REF8)
    cluster = {"GPU": 3, "CPU": 64}
    with pytest.raises(resources.ResourceError, match=r"needs 10 GPU and 11 CPU slots .* has 3 GPU and 64 CPU"):
        resources.check(args, cluster, [cluster])
    resources.check(_args(*REF8, "--ref.num_gpus_per_node", "1"), cluster, [cluster])
    # colocating the reference with the policy needs the same counts; then it takes no GPU of its own
    colocated = _args(*REF8, "--ref.num_gpus_per_node", "1", "--train.colocate_actor_ref")
    assert resources.totals(resources.requests(colocated))["GPU"] == 2
    # a critic left at upstream's default on the same cluster: named, with the estimator way out
    with pytest.raises(resources.ResourceError, match=r"critic: 8 GPU \+ 8 CPU .*--algo.advantage.estimator"):
        resources.check(_args("--algo.advantage.estimator", "gae"), cluster, [cluster])


def test_a_dedicated_model_is_one_unsharded_gpu():
    # The scorer loads one HF copy onto one device; a second GPU would be reserved and idle.
    with pytest.raises(config.ConfigError, match=r"--algo.prox_dedicated_num_gpus 2\.0: .* not sharded"):
        _args("--train.async_enable", "--algo.prox_mode", "dedicated", "--algo.prox_dedicated_num_gpus", "2")
    args = _args("--train.async_enable", "--algo.prox_mode", "dedicated", "--algo.prox_dedicated_num_gpus", "1")
    nodes = [{"GPU": 1, "CPU": 8}] * 3
    resources.check(args, {"GPU": 3, "CPU": 24}, nodes)
    # the dedicated model's CPU comes after the controllers start: no extra CPU slot beyond theirs
    assert resources.totals(resources.requests(args)) == {"GPU": 3, "CPU": 3}


# ---------------------------------------------------------------------------------- placement watchdog

TABLE = {
    "aa01": {"state": "CREATED", "bundles": {0: {"GPU": 1.0, "CPU": 1.0}}},
    "bb02": {"state": "PENDING", "bundles": {i: {"GPU": 1.0, "CPU": 1.0} for i in range(8)}},
}


def test_pending_message_names_the_request_and_the_cluster():
    reqs = resources.requests(_args(*REF8))
    msg = resources.pending_message([TABLE["bb02"]], 61.2, {"GPU": 10, "CPU": 8}, {"GPU": 8.0, "CPU": 0.0}, reqs)
    assert msg.startswith("still waiting after 61 s for Ray to place 1 placement group: 8 bundles of {CPU: 1, GPU: 1}")
    assert "(8 CPU, 8 GPU in all; the size of the reference model's request)" in msg
    assert "10 GPU and 8 CPU in total, 8 GPU and 0 CPU free now" in msg
    assert "The run goes on waiting." in msg


def test_watchdog_reports_a_pending_group_once_after_the_bound():
    now = [0.0]
    printed = []
    dog = resources.PlacementWatchdog(
        resources.requests(_args(*REF8)),
        bound=60,
        out=printed.append,
        table=lambda: TABLE,
        cluster=lambda: {"GPU": 10, "CPU": 8},
        available=lambda: {"GPU": 8, "CPU": 0},
        clock=lambda: now[0],
    )
    assert dog.tick() is None  # first seen now
    now[0] = 59
    assert dog.tick() is None
    now[0] = 60
    assert dog.tick() is not None and len(printed) == 1 and "8 bundles" in printed[0]
    now[0] = 300
    assert dog.tick() is None and len(printed) == 1  # once per group
    # the thread: polls, never raises (a failing Ray call is ignored), stops promptly
    calls = []

    def table():
        calls.append(1)
        raise ConnectionError("GCS gone")

    t0 = time.time()
    thread = resources.PlacementWatchdog([], poll=0.01, table=table, cluster=dict, available=dict).start()
    time.sleep(0.1)
    thread.stop()
    assert calls and time.time() - t0 < 2


# ---------------------------------------------------------------------------------- the real CLI


@pytest.mark.real_stack
def test_cli_fails_fast_on_the_measured_hang(tiny_world, tmp_path):
    """`--algo.kl.use_loss --algo.kl.init_coef 0.01` with the reference at upstream's default used to wait
    forever with nothing printed; now the CLI stops right after Ray starts, before any model loads."""
    from tests.helpers.e2e import tiny_args
    from tests.helpers.faults import run_cli_tracked

    run_dir = str(tmp_path)
    args = tiny_args(tiny_world, run_dir)
    args[args.index("--algo.kl.init_coef") + 1] = "0.01"
    t0 = time.time()
    run = run_cli_tracked(args + ["--algo.kl.use_loss"], run_dir, timeout=120)
    seconds = time.time() - t0
    assert not run.timed_out and run.rc == 2, run.log[-4000:]
    ours = [line for line in run.log.splitlines() if line.startswith("openrlhf-ess: error:")]
    assert len(ours) == 1 and "can never be placed" in ours[0], run.log[-4000:]
    assert "--ref.num_gpus_per_node 8 (upstream's default" in ours[0] and "Change: for the reference model" in ours[0]
    assert "Traceback" not in run.log and "RolloutRayActor" not in run.log  # nothing was started
    assert seconds < 60, seconds  # measured ~15 s on 2 busy cores (Ray's start-up)
    assert not run.leftovers, run.leftovers


def test_host_memory_of_the_reload_sync_at_scale_is_refused_with_the_flag():
    # Reload ships the model in messages of at most m = 1 GiB: rank 0 holds one message being built (3·m) and
    # Ray's copy per engine (E·m); each engine's worker stages the model (M) plus a message and its tensors (2·m),
    # its front end the message in transit (2·m). A 7B model in bf16 (M = 14 GiB), one engine at TP 1:
    gib = 1 << 30
    args = _args("--vllm.sync_backend", "reload", "--vllm.tensor_parallel_size", "1")
    needs = resources.host_memory_needs(args, 14 * gib)
    engines = args.vllm.num_engines
    assert needs == {
        "actor rank 0 (--vllm.sync_backend reload)": (3 + engines) * gib,
        "each vLLM engine with its 1 worker(s) (--vllm.sync_backend reload)": (14 + 2 + 2) * gib,
    }
    with pytest.raises(
        resources.ResourceError, match=r"host memory: .*14\.0 GiB.*18\.0 GiB.*--vllm.sync_backend nccl"
    ):
        resources.check_host_memory(args, [{"memory": 16 * gib}, {"memory": 15 * gib}], 14 * gib)
    resources.check_host_memory(args, [{"memory": 32 * gib}], 14 * gib)  # fits the largest node
    # a small model is one message: m = M
    small = resources.host_memory_needs(args, 100 << 20)
    assert small["actor rank 0 (--vllm.sync_backend reload)"] == (3 + engines) * (100 << 20)
    resources.check_host_memory(args, [{"memory": 1 * gib}], 0)  # a hub id: size unknown, not checked


def test_model_bytes_counts_the_weight_files(tmp_path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 24)
    (tmp_path / "config.json").write_text("{}")
    assert resources.model_bytes(str(tmp_path)) == 1024
    assert resources.model_bytes("Qwen/Qwen2.5-7B") == 0
