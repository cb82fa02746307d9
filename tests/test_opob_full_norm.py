"""The whole model's per-trajectory gradient norm (``--algo.advantage.opob_norm full``) against autograd: one
backward per trajectory over every parameter, summed in float64 (an independent computation: no hook, no ghost
identity)."""

import pytest
import torch

from openrlhf_ess.models import opob
from openrlhf_ess.trainer import opob as trainer_opob
from tests.helpers.tiny_qwen2 import tiny_qwen2


def _batch(vocab, seed=0, rows=3, length=12, actions=5):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(3, vocab, (rows, length), generator=g)
    att = torch.ones(rows, length, dtype=torch.long)
    att[1, :3] = 0  # left padding, as upstream's batches
    seq[1, :3] = 0
    am = torch.ones(rows, actions, dtype=torch.bool)
    am[2, -2:] = False  # a response that ended early
    return seq, att, am


def _log_prob_sums(model, seq, att, am, temperature):
    """Σ_t m_t log softmax(z_t/τ)[y_t] per row, written here from the logits (not upstream's Actor)."""
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=seq, attention_mask=att, position_ids=pos).logits
    a = am.shape[1]
    z = logits[:, -a - 1 : -1] / temperature
    lp = torch.log_softmax(z, -1).gather(-1, seq[:, -a:, None])[..., 0]
    return (lp * am.to(lp.dtype)).sum(-1)


def _autograd_sq_norms(model, seq, att, am, temperature):
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(seq.shape[0]):
        f = _log_prob_sums(model, seq[i : i + 1], att[i : i + 1], am[i : i + 1], temperature)[0]
        grads = torch.autograd.grad(f, params)
        out.append(sum((g.double() ** 2).sum() for g in grads))
    return torch.stack(out)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_full_norms_equal_per_trajectory_autograd_float64(tie, temperature):
    # padding_idx 0: the pad token's row gets no gradient from a lookup (the padded row and one response use it)
    model = tiny_qwen2(vocab=96, tie_word_embeddings=tie, pad_token_id=0).double()
    seq, att, am = _batch(96)
    seq[0, 8] = 0
    want = _autograd_sq_norms(model, seq, att, am, temperature)
    got = trainer_opob.model_sq_grad_norms(model, lambda: _log_prob_sums(model, seq, att, am, temperature))
    assert not any(p.grad is not None for p in model.parameters())  # no parameter gradient written
    torch.testing.assert_close(got, want, rtol=1e-9, atol=0)
    assert got.std() > 0  # the rows differ: a norm summed over the batch would not pass


@pytest.mark.parametrize("reentrant", [False, True])
def test_full_norms_under_gradient_checkpointing(reentrant):
    model = tiny_qwen2(vocab=96).double()
    seq, att, am = _batch(96, seed=1)
    want = _autograd_sq_norms(model, seq, att, am, 1.0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()  # HF checkpoints in training mode only
    got = trainer_opob.model_sq_grad_norms(model, lambda: _log_prob_sums(model, seq, att, am, 1.0))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=0)


def _upstream_actor(model, temperature=0.7):
    from benchmarks.opob_full_cost import upstream_actor

    return upstream_actor(model, temperature)


def _calls_of(module):
    """The (rows, columns) of each call of ``module``'s forward (a pre-hook; the caller removes it)."""
    shapes = []
    handle = module.register_forward_pre_hook(
        lambda m, args, kwargs: shapes.append(tuple(kwargs.get("input_ids", args[0] if args else None).shape)),
        with_kwargs=True,
    )
    return shapes, handle


def test_full_norms_through_upstreams_actor_whatever_the_rows_per_pass():
    """Through upstream's ``Actor`` in float64: a token budget of one row per pass (12 tokens: three passes, the
    padded row trimmed to its 9 columns), two rows, or the whole micro-batch in one pass gives the same norms
    (and autograd's) and the same log-probs, upstream's evaluation-mode no-grad forward's."""
    model = tiny_qwen2(vocab=96).double()
    actor = _upstream_actor(model)
    seq, att, am = _batch(96, seed=2)
    want = _autograd_sq_norms(model, seq, att, am, 0.7)
    actor.eval()
    with torch.no_grad():
        upstream_log_probs = actor(seq, am, att)
    results = {}
    for budget, passes in ((12, [(1, 12), (1, 9), (1, 12)]), (24, [(2, 12), (1, 12)]), (None, [(3, 12)])):
        shapes, handle = _calls_of(model)
        results[budget] = trainer_opob.full_norms(actor, seq, am, att, max_tokens=budget)
        handle.remove()
        assert shapes == passes  # the HF model's forwards: one per pass, no other
        torch.testing.assert_close(results[budget][1].double(), want, rtol=1e-6, atol=0)  # returned in fp32
        torch.testing.assert_close(results[budget][0], upstream_log_probs, rtol=1e-12, atol=1e-12)
    assert torch.equal(results[12][1], results[None][1]) and torch.equal(results[24][1], results[None][1])
    assert actor.training is False  # its mode put back


def test_the_pass_trims_columns_that_are_padding_in_every_row():
    """Three left-padding columns shared by every row and two response columns every row ended before: the pass
    runs on the 7 columns left (a shorter T), and its norms and log-probs are those of the untrimmed batch (the
    model scored whole by the same pass, float64), the trimmed action columns 0 as upstream's masked ones."""
    model = tiny_qwen2(vocab=96).double()
    actor = _upstream_actor(model)
    seq, att, am = _batch(96, seed=6)  # rows of 12 columns, 5 actions; row 1 left-padded by 3
    att[:, :3] = 0
    seq[:, :3] = 0
    am[:, -2:] = False
    att[:, -2:] = 0
    assert trainer_opob.kept_columns(att, am) == (3, 10)
    got_lp, got = None, None
    shapes, handle = _calls_of(model)
    got_lp, got = trainer_opob.full_norms(actor, seq, am, att)
    handle.remove()
    assert shapes == [(3, 7)]
    whole = []

    def score():  # the untrimmed batch through the same pass
        lp = actor(seq, am, att)
        whole.append(lp.detach())
        return (lp * am.to(lp.dtype)).sum(-1)

    actor.train()
    want = trainer_opob.model_sq_grad_norms(model, score)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_lp, whole[0], rtol=1e-12, atol=1e-12)
    assert got_lp[:, -2:].abs().sum() == 0 and got_lp[:, :3].abs().min() > 0


def _policy_actor(model, norm: str, pass_tokens: int = 0):
    """The real ``PolicyModelActorImpl`` (not a Ray actor) around upstream's ``Actor`` of ``model``, with the flags
    the make-experience forward reads (``--data.max_len`` 12, the rows of :func:`_batch`)."""
    from benchmarks.opob_full_cost import policy_actor

    return policy_actor(model, norm=norm, pass_tokens=pass_tokens, max_len=12, temperature=0.7)


@pytest.mark.parametrize("pass_tokens, passes", [(0, 3), (36, 1)])
def test_the_make_experience_forward_runs_no_forward_beside_the_pass(pass_tokens, passes):
    """The actor's make-experience forward (``PolicyModelActorImpl.forward``) with the whole-model norm, fp32:
    the HF model runs once per pass and nowhere else (one forward fewer per micro-batch than upstream's forward
    followed by the pass), and the log-probs it returns equal upstream's own forward's (evaluation mode, no
    gradient) to 1e-6, in fp32; the head's norm runs upstream's one forward. Budgets: the default, one training
    micro-batch (1 row) of --data.max_len (12), and 36 tokens (the 3 rows)."""
    from openrlhf_ess.trainer.ray.ppo_actor import _UpstreamPolicyModelActor

    model = tiny_qwen2(vocab=96)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seq, att, am = _batch(96, seed=8)
    impl = _policy_actor(model, "full", pass_tokens)
    want = _UpstreamPolicyModelActor.forward(impl, seq, am, att)  # upstream's make-experience forward
    shapes, handle = _calls_of(model)
    got = impl.forward(seq, am, att)
    handle.remove()
    assert len(shapes) == passes
    assert got.shape == (3, am.shape[1] + 1) and got.device.type == "cpu"
    torch.testing.assert_close(got[:, :-1], want, rtol=1e-6, atol=1e-6)
    norms = trainer_opob.full_norms(_upstream_actor(model), seq, am, att)[1]
    torch.testing.assert_close(got[:, -1], norms, rtol=1e-6, atol=0)
    head = _policy_actor(model, "head")
    shapes, handle = _calls_of(model)
    head.forward(seq, am, att)
    handle.remove()
    assert len(shapes) == 1


def test_kept_columns_by_hand():
    att = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0]])
    am = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)  # the last 3 columns are the actions
    assert trainer_opob.kept_columns(att, am) == (1, 6)
    # no response token anywhere: the last prompt column and the first action column stay
    assert trainer_opob.kept_columns(torch.tensor([[1, 1, 0, 0]]), torch.zeros(1, 2, dtype=torch.bool)) == (0, 3)
    assert [trainer_opob.rows_per_pass(100, 8, b) for b in (0, 99, 100, 350, 10_000)] == [1, 1, 1, 3, 8]


def test_dropout_is_off_in_the_pass_and_back_on_after():
    """A model with dropout (p = 0.5 before the LM head): the pass's log-probs are the evaluation-mode ones, the
    same on every call, and the dropout module trains again afterwards."""
    model = tiny_qwen2(vocab=96).double()
    drop = torch.nn.Dropout(0.5)
    model.model.norm = torch.nn.Sequential(model.model.norm, drop)  # its output feeds the LM head
    seq, att, am = _batch(96, seed=7)
    model.train()
    torch.manual_seed(0)
    first = trainer_opob.full_norms(_upstream_actor(model), seq, am, att)
    second = trainer_opob.full_norms(_upstream_actor(model), seq, am, att)
    assert drop.training
    actor = _upstream_actor(model)
    actor.eval()
    with torch.no_grad():
        want = actor(seq, am, att)
    torch.testing.assert_close(first[0], want, rtol=1e-12, atol=1e-12)
    assert torch.equal(first[1], second[1])


def _count_linear_runs(model):
    """Per linear module, how many of its forwards ran to the end (an instance-level wrapper, not a hook: the
    pass's own hooks are not what is counted)."""
    import collections

    counts = collections.Counter()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):

            def run(*args, _forward=module.forward, _name=name, **kwargs):
                out = _forward(*args, **kwargs)
                counts[_name] += 1
                return out

            module.forward = run
    return counts


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_pass_runs_each_linear_as_often_as_a_training_step(reentrant):
    """Gradient checkpointing on: the pass's forward and recomputation run each linear exactly as often as a
    training step's forward and backward under upstream's default (non-re-entrant, early stop): twice inside a
    checkpointed layer, except down_proj, at which the recomputation stops (once), and the LM head once. A
    re-entrant step recomputes down_proj too; the pass never does."""
    model = tiny_qwen2(vocab=96).double()
    seq, att, am = _batch(96, seed=5)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    counts = _count_linear_runs(model)
    _log_prob_sums(model, seq, att, am, 1.0).sum().backward()
    step = dict(counts)
    counts.clear()
    model.zero_grad(set_to_none=True)
    trainer_opob.model_sq_grad_norms(model, lambda: _log_prob_sums(model, seq, att, am, 1.0))
    passed = dict(counts)
    # written from the architecture: 2 layers x (q, k, v, o, gate, up, down) + the LM head
    body = {
        f"model.layers.{i}.{m}": 2
        for i in (0, 1)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        )
    }
    want = {**body, "model.layers.0.mlp.down_proj": 1, "model.layers.1.mlp.down_proj": 1, "lm_head": 1}
    assert passed == want
    if reentrant:
        assert step == {**want, "model.layers.0.mlp.down_proj": 2, "model.layers.1.mlp.down_proj": 2}
    else:
        assert step == passed


# Tiny random models of each family the docs name: 2 layers, head_dim 32, a small vocabulary, built in memory.
FAMILIES = {
    "qwen2": dict(num_key_value_heads=1),  # q/k/v biases
    "qwen2_tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(num_key_value_heads=1),  # per-head q_norm / k_norm on (B, T, heads, head_dim)
    "llama": dict(num_key_value_heads=1, attention_bias=True),
    "mistral": dict(num_key_value_heads=1, sliding_window=8),
    "gemma": dict(num_key_value_heads=1, tie_word_embeddings=True),  # (1 + w) RMSNorm, embedding scaled by √H
}


def _family_config(family: str, vocab: int = 96, **extra):
    from transformers import AutoConfig

    kw = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=32,
        vocab_size=vocab,
        max_position_embeddings=128,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    kw.update(FAMILIES.get(family, {}))
    kw.update(extra)
    return AutoConfig.for_model(family.removesuffix("_tied"), **kw)


def _family_model(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_family_config(family), dtype=torch.float64).eval()
    with torch.no_grad():  # non-trivial norm scales (RMSNorm w starts at 1, Gemma's at 0) and biases
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_norms_of_each_family_equal_per_trajectory_autograd_float64(family, checkpointing):
    """Each family the docs name (tied and untied heads, Qwen3's per-head norms, Gemma's scaled embedding and
    (1 + w) norms), left padding through the padding row, a response ended early, with and without gradient
    checkpointing: the pass's per-trajectory norms equal one float64 autograd backward per trajectory."""
    model = _family_model(family)
    assert model.config.tie_word_embeddings == (family in ("qwen2_tied", "gemma"))
    seq, att, am = _batch(96, seed=4)
    want = _autograd_sq_norms(model, seq, att, am, 0.7)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.train()  # HF checkpoints in training mode only (dropout is 0 in these configs)
    got = trainer_opob.model_sq_grad_norms(model, lambda: _log_prob_sums(model, seq, att, am, 0.7))
    assert not any(p.grad is not None for p in model.parameters())
    torch.testing.assert_close(got, want, rtol=1e-9, atol=0)
    assert got.std() > 0


def test_qwen3_per_head_norm_squares_the_sum_over_tokens_and_heads():
    """q_norm's weight multiplies x̂ of shape (B, T, heads, head_dim): its per-row gradient is Σ_{t,h} g ⊙ x̂ and
    the norm is its square, not Σ_h ‖Σ_t g ⊙ x̂‖² (the two differ whenever heads' sums do not cancel)."""
    g = torch.tensor([[[[1.0, 2.0], [3.0, -1.0]]]], dtype=torch.float64)  # (B=1, T=1, heads=2, d=2)
    xhat = torch.ones_like(g)
    # Σ_{t,h} g ⊙ x̂ = (1 + 3, 2 − 1) = (4, 1) -> 17; Σ_h of squares would be 1 + 4 + 9 + 1 = 15
    assert opob.scale_sq_grad_norms(xhat, g, bias=False).tolist() == [17.0]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_moe_experts_are_refused_from_the_meta_module_tree(family):
    from transformers import AutoModelForCausalLM

    extra = dict(num_experts=4, moe_intermediate_size=32) if family == "qwen3_moe" else dict(num_local_experts=4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_family_config(family, num_experts_per_tok=2, **extra))
    with pytest.raises(ValueError, match=r"module model\.layers\.0\.mlp\.\w+ .*--algo\.advantage\.opob_norm head"):
        trainer_opob.norm_plan(model)


def test_preflight_refuses_fused_moe_experts_before_anything_starts(tiny_world, tmp_path, monkeypatch):
    """--algo.vcpo_enable sets --algo.advantage.opob_norm full: pre-flight builds the actor's module tree on the meta
    device and refuses a Qwen3-MoE actor, naming the module and the flag that avoids it; the dense tiny model
    passes the same check."""
    from openrlhf_ess.checks import preflight
    from openrlhf_ess.config import ConfigError
    from openrlhf_ess.tiny.world_moe import build_moe_world
    from tests.helpers.preflight_inputs import _args

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    moe = build_moe_world(str(tmp_path / "moe"), n_prompts=8, family="qwen3_moe")
    args = _args(tiny_world, tmp_path, ["--algo.vcpo_enable", "--actor.model_name_or_path", moe["model"]])
    assert args.algo.advantage.opob_norm == "full"
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.\w+ \(Qwen3Moe.*--algo\.advantage\.opob_norm head"):
        preflight.check(args)
    notices: list = []
    preflight.model._check_opob_norm(_args(tiny_world, tmp_path, ["--algo.vcpo_enable"]), notices)
    assert notices == []


def test_lora_with_the_full_norm_is_refused_before_anything_starts_naming_the_head_norm(tiny_world, tmp_path):
    """--ds.lora.rank with --algo.vcpo_enable (which sets --algo.advantage.opob_norm full): refused while the flags
    are checked, naming the flag that set the pass and the one that avoids it; with the head's norm it passes."""
    from openrlhf_ess.config import ConfigError
    from tests.helpers.preflight_inputs import _args

    with pytest.raises(
        ConfigError,
        match=r"opob_norm full \(set by --algo\.vcpo_enable\) with --ds\.lora\.rank 4.*"
        r"Pass --algo\.advantage\.opob_norm head",
    ):
        _args(tiny_world, tmp_path, ["--algo.vcpo_enable", "--ds.lora.rank", "4"])
    args = _args(
        tiny_world, tmp_path, ["--algo.vcpo_enable", "--ds.lora.rank", "4", "--algo.advantage.opob_norm", "head"]
    )
    assert args.ds.lora.rank == 4 and args.algo.advantage.opob_norm == "head"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_preflight_takes_every_dense_family_from_its_meta_tree(family, monkeypatch):
    """The meta-device check (module kinds, each norm class's forward against its form) passes every family the
    pass computes exactly above, and refuses a norm whose forward is not the form its name says."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_family_config(family))
    trainer_opob.check_scale_forms(model)
    layer_norm = torch.nn.functional.layer_norm  # mean-centred: not an RMSNorm, whatever its class says
    monkeypatch.setattr(type(model.model.norm), "forward", lambda self, x: layer_norm(x, x.shape[-1:]) * self.weight)
    with pytest.raises(ValueError, match=r"module model\.layers\.0\.[\w.]+ .*--algo\.advantage\.opob_norm head"):
        trainer_opob.check_scale_forms(model)


class _Toy(torch.nn.Module):
    """Embedding -> Linear -> head, with a fault: its linear called twice, or its weight used outside it."""

    def __init__(self, fault: str):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.lin = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10)
        self.fault = fault

    def forward(self, ids):
        h = self.lin(self.embed(ids))
        if self.fault == "twice":
            h = self.lin(h)
        elif self.fault == "outside":
            h = h + h @ self.lin.weight.T  # the weight used by the parent, not through its module
        return torch.log_softmax(self.head(h), -1)[..., 0].sum(-1)


@pytest.mark.parametrize("fault, message", [("twice", "called more than once"), ("outside", "enters the forward 2")])
def test_a_weight_used_twice_or_outside_its_module_is_refused(fault, message):
    model = _Toy(fault).double()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match=message + r".*--algo\.advantage\.opob_norm head"):
        trainer_opob.model_sq_grad_norms(model, lambda: model(ids))
    model.fault = "none"  # the same model used once per weight: no refusal, and autograd's norms
    got = trainer_opob.model_sq_grad_norms(model, lambda: model(ids))
    params = list(model.parameters())
    want = [sum(g.pow(2).sum() for g in torch.autograd.grad(model(ids[i : i + 1])[0], params)) for i in range(2)]
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-12, atol=0)


def test_a_module_fed_flattened_rows_is_refused():
    """A linear fed (B·T, d) (as a MoE router is) has lost the row: its norm cannot be read per trajectory."""

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, ids):
            return self.lin(self.embed(ids).reshape(-1, 4)).reshape(ids.shape).sum(-1)

    model = Flat().double()
    with pytest.raises(ValueError, match=r"module lin receives an input of shape \[6, 4\]"):
        trainer_opob.model_sq_grad_norms(model, lambda: model(torch.tensor([[1, 2, 3], [4, 5, 6]])))


def test_the_pass_peaks_no_higher_than_the_training_step_it_precedes():
    """Peak of live CPU allocations (torch.profiler's memory events) of a random 4-layer Qwen2 (H = 128, V = 256,
    gradient checkpointing on) scoring 2 rows of 256 tokens: the pass is at most the training forward + backward of
    the same rows with each gradient dropped as it accumulates (ZeRO-3's footprint); keeping every layer's input
    from the forward instead (the pass's earlier form) is far above it (the recomputation is what bounds it)."""
    from benchmarks.opob_norm_memory import build, peaks

    p = peaks(build(4, vocab=256), rows=2, length=256)
    print({k: f"{v / 2**20:.1f} MiB" for k, v in p.items()})
    assert p["pass"] <= 1.02 * p["step"]
    assert p["kept"] >= 1.3 * p["step"]


def test_the_memory_self_check_counts_the_pass_and_names_the_flags(tiny_world, tmp_path):
    """The start-up memory check adds what the pass holds beyond a training micro-batch (docs/opob.md) and, short
    of it, refuses with the numbers and the flags that change it."""
    from openrlhf_ess.checks import selfcheck
    from tests.helpers.preflight_inputs import _args

    args = _args(tiny_world, tmp_path, ["--algo.vcpo_enable", "--vllm.sync_check_tol", "0"])
    args.data.max_len, args.train.micro_batch_size = 4096, 1
    needs = selfcheck.memory_needs(args, 15 << 30, 1 << 30, 8, hidden=3584)
    # max(8 · 4096², 2 · 64 MiB) = 128 MiB; 16 · 1 · 4096 · 3584 bytes = 224 MiB: 352 MiB at Qwen2.5-7B's width
    key = "--algo.advantage.opob_norm full (head: no pass) / --algo.advantage.opob_pass_tokens"
    assert needs[key] == 352 << 20
    args.algo.advantage.opob_pass_tokens = 3 * 4096  # three rows of the longest length: 3 · 224 MiB + 128 MiB
    assert selfcheck.memory_needs(args, 15 << 30, 1 << 30, 8, hidden=3584)[key] == 800 << 20
    args.algo.advantage.opob_pass_tokens = 0
    report = {"model_bytes": 15 << 30, "largest_param_bytes": 1 << 30, "world": 8, "hidden": 3584}
    with pytest.raises(selfcheck.SelfCheckError, match=r"300 MiB free .* need 3\d\d MiB more .*opob_norm full"):
        selfcheck.check_memory([dict(report, free=300 << 20)], args)
    assert "MiB free" in selfcheck.check_memory([dict(report, free=8 << 30)], args)


def test_the_memory_formula_takes_the_widest_normed_activation():
    """W is the hidden size, or heads × head_dim where per-head q/k norms see more (the published configs' numbers)."""
    from types import SimpleNamespace as C

    from openrlhf_ess.trainer.opob import norm_width

    qwen25_7b = C(hidden_size=3584, num_attention_heads=28, head_dim=None)  # head_dim derived: 128
    assert norm_width(qwen25_7b) == 3584
    assert norm_width(C(hidden_size=1024, num_attention_heads=16, head_dim=128)) == 2048  # Qwen3-0.6B
    assert norm_width(C(hidden_size=2560, num_attention_heads=32, head_dim=128)) == 4096  # Qwen3-4B
    assert norm_width(C(hidden_size=5120, num_attention_heads=64, head_dim=128)) == 8192  # Qwen3-32B
    assert norm_width(C()) == 0


@pytest.mark.parametrize("shape", [(7, 3, 5), (2, 40, 50)])  # T(d_in + d_out) > d_in d_out: direct; else gram
def test_linear_ghost_norms_equal_the_explicit_gradient(shape):
    t, d_in, d_out = shape
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(4, t, d_in, generator=g).double(), torch.randn(4, t, d_out, generator=g).double()
    want = torch.stack([(dy[b].T @ x[b]).pow(2).sum() + dy[b].sum(0).pow(2).sum() for b in range(4)])
    torch.testing.assert_close(opob.linear_sq_grad_norms(x, dy, bias=True, block_bytes=64), want, rtol=1e-12, atol=0)


def test_embedding_norms_sum_the_rows_of_repeated_tokens():
    ids = torch.tensor([[1, 2, 1, 3]])
    g = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [3.0, 1.0], [0.0, 0.0]]], dtype=torch.float64)
    # token 1: (1, 0) + (3, 1) = (4, 1) -> 17; token 2: (0, 2) -> 4; token 3: 0
    assert opob.embedding_sq_grad_norms(ids, g).tolist() == [21.0]


def test_a_module_it_cannot_take_is_refused_with_the_flag():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(()))

        def forward(self, x):
            return x * self.gain

    model = torch.nn.Sequential(torch.nn.Embedding(4, 2), Scaled())
    with pytest.raises(ValueError, match="--algo.advantage.opob_norm head"):
        trainer_opob.norm_plan(model)


@pytest.mark.engine
@pytest.mark.parametrize("zero_stage", [3])
def test_full_norms_through_a_deepspeed_actor_leave_its_step_unchanged(tiny_world, tmp_path, zero_stage):
    """ZeRO-3 (parameters partitioned, gradient checkpointing on): the norms equal autograd's on the plain model
    loaded from the same folder, and the optimizer step after the norm pass is the step without it (the pass
    writes no gradient and leaves no state in DeepSpeed's hooks)."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from tests.helpers.opob_full_ds import batch

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(*extra):
        out = tmp_path / f"out{len(extra)}.json"
        cmd = [
            sys.executable,
            "-m",
            "tests.helpers.opob_full_ds",
            tiny_world["model"],
            tiny_world["prompts"],
            str(out),
        ]
        done = subprocess.run(
            cmd + ["--zero_stage", str(zero_stage), *extra], cwd=repo, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return json.loads(out.read_text())

    with_norms = run()
    model = AutoModelForCausalLM.from_pretrained(tiny_world["model"], dtype=torch.float64)
    seq, am, att = batch()
    want = _autograd_sq_norms(model, seq, att, am, 1.0)
    torch.testing.assert_close(torch.tensor(with_norms["norms"], dtype=torch.float64), want, rtol=1e-4, atol=0)
    # the pass's log-probs are those of upstream's no-grad forward through the DeepSpeed engine (fp32)
    got_lp, upstream_lp = (torch.tensor(with_norms[k]) for k in ("pass_log_probs", "upstream_log_probs"))
    torch.testing.assert_close(got_lp, upstream_lp, rtol=1e-6, atol=1e-6)
    without = run("--no_norms")
    assert without["loss"] == with_norms["loss"] and without["after"] == with_norms["after"]


@pytest.mark.engine
def test_full_norms_on_two_zero3_ranks_with_micro_batches_of_unequal_size(tiny_world, tmp_path):
    """Two ZeRO-3 ranks (gloo, torchrun): rank 0 holds rows 0-1, rank 1 row 2, as a prompt group split across
    ranks gives. A budget of one row per pass: rank 0 needs two passes, rank 1 one, and the ranks agree on two
    (rank 1's second is a filler, so ZeRO-3's gathers stay matched: no hang); each row's norm equals autograd's on
    the plain model, and each rank's log-probs those of upstream's no-grad forward."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from tests.helpers.opob_full_ds import batch
    from tests.helpers.ports import free_port

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), "-m", "tests.helpers.opob_full_ds"]
    done = subprocess.run(
        cmd + [tiny_world["model"], tiny_world["prompts"], out], cwd=repo, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = [json.loads(open(f"{out}.rank{r}.json").read()) for r in (0, 1)]
    got = [v for r in results for v in r["norms"]]
    for r in results:
        torch.testing.assert_close(torch.tensor(r["pass_log_probs"]), torch.tensor(r["upstream_log_probs"]))
    model = AutoModelForCausalLM.from_pretrained(tiny_world["model"], dtype=torch.float64)
    seq, am, att = batch()
    want = _autograd_sq_norms(model, seq, att, am, 1.0)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-4, atol=0)


def test_the_cost_benchmark_measures_the_pass_and_upstreams_forward_at_a_small_shape(tmp_path):
    """benchmarks/opob_full_cost.py at a small shape: its ``full`` runs the HF model once, as the whole micro-batch
    (one pass, upstream's forward skipped), its ``upstream`` once too, its ``step`` writes every weight's gradient
    and clears it; the table it writes has the three rows, the step at 1.00× of itself."""
    from benchmarks import opob_full_cost as bench

    model = bench.build(hidden=128, layers=2, vocab=512, max_len=24)
    seq, att, am = bench.batch(512, rows=2, prompt=8, actions=16)
    fns = bench.runners(model, seq, att, am)
    for name in ("full", "upstream"):
        shapes, handle = _calls_of(model)
        fns[name]()
        handle.remove()
        assert shapes == [(2, 24)], name
    grads = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: grads.append(p)) for p in model.parameters()]
    fns["step"]()
    for h in hooks:
        h.remove()
    assert len(grads) == len(list(model.parameters())) and all(p.grad is None for p in model.parameters())
    out = tmp_path / "cost.md"
    small = ["--hidden", "128", "--layers", "2", "--vocab", "512", "--rows", "2", "--prompt", "8", "--actions", "16"]
    bench.main(small + ["--reps", "1", "--no-memory", "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "×" in line][1:]  # no header
    assert len(rows) == 3 and rows[2].startswith("| training step") and "| 1.00× |" in rows[2]
