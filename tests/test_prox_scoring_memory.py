"""Scoring token streams at a sync under a memory budget (``prox.stream_log_probs``).

At V = 151,936 (Qwen2's vocabulary) the full-vocabulary fp32 logits of 16 streams x T = 4096 are 40 GB, and
the old scorer also held a temperature-scaled copy and a log-softmax copy. The scorer now runs the model body once
per group of streams and applies the LM head to the final hidden states ``rows_per_chunk`` positions at a time.

Peak of scoring at a sync (bytes, beyond the weights), with budget B = ``--algo.prox_score_memory_mb`` x 2^20:

    peak ≈ r · V · b                 the logits chunk and its temporaries, ≤ B
         + g · W · H · s             the group's final hidden states (g · W · H · 4 ≤ B), g ≤ 16 streams of width W
         + activations of one body forward over g x W tokens
         + 2 · g · V · s             the last position's logits (the model's own head call, and its check)

r = max(1, ⌊B / (V · b)⌋) positions per chunk, b = 8 fp32 bytes per logit (the logits + exp(x − max)), 32 with
kept counts (sampling mask: measured 20-24 at worst, k = V and banned stop tokens), s = the model dtype's bytes.
The old scorer's peak was ≈ 3 · g · W · V · 4 bytes (logits, logits / T, log-softmax).
"""

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()  # upstream's Actor imports flash_attn: the CPU stand-ins

import pytest  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import peak_allocated_bytes  # noqa: E402
from openrlhf_ess.trainer import prox  # noqa: E402
from tests.helpers.tiny_qwen2 import tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.engine  # an engine, DeepSpeed ranks or child processes: not in --fast

VOCAB = 151_936  # Qwen2's
STOP = 2
STREAMS, LENGTH = 16, 512  # the memory test: 16 streams x T = 512


def tiny_model(vocab=VOCAB, seed=0, **extra):
    """A random 2-layer causal LM with hidden size 32 and a full-size vocabulary (weights ~40 MB, fp32)."""
    return tiny_qwen2(vocab, seed, **extra)


def reference_log_probs(model, streams, temperature, kept=None, stop_ids=(STOP,)):
    """Written out here: one full forward of the right-padded streams, logits / T in fp32, log_softmax in fp64
    (see the test for why), gather; with kept counts, each truncated row renormalised over its top-|k| tokens of the
    fp32 logits (stop tokens first removed where k < 0; ties kept; the sampled token always kept)."""
    width = max(len(s) for s in streams)
    ids = torch.zeros(len(streams), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(streams):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(width).expand_as(ids)).logits
    z = logits.float() / temperature  # the trainer's fp32 scaled logits: they rank the support
    full = z.double().log_softmax(-1)
    out = []
    for i, s in enumerate(streams):
        row = []
        for t in range(len(s) - 1):
            y, c = s[t + 1], 0 if kept is None else kept[i][t + 1]
            if c == 0:
                row.append(full[i, t, y].item())
                continue
            rank = z[i, t].clone()
            if c < 0:
                rank[list(stop_ids)] = float("-inf")
            k = abs(c)
            support = rank > float("-inf") if k >= VOCAB else rank >= rank.topk(k).values[-1]
            if c < 0:
                support &= rank > float("-inf")
            support[y] = True
            row.append((z[i, t, y].double() - z[i, t][support].double().logsumexp(-1)).item())
        out.append(torch.tensor(row, dtype=torch.float32))
    return out


def test_chunked_scoring_equals_full_forward_log_softmax():
    """Chunks of one position, two streams per forward, a stream of one token (nothing to score): the same numbers
    as the plain full forward + log_softmax, with and without kept counts (the sampling-mask path), to 1e-6
    (+ 1e-6 relative). The reference reduces in fp64: over V = 151,936 logits, fp32 ``log_softmax`` itself (the old
    scorer) is up to 2.3e-5 off it here (1.4e-6 relative; 2 fp32 summation orders), our fp32 logsumexp 2e-6."""
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    streams = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 33, 1, 17, 24, 5)]
    counts = [1, 5, 50, -3, -40, 7000, 0, VOCAB + 5, -(VOCAB - 1), 2]
    kept = [[0] * 3 + [counts[(i + t) % len(counts)] for t in range(len(s) - 3)] for i, s in enumerate(streams)]
    kept[2] = [0]
    streams[1][5] = STOP  # a stop token sampled where stops were banned (k = -3 there): kept in its own support
    assert kept[1][5] == -3
    assert prox.rows_per_chunk(VOCAB, memory_mb=1) == 1  # every position its own LM-head call
    for mask in (None, kept):
        expected = reference_log_probs(model, streams, 0.7, mask)
        for memory_mb, micro_batch in ((1, 2), (prox.SCORE_MEMORY_MB, prox.MICRO_BATCH)):
            ours = prox.stream_log_probs(
                model, streams, 0.7, micro_batch=micro_batch, kept=mask, stop_ids=(STOP,), memory_mb=memory_mb
            )
            assert [len(lp) for lp in ours] == [len(s) - 1 for s in streams]
            for a, b in zip(ours, expected):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    plain = prox.stream_log_probs(model, streams, 0.7, memory_mb=1)
    masked = prox.stream_log_probs(model, streams, 0.7, kept=kept, stop_ids=(STOP,), memory_mb=1)
    assert (plain[1] - masked[1]).abs().max() > 1e-2  # the mask matters here: the check could fail


class Opaque(torch.nn.Module):
    """A causal LM seen from outside only: ``input_ids, ... -> .logits`` (like tests/helpers' TinyLM)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, **kwargs):
        self.calls += 1
        return self.inner(**kwargs)


def test_upstream_actor_and_soft_capped_models():
    """An upstream ``Actor`` around the model scores like the model; a Gemma-2-style final-logit soft-cap is
    applied as the model's forward applies it; a model that transforms its logits otherwise is refused."""
    from openrlhf.models.actor import Actor
    from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM

    model = tiny_model(vocab=1000)
    streams = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    direct = prox.stream_log_probs(model, streams, 0.7, memory_mb=1)
    wrapped = prox.stream_log_probs(Actor(model), streams, 0.7, memory_mb=1)
    assert all(torch.equal(a, b) for a, b in zip(direct, wrapped))
    opaque = Opaque(model)  # no separable head: scored from its full logits, in the same chunks
    for a, b in zip(prox.stream_log_probs(opaque, streams, 0.7, memory_mb=1), direct):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert opaque.calls == 1

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    small.update(num_key_value_heads=2, head_dim=8, vocab_size=1000)
    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(Gemma2Config(final_logit_softcapping=3.0, **small)).eval()
    with torch.no_grad():
        gemma.lm_head.weight.normal_(0.0, 0.5)
    ours = prox.stream_log_probs(gemma, streams, 0.7, memory_mb=1)
    for a, b in zip(ours, reference_log_probs(gemma, streams, 0.7)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    cohere = CohereForCausalLM(CohereConfig(logit_scale=0.5, bos_token_id=1, eos_token_id=STOP, **small)).eval()
    with pytest.raises(RuntimeError, match="logits are not its LM head's output"):
        prox.stream_log_probs(cohere, streams, memory_mb=1)


def test_forward_count_is_the_padding_contract():
    """ZeRO-3: every rank runs ``forwards_needed`` of its own streams, padded to the ranks' maximum. The count is
    one forward per group of ≤ micro_batch consecutive streams whose fp32 hidden states fit the budget."""
    # hidden 1024, 1 MB: two 100-token streams fit (800 kB), a third does not; a 400-token stream alone (1.6 MB)
    groups = prox.stream_groups([100, 100, 100, 400, 5, 5, 5], hidden_size=1024, memory_mb=1, micro_batch=2)
    assert [list(r) for r in groups] == [[0, 1], [2], [3], [4, 5], [6]]
    assert prox.stream_groups([], hidden_size=1024) == []

    model = tiny_model(vocab=1000, hidden_size=256, num_attention_heads=4)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    streams = [[5] * 600, [6] * 600, [7] * 30, [8] * 2]  # 600 x 256 x 4 = 600 kB per stream: one per forward
    needed = prox.forwards_needed(streams, model=model, memory_mb=1)
    assert needed == 3 and prox.forwards_needed(4) == 1  # a count alone: the micro-batch bound
    plain = prox.stream_log_probs(model, streams, memory_mb=1)
    assert len(calls) == needed
    calls.clear()
    padded = prox.stream_log_probs(model, streams, memory_mb=1, forwards=5)
    assert len(calls) == 5 and all(torch.equal(a, b) for a, b in zip(plain, padded))
    calls.clear()
    assert prox.stream_log_probs(model, [], forwards=2) == [] and len(calls) == 2


def test_the_budget_flag_must_be_positive(tiny_world):
    from openrlhf_ess import config
    from openrlhf_ess.cli import train_ppo_ray as cli

    argv = ["--actor.model_name_or_path", tiny_world["model"], "--data.prompt_dataset", tiny_world["prompts"]]
    argv += ["--reward.remote_url", tiny_world["reward"], "--vllm.num_engines", "1"]
    argv += ["--ds.attn_implementation", "sdpa", "--algo.advantage.estimator", "reinforce"]
    args, _ = cli.parse_args(argv)
    assert args.algo.prox_score_memory_mb == prox.SCORE_MEMORY_MB == 2048
    with pytest.raises(config.ConfigError, match="--algo.prox_score_memory_mb must be > 0"):
        cli.parse_args(argv + ["--algo.prox_score_memory_mb", "0"])


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "kept"])
def test_scoring_peak_stays_under_the_budget(masked):
    """Measured allocations at V = 151,936: 16 streams x T = 512 (plain; kept counts: 4 x 64, with worst-case
    supports) stay under the budget + the model's size. The old scorer held the logits, logits / T and a
    log-softmax copy: 3 x 16 x 511 x V x 4 bytes = 14.9 GB here; run against it (inlined for one run, at T = 128 to
    spare the shared machine) this test failed with 3,542 MiB measured. Measured now: 258.4 MiB (budget 256 MiB +
    hidden states and attention), and 148 MiB with kept counts."""
    model = tiny_model()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # 39 MB
    budget_mb = 256
    g = torch.Generator().manual_seed(0)
    n, length = (4, 64) if masked else (STREAMS, LENGTH)
    streams = torch.randint(3, VOCAB, (n, length), generator=g).tolist()
    kept = None
    if masked:  # k = V - 2 with stops banned (a top-k of nearly the whole row, -inf stops), and moderate k
        kept = [[0] * 4 + [(-(VOCAB - 2) if t % 3 == 0 else 1 + 97 * t) for t in range(length - 4)] for _ in streams]
    peak = peak_allocated_bytes(
        lambda: prox.stream_log_probs(model, streams, 0.7, kept=kept, stop_ids=(STOP,), memory_mb=budget_mb)
    )
    rows = prox.rows_per_chunk(VOCAB, budget_mb, masked)
    print(f"peak {peak / 2**20:.1f} MB, budget {budget_mb} MB, {rows} positions per chunk, model {model_bytes} B")
    assert peak >= rows * VOCAB * 4  # the instrument sees at least one fp32 chunk of logits
    assert peak <= budget_mb * 2**20 + model_bytes
    if not masked:  # the bound is used, not just respected: 220 positions x V x 8 bytes ≈ the budget
        assert peak >= 0.9 * rows * VOCAB * prox.PLAIN_BYTES_PER_LOGIT


@pytest.mark.slow
def test_zero3_ranks_with_different_streams_run_the_same_forwards(tiny_world, tmp_path):
    """ZeRO-3 on two gloo ranks, interrupt's scoring (``ProxSources.score_streams``) with the LM head in one-position
    chunks and hidden-state groups of about one stream: rank 0 scores 20 streams (20 forwards), rank 1 one stream
    and pads to 20; both match a full forward + log_softmax of the same weights. The head's chunks run inside its
    own call, while ZeRO-3 holds its weight gathered."""
    import json
    import os
    import subprocess
    import sys

    from tests.helpers.ports import free_port

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), "-m", "tests.test_prox_scoring_memory"]
    cmd += [tiny_world["model"], tiny_world["prompts"], str(tmp_path / "ranks")]
    run = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"ranks.{r}.json").read_text()) for r in (0, 1))
    assert r0["partitioned"] and r0["rows"] == 1
    assert (r0["streams"], r0["needed"], r0["forwards"]) == (20, 20, 20)
    assert (r1["streams"], r1["needed"], r1["forwards"]) == (1, 1, 20)
    assert r0["diff"] < 1e-5 and r1["diff"] < 1e-5, (r0["diff"], r1["diff"])


def zero3_ranks(model_path, prompts, out):
    """One rank of the ZeRO-3 test: a DeepSpeed actor (snapshot mode keeps version 0, the live weights)."""
    import json
    import os

    from tests.helpers.ds_actor import build_actor
    from tests.helpers.ess_ds import MICRO

    extra = ["--vllm.num_engines", "1", "--algo.kl.init_coef", "0", "--algo.prox_mode", "snapshot"]
    extra += ["--algo.prox_score_memory_mb", "1"]
    strategy, model, optim, scheduler = build_actor(
        model_path,
        prompts,
        3,
        "fp32",
        MICRO * int(os.environ["WORLD_SIZE"]),
        MICRO,
        extra=extra,
        zero_overrides={"stage3_param_persistence_threshold": 100},
    )
    from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer

    # the tiny model's V = 93: force one position per LM-head chunk and hidden-state groups of ~one stream
    prox.PLAIN_BYTES_PER_LOGIT, prox.HIDDEN_BYTES = 10**6, 4000
    trainer = ActorPPOTrainer(
        strategy, model, None, optim, scheduler, micro_train_batch_size=MICRO, dataloader_pin_memory=False
    )
    module = model.model.module
    rank = torch.distributed.get_rank()
    vocab, _ = prox.head_shape(prox.output_head(module))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 40, (21,), generator=g).tolist()
    streams = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    mine = streams[:20] if rank == 0 else streams[20:]
    calls = []
    hook = module.register_forward_hook(lambda *_: calls.append(1))
    scored = trainer.score_streams(0, mine)  # version 0: the kept snapshot, equal to the live weights (no step)
    hook.remove()
    # the reference: one full forward of every stream on both ranks (the same gathers on both)
    expected = reference_log_probs(module.eval(), streams, trainer.args.rollout.temperature)
    expected = expected[:20] if rank == 0 else expected[20:]
    result = dict(
        partitioned=prox.is_partitioned(module),
        rows=prox.rows_per_chunk(vocab, 1),
        streams=len(mine),
        needed=prox.forwards_needed(mine, model=module, memory_mb=1),
        forwards=len(calls),
        diff=max((a - b).abs().max().item() for a, b in zip(scored, expected)),
    )
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import sys

    zero3_ranks(*sys.argv[1:4])
