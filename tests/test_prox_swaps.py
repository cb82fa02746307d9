"""π_prox weight swaps grouped by version: one swap per stored version per make-experience, not per micro-batch.

The bytes a step moves are bounded by (distinct stale versions × this rank's stored bytes); every token still gets
its version's log-prob, recomputed here in float64 from the weights the test kept itself.
"""

import types

import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

from openrlhf_ess.checks import selfcheck  # noqa: E402
from openrlhf_ess.trainer import prox_sources  # noqa: E402
from openrlhf_ess.trainer.prox_sources import ProxSources  # noqa: E402

VOCAB, HIDDEN, T, A = 11, 6, 7, 4
N = -1  # NO_VERSION: prompt / padding columns


def _policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB))


@torch.no_grad()
def _log_probs(module, seqs):
    """The module's log-probs of the last A tokens (what an actor's old-log-prob forward returns), fp32."""
    logits = module(seqs)[:, -A - 1 : -1]
    return logits.log_softmax(-1).gather(-1, seqs[:, -A:, None])[..., 0]


def _expected(weights, seqs):
    """The same log-probs from a weight dict, by hand in float64: z = E[x] Wᵀ + b, log softmax, gather."""
    h = weights["0.weight"].double()[seqs[:, -A - 1 : -1]]
    z = h @ weights["1.weight"].double().T + weights["1.bias"].double()
    return z.log_softmax(-1).gather(-1, seqs[:, -A:, None])[..., 0]


def _weights(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _perturb(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g))


def _bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())  # this rank's stored bytes, one version


def _snapshot_sources(partitioned=False, releases=None):
    """Versions 0..4 stored as they happen, 3 kept (2, 3, 4); the live weights are version 4."""
    module = _policy()
    optimizer = types.SimpleNamespace(empty_partition_cache=lambda: releases.append(1) if releases is not None else 0)
    engine = types.SimpleNamespace(module=module, global_steps=0, optimizer=optimizer)
    algo = types.SimpleNamespace(prox_mode="snapshot", prox_snapshots=3)
    src = ProxSources(types.SimpleNamespace(algo=algo), engine, weight_version=0, partitioned=partitioned)
    weights = {0: _weights(module)}
    for v in range(1, 5):
        _perturb(module, v)
        src.after_sync(v)
        weights[v] = _weights(module)
    assert src.snapshots.versions() == [2, 3, 4]
    return src, module, weights


# four micro-batches of two rows: versions 2 and 3 stale and kept, 1 evicted, 4 the live one
VERSIONS = [
    torch.tensor([[2, 2, 4, 4], [3, 3, 3, N]]),
    torch.tensor([[4, 4, 4, 4], [4, 4, N, N]]),
    torch.tensor([[2, 3, 4, 4], [1, 1, 2, 4]]),
    torch.tensor([[3, 3, 3, 3], [2, 4, 4, 4]]),
]


def _micro_batches(n=len(VERSIONS), seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, T), generator=g) for _ in range(n)]


def _actor_forward(src, module, seqs, versions, weight_version, extra_column=False):
    """One micro-batch of the actor's old-log-prob forward: the live forward, π_prox asked with a self-contained
    re-forward, and (like OPOB) optionally one more column after the A π_prox ones."""
    out = src.log_probs(_log_probs(module, seqs), versions, lambda: _log_probs(module, seqs), weight_version)
    return torch.cat([out, torch.full((out.shape[0], 1), 5.0)], dim=1) if extra_column else out


@pytest.mark.parametrize("extra_column", [False, True])
def test_each_stale_version_is_swapped_in_once_for_all_micro_batches(extra_column):
    src, module, weights = _snapshot_sources()
    batches = _micro_batches()
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))

    def loop():  # upstream's execute_batch: one forward per micro-batch
        return [_actor_forward(src, module, s, v, 4, extra_column) for s, v in zip(batches, VERSIONS)]

    results = src.grouped_forwards(loop, weight_version=4)
    for seqs, versions, got in zip(batches, VERSIONS, results):
        expected = _expected(weights[4], seqs)  # the live weights: version 4 and untagged columns
        for v in (2, 3):
            expected[versions == v] = _expected(weights[v], seqs)[versions == v]
        expected[versions == 1] = float("nan")  # evicted: never scored with other weights
        assert torch.allclose(got[:, :A].double(), expected, atol=1e-5, equal_nan=True)
        if extra_column:
            assert torch.equal(got[:, A], torch.full((2,), 5.0))
    # live weights back
    assert all(torch.equal(p, weights[4][n]) for n, p in module.named_parameters())
    m = src.metrics()
    # the bound: 2 distinct stale versions × this rank's stored bytes (fp32: 4 bytes per parameter)
    assert m["prox/swap_bytes"] == 2 * _bytes(module) == 2 * 4 * (VOCAB * HIDDEN + HIDDEN * VOCAB + VOCAB)
    # swapped forwards: version 2 in micro-batches 0, 2, 3 and version 3 in 0, 2, 3; + 4 live ones
    assert m["prox/extra_forwards"] == 6 and len(calls) == 4 + 6
    assert m["prox/missing_version_tokens"] == 2 and m["prox/swap_seconds"] >= 0
    assert src.metrics()["prox/swap_bytes"] == 0  # per step: reset with the other metrics


def test_per_micro_batch_swaps_would_move_three_times_the_bound():
    """The same batch scored one micro-batch at a time (each asks and is answered at once): the values agree and
    the bytes are 6 versions-swaps, three times the grouped bound: the bound is what grouping buys."""
    src, module, _ = _snapshot_sources()
    batches = _micro_batches()
    grouped = src.grouped_forwards(
        lambda: [_actor_forward(src, module, s, v, 4) for s, v in zip(batches, VERSIONS)], 4
    )
    assert src.metrics()["prox/swap_bytes"] == 2 * _bytes(module)
    one_by_one = [_actor_forward(src, module, s, v, 4) for s, v in zip(batches, VERSIONS)]
    assert src.metrics()["prox/swap_bytes"] == 6 * _bytes(module)
    for a, b in zip(grouped, one_by_one):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_a_forward_that_skips_pi_prox_is_refused():
    src, module, _ = _snapshot_sources()
    batches = _micro_batches(2)
    with pytest.raises(RuntimeError, match="asked for pi_prox 1 times"):
        src.grouped_forwards(
            lambda: [_actor_forward(src, module, batches[0], VERSIONS[0], 4), _log_probs(module, batches[1])], 4
        )


def test_zero3_ranks_pad_to_the_busiest_rank_per_version(monkeypatch):
    """Under ZeRO-3 the swapped forwards gather collectively: this rank needs version 2 in one micro-batch and
    version 3 nowhere; another rank needs both in 3 micro-batches. This rank runs 3 forwards per version (its own,
    then repeats of its first micro-batch, dropped), each version swapped in once, and its values stay right."""
    releases = []
    src, module, weights = _snapshot_sources(partitioned=True, releases=releases)
    other_rank = [[1.0, 1.0], [3.0, 3.0]]  # its agreement flags for versions [2, 3], then its forwards per version
    monkeypatch.setattr(
        prox_sources.distributed,
        "all_reduce_max",
        lambda values: [max(a, b) for a, b in zip(values, other_rank.pop(0))],
    )
    versions = [torch.tensor([[2, 4, 4, 4], [4, 4, N, N]]), torch.tensor([[4, 4, 4, 4], [4, 4, 4, 4]])]
    batches = _micro_batches(2)
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))
    results = src.grouped_forwards(
        lambda: [_actor_forward(src, module, s, v, 4) for s, v in zip(batches, versions)], 4
    )
    assert not other_rank  # both collectives ran
    expected = _expected(weights[4], batches[0])
    expected[versions[0] == 2] = _expected(weights[2], batches[0])[versions[0] == 2]
    assert torch.allclose(results[0].double(), expected, atol=1e-5)
    assert torch.allclose(results[1].double(), _expected(weights[4], batches[1]), atol=1e-5)
    assert len(calls) == 2 + 3 + 3  # the live forwards, then 3 per version
    m = src.metrics()
    assert m["prox/swap_bytes"] == 2 * _bytes(module) and m["prox/extra_forwards"] == 6
    assert len(releases) == 2 * 2  # gathered copies released before and after each of the two swaps


def test_zero3_rank_without_micro_batches_cannot_join_and_says_why(monkeypatch):
    src, _, _ = _snapshot_sources(partitioned=True)
    monkeypatch.setattr(prox_sources.distributed, "all_reduce_max", lambda values: [1.0 for _ in values])
    with pytest.raises(RuntimeError, match="no micro-batch to join them"):
        src.grouped_forwards(lambda: [], 4)


def test_batch_ewma_is_swapped_in_once_for_all_micro_batches():
    """--algo.prox_ewma_style batch: θ̂_n = Σ_k (1−β) β^(n−k) θ_k / (1 − βⁿ) over the weights after each optimizer
    step, computed here from the test's own copies; one swap (its fp32 bytes) for the whole batch."""
    beta = 0.5
    module = _policy()
    engine = types.SimpleNamespace(module=module, global_steps=0)
    algo = types.SimpleNamespace(
        prox_mode="ewma", prox_ewma_decay=beta, prox_ewma_ref_batch=None, prox_ewma_style="batch"
    )
    src = ProxSources(types.SimpleNamespace(algo=algo), engine, partitioned=False)
    steps = []
    for n in range(1, 4):
        _perturb(module, 10 + n)
        engine.global_steps = n
        src.after_optimizer_step()
        steps.append(_weights(module))
    average = {
        name: sum((1 - beta) * beta ** (3 - k) * steps[k - 1][name].double() for k in (1, 2, 3)) / (1 - beta**3)
        for name in steps[0]
    }
    batches = _micro_batches(3)
    versions = [torch.tensor([[0, 1, 2, 2], [1, 1, N, N]])] * 3
    results = src.grouped_forwards(
        lambda: [_actor_forward(src, module, s, v, 2) for s, v in zip(batches, versions)], 2
    )
    for seqs, got in zip(batches, results):
        assert torch.allclose(got.double(), _expected(average, seqs), atol=1e-5)
    assert all(torch.equal(p, steps[-1][n]) for n, p in module.named_parameters())  # live weights back
    m = src.metrics()
    assert m["prox/swap_bytes"] == _bytes(module) and m["prox/extra_forwards"] == 3


def test_the_actors_forward_defers_and_groups_through_execute_batch(tiny_world):
    """The real ``PolicyModelActorImpl.forward`` run by its ``execute_batch`` (upstream's loop) on the tiny HF
    model: π_prox of each token equals HF's log-prob under its version's weights, and the stale versions move
    once each for three micro-batches."""
    from openrlhf.models.actor import Actor
    from transformers import AutoModelForCausalLM

    from openrlhf_ess.trainer.ray.ppo_actor import PolicyModelActorImpl

    actor = Actor(tiny_world["model"], attn_implementation="sdpa", param_dtype="fp32")
    hf = actor.model
    algo = types.SimpleNamespace(prox_mode="snapshot", prox_snapshots=3, advantage=types.SimpleNamespace(baseline="x"))
    src = ProxSources(types.SimpleNamespace(algo=algo), types.SimpleNamespace(module=hf), 0, partitioned=False)
    weights = {0: _weights(hf)}
    for v in (1, 2):
        _perturb(hf, 20 + v)
        src.after_sync(v)
        weights[v] = _weights(hf)
    impl = PolicyModelActorImpl.__new__(PolicyModelActorImpl)
    impl.actor = actor
    impl.strategy = types.SimpleNamespace(
        args=types.SimpleNamespace(algo=algo), ring_attn_group=None, is_rank_0=lambda: False
    )
    impl.trainer = types.SimpleNamespace(
        prox=src,
        weight_version=2,
        routing_replay=False,
        stop_ids=None,
        proximal_log_probs=lambda current, versions, forward: src.log_probs(current, versions, forward, 2),
    )
    g = torch.Generator().manual_seed(3)
    vocab = hf.config.vocab_size
    sequences = [torch.randint(4, vocab, (2, 9), generator=g) for _ in range(3)]
    n_actions = 5
    versions = [
        torch.tensor([[0, 0, 1, 2, 2], [1, 1, 1, 1, 2]]),
        torch.tensor([[2, 2, 2, 2, 2], [0, 2, 2, N, N]]),
        torch.tensor([[1, 0, 1, 0, 2], [2, 2, 2, 2, 2]]),
    ]
    data = {
        "sequences": sequences,
        "action_mask": [torch.ones(2, n_actions, dtype=torch.bool)] * 3,
        "attention_mask": [torch.ones(2, 9, dtype=torch.long)] * 3,
        "rollout_versions": versions,
    }
    results = impl.execute_batch("forward", data, 0, 3)
    reference = AutoModelForCausalLM.from_pretrained(tiny_world["model"], dtype=torch.float32).eval()
    for seqs, vers, got in zip(sequences, versions, results):
        expected = torch.empty_like(got)
        for v in (0, 1, 2):
            reference.load_state_dict({**reference.state_dict(), **weights[v]})
            with torch.no_grad():
                lp = reference(seqs).logits.float().log_softmax(-1)[:, :-1]
            per_v = lp.gather(-1, seqs[:, 1:, None])[..., 0][:, -n_actions:]
            selected = (vers == v) | ((vers == N) & (v == 2))
            expected[selected] = per_v[selected]
        assert (got - expected).abs().max().item() < 1e-5
    m = src.metrics()
    assert m["prox/swap_bytes"] == 2 * _bytes(hf)  # versions 0 and 1, once each
    assert m["prox/extra_forwards"] == 3 + 2  # version 0 in micro-batches 0, 1, 2; version 1 in 0 and 2


def test_memory_check_counts_one_swapped_copy():
    """Device bytes of a swap per actor rank, by hand: 7B in bf16 (15.2 GB) with a 152k × 3584 embedding."""
    model, largest = 15_231_233_024, 152_064 * 3_584 * 2
    assert selfcheck.swap_device_bytes("snapshot", model, largest, 1) == model  # ZeRO 0-2: the whole model
    assert selfcheck.swap_device_bytes("interrupt", model, largest, 8) == model // 8  # ZeRO-3 over 8 ranks
    # EWMA: the swapped copy in bf16 + the largest parameter's share in fp32 while it is scaled and cast
    assert selfcheck.swap_device_bytes("ewma", model, largest, 8) == model // 8 + 2 * largest // 8
    assert selfcheck.swap_device_bytes("recompute", model, largest, 1) == 0
