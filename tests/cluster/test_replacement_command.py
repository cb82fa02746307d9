"""The cluster check of engine replacement (``tests/cluster/test_replacement_on_cluster.py``, marked ``cluster``)
cannot run here; what it would do can be checked on any machine, so that it is not dead on arrival on a user's
cluster: when it skips and why, its command parsed and validated as on a GPU machine (CUDA faked: nothing is
loaded) and through pre-flight on the tiny model, and its reward file's choice of what to signal, with the engine's
processes and Ray's tables made up."""

import json
import os
import re
import shutil
import signal

import pytest

from tests.cluster import kill_reward
from tests.cluster import test_replacement_on_cluster as cluster

# ---------------------------------------------------------------- when it runs


def test_it_skips_without_the_model_variable_and_names_it(monkeypatch):
    monkeypatch.setattr(cluster, "gpu_count", lambda: pytest.fail("asked for GPUs before the model"))
    reason = cluster.skip_reason({})
    assert reason.startswith("OPENRLHF_ESS_CLUSTER_MODEL is not set: name a small instruct model"), reason


def test_it_skips_without_ray_or_vllm(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    reason = cluster.skip_reason({cluster.MODEL_ENV: "/m"})
    assert reason == "needs vllm installed (a GPU cluster with vLLM's CUDA build and Ray)", reason


def test_it_skips_below_five_gpus_saying_why_five(monkeypatch):
    """Two engines x TP 2 take four GPUs, and the policy one of its own: replacement refuses --train.colocate_all."""
    monkeypatch.setattr(cluster, "gpu_count", lambda: 4)
    monkeypatch.setattr(cluster, "vllm_device", lambda: pytest.fail("asked vLLM without the GPUs"))
    reason = cluster.skip_reason({cluster.MODEL_ENV: "/m"})
    assert reason == (
        "needs 5 CUDA GPUs on this machine (2 engines x tensor-parallel 2 + 1 for the policy); torch sees 4"
    ), reason


def test_it_skips_on_vllms_cpu_build_and_runs_on_its_cuda_build(monkeypatch):
    monkeypatch.setattr(cluster, "gpu_count", lambda: 8)
    monkeypatch.setattr(cluster, "vllm_device", lambda: "cpu")
    assert cluster.skip_reason({cluster.MODEL_ENV: "/m"}) == "needs vLLM's CUDA build; this vLLM's platform is 'cpu'"
    monkeypatch.setattr(cluster, "vllm_device", lambda: "cuda")
    assert cluster.skip_reason({cluster.MODEL_ENV: "/m"}) is None


def test_the_vllm_probe_names_an_attribute_vllm_has():
    """``vllm_device`` asks ``current_platform.device_type`` in a child: the attribute exists on vLLM's platform
    class (read from its source, nothing imported: vLLM's import takes seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed here")
    source = os.path.join(os.path.dirname(spec.origin), "platforms", "interface.py")
    assert re.search(r"^\s+device_type\b", open(source).read(), re.M)
    assert "current_platform" in open(os.path.join(os.path.dirname(spec.origin), "platforms", "__init__.py")).read()


# ---------------------------------------------------------------- its command


def _parsed(monkeypatch, tmp_path, model="PLACEHOLDER"):
    from openrlhf_ess.cli import train_ppo_ray as cli
    from openrlhf_ess.runtime import cpu_compat

    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: True)
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    inputs = cluster.write_inputs(run_dir)
    args, notices = cli.parse_args(cluster.cluster_args(model, inputs, run_dir))
    return args, cli.check_with_cluster(args, notices), inputs, run_dir


def test_the_command_parses_and_passes_validation_as_on_a_gpu_machine(monkeypatch, tmp_path):
    """Upstream's and our cross-flag checks with CUDA (without it the CLI turns nccl into reload: here nccl stays);
    the flags the check is about arrive as written; it asks for the GPUs the skip counts; and the start-up
    self-check will form the NCCL group a second time (the line the cluster test asserts)."""
    from openrlhf_ess import config
    from openrlhf_ess.checks import resources, selfcheck

    args, notices, _, _ = _parsed(monkeypatch, tmp_path)
    assert notices[0] == "accelerator: cuda (--ray.accelerator)" and config.on_cuda(args)
    vllm = args.vllm
    assert (vllm.num_engines, vllm.tensor_parallel_size, vllm.sync_backend) == (2, 2, "nccl")
    assert (vllm.max_restarts, vllm.watchdog_s) == (cluster.MAX_RESTARTS, cluster.WATCHDOG_S)
    assert args.data.apply_chat_template and args.data.max_samples == cluster.N_PROMPTS
    assert args.algo.prox_audit_dir.endswith("audit")
    assert sum(r.gpus for r in resources.requests(args)) == cluster.GPUS_NEEDED == 5
    assert selfcheck.regroup_probe_due(args)


def test_the_command_passes_pre_flight_on_the_tiny_model(monkeypatch, tmp_path, tiny_world):
    """Every input of the command checked as the CLI does before Ray starts (openrlhf_ess/checks/preflight), with
    the tiny model in place of the user's, given a chat template: the prompts through upstream's preprocessing and
    the template, the reward file imported and called once (it finds no kill due), the output folders apart from
    the inputs and writable."""
    from openrlhf_ess.checks import preflight

    model = str(tmp_path / "tiny_chat_model")
    shutil.copytree(tiny_world["model"], model)
    with open(os.path.join(model, "chat_template.jinja"), "w") as f:
        f.write(
            "{% for m in messages %}<{{ m['role'] }}>: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>: {% endif %}"
        )
    args, _, _, run_dir = _parsed(monkeypatch, tmp_path, model)
    notices = preflight.check(args)
    assert notices[-1].startswith("pre-flight checks passed in "), notices
    assert not os.path.exists(os.path.join(run_dir, "looks"))  # the dry call looked for no kill


def test_the_prompts_are_tagged_once_and_mix_short_and_long_answers_in_every_batch():
    prompts = cluster.prompts()
    assert len(prompts) == len(set(prompts)) == cluster.N_PROMPTS
    assert [cluster.TAG.search(p).group(0) for p in prompts] == [f"[q{i:02d}]" for i in range(cluster.N_PROMPTS)]
    for start in range(0, cluster.N_PROMPTS, cluster.PROMPTS_PER_STEP):
        batch = prompts[start : start + cluster.PROMPTS_PER_STEP]
        assert sum("one word only" in p for p in batch) == 2 and sum("200 words" in p for p in batch) == 2


def test_free_memory_is_back_within_the_margin():
    mib = 1 << 20
    assert cluster.memory_not_back([8000 * mib, 8000 * mib], [7600 * mib, 8100 * mib]) == []
    assert cluster.memory_not_back([8000 * mib, 8000 * mib], [8000 * mib, 7000 * mib]) == [
        "GPU 1: 8,000 MiB free before, 7,000 MiB after"
    ]


def test_the_audit_trail_is_counted_by_the_prompt_tag_after_the_chat_template(tmp_path, tiny_world):
    """Two micro-batches as the audit trail keeps them (left padding masked out), each sequence a chat-templated
    prompt and its response, which may repeat a tag: each sample counts once, for the first tag in it."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    texts = ["<user>: [q00] Describe it.\n<assistant>: It is [q01].", "<user>: [q01] Name one.\n<assistant>: Blue"]
    texts += ["<user>: no tag\n<assistant>: none"]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows)) + 2
    pad = tokenizer.pad_token_id
    seqs = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    micro = [{"sequences": seqs[:2], "attention_mask": mask[:2]}, {"sequences": seqs[2:], "attention_mask": mask[2:]}]
    torch.save({"weight_version": 0, "micro_batches": micro}, tmp_path / "batch_v0.pt")
    torch.save({"weight_version": 1, "micro_batches": micro[:1]}, tmp_path / "batch_v1.pt")
    assert cluster.trained_by_tag(str(tmp_path), tokenizer) == {
        "[q00]": 2,
        "[q01]": 2,
        "(no tag) '<user>: no tag\\n<assistant>: none'": 1,
    }


def test_the_log_lines_are_read_as_the_package_writes_them():
    """The keeper's line (engine_keeper.restart_line), the regroup line (replacement_sync.regroup_if_replaced) and
    the check before training (ppo_trainer), as the cluster test parses them."""
    from openrlhf_ess.trainer.ray import engine_keeper

    event = {"engine": 1, "old_pid": 41, "new_pid": 42, "version": 3, "seconds": 51.25, "canary": 1e-3}
    event["cause"] = "the vLLM engine 1 (RolloutRayActorImpl, pid 41) hung: it had 3 request(s) in flight, past x"
    log = f"(EngineKeeperImpl pid=9) [openrlhf-ess] engine replaced: {engine_keeper.restart_line(event, False)}\n"
    assert cluster.replacements(log) == [
        {"engine": 1, "old_pid": 41, "cause": event["cause"], "new_pid": 42, "version": 3, "seconds": 51.2}
    ]
    regroup = (
        "[openrlhf-ess] weight sync group formed again with every vLLM engine after 2 engine restart(s) "
        "(--vllm.sync_backend nccl)"
    )
    assert [m[1] for m in cluster.REGROUP.finditer(regroup)] == ["2"]
    checked = (
        "[openrlhf-ess] replaced vLLM engine(s) [0, 1]: the weight sync check (checksums now, canary) passed on "
        "every engine at version 3; training on their samples"
    )
    assert [m[1] for m in cluster.CHECKED.finditer(checked)] == ["0, 1"]


def test_the_lines_it_asserts_are_the_packages_own():
    """The regroup and start-up probe texts are read from the package's source (a rewording fails here, not on a
    cluster)."""
    import inspect

    from openrlhf_ess.trainer import ppo_trainer, replacement_sync

    source = inspect.getsource(replacement_sync)
    assert 'f"[openrlhf-ess] weight sync group formed again with every vLLM engine after {restarts} engine "' in source
    assert 'f"restart(s) (--vllm.sync_backend {self.args.vllm.sync_backend})"' in source
    assert 'f"replacement: the weight sync group formed a second time with {len(engines)} engine(s) and a probe "' in (
        source
    )
    assert '"broadcast through it arrived intact in every worker' in source
    assert "the weight sync check (checksums now, canary) " in inspect.getsource(ppo_trainer)


# ---------------------------------------------------------------- its reward file


def test_the_workers_are_the_alive_actors_of_the_driver_below_the_engine_on_this_node():
    jobs = [
        {"JobID": "01", "DriverPid": 100, "IsDead": False},  # the CLI's job
        {"JobID": "02", "DriverPid": 201, "IsDead": False},  # this engine's EngineCore
        {"JobID": "03", "DriverPid": 301, "IsDead": False},  # the other engine's
        {"JobID": "04", "DriverPid": 201, "IsDead": True},  # an earlier driver with a reused pid
    ]

    def actor(job, pid, state="ALIVE", node="n1"):
        return {"JobID": job, "Pid": pid, "State": state, "Address": {"NodeID": node}}

    actors = {
        "a": actor("01", 200),  # this engine actor itself (the CLI's job)
        "b": actor("02", 211),
        "c": actor("02", 210),
        "d": actor("02", 212, state="DEAD"),
        "e": actor("02", 213, node="n2"),  # another node's pid means nothing here
        "f": actor("03", 311),
        "g": actor("04", 411),
    }
    assert kill_reward.select_workers([201, 202], jobs, actors, "n1") == [210, 211]
    assert kill_reward.select_workers([], jobs, actors, "n1") == []


class _Engine:
    """One engine actor as the reward sees it: its pid, Ray actor id, requests in flight, processes."""

    def __init__(self, monkeypatch, sent, pid, actor, inflight=3, core=(500,), workers=(510, 511)):
        self.monkeypatch, self.sent = monkeypatch, sent
        self.pid, self.actor, self.inflight, self.core, self.workers = pid, actor, inflight, list(core), list(workers)

    def reward(self):
        m = self.monkeypatch
        m.setattr(kill_reward, "_pid", lambda: self.pid)
        m.setattr(kill_reward, "_actor_id", lambda: self.actor)
        m.setattr(kill_reward, "_inflight", lambda: self.inflight)
        m.setattr(kill_reward, "_engine_children", lambda: list(self.core))
        m.setattr(kill_reward, "_workers", lambda below: list(self.workers) if below == self.core else [])
        m.setattr(kill_reward, "_send", lambda pid, sig: self.sent.append((pid, sig)))
        kill_reward.reward_func(["q"], ["p"], [None])


def test_the_reward_kills_one_worker_then_stops_the_other_engine_once_each_by_progress(monkeypatch, tmp_path):
    """Kill 0 (worker) waits for batch_v0.pt and a request in flight, then SIGKILLs the last of the engine's two
    workers, once; kill 1 (stop) waits for batch_v1.pt and refuses the engine of kill 0 (its restart keeps the
    actor id), then SIGSTOPs the other engine's EngineCore and both its workers. Each look is recorded."""
    run_dir, audit = tmp_path / "run", tmp_path / "audit"
    run_dir.mkdir()
    audit.mkdir()
    plan = {"run_dir": str(run_dir), "audit": str(audit), "tp": 2, "kills": cluster.KILLS}
    monkeypatch.setattr(kill_reward, "_PLAN", [plan])
    sent = []
    a = _Engine(monkeypatch, sent, pid=20, actor="A", core=[21], workers=[22, 23])
    b = _Engine(monkeypatch, sent, pid=30, actor="B", core=[31], workers=[32, 33])

    a.reward()
    assert sent == [] and not os.path.exists(run_dir / "looks")  # nothing due before step 1's batch
    (audit / "batch_v0.pt").touch()
    a.inflight = 0
    a.reward()
    assert sent == [] and "no request in flight" in (run_dir / "looks").read_text()
    b.workers = [32]  # a layout the reward does not know: it says so and signals nothing
    b.reward()
    assert sent == [] and "expected one EngineCore child and 2 Ray worker actor(s)" in (run_dir / "looks").read_text()
    b.workers = [32, 33]
    a.inflight = 5
    a.reward()
    assert sent == [(23, signal.SIGKILL)]
    killed0 = json.loads((run_dir / "killed0").read_text())
    assert killed0 == {
        "kill": 0,
        "kind": "worker",
        "pid": 20,
        "inflight": 5,
        "actor_id": "A",
        "core": [21],
        "workers": [22, 23],
        "signalled": [23],
    }
    a.pid = 40  # A restarted: a new process, the same actor
    a.reward()
    b.reward()
    assert sent == [(23, signal.SIGKILL)]  # kill 0 is made; kill 1 not due
    (audit / "batch_v1.pt").touch()
    a.reward()
    assert (
        sent == [(23, signal.SIGKILL)] and "an earlier kill was made on this engine" in (run_dir / "looks").read_text()
    )
    b.reward()
    assert sent[1:] == [(31, signal.SIGSTOP), (32, signal.SIGSTOP), (33, signal.SIGSTOP)]
    killed1 = json.loads((run_dir / "killed1").read_text())
    assert (killed1["kind"], killed1["pid"], killed1["signalled"]) == ("stop", 30, [31, 32, 33])
    a.reward()
    b.reward()
    assert len(sent) == 4  # once each


def test_a_kill_claimed_by_another_engine_is_not_made_twice(monkeypatch, tmp_path):
    """Both engines found kill 0 due at once: the one whose exclusive create of the marker fails signals nothing."""
    run_dir, audit = tmp_path / "run", tmp_path / "audit"
    run_dir.mkdir()
    audit.mkdir()
    (audit / "batch_v0.pt").touch()
    plan = {"run_dir": str(run_dir), "audit": str(audit), "tp": 2, "kills": cluster.KILLS}
    monkeypatch.setattr(kill_reward, "_PLAN", [plan])
    fd = kill_reward._claim(str(run_dir / "claimed"))
    assert fd is not None and kill_reward._claim(str(run_dir / "claimed")) is None
    os.close(fd)
    monkeypatch.setattr(kill_reward, "_claim", lambda path: None)  # the other engine's create came first
    sent = []
    _Engine(monkeypatch, sent, pid=20, actor="A", core=[21], workers=[22, 23]).reward()
    assert sent == [] and "another engine claimed this kill" in (run_dir / "looks").read_text()
