"""--algo.routing_replay through the trainer (openrlhf_ess/trainer/routing_replay.py), CPU, tiny MoE models.

Alignment and padding are checked against rows written out by hand; the engine side runs the real tracked stream
and executor wrapper on fake vLLM outputs (vLLM's CPU backend cannot return routes, docs/routing_replay.md); the
forward side runs upstream's ``Actor`` on the tiny Qwen2-MoE model through our training-step wrapper.
The flag's rejections are rows of docs/bad_inputs.md (tests/test_config.py, tests/test_preflight.py).
"""

import asyncio
import types

import numpy as np
import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

from openrlhf_ess import config  # noqa: E402
from openrlhf_ess.models import routing_replay as seam  # noqa: E402
from openrlhf_ess.trainer import carried, routing_replay  # noqa: E402
from openrlhf_ess.trainer.engine_contract import EngineContractError  # noqa: E402
from openrlhf_ess.trainer.ray import rollout_tags, vllm_engine  # noqa: E402


@pytest.fixture(scope="module")
def moe_world(tmp_path_factory):
    from openrlhf_ess.tiny.world_moe import build_moe_world

    return build_moe_world(str(tmp_path_factory.mktemp("qwen2_moe")), seed=0, n_prompts=4, family="qwen2_moe")


# ---- alignment and padding ----------------------------------------------------------------------------------


def test_observation_routes_by_hand():
    # a 3-token prompt + 2 sampled tokens: vLLM forwards 4 of the 5 tokens (the last sampled one never)
    rows = np.array([[[0, 1]], [[2, 3]], [[1, 0]], [[3, 2]]], dtype=np.uint8)  # [4, L=1, k=2]
    out = routing_replay.observation_routes(rows, n_tokens=5, truncate_length=2048)
    assert out.dtype == torch.uint8 and out.shape == (1, 5, 1, 2)
    assert out[0, :, 0].tolist() == [[0, 1], [2, 3], [1, 0], [3, 2], [255, 255]]  # last token: the sentinel
    # upstream keeps the first max_len tokens: the routes follow
    cut = routing_replay.observation_routes(rows, n_tokens=5, truncate_length=3)
    assert cut[0, :, 0].tolist() == [[0, 1], [2, 3], [1, 0]]
    # more than 256 experts: vLLM's uint16 becomes int16, sentinel -1
    wide = routing_replay.observation_routes(np.array([[[300, 7]]], dtype=np.uint16), 2, 2048)
    assert wide.dtype == torch.int16 and wide[0, :, 0].tolist() == [[300, 7], [-1, -1]]
    with pytest.raises(RuntimeError, match="routes for 4 tokens of a 6-token sample"):
        routing_replay.observation_routes(rows, n_tokens=6, truncate_length=2048)


def test_pad_routes_follows_upstream_right_padding():
    a = torch.tensor([[[1, 2]], [[3, 0]]], dtype=torch.uint8)  # S=2
    b = torch.tensor([[[0, 1]], [[2, 3]], [[255, 255]]], dtype=torch.uint8)  # S=3, last token's sentinel
    out = routing_replay.pad_routes([a, b], width=4)
    assert out.shape == (2, 4, 1, 2)
    assert out[0, :, 0].tolist() == [[1, 2], [3, 0], [255, 255], [255, 255]]
    assert out[1, :, 0].tolist() == [[0, 1], [2, 3], [255, 255], [255, 255]]
    assert routing_replay.pad_routes([b], width=2)[0, :, 0].tolist() == [[0, 1], [2, 3]]


def _sample(seq_len: int, prompt_len: int, first_id: int):
    from openrlhf.trainer.ppo_utils.experience import Experience

    action = torch.zeros(1, seq_len - 1, dtype=torch.long)
    action[0, prompt_len - 1 :] = 1
    exp = Experience(
        sequences=torch.arange(10, 10 + seq_len).unsqueeze(0),
        attention_mask=torch.ones(1, seq_len, dtype=torch.long),
        action_mask=action,
        prompts=["p"],
        labels=["l"],
        info={},
    )
    rows = np.arange(first_id, first_id + 2 * (seq_len - 1)).reshape(seq_len - 1, 1, 2).astype(np.uint8)
    exp.rollout_routes = routing_replay.observation_routes(rows, seq_len, 2048)
    return exp


def test_split_rollout_samples_places_routes_on_sequence_columns():
    """Upstream's split right-pads ``sequences`` (pad id) to the micro-batch width; the routes follow, sentinel
    on padding and on each sample's last token."""
    from openrlhf_ess.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.args = types.SimpleNamespace(
        train=types.SimpleNamespace(dynamic_batch_enable=False),
        rollout=types.SimpleNamespace(micro_batch_size=2),
        algo=types.SimpleNamespace(sampling_mask="off", routing_replay=True),
    )
    maker.tokenizer = types.SimpleNamespace(pad_token_id=0)
    samples = [_sample(3, 2, 0), _sample(5, 2, 100), _sample(4, 3, 50)]
    batches = maker.split_rollout_samples(samples)
    assert [b.sequences.shape[1] for b in batches] == [5, 4]
    first = batches[0]
    assert first.rollout_routes.shape == (2, 5, 1, 2)
    assert first.sequences[0].tolist() == [10, 11, 12, 0, 0]
    # sample 0: tokens 0, 1 forwarded (ids 0..3), token 2 = last, columns 3, 4 padding
    assert first.rollout_routes[0, :, 0].tolist() == [[0, 1], [2, 3], [255, 255], [255, 255], [255, 255]]
    assert first.rollout_routes[1, :, 0].tolist() == [[100, 101], [102, 103], [104, 105], [106, 107], [255, 255]]
    assert batches[1].rollout_routes[0, :, 0].tolist() == [[50, 51], [52, 53], [54, 55], [255, 255]]


def test_samples_generator_attaches_routes_and_refuses_a_response_without():
    from openrlhf_ess.trainer.ppo_utils.samples_generator import SamplesGenerator

    gen = SamplesGenerator.__new__(SamplesGenerator)
    gen.args = types.SimpleNamespace(
        reward=types.SimpleNamespace(failure_policy="off"),
        algo=types.SimpleNamespace(sampling_mask="off", routing_replay=True, nonfinite_logprobs="drop"),
    )
    response = {
        "prompt": "p",
        "label": "l",
        "observation_tokens": [5, 6, 7, 8],
        "action_ranges": [(2, 4)],
        "rollout_log_probs": None,
        "reward": 1.0,
        "scores": 1.0,
        "rollout_routes": np.array([[[1, 2], [0, 3]], [[2, 3], [1, 2]], [[0, 1], [3, 0]]], dtype=np.uint8),
    }
    exp = gen._process_response_into_experience(response, max_len=2048)
    assert exp.rollout_routes.shape == (1, 4, 2, 2) == (*exp.sequences.shape, 2, 2)
    assert exp.rollout_routes[0, 2].tolist() == [[0, 1], [3, 0]] and (exp.rollout_routes[0, 3] == 255).all()
    with pytest.raises(RuntimeError, match="without the engine.s routes \\(routed_experts\\)"):
        gen._process_response_into_experience({**response, "rollout_routes": None}, max_len=2048)
    gen.args.algo.routing_replay = False  # off: nothing attached
    assert not hasattr(gen._process_response_into_experience(response, max_len=2048), "rollout_routes")
    gen.args.algo.sampling_mask = "keep"  # the kept counts are refused the same way
    with pytest.raises(
        RuntimeError, match="--algo.sampling_mask keep: a response came back without the engine.s kept"
    ):
        gen._process_response_into_experience(response, max_len=2048)


def _item_experience(routes, widths):
    from openrlhf.trainer.ppo_utils.experience import Experience

    b, s = routes.shape[:2]
    exp = Experience(
        sequences=torch.arange(b * s).reshape(b, s),
        attention_mask=torch.ones(b, s, dtype=torch.long),
        action_mask=torch.zeros(b, s - 1, dtype=torch.bool),
        action_log_probs=torch.zeros(b, s - 1),
        advantages=torch.zeros(b, s - 1),
        info={"reward": torch.zeros(b)},
    )
    for i, w in enumerate(widths):
        exp.attention_mask[i, w:] = 0  # right padding, cut by the replay buffer
        exp.action_mask[i, 1 : w - 1] = True
    exp.rollout_routes = routes
    exp.rollout_kept_counts = torch.full((b, s - 1), 7)
    return exp


def test_replay_buffer_carries_routes_through_split_and_collate():
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer

    buffer = NaiveReplayBuffer(sample_batch_size=2, limit=0, cpu_offload=False)
    carried.adopt_replay_buffer(buffer)  # the kept counts and the routes, as with both flags on
    routes = torch.arange(2 * 4 * 1 * 2, dtype=torch.uint8).reshape(2, 4, 1, 2)
    buffer.append(_item_experience(routes, [4, 3]))
    assert [item.rollout_routes.shape[0] for item in buffer.items] == [4, 3]  # cut like sequences
    assert buffer.items[1].rollout_routes[:, 0].tolist() == [[8, 9], [10, 11], [12, 13]]
    batch = buffer.collate_fn([buffer.items[1], buffer.items[0]])
    assert batch.rollout_routes.shape[:2] == batch.sequences.shape
    assert batch.rollout_routes[0, :, 0].tolist() == [[8, 9], [10, 11], [12, 13], [255, 255]]
    assert torch.equal(batch.rollout_routes[1], routes[0])
    assert batch.rollout_kept_counts is not None
    plain = NaiveReplayBuffer(sample_batch_size=2, limit=0, cpu_offload=False)  # off: upstream's buffer
    carried.adopt_replay_buffer(plain)
    exp = _item_experience(routes, [4, 3])
    del exp.rollout_routes
    plain.append(exp)
    assert carried.batched(carried.ROUTES, plain.items, 4) is None


# ---- engine side ----------------------------------------------------------------------------------------------


def test_check_routes_contract():
    routing_replay.check_routes_contract((6, 48, 8), 48, 8, rows=6)
    routing_replay.check_routes_contract((9, 2, 2), 2, 2)
    with pytest.raises(EngineContractError, match="returned no routed_experts.*vLLM >= 0.29"):
        routing_replay.check_routes_contract(None, 48, 8)
    with pytest.raises(EngineContractError, match=r"shape \[6, 47, 8\], expected \[6, 48, 8\]"):
        routing_replay.check_routes_contract((6, 47, 8), 48, 8, rows=6)
    with pytest.raises(EngineContractError, match="--algo.routing_replay"):
        routing_replay.check_routes_contract((5, 48, 8), 48, 8, rows=6)
    with pytest.raises(EngineContractError, match="Model Runner V2"):
        routing_replay.check_routes_contract((6, 48), 48, 8)


def _output(prompt, tokens, routes=None):
    out = types.SimpleNamespace(token_ids=tokens, logprobs=None, routed_experts=routes)
    return types.SimpleNamespace(prompt_token_ids=prompt, outputs=[out])


def test_engine_attaches_the_final_outputs_routes_to_the_response():
    """The real tracked stream and executor wrapper on fake vLLM outputs: only the final output carries
    routed_experts (vLLM 0.29), and it becomes ``response["rollout_routes"]``."""
    final_routes = np.zeros((4, 2, 2), dtype=np.uint8)

    async def generate(prompt, sampling_params, *args, request_id=None, **kwargs):
        yield _output([1, 2, 3], [9])
        yield _output([1, 2, 3], [9, 8], final_routes)

    engine = types.SimpleNamespace(
        weight_version=0, _inflight={}, _finished=[], report_outgoing=False, report_kept_counts=False
    )

    class Inner:
        async def execute(self, *args, **kwargs):
            async for _ in tracked([1, 2, 3], types.SimpleNamespace(min_tokens=0), "r0"):
                pass
            return {"observation_tokens": [1, 2, 3, 9, 8], "action_ranges": [(3, 5)]}

    for report in (True, False):
        engine.report_routes = report
        tracked = vllm_engine.RolloutRayActorImpl._tracking_stream(engine, generate)
        executor = rollout_tags._VersionTaggingExecutor(Inner(), routes=report)
        response = asyncio.run(executor.execute())
        assert response["rollout_versions"] == [-1, -1, -1, 0, 0]
        if report:
            assert np.array_equal(response["rollout_routes"], final_routes)
        else:  # off: nothing attached
            assert "rollout_routes" not in response


def test_engine_init_asks_vllm_for_routes_and_runs_the_self_check(monkeypatch):
    """``report_routes`` becomes vLLM's ``enable_return_routed_experts`` and the start-up check runs on the
    engine: a wrong layer count stops the engine with the contract error. Upstream's init is replaced."""
    seen = {}
    parent = vllm_engine.RolloutRayActorImpl.__mro__[1]

    async def fake_init(self, *args, **kwargs):
        seen.update(kwargs)

        async def generate(prompt, params, request_id=None):
            n = params.max_tokens
            yield _output(prompt["prompt_token_ids"], list(range(n)), np.zeros((3 + n - 1, 2, 2), np.uint8))

        hf = types.SimpleNamespace(num_hidden_layers=seen.get("layers", 2), num_experts_per_tok=2)
        self.llm = types.SimpleNamespace(generate=generate, model_config=types.SimpleNamespace(hf_text_config=hf))
        self.executor = object()

    monkeypatch.setattr(parent, "__init__", fake_init)
    engine = object.__new__(vllm_engine.RolloutRayActorImpl)
    asyncio.run(vllm_engine.RolloutRayActorImpl.__init__(engine, report_routes=True))
    assert seen["enable_return_routed_experts"] is True
    assert isinstance(engine.executor, rollout_tags._VersionTaggingExecutor)
    seen.clear()
    with pytest.raises(EngineContractError, match="expected \\[6, 3, 2\\]"):
        asyncio.run(vllm_engine.RolloutRayActorImpl.__init__(engine, report_routes=True, layers=3))
    seen.clear()
    asyncio.run(vllm_engine.RolloutRayActorImpl.__init__(object.__new__(vllm_engine.RolloutRayActorImpl)))
    assert "enable_return_routed_experts" not in seen  # off: upstream's engine kwargs


# ---- agent turns and scoring at a weight sync ------------------------------------------------------------------


def _rows(first: int, n: int) -> np.ndarray:
    """n rows [n, 1 layer, 1 id] numbered first, first + 1, ... (uint8), so a row's origin reads off its value."""
    return (np.arange(n, dtype=np.uint8) + first).reshape(n, 1, 1)


# An agent sample: prompt [1 2 3], turn 0 acts [10 11], feedback [20 21], turn 1 acts [12 13], feedback [30].
AGENT_OBSERVATION = [1, 2, 3, 10, 11, 20, 21, 12, 13, 30]
AGENT_CALLS = [([1, 2, 3], [10, 11], _rows(100, 4)), ([1, 2, 3, 10, 11, 20, 21], [12, 13], _rows(200, 8))]
# Position i scores token i + 1. Positions 2-3 score turn 0's tokens (10, 11): turn 0's rows. Positions 6-7 score
# turn 1's (12, 13): turn 1's. Positions 0, 1, 4, 5 (prompt, feedback): the latest turn that forwarded them (1).
# Position 8 (token 13, scoring the final feedback 30): no request forwarded it.
AGENT_EXPECTED = [200, 201, 102, 103, 204, 205, 206, 207, 255]


def test_agent_routes_by_hand():
    out = routing_replay.agent_routes(AGENT_OBSERVATION, AGENT_CALLS)
    assert out.dtype == np.uint8 and out.shape == (9, 1, 1)
    assert out[:, 0, 0].tolist() == AGENT_EXPECTED
    single = routing_replay.agent_routes([1, 2, 3, 10, 11], AGENT_CALLS[:1])  # one call: its rows unchanged
    assert np.array_equal(single, _rows(100, 4))


def test_agent_routes_refuses_turns_it_cannot_place():
    edited = [(AGENT_CALLS[1][0][:-1] + [99], AGENT_CALLS[1][1], AGENT_CALLS[1][2])]  # the agent edited a token
    with pytest.raises(RuntimeError, match="not a prefix of the sample"):
        routing_replay.agent_routes(AGENT_OBSERVATION, edited)
    short = [(AGENT_CALLS[0][0], AGENT_CALLS[0][1], _rows(100, 3))]  # one row too few for 3 + 2 tokens
    with pytest.raises(RuntimeError, match="routes for 3"):
        routing_replay.agent_routes(AGENT_OBSERVATION, short)


def test_engine_places_an_agents_routes_from_each_turn():
    """The real tracked stream and executor wrapper, two generate() calls (one per agent turn) on fake vLLM
    outputs: the response's routes follow the by-hand rule above."""
    by_prompt = {len(prompt): (prompt, tokens, routes) for prompt, tokens, routes in AGENT_CALLS}

    async def generate(prompt, sampling_params, *args, request_id=None, **kwargs):
        p, tokens, routes = by_prompt[len(prompt)]
        yield _output(p, tokens[:1])
        yield _output(p, tokens, routes)

    engine = types.SimpleNamespace(
        weight_version=0, _inflight={}, _finished=[], report_outgoing=False, report_kept_counts=False
    )
    engine.report_routes = True
    tracked = vllm_engine.RolloutRayActorImpl._tracking_stream(engine, generate)

    class Agent:
        async def execute(self, *args, **kwargs):
            for prompt, _, _ in AGENT_CALLS:
                async for _ in tracked(prompt, types.SimpleNamespace(min_tokens=0), f"r{len(prompt)}"):
                    pass
            return {"observation_tokens": AGENT_OBSERVATION, "action_ranges": [(3, 5), (7, 9)]}

    response = asyncio.run(rollout_tags._VersionTaggingExecutor(Agent(), routes=True).execute())
    assert response["rollout_routes"][:, 0, 0].tolist() == AGENT_EXPECTED
    sample = routing_replay.observation_routes(response["rollout_routes"], len(AGENT_OBSERVATION), 64)
    assert sample.shape == (1, 10, 1, 1) and sample[0, -1, 0, 0] == 255  # the last token: the sentinel


def _output_processor(request_id: str = "r0", max_tokens: int = 3):
    """vLLM's real OutputProcessor (the AsyncLLM front end's) with one request ``request_id`` (internal id
    ``request_id-1``) of a 3-token prompt. vLLM's CPU backend cannot produce routes, so the engine core's outputs
    are written here, in vLLM 0.29's order: the prompt's 3 rows with the first token, then one row per decoded
    token."""
    import time

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

    processor = OutputProcessor(None, log_stats=False)
    params = SamplingParams(max_tokens=max_tokens, detokenize=False, output_kind=RequestOutputKind.CUMULATIVE)
    request = EngineCoreRequest(
        request_id=f"{request_id}-1",
        prompt_token_ids=[1, 2, 3],
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=request_id,
    )
    queue = RequestOutputCollector(RequestOutputKind.CUMULATIVE, request_id)
    processor.add_request(request, None, None, 0, queue)
    return processor, queue


def _step(processor, token: int, routes: np.ndarray, finished: bool = False, request_id: str = "r0") -> None:
    from vllm.v1.engine import EngineCoreOutput, FinishReason

    reason = FinishReason.LENGTH if finished else None
    out = EngineCoreOutput(
        request_id=f"{request_id}-1", new_token_ids=[token], routed_experts=routes, finish_reason=reason
    )
    processor.process_outputs([out])


def test_inflight_routes_reads_vllms_output_processor():
    """Mid-generation, ``inflight_routes`` returns the rows vLLM has accumulated (prompt + tokens so far - 1); they
    are the first rows of the routes vLLM's own final output carries."""
    processor, queue = _output_processor()
    llm = types.SimpleNamespace(output_processor=processor)
    assert rollout_tags.inflight_routes(llm, "r0") is None  # nothing forwarded yet
    _step(processor, 7, _rows(0, 3))
    assert queue.get_nowait().outputs[0].routed_experts is None  # vLLM returns routes only when it finishes
    assert rollout_tags.inflight_routes(llm, "r0")[:, 0, 0].tolist() == [0, 1, 2]
    _step(processor, 8, _rows(3, 1))
    mid = rollout_tags.inflight_routes(llm, "r0")
    assert mid[:, 0, 0].tolist() == [0, 1, 2, 3]
    _step(processor, 9, _rows(4, 1), finished=True)
    final = queue.get_nowait().outputs[0].routed_experts
    assert final.shape == (5, 1, 1) and np.array_equal(final[: len(mid)], mid)
    with pytest.raises(RuntimeError, match="holds 0 states for request 'r0'"):  # finished: vLLM dropped it
        rollout_tags.inflight_routes(llm, "r0")


def test_outgoing_streams_carry_routes_of_the_tokens_streamed_so_far():
    """The real ``outgoing_streams``: an in-flight request's routes come from vLLM's output processor, cut to the
    tokens the caller has seen (vLLM may have processed more); a finished one's from its final output."""
    processor, _ = _output_processor()
    _step(processor, 7, _rows(0, 3))
    _step(processor, 8, _rows(3, 1))  # vLLM has 2 tokens; the stream consumer saw only the first
    inflight = rollout_tags._Progress(0)
    inflight.streamed, inflight.prompt, inflight.tokens = 1, [1, 2, 3], [7]
    done = rollout_tags._Progress(0)
    done.streamed, done.prompt, done.tokens, done.routes = 2, [5, 6], [4, 4], _rows(50, 3)
    engine = types.SimpleNamespace(
        weight_version=0,
        _inflight={"r0": inflight},
        _finished=[done],
        report_kept_counts=False,
        report_routes=True,
        llm=types.SimpleNamespace(output_processor=processor),
    )
    reports = asyncio.run(vllm_engine.RolloutRayActorImpl.outgoing_streams(engine))
    assert [r["stream"] for r in reports] == [[1, 2, 3, 7], [5, 6, 4, 4]]
    assert reports[0]["routes"][:, 0, 0].tolist() == [0, 1, 2]  # 4 tokens: the rows of the first 3
    assert reports[1]["routes"][:, 0, 0].tolist() == [50, 51, 52]
    done.routes = _rows(50, 2)  # fewer rows than the stream needs: refused, not scored on the wrong tokens
    engine._inflight, engine._finished = {}, [done]
    with pytest.raises(RuntimeError, match="has 2 rows of routes"):
        asyncio.run(vllm_engine.RolloutRayActorImpl.outgoing_streams(engine))


def test_check_inflight_routes_contract():
    routing_replay.check_inflight_routes_contract(5, 5, True)
    with pytest.raises(EngineContractError, match="had None rows"):
        routing_replay.check_inflight_routes_contract(None, 5, True)
    with pytest.raises(EngineContractError, match="had 4 rows, expected >= 5"):
        routing_replay.check_inflight_routes_contract(4, 5, True)
    with pytest.raises(EngineContractError, match="differ from the first 5 rows"):
        routing_replay.check_inflight_routes_contract(5, 5, False)
    with pytest.raises(EngineContractError, match="a 32-token request streamed no output before"):
        routing_replay.check_inflight_routes_contract(None, 0, False, 32)


def test_streams_scored_at_a_sync_replay_the_engines_routes(moe_world):
    """interrupt (``ProxSources.score_streams``) and dedicated (``ProxScorerImpl.score``) score with the engine's
    routes: equal to upstream's Actor forward under the same routes (an independent path: upstream's forward and
    log-prob code, the seam's hook), and different from scoring without them."""
    from openrlhf_ess.trainer import prox
    from openrlhf_ess.trainer.prox_sources import ProxSources
    from openrlhf_ess.trainer.ray.prox_scorer import ProxScorerImpl

    actor = _actor(moe_world["model"])
    hf = routing_replay.hf_model(actor)
    seqs, attn, _ = _batch(hf.config.vocab_size)
    lengths = [int(n) for n in attn.sum(-1)]
    streams = [seqs[b, :n].tolist() for b, n in enumerate(lengths)]
    with torch.no_grad(), seam.record_routes(hf) as rec:
        hf(input_ids=seqs, attention_mask=attn)
    shifted = ((rec.routes.long() + 1) % 4).to(torch.uint8)  # [B, S, L, k]: experts the model would not pick
    engine_rows = [shifted[b, : n - 1].numpy() for b, n in enumerate(lengths)]  # vLLM's layout: all but the last
    action_mask = torch.zeros(2, seqs.shape[1] - 1, dtype=torch.bool)
    for b, n in enumerate(lengths):
        action_mask[b, : n - 1] = True
    with torch.no_grad(), routing_replay.applied(actor, shifted):
        expected = actor(seqs, action_mask, attn)
    with torch.no_grad():
        plain = prox.stream_log_probs(hf, streams)
    sources = ProxSources(
        types.SimpleNamespace(
            algo=types.SimpleNamespace(prox_mode="interrupt", prox_snapshots=1),
            rollout=types.SimpleNamespace(temperature=1.0),
        ),
        types.SimpleNamespace(module=hf),
        partitioned=False,
    )
    scorer = ProxScorerImpl(moe_world["model"], "fp32", "sdpa", 1.0)
    for scored in (
        sources.score_streams(0, streams, routes=engine_rows),
        scorer.score(0, streams, routes=engine_rows),
    ):
        for b, n in enumerate(lengths):
            torch.testing.assert_close(scored[b], expected[b, : n - 1].float(), atol=1e-5, rtol=0)
            assert (scored[b] - plain[b]).abs().max() > 1e-3


# ---- flags ----------------------------------------------------------------------------------------------------


def _parse(world, tmp_path, *extra):
    from openrlhf_ess.cli import train_ppo_ray as cli
    from tests.helpers.e2e import tiny_args

    return cli.parse_args(tiny_args(world, str(tmp_path)) + list(extra))


def test_flag_on_and_off(moe_world, tmp_path):
    from openrlhf_ess.checks import preflight
    from openrlhf_ess.trainer.ray.vllm_engine import engine_kwargs

    args, _ = _parse(moe_world, tmp_path, "--algo.routing_replay")
    assert config.routing_replay_on(args) and config.needs_our_controllers(args)
    assert engine_kwargs(args)["report_routes"] is True
    preflight.model._check_routing_replay(args)  # a qwen2_moe model passes pre-flight
    args, _ = _parse(moe_world, tmp_path)
    assert not config.routing_replay_on(args) and "report_routes" not in engine_kwargs(args)
    assert not config.needs_our_controllers(args)  # off: upstream's controllers


# ---- forward side ---------------------------------------------------------------------------------------------


def _actor(model_dir):
    from openrlhf.models.actor import Actor

    return Actor(model_dir, attn_implementation="sdpa", param_dtype="fp32").eval()


def _batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    seqs = torch.randint(4, vocab, (2, 9), generator=g)
    attn = torch.ones_like(seqs)
    attn[1, 7:] = 0  # right padding, as upstream batches samples
    action_mask = torch.zeros(2, 8, dtype=torch.bool)
    action_mask[0, 3:] = True
    action_mask[1, 3:6] = True
    return seqs, attn, action_mask


def test_actor_forward_under_replay(moe_world):
    """Upstream's Actor: replaying the model's own recorded routes gives bit-identical log-probs; other routes
    change them; an unwrapped (DeepSpeed-like) module is found through ``module``/``model``."""
    actor = _actor(moe_world["model"])
    hf = routing_replay.hf_model(actor)
    assert hf is actor.model and "lm_head" in hf._modules
    seqs, attn, action_mask = _batch(hf.config.vocab_size)
    with torch.no_grad(), seam.record_routes(hf) as rec:
        plain = actor(seqs, action_mask, attn)
    own = rec.routes.to(torch.uint8)
    chosen = seam.RouteRecord(len(seam.moe_layers(hf)))  # the router's own choice, recorded by the replay hook
    with torch.no_grad(), routing_replay.applied(actor, own, chosen):
        replayed = actor(seqs, action_mask, attn)
    assert torch.equal(plain, replayed) and torch.equal(chosen.routes, rec.routes)
    shifted = ((own.long() + 1) % 4).to(torch.uint8)
    with torch.no_grad(), routing_replay.applied(actor, shifted, chosen):
        other = actor(seqs, action_mask, attn)
    assert (other - plain).abs().max() > 1e-3
    assert torch.equal(chosen.routes[:, :, 0], rec.routes[:, :, 0])  # layer 0's input is unchanged by replay
    with torch.no_grad(), routing_replay.applied(actor, None):  # no routes: upstream's forward
        assert torch.equal(actor(seqs, action_mask, attn), plain)

    class Engine(torch.nn.Module):  # DeepSpeed's engine: the model under ``module``, attributes forwarded
        def __init__(self, module):
            super().__init__()
            self.module = module

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.module, name)

    wrapped = torch.nn.Module()
    wrapped.model = Engine(hf)
    assert routing_replay.hf_model(wrapped) is hf


def test_training_step_wrapper_replays_forward_and_backward_and_reports(moe_world):
    """``ActorPPOTrainer.training_step`` (the real method, a stand-in trainer): the upstream step it wraps sees
    the engine's routes in its forward and in a gradient-checkpointing recompute during backward; the metrics are
    the ones counted by hand."""
    from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer

    actor = _actor(moe_world["model"])
    hf = routing_replay.hf_model(actor)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seqs, attn, action_mask = _batch(hf.config.vocab_size)
    with torch.no_grad(), seam.record_routes(hf) as rec:
        actor(seqs, action_mask, attn)
    own = rec.routes.to(torch.uint8)
    engine_routes = own.clone()
    engine_routes[0, 5] = ((own[0, 5].long() + 1) % 4).to(torch.uint8)  # both layers differ at position 5
    engine_routes[0, 6, 1] = own[0, 6, 1].flip(-1)  # same set, other order: not a disagreement
    engine_routes[0, 8] = 255  # the last token: no route (not a scoring position either)
    engine_routes[1, 7:] = 255  # padding
    seen = []

    def upstream_step(experience, kl_ctl, step, loss_batch_info):
        actor.train()
        with seam.record_routes(hf) as used:  # inside replay: the ids the experts really used
            log_probs = actor(experience.sequences, experience.action_mask, experience.attention_mask)
            log_probs[experience.action_mask].sum().backward()
        seen.append(used.routes)
        return {"metrics": {}, "weights": {}}

    trainer = types.SimpleNamespace(routing_replay=True, actor=actor, _masked_training_step=upstream_step)
    experience = types.SimpleNamespace(
        sequences=seqs, attention_mask=attn, action_mask=action_mask, rollout_routes=engine_routes
    )
    status = ActorPPOTrainer.training_step(trainer, experience, 0.0, 0)
    # the recompute in backward overwrote the record last: it replayed the engine's routes too
    valid = routing_replay.has_route(engine_routes, 4)
    assert torch.equal(seen[0][valid], engine_routes.long()[valid])
    assert all(p.grad is not None for p in (layer.router.weight for layer in seam.moe_layers(hf)))
    # scoring positions: row 0 columns 3..7 (5), row 1 columns 3..5 (3); all have routes -> replayed 8/8
    # disagreeing: row 0 column 5 in both layers -> per layer 1/8, mean 1/8
    assert status["metrics"]["routing/replayed_frac"].item() == 1.0
    assert status["metrics"]["routing/disagree_frac"].item() == pytest.approx(1 / 8)
    assert status["weights"]["routing/disagree_frac"] == "token"
    with pytest.raises(RuntimeError, match="a training batch came without the engine's routes"):
        ActorPPOTrainer.training_step(trainer, types.SimpleNamespace(rollout_routes=None), 0.0, 0)


def test_replay_stats_by_hand():
    # B=1, S=4, one MoE layer, k=2, E=4; action_mask (1, 3): positions 1 and 2 score response tokens
    engine = torch.tensor([[[[0, 1]], [[2, 3]], [[255, 255]], [[255, 255]]]], dtype=torch.uint8)
    own = torch.tensor([[[[0, 1]], [[3, 1]], [[0, 2]], [[1, 2]]]])
    stats = routing_replay.replay_stats(engine, own, torch.tensor([[0, 1, 1]]), num_experts=4)
    assert stats.replayed_frac.item() == 0.5  # position 2 has no route
    assert stats.disagree_frac.item() == 1.0  # position 1: {2,3} vs {1,3}
    assert stats.tokens.item() == 2


_DS_SCRIPT = r"""
import json, sys
import torch
from tests.helpers.ds_actor import build_actor, single_process_env
from openrlhf_ess.models import routing_replay as seam
from openrlhf_ess.trainer import routing_replay

single_process_env()
model_dir, prompts, out = sys.argv[1:4]
strategy, model, optim, scheduler = build_actor(model_dir, prompts, 2, "fp32", train_batch=2, micro_batch=2)
hf = routing_replay.hf_model(model)  # Actor -> DeepSpeedEngine -> HF model
torch.manual_seed(0)
seq = torch.randint(4, 90, (2, 12))
action_mask = torch.ones(2, 6, dtype=torch.long)
attention_mask = torch.ones_like(seq)
with torch.no_grad(), seam.record_routes(hf) as rec:
    plain = model(seq, action_mask, attention_mask=attention_mask)
own = rec.routes.to(torch.uint8)
with torch.no_grad(), routing_replay.applied(model, own):
    replayed = model(seq, action_mask, attention_mask=attention_mask)
with torch.no_grad(), routing_replay.applied(model, ((own.long() + 1) % 4).to(torch.uint8)):
    other = model(seq, action_mask, attention_mask=attention_mask)
experience = type("E", (), dict(rollout_routes=own, action_mask=action_mask))()
with routing_replay.replayed_step(model, experience) as stats:
    loss = -model(seq, action_mask, attention_mask=attention_mask).float().mean()
    strategy.backward(loss, model, optim)
    strategy.optimizer_step(optim, model, scheduler, name="actor")
json.dump(
    {
        "hf": type(hf).__name__,
        "equal": bool(torch.equal(plain, replayed)),
        "other_gap": float((other - plain).abs().max()),
        "replayed_frac": float(stats[0].replayed_frac),
        "disagree_frac": float(stats[0].disagree_frac),
        "loss": float(loss),
    },
    open(out, "w"),
)
"""


@pytest.mark.slow
def test_deepspeed_actor_log_probs_under_replay(moe_world, tmp_path):
    """Upstream's Actor prepared by DeepSpeed (ZeRO-2, fp32, one process): the wrapper finds the HF model inside
    the engine, own routes replay bit-identically, other routes change the log-probs, and a step (backward and
    optimizer step) under ``replayed_step`` reports replayed 1.0, disagreement 0."""
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "ds.json"
    cmd = [sys.executable, "-c", _DS_SCRIPT, moe_world["model"], moe_world["prompts"], str(out)]
    run = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["hf"] == "Qwen2MoeForCausalLM" and res["equal"] and res["other_gap"] > 1e-3
    assert res["replayed_frac"] == 1.0 and res["disagree_frac"] == 0.0


def test_self_check_reads_routes_mid_generation_when_a_sync_scores_streams(monkeypatch):
    """With scoring at a weight sync (``report_outgoing``), the start-up check reads the routes at the first
    streamed output through vLLM's real OutputProcessor, and stops the engine when they are not the first rows of
    the final routes (here: a row rewritten after the read)."""
    parent = vllm_engine.RolloutRayActorImpl.__mro__[1]
    tamper = {"on": False}

    async def fake_init(self, *args, **kwargs):
        async def generate(prompt, params, request_id=None):
            processor, queue = _output_processor(request_id, params.max_tokens)
            self.llm.output_processor = processor
            _step(processor, 7, np.ones((3, 2, 2), np.uint8), request_id=request_id)
            yield queue.get_nowait()
            if tamper["on"]:
                processor.request_states[f"{request_id}-1"].routed_experts_chunks[0][0, 0, 0] = 3
            for i in range(1, params.max_tokens):
                last = i == params.max_tokens - 1
                _step(processor, 7, np.ones((1, 2, 2), np.uint8), finished=last, request_id=request_id)
                yield queue.get_nowait()

        hf = types.SimpleNamespace(num_hidden_layers=2, num_experts_per_tok=2)
        self.llm = types.SimpleNamespace(generate=generate, model_config=types.SimpleNamespace(hf_text_config=hf))
        self.executor = object()

    monkeypatch.setattr(parent, "__init__", fake_init)
    engine = object.__new__(vllm_engine.RolloutRayActorImpl)
    asyncio.run(vllm_engine.RolloutRayActorImpl.__init__(engine, report_routes=True, report_outgoing=True))
    tamper["on"] = True
    with pytest.raises(EngineContractError, match="differ from the first 3 rows"):
        asyncio.run(vllm_engine.RolloutRayActorImpl.__init__(engine, report_routes=True, report_outgoing=True))


# ---- packed forwards (--ds.packing_samples, forced on by --train.dynamic_batch_enable) ---------------------


def _flash_attn_padding(monkeypatch):
    """flash-attn's three padding helpers, which upstream's packed ``Actor.forward`` calls (flash-attn cannot be
    installed without CUDA, and cpu_compat's shim refuses them), written out from their definition: unpad keeps
    ``attention_mask.flatten().nonzero()`` in that order; pad puts the rows back."""
    from openrlhf.models import ring_attn_utils

    def unpad_input(hidden, mask):
        indices = mask.reshape(-1).nonzero().squeeze(-1)
        lengths = mask.sum(-1, dtype=torch.int32)
        cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        return hidden.reshape(-1, *hidden.shape[2:])[indices], indices, cu, int(lengths.max()), lengths

    def pad_input(hidden, indices, batch, seqlen):
        out = torch.zeros(batch * seqlen, *hidden.shape[1:], dtype=hidden.dtype, device=hidden.device)
        out[indices] = hidden
        return out.reshape(batch, seqlen, *hidden.shape[1:])

    monkeypatch.setattr(ring_attn_utils, "unpad_input", unpad_input)
    monkeypatch.setattr(ring_attn_utils, "pad_input", pad_input)
    monkeypatch.setattr(ring_attn_utils, "index_first_axis", lambda x, indices: x[indices])


def test_packed_forward_replays_each_tokens_route_and_reports(moe_world, monkeypatch):
    """A packing ``Actor`` (upstream's, unpadding to (1, N)): every packed token's MoE layers use the route of
    that token (placed by hand here), and the training-step metrics count the packed scoring positions. (The CPU
    forward attends across the packed samples, flash-attn's varlen kernel does not; the routes' placement does
    not depend on it.)"""
    from openrlhf.models.actor import Actor

    _flash_attn_padding(monkeypatch)
    actor = Actor(moe_world["model"], attn_implementation="sdpa", param_dtype="fp32", packing_samples=True).eval()
    assert routing_replay.packs(actor)
    hf = routing_replay.hf_model(actor)
    seqs, attn, action_mask = _batch(hf.config.vocab_size)
    with torch.no_grad(), seam.record_routes(hf) as rec:
        plain = actor(seqs, action_mask, attn)
    own_packed = rec.routes  # [1, N, L, k]: the packed forward's own choice
    assert own_packed.shape[1] == int(attn.sum())
    routes = torch.full((*seqs.shape, *own_packed.shape[2:]), 255, dtype=torch.uint8)  # back to [B, S], by hand
    j = 0
    for b in range(seqs.shape[0]):
        for s in range(seqs.shape[1]):
            if attn[b, s]:
                routes[b, s] = own_packed[0, j]
                j += 1
    shifted = torch.where(routes == 255, routes, ((routes.long() + 1) % 4).to(torch.uint8))
    experience = types.SimpleNamespace(attention_mask=attn, action_mask=action_mask, rollout_routes=routes)
    with torch.no_grad(), routing_replay.replayed_step(actor, experience) as stats:
        replayed = actor(seqs, action_mask, attn)
    assert torch.equal(replayed, plain)  # own routes, packed back in place: the same forward, bit for bit
    assert stats[0].replayed_frac == 1.0 and stats[0].disagree_frac == 0.0
    assert stats[0].tokens == action_mask.sum()
    experience.rollout_routes = shifted
    with torch.no_grad(), routing_replay.replayed_step(actor, experience) as stats:
        with seam.record_routes(hf) as used:  # inside the replay: the ids the experts used
            actor(seqs, action_mask, attn)
    expected = torch.cat([shifted[b][attn[b].bool()] for b in range(seqs.shape[0])]).unsqueeze(0)
    assert torch.equal(used.routes, expected.long())
    assert stats[0].disagree_frac > 0.4  # layer 0's input is unchanged, so all its scored tokens disagree
    with pytest.raises(RuntimeError, match="needs the attention mask"):
        with routing_replay.applied(actor, routes):
            pass
