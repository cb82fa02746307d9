"""Score-at-sync pieces (interrupt / dedicated π_prox modes), checked against independent computations."""

import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

from openrlhf_ess.trainer import prox  # noqa: E402
from openrlhf_ess.trainer.ppo_utils.experience_maker import fill_prox_from_store  # noqa: E402

N = -1  # NO_VERSION


def test_store_round_trip_by_content_and_version():
    store = prox.ProxStore(keep_versions=2)
    stream = [5, 6, 7, 8, 9, 10]  # prompt 5 6, outputs 7 8 | 9 10 (sync after 8)
    versions = [N, N, 0, 0, 1, 1]
    lp0 = torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5])  # per token t >= 1: column t - 1
    store.put(stream[:4], versions[:4], 0, lp0[:3])  # at sync 0 -> 1 the request had produced 7 8
    action_versions = versions[1:]
    got = store.take(stream, action_versions, 0)
    assert torch.equal(got, lp0[:3])  # columns 1, 2 (tokens 7, 8) are the version-0 ones
    assert store.take(stream, action_versions, 0) is None  # consumed once
    assert len(store) == 0


def test_store_counts_identical_samples_and_evicts_old_versions():
    store = prox.ProxStore(keep_versions=1)
    stream, versions = [1, 2, 3], [N, 4, 4]
    lp = torch.tensor([-1.0, -2.0])
    store.put(stream, versions, 4, lp)
    store.put(stream, versions, 4, lp)  # two requests produced the same tokens
    assert torch.equal(store.take(stream, versions[1:], 4), lp)
    assert torch.equal(store.take(stream, versions[1:], 4), lp)
    assert store.take(stream, versions[1:], 4) is None
    store.put(stream, versions, 4, lp)
    assert store.evict_before(5) == 0  # version 4 is within 1 of 5
    assert store.evict_before(6) == 1 and len(store) == 0


def test_a_different_prefix_is_not_matched():
    store = prox.ProxStore(keep_versions=2)
    store.put([1, 2, 3], [N, 0, 0], 0, torch.tensor([-1.0, -2.0]))
    assert store.take([1, 2, 4], [0, 0], 0) is None  # the last version-0 token differs


def test_fill_uses_store_for_stale_tokens_and_live_forward_for_current(monkeypatch):
    from collections import Counter
    from types import SimpleNamespace

    store = prox.ProxStore(keep_versions=3)
    # one row: prompt [3, 4], response tokens 5 6 (version 0) 7 (version 1) 8 (version 2 = current)
    seq = torch.tensor([[3, 4, 5, 6, 7, 8, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    versions = torch.tensor([[N, 0, 0, 1, 2, N]])
    live = torch.full((1, 6), -9.0)
    exp = SimpleNamespace(sequences=seq, attention_mask=attn, rollout_versions=versions, action_log_probs=live)
    store.put([3, 4, 5, 6], [N, N, 0, 0], 0, torch.tensor([-0.1, -0.2, -0.3]))
    store.put([3, 4, 5, 6, 7], [N, N, 0, 0, 1], 1, torch.tensor([-1.1, -1.2, -1.3, -1.4]))
    consumed = Counter()
    fill_prox_from_store(exp, store, consumed, version=2)
    expected = torch.tensor([[-9.0, -0.2, -0.3, -1.4, -9.0, -9.0]])
    assert torch.equal(exp.action_log_probs, expected)
    assert consumed[(3, 4, 5, 6, 7, 8)] == 1
    # nothing stored for a stale version: NaN (masked and counted by the caller), never the live value
    exp2 = SimpleNamespace(
        sequences=seq, attention_mask=attn, rollout_versions=versions, action_log_probs=torch.full((1, 6), -9.0)
    )
    fill_prox_from_store(exp2, store, consumed, version=2)
    assert torch.isnan(exp2.action_log_probs[0, 1:4]).all() and exp2.action_log_probs[0, 4] == -9.0


def test_stream_log_probs_match_upstream_actor_forward(tiny_world):
    """Right-padded streams give what upstream's Actor.forward computes on its own layout (temperature
    applied): independent code path, same numbers."""
    from openrlhf.models.actor import Actor

    actor = Actor(tiny_world["model"], attn_implementation="sdpa", param_dtype="fp32", temperature=0.7)
    actor.eval()
    g = torch.Generator().manual_seed(0)
    vocab = actor.model.config.vocab_size
    streams = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (9, 5, 12)]
    ours = prox.stream_log_probs(actor.model, streams, temperature=0.7, micro_batch=2)
    for s, lp in zip(streams, ours):
        seq = torch.tensor([s])
        with torch.no_grad():
            ref = actor(seq, action_mask=torch.ones(1, len(s) - 1), attention_mask=torch.ones_like(seq))
        assert lp.shape == (len(s) - 1,)
        assert (lp - ref[0].float()).abs().max().item() < 1e-5
    hot = prox.stream_log_probs(actor.model, streams[:1], temperature=1.0)[0]
    assert (hot - ours[0]).abs().max().item() > 1e-3  # temperature matters: the check could fail


def test_stream_scoring_pads_forwards_for_zero3_ranks(tiny_world):
    """Under ZeRO-3 every rank runs as many forwards as the busiest at a sync: padding adds forwards,
    changes no score, and a rank with no stream can still join."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_world["model"], dtype=torch.float32).eval()
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    streams = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    plain = prox.stream_log_probs(model, streams, micro_batch=2)
    assert len(calls) == 2 == prox.forwards_needed(3, micro_batch=2)
    calls.clear()
    padded = prox.stream_log_probs(model, streams, micro_batch=2, forwards=5)
    assert len(calls) == 5 and all(torch.equal(a, b) for a, b in zip(plain, padded))
    calls.clear()
    assert prox.stream_log_probs(model, [], forwards=2) == [] and len(calls) == 2


def test_ewma_partitions_from_another_layout_are_refused():
    """EWMA weights saved under ZeRO-3 are one rank's partitions: loading them into another layout names the
    flags to keep instead of averaging mismatched shards."""

    import pytest

    from openrlhf_ess.trainer.prox_sources import check_partition_layout

    module = torch.nn.Linear(4, 2)
    fits = {name: torch.zeros_like(p) for name, p in module.named_parameters()}
    check_partition_layout(module, fits)  # same shapes: accepted
    halves = {name: torch.zeros(-(-p.numel() // 2)) for name, p in module.named_parameters()}  # 2-rank shards
    with pytest.raises(RuntimeError, match="same --ds.zero_stage and number of actor ranks"):
        check_partition_layout(module, halves)


def test_dedicated_model_gets_the_blob_the_reload_sync_just_sent():
    """With the reload backend the weights are gathered and serialised once per sync: the dedicated model is sent
    the engines' blob; the next sync (or another backend) gathers anew."""

    from openrlhf_ess.trainer.weight_sync import WeightSync

    gathered = []
    sync = WeightSync.__new__(WeightSync)
    sync._blob_for_dedicated, sync.weights_blob = (b"synced",), lambda: gathered.append(1) or b"new"
    assert sync.blob_for_dedicated() == b"synced" and not gathered
    assert sync.blob_for_dedicated() == b"new" and gathered == [1]
    sync._blob_for_dedicated = (None,)  # a rank other than 0: no blob, and no gather either
    assert sync.blob_for_dedicated() is None and gathered == [1]
