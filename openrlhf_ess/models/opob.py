r"""VCPO's off-policy optimal baseline (OPOB), the maths (docs/opob.md; VCPO, arXiv 2602.17616).

Notation: trajectory i of a baseline set G (the n samples of one prompt), reward R_i, sequence-level importance
weight w_i (1 on-policy), and g_i = ∇_θ log π_θ(τ_i) = Σ_t ∇_θ log π_θ(y_t | s_t). The IS-weighted estimator
ĝ = Σ_i w_i (R_i − b) g_i has trace variance Σ_i w_i² (R_i − b)² ‖g_i‖² − ‖E ĝ‖² (for independent i), which is
minimised by

    b* = Σ_{i∈G} w_i² ‖g_i‖² R_i / Σ_{i∈G} w_i² ‖g_i‖²          A_i = R_i − b*                       (OPOB)

At w ≡ 1 it is the on-policy optimal baseline (Greensmith et al., 2004); with all w_i ‖g_i‖ equal it is the group
mean, so GRPO's / REINFORCE-baseline's mean is the special case of equal norms and weights.

Which parameters ‖g_i‖ covers: the LM head's weight W (V × H, logits z_t = W h_t), exactly, by the ghost-norm
identity of a linear layer (Goodfellow, 2015, "Efficient per-example gradient computations"):

    ∇_W log π(τ_i) = (1/τ) Σ_t m_t a_t h_tᵀ,   a_t = e_{y_t} − p_t,   p_t = softmax(z_t / τ)
    ‖∇_W log π(τ_i)‖²_F = (1/τ²) Σ_{t,s} m_t m_s (a_t · a_s)(h_t · h_s)
    a_t · a_s = [y_t = y_s] − p_t[y_s] − p_s[y_t] + p_t · p_s

from the activations the old-log-prob forward already has, with no backward and no V × H gradient. Data
parallelism and ZeRO 0–3 partition parameters, gradients and optimizer states, never a sample's activations: the
rank that forwards trajectory i holds all of h and z for it, so the norm needs no collective. Tensor-parallel LM
heads (vocabulary-sharded logits) and sequence parallelism (ring attention) would split them; pre-flight refuses
those. The body's parameters are not covered: the measured reason and its cost are in docs/opob.md.

Memory per sequence of A action positions (beyond the forward's own logits, which are read in column blocks and
never copied whole): a few A × A fp32 matrices (64 MiB each at A = 4096) and a few A × C fp32 blocks
(C = ``vocab_chunk``, 64 MiB each at A = 4096). Compute: A²·V multiply-adds for p_t · p_s, besides the A·V·H of
the LM head's own forward; measured in ``benchmarks/opob_cost.py`` (docs/opob.md).
"""

from __future__ import annotations

from typing import Optional

import torch

OPOB_ESTIMATORS = ("reinforce_baseline", "rloo", "group_norm", "dr_grpo")
VOCAB_CHUNK = 4096  # columns of softmax probabilities held at once (A × C fp32: 64 MiB at A = 4096)


def optimal_baseline(
    rewards: torch.Tensor, weights: torch.Tensor, sq_norms: torch.Tensor, group_size: int
) -> torch.Tensor:
    r"""b* per trajectory: Σ_G w² ‖g‖² R / Σ_G w² ‖g‖² over its group (VCPO's OPOB, module docstring).

    Args:
        rewards: (N,) R_i, N = groups × ``group_size``, group g = rows [g·n, (g+1)·n) (upstream's prompt order).
        weights: (N,) sequence-level IS weights w_i (ones on-policy).
        sq_norms: (N,) ‖g_i‖².
        group_size: n, the samples per prompt.
    Returns:
        (N,) float64, each row its group's b*. A group whose Σ w²‖g‖² is 0 (no response token anywhere, or every
        weight 0) gets its plain mean: the estimator is then 0 whatever the baseline.
    """
    r = rewards.to(torch.float64).reshape(-1, group_size)
    c = (weights.to(torch.float64) ** 2 * sq_norms.to(torch.float64)).reshape(-1, group_size)
    total = c.sum(-1, keepdim=True)
    weighted = (c * r).sum(-1, keepdim=True) / total.clamp(min=torch.finfo(torch.float64).tiny)
    b = torch.where(total > 0, weighted, r.mean(-1, keepdim=True))
    return b.expand_as(r).reshape(-1)


def optimal_baseline_log(
    rewards: torch.Tensor, log_weights: torch.Tensor, sq_norms: torch.Tensor, group_size: int
) -> torch.Tensor:
    r""":func:`optimal_baseline` from log w_i: c_i = exp(2 log w_i + log ‖g_i‖² − max_G), so an untruncated
    trajectory ratio exp(Σ_t log π/μ) over thousands of tokens (far past float64's exp range) gives the same b*
    as its exact value would: b* depends on the c_i of a group only through their ratios. log w_i = −∞ is w_i = 0.
    """
    r = rewards.to(torch.float64).reshape(-1, group_size)
    log_c = (2 * log_weights.to(torch.float64) + sq_norms.to(torch.float64).log()).reshape(-1, group_size)
    top = log_c.amax(-1, keepdim=True)
    c = torch.where(torch.isfinite(top), (log_c - top).exp(), torch.zeros_like(log_c))  # a group of all −∞: 0
    total = c.sum(-1, keepdim=True)
    weighted = (c * r).sum(-1, keepdim=True) / total.clamp(min=torch.finfo(torch.float64).tiny)
    b = torch.where(total > 0, weighted, r.mean(-1, keepdim=True))
    return b.expand_as(r).reshape(-1)


NORM_METHODS = ("auto", "gram", "direct")


def lm_head_sq_grad_norms(
    hidden: torch.Tensor,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    vocab_chunk: int = VOCAB_CHUNK,
    method: str = "auto",
) -> torch.Tensor:
    r"""‖∇_W Σ_t m_t log softmax(z_t/τ)[y_t]‖²_F per row, W the LM head's weight (ghost-norm identity, module docs).

    Two exact ways, by cost per sequence of A scored tokens (V vocabulary, H hidden):

    - ``gram``: (1/τ²) Σ_{t,s} m_t m_s (a_t·a_s)(h_t·h_s) from A × A matrices: A²·V multiply-adds for p_t·p_s.
    - ``direct``: the gradient itself, (1/τ) Σ_t m_t a_t h_tᵀ, one block of C vocabulary rows at a time (C × H),
      squared and summed: A·V·H multiply-adds, the cost of the LM head's own forward (its product in
      :func:`product_dtype`).
    - ``auto`` (default): ``gram`` when A ≤ H, else ``direct``, i.e. min(A²·V, A·V·H).

    Args:
        hidden: (B, A, H) h_t, the LM head's inputs at the positions whose logits score the actions.
        logits: (B, A, V) z_t = W h_t (before temperature). Read in (A, C) column blocks, never copied whole.
        tokens: (B, A) y_t, the action tokens those positions score.
        mask: (B, A) m_t, 1 on scored actions.
        temperature: τ of the forward (π = softmax(z/τ)).
        vocab_chunk: C, the columns of probabilities held at once.
        method: one of :data:`NORM_METHODS`.
    Returns:
        (B,) float32 ‖g_i^W‖², computed in fp32 (fp64 when the logits are fp64).
    """
    if method not in NORM_METHODS:
        raise ValueError(f"unknown norm method {method!r}; expected one of {NORM_METHODS}")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    mm = product_dtype(hidden, dtype)
    vocab, n_actions, width = logits.shape[-1], logits.shape[1], hidden.shape[-1]
    direct = method == "direct" or (method == "auto" and n_actions > width)
    out = []
    for b in range(logits.shape[0]):
        z, m = logits[b], mask[b].to(dtype)  # (A, V) view, (A,)
        y = tokens[b].long()

        def block(start: int) -> torch.Tensor:
            return z[:, start : start + vocab_chunk].to(dtype) / temperature

        # logsumexp over V in column blocks: a running max, then the sum of exp below it
        top = torch.stack([block(c).amax(-1) for c in range(0, vocab, vocab_chunk)]).amax(0)
        total = sum(torch.exp(block(c) - top[:, None]).sum(-1) for c in range(0, vocab, vocab_chunk))
        lse = (top + torch.log(total))[:, None]  # (A, 1)
        h = hidden[b].to(dtype)
        if direct:
            hm = (h * m[:, None]).to(mm)  # m_t h_t
            sq = torch.zeros((), dtype=dtype, device=z.device)
            for c in range(0, vocab, vocab_chunk):
                a = -torch.exp(block(c) - lse)  # a_t = e_{y_t} − p_t on this block's columns
                inside = (y >= c) & (y < c + a.shape[1])  # the label's 1, without a host sync (no nonzero)
                a.scatter_add_(1, (y - c).clamp(0, a.shape[1] - 1)[:, None], inside[:, None].to(a.dtype))
                grad = (a.to(mm).T @ hm).to(dtype)  # (C, H): this block's rows of Σ_t m_t a_t h_tᵀ
                sq += torch.dot(grad.reshape(-1), grad.reshape(-1))
            out.append(sq / temperature**2)
            continue
        pp = torch.zeros(z.shape[0], z.shape[0], dtype=dtype, device=z.device)  # p_t · p_s
        for c in range(0, vocab, vocab_chunk):
            p = torch.exp(block(c) - lse)
            pp += p @ p.T
        q = torch.exp(z[:, y].to(dtype) / temperature - lse)  # q[t, s] = p_t[y_s]
        same = (y[:, None] == y[None, :]).to(dtype)
        aa = (same - q - q.T + pp) * (h @ h.T)
        out.append((m @ aa @ m) / temperature**2)
    return torch.stack(out).float() if dtype == torch.float32 else torch.stack(out)


def product_dtype(activations: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the ghost norms' matrix products: on CUDA a bf16/fp16 model's own (tensor cores, fp32
    accumulation, as its training step's products), else ``dtype``; the squares are summed in ``dtype``."""
    low = activations.dtype in (torch.bfloat16, torch.float16) and activations.is_cuda
    return activations.dtype if low else dtype


def linear_sq_grad_norms(x: torch.Tensor, g: torch.Tensor, bias: bool, block_bytes: int = 64 << 20) -> torch.Tensor:
    r"""Per-row ‖∇_W‖²_F (+ ‖∇_b‖²) of a linear layer y_t = W x_t + b from its inputs and output gradients
    (ghost norms, Goodfellow 2015): ∇_W = Σ_t g_t x_tᵀ, ∇_b = Σ_t g_t, per sample, t running over every position of
    the row (tokens, and heads where the layer acts on them). The cheaper exact way per row of T positions:
    ``gram`` Σ_{t,s} (g_t·g_s)(x_t·x_s), T²(d_in + d_out) multiply-adds and two T × T matrices, when
    T(d_in + d_out) ≤ d_in·d_out; else the gradient itself in blocks of output rows (≤ ``block_bytes`` each),
    T·d_in·d_out. The products run in :func:`product_dtype`.

    Args:
        x: (B, ..., d_in) the layer's inputs; g: (B, ..., d_out) ∂L/∂y for L = Σ_i (row i's objective).
    Returns:
        (B,) fp32 (fp64 when either input is fp64).
    """
    dtype = torch.float64 if torch.float64 in (x.dtype, g.dtype) else torch.float32
    mm = product_dtype(x, dtype)
    x, g = x.reshape(x.shape[0], -1, x.shape[-1]), g.reshape(g.shape[0], -1, g.shape[-1])
    t, d_in, d_out = x.shape[1], x.shape[-1], g.shape[-1]
    rows = max(1, block_bytes // (d_in * torch.finfo(dtype).bits // 8))
    out = []
    for b in range(x.shape[0]):
        xb, gb = x[b].to(mm), g[b].to(mm)
        if t * (d_in + d_out) <= d_in * d_out:
            sq = ((gb @ gb.T).to(dtype) * (xb @ xb.T).to(dtype)).sum()
        else:
            sq = torch.zeros((), dtype=dtype, device=xb.device)
            for c in range(0, d_out, rows):
                grad = (gb[:, c : c + rows].T @ xb).to(dtype)  # (rows, d_in): these rows of Σ_t g_t x_tᵀ
                sq += torch.dot(grad.reshape(-1), grad.reshape(-1))
        if bias:
            s = g[b].to(dtype).sum(0)
            sq = sq + s @ s
        out.append(sq)
    return torch.stack(out)


def embedding_sq_grad_norms(ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    r"""Per-row ‖∇_E‖²_F of an embedding lookup e_t = E[x_t]: ∇_E = Σ_t e_{x_t} g_tᵀ has one nonzero row per
    distinct token, the sum of its positions' g_t. O(T·H) per row (no T × T or V × H matrix).

    Args:
        ids: (B, T) token ids; g: (B, T, H) ∂L/∂e_t.
    Returns:
        (B,) fp32 (fp64 with fp64 g).
    """
    dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    out = []
    for b in range(ids.shape[0]):
        uniq, inv = ids[b].unique(return_inverse=True)
        rows = torch.zeros(uniq.shape[0], g.shape[-1], dtype=dtype, device=g.device).index_add_(0, inv, g[b].to(dtype))
        out.append((rows * rows).sum())
    return torch.stack(out)


def tied_head_projection(ids: torch.Tensor, h: torch.Tensor, g_head: torch.Tensor) -> torch.Tensor:
    r"""P_s = Σ_t g^z_t[x_s] h_t per input position s, for a matrix E (V × H) used both as the input embedding
    (e_s = E[x_s]) and as the LM head (z_t = E h_t): the head part of ∇_E = Σ_t g^z_t h_tᵀ, read at the rows the
    lookup touches. With it the cross term of ‖∇_E‖² = ‖lookup part‖² + ‖head part‖² + 2⟨lookup, head⟩ is

        ⟨Σ_s e_{x_s} (c g^e_s)ᵀ, Σ_t g^z_t h_tᵀ⟩ = c Σ_s P_s · g^e_s           (c: the lookup's scale, 1 but Gemma)

    so the V-wide logits' gradient need not be kept until the lookup's gradient arrives.

    Args:
        ids: (B, S) input ids; h: (B, ..., H) the head's inputs; g_head: (B, ..., V) ∂L/∂z.
    Returns:
        (B, S, H), fp64 when an input is fp64, else fp32. T × S memory per row while it runs.
    """
    dtype = torch.float64 if torch.float64 in (h.dtype, g_head.dtype) else torch.float32
    h, g_head = h.reshape(h.shape[0], -1, h.shape[-1]), g_head.reshape(g_head.shape[0], -1, g_head.shape[-1])
    out = []
    for b in range(ids.shape[0]):
        m = g_head[b][:, ids[b].long()].to(dtype)  # (T, S): g^z_t[x_s]
        out.append(m.T @ h[b].to(dtype))
    return torch.stack(out)


def scale_sq_grad_norms(normalized: torch.Tensor, g: torch.Tensor, bias: bool) -> torch.Tensor:
    r"""Per-row ‖∇_w‖² (+ ‖∇_b‖²) of an elementwise affine y = w ⊙ x̂ (+ b) over the last dimension, as RMSNorm and
    LayerNorm end (w or 1 + w): ∇_w = Σ_p g_p ⊙ x̂_p, ∇_b = Σ_p g_p, p running over every position of the row but
    the last dimension (tokens; tokens × heads for Qwen3's per-head q/k norms): the sum is taken before the square.

    Args:
        normalized: (B, ..., H) x̂, the normalised inputs the weight multiplies; g: (B, ..., H) ∂L/∂y.
    Returns:
        (B,) fp32 (fp64 when an input is fp64).
    """
    dtype = torch.float64 if torch.float64 in (normalized.dtype, g.dtype) else torch.float32
    rows, width = g.shape[0], g.shape[-1]
    gw = (g.to(dtype) * normalized.to(dtype)).reshape(rows, -1, width).sum(1)
    sq = (gw * gw).sum(-1)
    if bias:
        gb = g.to(dtype).reshape(rows, -1, width).sum(1)
        sq = sq + (gb * gb).sum(-1)
    return sq


def opob_shift(upstream_baseline: torch.Tensor, opob_baseline: torch.Tensor, scale: Optional[torch.Tensor] = None):
    r"""What to add to upstream's per-sample advantage to replace its baseline by b*: (b_up − b*) · s.

    For RLOO (b_up = the leave-one-out mean), Dr. GRPO (the group mean) s = 1; for GRPO (``group_norm``,
    A = (R − mean)/(std + ε)) s = 1/(std + ε), the same scale upstream divides by. All (N,)."""
    shift = upstream_baseline.to(torch.float64) - opob_baseline.to(torch.float64)
    return shift if scale is None else shift * scale.to(torch.float64)
