"""``--algo.advantage.baseline opob`` (VCPO's off-policy optimal baseline; maths in ``models/opob.py``).

Two places, one concern:

- actor ranks: each sample's squared gradient norm at the current weights θ, by ``--algo.advantage.opob_norm``:
  ``head`` (:func:`norms_captured`): during the make-experience forward, a forward hook on the LM head computes
  ‖∇_W log π_θ(τ_i)‖² from the head's own inputs and outputs (ghost-norm identity), before upstream's
  ``Actor.forward`` divides the logits by the temperature in place; ``full`` (:func:`full_norms`): ‖∇_θ log
  π_θ(τ_i)‖² over every parameter, from one more forward with autograd and one backward that writes no parameter
  gradient (:func:`model_sq_grad_norms`). The norms ride back with the log-probs as one extra last column
  (:func:`with_norms` / :func:`split_norms`), so upstream's result plumbing is untouched and no other call is
  made. In bypass mode that forward runs for the norms alone.
- controller (:func:`replace_baseline`): the group baseline of upstream's estimator is replaced by
  b* = Σ w²‖g‖²R / Σ w²‖g‖² over each prompt's n samples (the set VCPO defines it on), w_i the IS weight the loss
  applies: min(exp(mean_t log π_prox/μ), C) with ``--algo.tis_cap C``, 1 without one (or without μ).
  RLOO, Dr. GRPO, GRPO: upstream's advantages are shifted by (b_up − b*)·s afterwards (s = 1/(std + ε) for GRPO),
  which is exact because they are not whitened. REINFORCE-baseline (whitened over the batch): R − b* goes through
  upstream's own ``reinforce`` path, i.e. the same cumulative returns and whitening without its mean baseline.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from typing import Callable, Iterator, List, Optional

import torch

from openrlhf_ess.models import corrections, opob


@contextlib.contextmanager
def norms_captured(head: torch.nn.Module, sequences, action_mask, temperature: float) -> Iterator[List]:
    """Within the block, the LM head's next forward computes the per-sample squared gradient norms of its weight
    for the actions ``sequences[:, -A:]`` (A = ``action_mask.shape[1]``): appended to the yielded list as a (B,)
    float32 CPU tensor. The logits scoring action t are at position −A−1+t of the head's output (upstream's
    ``Actor.forward`` slicing), whatever ``logits_to_keep`` the forward used."""
    out: List[torch.Tensor] = []
    n_actions = action_mask.shape[1]

    def hook(module, inputs, logits):
        if out:  # one capture per block: later forwards (e.g. a π_prox weight swap) are not θ's
            return
        h = inputs[0][:, -n_actions - 1 : -1]
        z = logits[:, -n_actions - 1 : -1]
        tokens = sequences[:, -n_actions:].to(z.device)
        mask = action_mask.to(device=z.device)
        out.append(opob.lm_head_sq_grad_norms(h, z.detach(), tokens, mask, temperature).cpu())

    handle = head.register_forward_hook(hook)
    try:
        yield out
    finally:
        handle.remove()


def _rms_eps(module: torch.nn.Module) -> Optional[float]:
    """ε of an RMSNorm of the Llama/Qwen/Mistral form, w ⊙ (x·rsqrt(mean x² + ε)) cast to the input dtype (Gemma's
    (1 + w) form is not); None for any other module."""
    name = type(module).__name__
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps if name.endswith("RMSNorm") and "Gemma" not in name and isinstance(eps, float) else None


def _normalized(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x̂, what the weight of a LayerNorm or an RMSNorm (:func:`_rms_eps`) multiplies."""
    if isinstance(module, torch.nn.LayerNorm):
        return torch.nn.functional.layer_norm(x, module.normalized_shape, eps=module.eps)
    xf = x.to(torch.float32)  # as the module computes it, whatever its dtype (float64 included)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _rms_eps(module))).to(x.dtype)


def norm_plan(model: torch.nn.Module) -> List[tuple]:
    """(module, kind) for every module that owns trainable parameters (kind: linear, embedding, scale), and checks
    that these cover every trainable parameter: one used by another kind of module, or shared other than as the
    input embedding and the LM head (tied), is refused with the flag that avoids it."""
    owners: dict = {}
    plan = []
    for module in model.modules():
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        names = {n for n, _ in params}
        if isinstance(module, torch.nn.Linear):
            kind = "linear"
        elif isinstance(module, torch.nn.Embedding):
            kind = "embedding"
        elif names <= {"weight", "bias"} and (isinstance(module, torch.nn.LayerNorm) or _rms_eps(module) is not None):
            kind = "scale"
        else:
            raise ValueError(
                "--algo.advantage.opob_norm full covers linear, embedding, RMSNorm and LayerNorm parameters; "
                f"{type(module).__name__} holds {sorted(names)}, which it cannot take per trajectory. Use "
                "--algo.advantage.opob_norm head for this model."
            )
        plan.append((module, kind))
        for _, p in params:
            owners.setdefault(id(p), []).append(kind)
    for kinds in owners.values():
        if len(kinds) > 1 and sorted(kinds) != ["embedding", "linear"]:
            raise ValueError(
                "--algo.advantage.opob_norm full: a parameter shared by several modules other than a tied input "
                "embedding and LM head. Use --algo.advantage.opob_norm head for this model."
            )
    return plan


@contextlib.contextmanager
def _non_reentrant_checkpoints(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, layers that checkpoint (transformers' ``_gradient_checkpointing_func``) do so without
    re-entry: a re-entrant checkpoint cannot run under ``torch.autograd.grad``. The same recomputation, the same
    memory; put back afterwards."""
    swapped = [
        (m, m._gradient_checkpointing_func) for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")
    ]
    for m, _ in swapped:
        m._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    try:
        yield
    finally:
        for m, func in swapped:
            m._gradient_checkpointing_func = func


def model_sq_grad_norms(model: torch.nn.Module, score: Callable[[], torch.Tensor]) -> torch.Tensor:
    r"""‖∇_θ f_i‖² over **every** trainable parameter θ of ``model`` for each row i of ``score()`` (B,) f_i (here
    f_i = log π_θ(τ_i) = Σ_t m_t log π_θ(y_t | s_t)), from one forward with autograd and one backward that takes
    no parameter gradient: forward hooks keep each layer's input, hooks on its output take ∂F/∂y for
    F = Σ_i f_i, and the per-row norm of each parameter's gradient comes from those two (models/opob.py: linear
    and embedding ghost norms, RMSNorm/LayerNorm scales, a tied embedding's cross term). Rows are independent
    (a row's activations depend on its own tokens only), so ∂F/∂y restricted to row i is ∂f_i/∂y.

    The backward runs to the input embeddings' outputs only (``torch.autograd.grad``), so no ``.grad`` is written
    and no optimizer state is touched: ZeRO 0–3 gather parameters for it through their own module hooks, as for
    any backward. Gradient checkpointing stays on (made non-re-entrant for the pass, which ``autograd.grad``
    needs): a layer's output that the backward does not reach (a recomputation's) gets no gradient.

    Memory: the forward's activations with autograd, as one
    training micro-batch of the same rows, plus per layer two T × T fp32 matrices or one ≤ 64 MiB block.
    """
    plan = norm_plan(model)
    tied = {id(m.weight) for m, k in plan if k == "linear"} & {id(m.weight) for m, k in plan if k == "embedding"}
    total: List[torch.Tensor] = []
    embedded: List[tuple] = []  # (module, ids, output)
    head_parts: dict = {}  # id(tied weight) -> (head input, ∂F/∂z)

    def add(sq):
        total.append(sq.to(torch.float64))

    def on_output(out, fn):
        if isinstance(out, torch.Tensor) and out.requires_grad:  # a reentrant checkpoint's first pass: no graph
            out.register_hook(lambda g: add(fn(g)))

    def hook(module, inputs, out, kind):
        x = inputs[0].detach()
        if kind == "embedding":
            if out.requires_grad:
                embedded.append((module, x, out))
        elif kind == "linear":
            bias = module.bias is not None and module.bias.requires_grad
            if id(module.weight) in tied:

                def fn(g, x=x, w=id(module.weight)):
                    head_parts[w] = (x, g)
                    return opob.linear_sq_grad_norms(x, g, bias)

                on_output(out, fn)
            else:
                on_output(out, lambda g: opob.linear_sq_grad_norms(x, g, bias))
        else:
            xhat = _normalized(module, x)
            bias = getattr(module, "bias", None) is not None and module.bias.requires_grad
            on_output(out, lambda g: opob.scale_sq_grad_norms(xhat, g, bias))

    handles = [m.register_forward_hook(functools.partial(hook, kind=k)) for m, k in plan]
    try:
        with torch.enable_grad(), _non_reentrant_checkpoints(model):
            f = score()
            if not embedded:
                raise ValueError("--algo.advantage.opob_norm full: the model's forward used no trainable embedding")
            grads = torch.autograd.grad(f.sum(), [out for _, _, out in embedded])
    finally:
        for h in handles:
            h.remove()
    for (module, ids, _), g in zip(embedded, grads):
        if module.padding_idx is not None:  # the padding row gets no gradient from a lookup (nn.Embedding)
            g = g.masked_fill((ids == module.padding_idx)[..., None], 0)
        add(opob.embedding_sq_grad_norms(ids, g))
        if id(module.weight) in head_parts:
            h, gz = head_parts[id(module.weight)]
            add(opob.tied_cross_sq_grad_norms(ids, g, h, gz))
    return torch.stack(total).sum(0)


def full_norms(actor, sequences, action_mask, attention_mask, rows: Optional[int] = None) -> torch.Tensor:
    """(B,) ‖∇_θ log π_θ(τ_i)‖² over all of the actor's parameters (``--algo.advantage.opob_norm full``), at the
    actor's current weights, ``rows`` trajectories per pass (default: the whole micro-batch in one pass, so every
    rank makes one pass per forward call and ZeRO-3's parameter gathers stay matched across ranks). ``actor``:
    upstream's ``Actor`` (its forward gives the action log-probs at its temperature), in
    training mode as for a training step: its gradient checkpointing bounds the pass's memory."""
    from openrlhf_ess import upstream
    from openrlhf_ess.trainer import prox

    model = prox.causal_lm(actor.model)
    was_training = actor.training
    actor.train()
    out = []
    rows = rows or sequences.shape[0]
    for start in range(0, sequences.shape[0], rows):
        part = slice(start, start + rows)
        mask = action_mask[part]

        def score(part=part, mask=mask):
            log_probs = actor(sequences[part], mask, attention_mask[part])
            return (log_probs * mask.to(log_probs.dtype)).sum(-1)

        with upstream.actor_past_its_engine(actor):
            out.append(model_sq_grad_norms(model, score))
    actor.train(was_training)
    return torch.cat(out).float().cpu()


def with_norms(log_probs: torch.Tensor, sq_norms: torch.Tensor) -> torch.Tensor:
    """(B, A) log-probs and (B,) norms -> (B, A + 1): what the actor's forward returns with OPOB on."""
    return torch.cat([log_probs, sq_norms.to(log_probs.dtype)[:, None]], dim=1)


def first_copies(per_actor: list, duplicate_factor: int) -> List[torch.Tensor]:
    """The actor group's per-micro-batch results flattened in upstream's order, ring / TP copies once."""
    return list(itertools.chain.from_iterable(per_actor[::duplicate_factor]))


def split_norms(per_actor: list, duplicate_factor: int):
    """The actor group's forward results (one list of (B, A + 1) tensors per actor) -> the same structure with the
    last column removed, and the norms of each micro-batch in upstream's flattened order (ring / TP copies once)."""
    stripped = [[t[:, :-1] for t in results] for results in per_actor]
    norms = [t[:, -1].float() for t in first_copies(per_actor, duplicate_factor)]
    return stripped, norms


def sequence_log_weights(exp, algo, theta_log_probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B,) float64 log of each sample's weight in b* (``--algo.advantage.opob_weight``), π_prox below being
    ``theta_log_probs`` where given (``--algo.prox_mode bypass``: the loss's ratio π_θ/μ weighs the gradient there,
    θ the current weights, so b* is the one the same batch gets in recompute mode):

    - ``tis``: w_i = the weight the loss applies, a sequence summary of it at the token level: min(w_i, C) with
      ``--algo.tis_cap C``, w_i = exp(Σ_t log π_prox/μ) at ``--algo.tis_level seq_product``, else the
      ``--algo.ess_lr_weight`` form (geometric mean by default); 0 (w = 1) without a TIS cap (the loss weights no
      sample: b* is then the optimal baseline of the estimator actually used) or without μ.
    - ``seq_product``: as VCPO's reference code (``use_is_weights=True, use_clipped_is_ratios=False``): the
      untruncated trajectory ratio exp(Σ_t log π_prox/μ) times the sequence weight d_i the loss applies
      (``--algo.tis_level seq``/``seq_product``; 1 otherwise). The reference's ‖g_i‖ is the norm of trajectory i's
      gradient of the IS-weighted loss, d_i·‖∇ log π(τ_i)‖, and its b* weighs that by the ratio² again; ours is the
      unweighted norm, so d_i enters here.
    - ``seq_product_truncated``: the same with the ratio truncated at C (``use_clipped_is_ratios=True``).

    In log space: a product over thousands of tokens overflows float64's exp, while b* only needs the weights'
    ratios within a group (:func:`opob.optimal_baseline_log`). A sample without a response token gets −inf (w = 0).
    """
    kind = algo.advantage.opob_weight
    if exp.rollout_log_probs is None or (kind == "tis" and algo.tis_cap is None):
        return torch.zeros(exp.action_mask.shape[0], dtype=torch.float64)
    prox = exp.action_log_probs if theta_log_probs is None else theta_log_probs.to(exp.action_log_probs)
    args = (prox, exp.rollout_log_probs, exp.action_mask)
    sequence_loss_weight = algo.tis_level in corrections.SEQUENCE_TIS_LEVELS and algo.tis_cap is not None
    if kind == "tis":
        form = "seq_product" if algo.tis_level == "seq_product" else algo.ess_lr_weight
        log_w, valid = corrections.sequence_log_weights(*args, form)
        log_w = log_w.clamp(max=math.log(algo.tis_cap))
    else:
        log_w, valid = corrections.sequence_log_weights(*args, "seq_product")
        if kind == "seq_product_truncated":
            log_w = log_w.clamp(max=math.log(algo.tis_cap))
        if sequence_loss_weight:  # d_i, the loss's own weight of the sequence
            form = "seq_product" if algo.tis_level == "seq_product" else "geo_mean"
            log_d, _ = corrections.sequence_log_weights(*args, form)
            log_w = log_w + log_d.clamp(max=math.log(algo.tis_cap))
    return torch.where(valid, log_w, torch.full_like(log_w, -math.inf))


def _in_prompt_order(experiences, per_exp: List[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-experience (B,) values and put them in upstream's prompt order (``experience.index``)."""
    indices = torch.tensor(list(itertools.chain.from_iterable(exp.index for exp in experiences)))
    flat = torch.cat([v.to(torch.float64) for v in per_exp])
    out = torch.empty_like(flat)
    out[indices] = flat
    return out


def _back_to_experiences(experiences, values: torch.Tensor) -> List[torch.Tensor]:
    indices = torch.tensor(list(itertools.chain.from_iterable(exp.index for exp in experiences)))
    return list(values[indices].split([len(exp.index) for exp in experiences]))


def replace_baseline(
    maker, experiences, upstream_compute, sq_norms: Optional[List[torch.Tensor]], theta: Optional[list] = None
):
    """Upstream's ``compute_advantages_and_returns`` with its group baseline replaced by b* (module docstring).
    ``theta``: per experience, θ's log-probs for the weights (bypass mode). Returns the experiences and the
    batch's metrics."""
    args = maker.strategy.args
    algo, n = args.algo, args.rollout.n_samples_per_prompt
    if sq_norms is None or len(sq_norms) != len(experiences):
        raise RuntimeError(
            "--algo.advantage.baseline opob: the actor's forward returned no gradient norms for this batch "
            f"({0 if sq_norms is None else len(sq_norms)} of {len(experiences)} micro-batches); this is a bug."
        )
    theta = theta if theta is not None else [None] * len(experiences)
    log_weights = _in_prompt_order(experiences, [sequence_log_weights(e, algo, t) for e, t in zip(experiences, theta)])
    weights = log_weights.exp()  # for the metrics only: b* is computed from the logs
    norms = _in_prompt_order(experiences, sq_norms)
    estimator = algo.advantage.estimator
    if estimator == "reinforce_baseline":
        rewards = _in_prompt_order(experiences, [exp.rewards for exp in experiences])
        b = opob.optimal_baseline_log(rewards, log_weights, norms, n)
        # upstream's length-penalty step copies exp.rewards into info["reward"] (the logged reward): both are put
        # back afterwards, so the shift reaches the advantages only
        raw = [(exp.rewards, exp.info.get("reward")) for exp in experiences]
        for exp, shifted in zip(experiences, _back_to_experiences(experiences, rewards - b)):
            exp.rewards = shifted.to(exp.rewards.dtype)
        saved = (algo.advantage.estimator, maker.advantage_estimator)
        algo.advantage.estimator = maker.advantage_estimator = "reinforce"
        try:
            experiences = upstream_compute(experiences)
        finally:
            algo.advantage.estimator, maker.advantage_estimator = saved
        for exp, (r, logged) in zip(experiences, raw):
            exp.rewards = r
            if logged is not None:
                exp.info["reward"] = logged
        b_up = rewards.reshape(-1, n).mean(-1, keepdim=True).expand(-1, n).reshape(-1)
    else:
        experiences = upstream_compute(experiences)  # length penalties applied to exp.rewards in place
        rewards = _in_prompt_order(experiences, [exp.rewards for exp in experiences]).reshape(-1, n)
        if estimator == "rloo":
            b_up = (rewards.sum(-1, keepdim=True) - rewards) / (n - 1)
        else:  # dr_grpo, group_norm: the group mean
            b_up = rewards.mean(-1, keepdim=True).expand(-1, n)
        scale = 1.0 / (rewards.std(-1, keepdim=True) + 1e-9) if estimator == "group_norm" else None
        b_up, rewards = b_up.reshape(-1), rewards.reshape(-1)
        b = opob.optimal_baseline_log(rewards, log_weights, norms, n)
        shift = opob.opob_shift(b_up, b, None if scale is None else scale.expand(-1, n).reshape(-1))
        for exp, s in zip(experiences, _back_to_experiences(experiences, shift)):
            delta = s.to(exp.advantages.dtype)[:, None] * exp.action_mask.to(exp.advantages.dtype)
            exp.advantages = exp.advantages + delta
            exp.returns = exp.returns + delta
    spread = norms.sqrt().reshape(-1, n)
    metrics = {
        "opob/baseline": b.mean().item(),
        "opob/baseline_minus_mean": (b - rewards.reshape(-1, n).mean(-1, keepdim=True).expand(-1, n).reshape(-1))
        .abs()
        .mean()
        .item(),
        "opob/upstream_baseline": b_up.mean().item(),
        "opob/grad_norm_mean": spread.mean().item(),
        # the norms' spread within a prompt's group: 0 when OPOB equals the mean baseline (equal w and norms)
        "opob/grad_norm_rel_spread": (spread.std(-1) / spread.mean(-1).clamp(min=1e-12)).mean().item(),
        "opob/weight_mean": weights.mean().item(),
    }
    return experiences, metrics
