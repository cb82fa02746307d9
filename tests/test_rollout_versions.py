"""μ and per-token versions from a real vLLM (CPU) engine across a mid-response weight sync.

The engine (our RolloutRayActor in a Ray actor, fp32, prefix caching on with 32-token blocks) generates long
responses; while they are in flight the test pauses generation, pushes new weights through the same path training
uses (``load_weights_from_safetensors`` = vLLM ``reload_weights``), sets the version and resumes — a partial
rollout. Every token's μ must equal the HF log-prob under the weights of the version it is tagged with, the HF
forward scoring the whole prefix with those weights (fp32: ~1e-5), and not the other version's; a boundary off by
one token fails, and so would a post-sync token that attended to KV the old weights computed (each request has
full, cached blocks of its own before the sync).
"""

import contextlib
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save

from tests.helpers.ray_local import local_ray

TEMPERATURE = 0.9
MAX_TOKENS = 300


def _engine_kwargs(model_dir):
    from openrlhf_ess.trainer.ray.vllm_engine import WORKER_EXTENSION

    return dict(
        model=model_dir,
        dtype="float32",
        seed=0,
        max_model_len=512,
        enforce_eager=True,
        worker_extension_cls=WORKER_EXTENSION,
        kv_cache_memory_bytes=128 << 20,
        logprobs_mode="processed_logprobs",
        max_logprobs=1,
        distributed_executor_backend="uni",
        num_gpus=0,
        force_logprobs=True,
        track_versions=True,
        enable_prefix_caching=True,
        block_size=32,
    )


def _hf_logprobs(model, obs, start, end, eos_id):
    with torch.no_grad():
        logits = model(torch.tensor([obs[:end]])).logits[0].float() / TEMPERATURE
    # min_tokens = max_tokens: vLLM masks EOS at every step, and μ is the log-prob of that processed
    # distribution (logprobs_mode=processed_logprobs), so the reference masks it too.
    logits[:, eos_id] = float("-inf")
    lp = logits.log_softmax(-1)
    idx = torch.arange(start, end)
    return lp[idx - 1, torch.tensor(obs[start:end])]


def test_refused_prefix_cache_reset_stops_the_sync():
    """vLLM answers False (a warning only) when requests still hold KV blocks; the engine must stop, naming the
    version and the requests, not carry on with old-weight KV under a new tag."""
    import asyncio

    from openrlhf_ess.trainer.ray.vllm_engine import RolloutRayActorImpl

    class Llm:
        answer = False

        async def reset_prefix_cache(self):
            return self.answer

    engine = RolloutRayActorImpl.__new__(RolloutRayActorImpl)
    engine.llm, engine.weight_version, engine._inflight = Llm(), 3, {"a": None, "b": None}
    with pytest.raises(RuntimeError, match=r"after version 3: vLLM refused .* 2 in-flight request"):
        asyncio.run(engine.reset_prefix_cache())
    engine.llm.answer = True
    assert asyncio.run(engine.reset_prefix_cache()) is True


@pytest.mark.stack
def test_mu_and_versions_exact_across_mid_flight_sync(tiny_world):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    model_dir = tiny_world["model"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    v0 = load_file(os.path.join(model_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    v1 = {k: t + 0.05 * torch.randn(t.shape, generator=g) for k, t in v0.items()}

    with local_ray() as ray:
        from openrlhf_ess.trainer.ray.vllm_engine import RolloutRayActor

        engine = RolloutRayActor.options(num_cpus=1, num_gpus=0).remote(**_engine_kwargs(model_dir))
        params = SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        prompts = ["ab12 =", "hello =", "x9 ="]
        refs = [
            engine.generate_responses.remote(p, None, params, max_length=512, hf_tokenizer=tok, num_samples=1)
            for p in prompts
        ]
        deadline = time.time() + 120
        while True:  # wait until every request has streamed some tokens, then sync mid-flight
            streamed = ray.get(engine.inflight_tokens.remote())
            if len(streamed) == len(prompts) and min(streamed) >= 70:  # >= 2 full 32-token blocks of response
                break
            assert time.time() < deadline, f"requests did not start streaming: {streamed}"
            time.sleep(0.01)
        ray.get(engine.pause_generation.remote())
        ray.get(engine.load_weights_from_safetensors.remote(save(v1)))
        assert ray.get(engine.set_weight_version.remote(1)) == len(prompts)  # all three still in flight
        ray.get(engine.resume_generation.remote())
        responses = [r[0] for r in ray.get(refs)]

    models = {}
    for version, state in ((0, v0), (1, v1)):
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        m.load_state_dict(state, strict=False)
        models[version] = m

    for resp in responses:
        obs, versions, mu = resp["observation_tokens"], resp["rollout_versions"], resp["rollout_log_probs"]
        ((start, end),) = resp["action_ranges"]
        assert end - start == MAX_TOKENS
        assert versions[:start] == [-1] * start  # prompt tokens carry no version
        tags = versions[start:end]
        boundary = tags.index(1)
        assert 70 <= boundary < MAX_TOKENS and tags == [0] * boundary + [1] * (MAX_TOKENS - boundary)
        mu = torch.tensor(mu[start:end])
        hf = {v: _hf_logprobs(models[v], obs, start, end, tok.eos_token_id) for v in (0, 1)}
        tagged = torch.where(torch.tensor(tags) == 0, hf[0], hf[1])
        other = torch.where(torch.tensor(tags) == 0, hf[1], hf[0])
        assert (mu - tagged).abs().max().item() < 1e-4  # fp32 engine vs HF, measured ~5e-6
        # the two versions are distinguishable right at the boundary, so an off-by-one tag fails above
        window = slice(boundary - 3, boundary + 3)
        assert (hf[0][window] - hf[1][window]).abs().min().item() > 1e-3
        assert (mu - other).abs().max().item() > 0.05


AGENT = """
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        return {"rewards": torch.tensor(1.0), "scores": torch.tensor(1.0), "environment_feedback": " ok =",
                "done": self.turn >= 2, "sampling_params": states["sampling_params"], "extra_logs": {}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


@contextlib.contextmanager
def _agent_engine(tiny_world, tmp_path, **extra):
    """A real engine (our RolloutRayActor, fp32) running the two-turn AGENT; yields (ray, engine, tokenizer,
    digit token ids: each turn stops at the first digit, so both turns fit in the budget)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_world["model"])
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789"]
    with local_ray() as ray:
        from openrlhf_ess.trainer.ray.vllm_engine import RolloutRayActor

        kwargs = {**_engine_kwargs(tiny_world["model"]), "agent_func_path": str(agent), **extra}
        yield ray, RolloutRayActor.options(num_cpus=1, num_gpus=0).remote(**kwargs), tok, digits


def _generator(sampling_mask: str):
    """Our SamplesGenerator with just the flags its response conversion reads."""
    from types import SimpleNamespace

    from openrlhf_ess.trainer.ppo_utils.samples_generator import SamplesGenerator

    gen = SamplesGenerator.__new__(SamplesGenerator)
    gen.args = SimpleNamespace(
        reward=SimpleNamespace(failure_policy="off"), algo=SimpleNamespace(sampling_mask=sampling_mask)
    )
    return gen


@pytest.mark.stack
def test_multi_turn_environment_tokens_carry_no_mu_or_version(tiny_world, tmp_path):
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    model_dir = tiny_world["model"]
    with _agent_engine(tiny_world, tmp_path) as (ray, engine, tok, digits):
        params = SamplingParams(temperature=1.0, stop_token_ids=digits, seed=0)
        resp = ray.get(engine.generate_responses.remote("ab =", None, params, max_length=200, hf_tokenizer=tok))[0]

    obs, versions, mu = resp["observation_tokens"], resp["rollout_versions"], resp["rollout_log_probs"]
    (s1, e1), (s2, e2) = resp["action_ranges"]
    feedback = list(range(e1, s2))
    assert len(feedback) == len(tok(" ok =", add_special_tokens=False)["input_ids"])
    assert all(versions[i] == -1 and mu[i] == 0.0 for i in feedback)  # environment: no version, no μ
    assert all(v == 0 for v in versions[s1:e1] + versions[s2:e2])  # sampled tokens, no sync happened
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = model(torch.tensor([obs])).logits[0].float().log_softmax(-1)
    for start, end in ((s1, e1), (s2, e2)):
        hf = lp[torch.arange(start - 1, end - 1), torch.tensor(obs[start:end])]
        assert (hf - torch.tensor(mu[start:end])).abs().max().item() < 1e-4
    # through the generator: environment tokens are outside action_mask, so never importance-weighted
    exp = _generator("off")._process_response_into_experience(resp, max_len=200)
    mask = exp.action_mask[0]
    assert mask[e1 - 1 : s2 - 1].sum().item() == 0 and mask.sum().item() == (e1 - s1) + (e2 - s2)


@pytest.mark.stack
def test_multi_turn_kept_counts_follow_each_turn(tiny_world, tmp_path):
    """--algo.sampling_mask keep on the agent path: each generate() call's tokens get k_t from the engine (top-k 5),
    environment tokens 0; μ is the truncated log-prob an independent computation gives from those supports; the
    generator aligns the counts with action_mask. A request that combines min_tokens with its own stop_token_ids
    (vLLM bans those too, which a count cannot describe) is refused with a message naming the flag."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    model_dir = tiny_world["model"]
    with _agent_engine(tiny_world, tmp_path, report_kept_counts=True) as (ray, engine, tok, digits):
        params = SamplingParams(temperature=1.0, top_k=5, stop_token_ids=digits, seed=0, logprobs=1)
        resp = ray.get(engine.generate_responses.remote("ab =", None, params, max_length=200, hf_tokenizer=tok))[0]
        banned = SamplingParams(temperature=1.0, top_k=5, min_tokens=1, stop_token_ids=digits, seed=0, logprobs=1)
        with pytest.raises(Exception, match="--algo.sampling_mask keep: a request sets stop_token_ids"):
            ray.get(engine.generate_responses.remote("ab =", None, banned, max_length=200, hf_tokenizer=tok))

    obs, kept, mu = resp["observation_tokens"], resp["rollout_kept_counts"], resp["rollout_log_probs"]
    (s1, e1), (s2, e2) = resp["action_ranges"]
    assert all(k == 0 for k in kept[:s1] + kept[e1:s2])  # prompt and environment feedback: not truncated
    assert all(k == 5 for k in kept[s1:e1] + kept[s2:e2])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([obs])).logits[0].float()
    for start, end in ((s1, e1), (s2, e2)):
        for t in range(start, end):
            top = logits[t - 1].topk(5).indices
            expected = logits[t - 1, obs[t]] - logits[t - 1, top].logsumexp(-1)
            assert abs(expected.item() - mu[t]) < 1e-4
    exp = _generator("keep")._process_response_into_experience(resp, max_len=200)
    mask = exp.action_mask[0].bool()
    assert ((exp.rollout_kept_counts[0] != 0) == mask).all()
