"""--algo.sampling_mask keep, the trainer's side (trainer/sampling_mask.py) and the engine's bookkeeping.

Expected values come from explicit per-row loops over HF logits (sort, keep the top k, log-softmax over the
kept tokens), never from the code under test; the layout checks use hand-made batches.
"""

import math

import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

from openrlhf_ess import config  # noqa: E402
from openrlhf_ess.models import sampling_mask as maths  # noqa: E402
from openrlhf_ess.trainer import carried, sampling_mask  # noqa: E402
from openrlhf_ess.trainer.ray import rollout_tags  # noqa: E402

LOGITS5 = torch.tensor([2.0, 1.0, 0.0, -1.0, -2.0])


def _loop_truncated(scaled_row: torch.Tensor, token: int, kept: int, stop_ids=()) -> float:
    """Independent: log-prob of ``token`` under softmax(scaled_row) cut to its top-|kept| (stop ids removed
    first when kept < 0), one row at a time in plain Python."""
    values = scaled_row.tolist()
    candidates = [i for i in range(len(values)) if not (kept < 0 and i in stop_ids)]
    if kept != 0 and abs(kept) < len(values):
        candidates = sorted(candidates, key=lambda i: -values[i])[: abs(kept)]
    if token not in candidates:
        candidates.append(token)
    lse = math.log(sum(math.exp(values[i]) for i in candidates))
    return values[token] - lse


def test_stop_ban_hand_numbers():
    # kept = -2 with stop id 0 banned: support = top-2 of {1, 2, 3, 4} = {1, 2}; token 1: 1 - log(e + 1) = -0.3133.
    out = maths.masked_log_probs(LOGITS5[None], torch.tensor([1]), torch.tensor([-2]), 1.0, stop_ids=(0,))
    assert out.item() == pytest.approx(1 - math.log(math.e + 1), abs=1e-6)
    # the same count without the ban keeps {0, 1}
    assert maths.masked_log_probs(LOGITS5[None], torch.tensor([1]), torch.tensor([2])).item() == pytest.approx(
        1 - math.log(math.e**2 + math.e), abs=1e-6
    )
    # "no truncation but EOS banned" (top-p 1, first token): kept = -(V - 1) keeps everything but the stop id
    mask = maths.support_mask(LOGITS5[None], torch.tensor([-4]), None, stop_ids=(0,))
    assert mask.tolist() == [[False, True, True, True, True]]


def test_apply_to_log_probs_matches_loop_and_gradient(monkeypatch):
    monkeypatch.setattr(maths, "CHUNK_ROWS", 3)  # several chunks, one partial
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 9, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 9, (2, 6), generator=g)
    kept = torch.randint(-5, 7, (2, 6), generator=g)
    kept[0, :2] = 0
    full = x.log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    out, log_z, sel = maths.apply_to_log_probs(x, labels, full, kept, stop_ids=(1, 4))
    for b in range(2):
        for t in range(6):
            k = int(kept[b, t])
            expected = _loop_truncated(x[b, t], int(labels[b, t]), k, (1, 4)) if k else full[b, t].item()
            assert out[b, t].item() == pytest.approx(expected, abs=1e-6)
    assert sel.sum() == (kept != 0).sum() and log_z.numel() == int(sel.sum()) and (log_z <= 1e-7).all()
    # gradient: the chunked custom backward equals autograd through the plain formula
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    w = torch.randn(2, 6, generator=g, dtype=torch.float64)
    fa = xa.log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    (maths.apply_to_log_probs(xa, labels, fa, kept, (1, 4))[0] * w).sum().backward()
    fb = xb.log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    ref = torch.where(kept != 0, maths.masked_log_probs(xb, labels, kept, 1.0, (1, 4)).double(), fb)
    (ref * w).sum().backward()
    assert (xa.grad - xb.grad).abs().max().item() < 1e-6


def test_label_layout_padded_and_packed():
    seqs = torch.tensor([[0, 5, 6, 7, 8], [0, 0, 9, 10, 11]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    # padded: position j predicts token j + 1 (upstream rolls the sequences by -1)
    assert torch.equal(sampling_mask.to_label_layout(seqs, seqs, attn), torch.roll(seqs, -1, 1))
    # packed (flash-attn unpad order: attention-mask positions, row-major), hand-written
    packed = torch.tensor([[5, 6, 7, 8, 0, 10, 11, 0]])
    assert torch.equal(sampling_mask.to_label_layout(seqs, packed, attn), packed)
    # counts follow the same layout: action column j of A = token S - A + j
    kept = sampling_mask.kept_by_token(torch.tensor([[3, 4], [5, 6]]), 5)
    assert kept.tolist() == [[0, 0, 0, 3, 4], [0, 0, 0, 5, 6]]


def test_installed_actor_forward_is_upstream_outside_and_truncated_inside(tiny_world):
    """A real upstream Actor (tiny model, fp32, T = 0.7): installed but outside ``applied`` it returns exactly
    what an uninstalled one does; inside, the response tokens get the loop's truncated log-prob."""
    from openrlhf.models.actor import Actor
    from transformers import AutoModelForCausalLM

    plain = Actor(tiny_world["model"], attn_implementation="sdpa", param_dtype="fp32", temperature=0.7).eval()
    ours = Actor(tiny_world["model"], attn_implementation="sdpa", param_dtype="fp32", temperature=0.7).eval()
    sampling_mask.install(ours)
    g = torch.Generator().manual_seed(1)
    vocab = plain.model.config.vocab_size
    seqs = torch.randint(4, vocab, (2, 10), generator=g)
    attn = torch.ones_like(seqs)
    attn[1, :2] = 0  # left padding, as upstream batches prompts
    action_mask = torch.ones(2, 4)
    with torch.no_grad():
        a = plain(seqs, action_mask, attn)
        b = ours(seqs, action_mask, attn)
    assert torch.equal(a, b)
    kept = torch.tensor([[-3, 5, 0, 7], [2, 2, 9, 1]])
    with torch.no_grad(), sampling_mask.applied(kept, seqs, attn, stop_ids=(2,)) as state:
        masked = ours(seqs, action_mask, attn)
    hf = AutoModelForCausalLM.from_pretrained(tiny_world["model"], dtype=torch.float32).eval()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = hf(seqs, attention_mask=attn, position_ids=pos).logits.float() / 0.7
    for b_ in range(2):
        for j in range(4):
            t = 10 - 4 + j  # token index
            k = int(kept[b_, j])
            expected = _loop_truncated(logits[b_, t - 1], int(seqs[b_, t]), k, (2,))
            assert masked[b_, j].item() == pytest.approx(expected, abs=1e-5)
    assert state.tokens == 7 and state.log_z_sum < 0  # the seven truncated positions, log Z < 0
    assert (masked - a).abs().max() > 1e-3  # the mask changed something: the check above could fail


def _experience(kept_rows, widths):
    from openrlhf.trainer.ppo_utils.experience import Experience

    b, a = len(kept_rows), max(widths)
    exp = Experience(
        sequences=torch.arange(b * (a + 2)).reshape(b, a + 2),
        attention_mask=torch.ones(b, a + 2, dtype=torch.long),
        action_mask=torch.zeros(b, a, dtype=torch.bool),
        action_log_probs=torch.zeros(b, a),
        advantages=torch.zeros(b, a),
        info={"reward": torch.zeros(b)},
    )
    for i, w in enumerate(widths):
        exp.attention_mask[i, 2 + w :] = 0  # right padding, cut by the replay buffer
        exp.action_mask[i, :w] = True
    exp.rollout_kept_counts = torch.tensor(kept_rows)
    return exp


def test_replay_buffer_carries_kept_counts_through_split_and_collate():
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer

    buffer = carried.adopt_replay_buffer(NaiveReplayBuffer(sample_batch_size=2, limit=3, cpu_offload=False))
    buffer.append(_experience([[5, 6, 7], [8, 9, 0]], [3, 2]))
    buffer.append(_experience([[-4, 1, 2], [3, 3, 3]], [3, 3]))  # the limit drops the first item
    assert [item.rollout_kept_counts.tolist() for item in buffer.items] == [[8, 9], [-4, 1, 2], [3, 3, 3]]
    batch = buffer.collate_fn([buffer.items[0], buffer.items[1]])
    assert batch.rollout_kept_counts.tolist() == [[8, 9, 0], [-4, 1, 2]]  # padded like the action mask
    assert batch.rollout_kept_counts.shape == batch.action_mask.shape


def test_engine_kept_counts_and_alignment():
    class LP:
        def __init__(self, rank):
            self.rank = rank

    tokens = [7, 8, 9]
    logprobs = [{7: LP(5)}, {8: LP(4)}, {9: LP(93)}]
    assert rollout_tags.kept_counts(tokens, logprobs, 3, min_tokens=1) == [-5, 4, 93]  # first token: EOS banned
    assert rollout_tags.kept_counts(tokens, logprobs, 2, min_tokens=0) == [5, 4]
    with pytest.raises(RuntimeError, match="--algo.sampling_mask keep"):
        rollout_tags.kept_counts(tokens, None, 3, 1)
    # multi-turn: the second call's tokens follow 2 environment tokens
    calls = [[-5, 4], [-3]]
    assert rollout_tags.align_to_observation(7, [(2, 4), (6, 7)], calls, fill=0) == [0, 0, -5, 4, 0, 0, -3]


def _parse(tiny_world, tmp_path, *extra):
    from openrlhf_ess.cli import train_ppo_ray as cli
    from tests.helpers.e2e import tiny_args

    return cli.parse_args(tiny_args(tiny_world, str(tmp_path)) + list(extra))


def test_flags(tiny_world, tmp_path):
    args, notices = _parse(tiny_world, tmp_path, "--algo.sampling_mask", "keep", "--rollout.top_p", "0.8")
    assert config.sampling_mask_on(args) and config.needs_rollout_logprobs(args)
    from openrlhf_ess.trainer.ray.vllm_engine import engine_kwargs

    kw = engine_kwargs(args)
    assert kw["report_kept_counts"] and kw["logprobs_mode"] == "processed_logprobs"
    assert not any("sampling_mask" in n for n in notices)
    _, notices = _parse(tiny_world, tmp_path, "--algo.sampling_mask", "keep")
    assert any("only takes out the first response token's EOS ban" in n for n in notices)
    # bypass + truncation: rejected without the mask, accepted with it
    with pytest.raises(config.ConfigError, match="--algo.sampling_mask keep"):
        _parse(tiny_world, tmp_path, "--algo.prox_mode", "bypass", "--rollout.top_k", "5")
    _parse(tiny_world, tmp_path, "--algo.prox_mode", "bypass", "--rollout.top_k", "5", "--algo.sampling_mask", "keep")
    with pytest.raises(config.ConfigError, match="--rollout.top_k must be -1"):
        _parse(tiny_world, tmp_path, "--rollout.top_k", "0")
    # off: nothing of ours is asked of the engines or the controllers
    args, _ = _parse(tiny_world, tmp_path)
    assert "report_kept_counts" not in engine_kwargs(args) and not config.sampling_mask_on(args)
    # top-k alone needs our generator (upstream has no top-k flag and would drop it)
    args, _ = _parse(tiny_world, tmp_path, "--rollout.top_k", "5")
    assert config.needs_our_controllers(args)


def test_stream_scoring_at_sync_uses_the_kept_counts(tiny_world):
    """interrupt / dedicated modes score whole streams at a sync: with kept counts each token's log-prob is the
    loop's truncated one (prompt tokens, count 0, stay full-vocabulary); without, upstream's."""
    from transformers import AutoModelForCausalLM

    from openrlhf_ess.trainer import prox

    model = AutoModelForCausalLM.from_pretrained(tiny_world["model"], dtype=torch.float32).eval()
    streams = [[5, 6, 7, 8, 9], [10, 11, 12]]
    kept = [[0, 0, -3, 4, 6], [0, 2, 7]]
    plain = prox.stream_log_probs(model, streams, temperature=0.7, micro_batch=1)
    masked = prox.stream_log_probs(model, streams, temperature=0.7, micro_batch=1, kept=kept, stop_ids=(2,))
    for s, k, lp_plain, lp in zip(streams, kept, plain, masked):
        with torch.no_grad():
            logits = model(torch.tensor([s])).logits[0].float() / 0.7
        for t in range(1, len(s)):
            expected = _loop_truncated(logits[t - 1], s[t], k[t], (2,))
            assert lp[t - 1].item() == pytest.approx(expected, abs=1e-5)
            if k[t] == 0:
                assert lp[t - 1].item() == pytest.approx(lp_plain[t - 1].item(), abs=1e-6)
    assert (masked[0] - plain[0]).abs().max() > 1e-3


def test_masking_keeps_no_logits_sized_tensor_for_backward():
    """GPU-path memory contract: the masked rows' backward is recomputed from the logits the forward already holds;
    nothing of [rows, V] is saved besides them (a plain masked_fill + logsumexp would save a second copy)."""
    saved = []

    def pack(t):
        saved.append((t.data_ptr(), t.numel()))
        return t

    x = torch.randn(4, 64, 500, requires_grad=True)
    labels = torch.randint(0, 500, (4, 64))
    kept = torch.randint(1, 50, (4, 64))
    full = x.log_softmax(-1).gather(-1, labels[..., None])[..., 0].detach()  # upstream's part, not measured here
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _, _ = maths.apply_to_log_probs(x, labels, full, kept)
    big = [(ptr, n) for ptr, n in saved if n >= 4 * 64 * 500 // 4]
    assert big and all(ptr == x.data_ptr() for ptr, _ in big), big  # only the input logits themselves
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        saved.clear()
        maths.masked_log_probs(x, labels, kept)  # the plain formula: saves masked copies (what the seam avoids)
    assert any(ptr != x.data_ptr() and n >= 4 * 64 * 500 for ptr, n in saved)
