"""``--algo.advantage.baseline opob`` (VCPO's off-policy optimal baseline; maths in ``models/opob.py``).

Two places, one concern:

- actor ranks: each sample's squared gradient norm at the current weights θ, by ``--algo.advantage.opob_norm``:
  ``head`` (:func:`norms_captured`): during the make-experience forward, a forward hook on the LM head computes
  ‖∇_W log π_θ(τ_i)‖² from the head's own inputs and outputs (ghost-norm identity), before upstream's
  ``Actor.forward`` divides the logits by the temperature in place; ``full`` (:func:`full_norms`): ‖∇_θ log
  π_θ(τ_i)‖² over every parameter, from the make-experience forward run with autograd (its log-probs are the
  ones upstream's no-grad forward would return, which then does not run) and one backward that writes no
  parameter gradient (:func:`model_sq_grad_norms`), as many rows per pass as ``--algo.advantage.opob_pass_tokens``
  allows. The norms ride back with the log-probs as one extra last column (:func:`with_norms` /
  :func:`split_norms`), so upstream's result plumbing is untouched and no other call is made. In bypass mode that
  forward runs for the norms alone.
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
from typing import Callable, Iterator, List, Optional, Tuple

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


SCALE_FORMS = ("rms", "rms_one_plus", "layer")


def _scale_form(module: torch.nn.Module) -> Optional[str]:
    """How an elementwise-scale module computes y = w' ⊙ x̂ over its last dimension, or None (not one we take):

    - ``rms``: the Llama/Qwen/Mistral RMSNorm, w ⊙ (x·rsqrt(mean x² + ε)) with x̂ cast to the input dtype first;
    - ``rms_one_plus``: Gemma's, (1 + w) ⊙ x̂ in fp32, cast afterwards (∇_w is the same g ⊙ x̂);
    - ``layer``: torch's LayerNorm (w ⊙ x̂ + b).

    Told by class name and ε; pre-flight checks each class's forward against its form on random inputs
    (:func:`check_scale_forms`), so a family whose RMSNorm differs is refused there."""
    if isinstance(module, torch.nn.LayerNorm) and type(module).forward is torch.nn.LayerNorm.forward:
        return "layer"
    name = type(module).__name__
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not name.endswith("RMSNorm") or not isinstance(eps, float):
        return None
    return "rms_one_plus" if "Gemma" in name else "rms"


def _normalized(module: torch.nn.Module, x: torch.Tensor, form: str) -> torch.Tensor:
    """x̂, what the weight of a scale module (:func:`_scale_form`) multiplies, as the module computes it."""
    if form == "layer":
        return torch.nn.functional.layer_norm(x, module.normalized_shape, eps=module.eps)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    xf = x.to(torch.float32)  # as the module computes it, whatever its dtype (float64 included)
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xhat if form == "rms_one_plus" else xhat.to(x.dtype)


def _embedding_scale(module: torch.nn.Module) -> Optional[str]:
    """How an embedding module computes e_t from E[x_t]: ``plain`` (torch's own forward), ``scaled`` (Gemma's
    ``*ScaledWordEmbedding``: E[x_t] · s, s its ``embed_scale`` buffer in the weight's dtype), or None."""
    if type(module).forward is torch.nn.Embedding.forward:
        return "plain"
    if type(module).__name__.endswith("ScaledWordEmbedding") and hasattr(module, "embed_scale"):
        return "scaled"
    return None


REFUSE_HINT = "Use --algo.advantage.opob_norm head for this model (the LM head's norm, from the forward alone)."


def norm_plan(model: torch.nn.Module) -> List[tuple]:
    """(name, module, kind) for every module that owns trainable parameters (kind: ``linear``, ``embedding``,
    ``scale``), checking that these cover every trainable parameter. A module of another kind (fused MoE experts,
    a router holding a bare weight, an embedding or linear with its own forward), or a parameter shared other than
    as a tied input embedding and LM head, is refused with its name and the flag that avoids it. Reads the module
    tree only: works on a model built on the meta device (pre-flight)."""
    owners: dict = {}
    plan = []
    for name, module in model.named_modules():
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        names = {n for n, _ in params}
        kind = None
        if isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward:
            kind = "linear"
        elif isinstance(module, torch.nn.Embedding) and names == {"weight"} and _embedding_scale(module):
            kind = "embedding"
        elif names <= {"weight", "bias"} and "weight" in names and _scale_form(module) is not None:
            kind = "scale"
        if kind is None:
            raise ValueError(
                "--algo.advantage.opob_norm full covers linear, embedding, RMSNorm and LayerNorm parameters, each "
                f"used once per forward; module {name or '(root)'} ({type(module).__name__}) holds "
                f"{sorted(names)}, which it cannot take per trajectory. {REFUSE_HINT}"
            )
        plan.append((name, module, kind))
        for _, p in params:
            owners.setdefault(id(p), []).append((kind, name))
    for used in owners.values():
        if len(used) > 1 and sorted(k for k, _ in used) != ["embedding", "linear"]:
            raise ValueError(
                f"--algo.advantage.opob_norm full: one parameter is held by modules {', '.join(n for _, n in used)}; "
                f"only a tied input embedding and LM head may share one. {REFUSE_HINT}"
            )
    return plan


def check_scale_forms(model: torch.nn.Module) -> None:
    """Each distinct scale-module class of ``model`` (meta or real) computes its :func:`_scale_form` exactly: a
    float64 copy on the CPU with random weights, on a random input, against w' ⊙ x̂ (+ b). Raises ValueError naming
    the module and the flag otherwise."""
    import copy

    seen = set()
    for name, module, kind in norm_plan(model):
        if kind != "scale" or type(module) in seen:
            continue
        seen.add(type(module))
        form = _scale_form(module)
        probe = copy.deepcopy(module).to_empty(device="cpu").double()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in probe.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            x = torch.randn(2, 3, probe.weight.shape[-1], generator=gen, dtype=torch.float64)
            w = probe.weight + 1 if form == "rms_one_plus" else probe.weight
            want = _normalized(probe, x, form).double() * w
            if getattr(probe, "bias", None) is not None:
                want = want + probe.bias
            got = probe(x)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            raise ValueError(
                f"--algo.advantage.opob_norm full: module {name} ({type(module).__name__}) does not compute the "
                f"normalisation its class name says ({form}: w ⊙ x̂ over the last dimension), so its per-trajectory "
                f"norm cannot be taken. {REFUSE_HINT}"
            )


@contextlib.contextmanager
def _non_reentrant_checkpoints(model: torch.nn.Module, inside: List[int]) -> Iterator[None]:
    """Within the block, layers that checkpoint (transformers' ``_gradient_checkpointing_func``) do so without
    re-entry (``torch.autograd.grad`` cannot run a re-entrant checkpoint), with torch's early stop as a training
    step's non-re-entrant checkpoint has it: the backward's recomputation of a layer stops once it has what the
    backward saved, so the layer's last linear (``down_proj``) is entered but not run again. Each module's input
    is taken from its forward pre-hook, which fires before that stop (:class:`_NormPass`). ``inside[0]`` counts
    the checkpointed calls under way. Put back afterwards."""
    swapped = [
        (m, m._gradient_checkpointing_func) for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")
    ]

    def run(fn, *args, **kwargs):
        inside[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            inside[0] -= 1

    def checkpoint(fn, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(run, fn, *args, use_reentrant=False, **kwargs)

    for m, _ in swapped:
        m._gradient_checkpointing_func = checkpoint
    try:
        yield
    finally:
        for m, func in swapped:
            m._gradient_checkpointing_func = func


@contextlib.contextmanager
def _dropout_off(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every dropout module of ``model`` computes as in evaluation (the pass runs in training
    mode for its gradient checkpointing, and its log-probs stand for upstream's evaluation-mode forward)."""
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training]
    for m in dropouts:
        m.training = False
    try:
        yield
    finally:
        for m in dropouts:
            m.training = True


def _graph_uses(root: torch.Tensor, params: dict) -> tuple:
    """Walk the autograd graph of ``root``: (edges into each parameter's gradient accumulator, keyed by id of the
    parameter; the set of graph nodes reached)."""
    uses: dict = {}
    seen = set()
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None and id(var) in params:
                uses[id(var)] = uses.get(id(var), 0) + 1
            stack.append(nxt)
    return uses, seen


class _NormPass:
    """The state of one pass of :func:`model_sq_grad_norms`: per module, its input x (or ids) and its output's
    gradient g, each kept only until the other arrives. In a checkpointed layer x is not kept from the forward:
    the backward's recomputation of the layer hands it over again (that is what makes checkpointing bound the pass
    as it bounds a training step), through a forward pre-hook, which fires even for the module at which the
    recomputation stops early (its input is what the stop waited for)."""

    def __init__(self, plan):
        self.plan = plan
        self.names = {m: n for n, m, _ in plan}
        self.kinds = {m: k for _, m, k in plan}
        self.forward = True  # False once score() returned: later forward calls are recomputations
        self.inside = [0]  # checkpointed calls under way (set by _non_reentrant_checkpoints)
        self.calls: dict = {}  # module -> calls in the forward
        self.out_nodes: dict = {}  # module -> grad_fn of its output
        self.shapes: dict = {}  # module -> its input's shape in the forward
        self.x: dict = {}
        self.g: dict = {}
        self.embedded: List[tuple] = []  # (module, ids, output)
        self.ids: dict = {}  # id(embedding weight) -> (module, ids)
        self.tied = {id(m.weight) for m, k in self.kinds.items() if k == "linear"} & {
            id(m.weight) for m, k in self.kinds.items() if k == "embedding"
        }
        self.projections: dict = {}  # id(tied weight) -> (B, S, H) P of the head part
        self.total: List[torch.Tensor] = []

    def pre_hook(self, module, inputs):
        """A checkpointed layer recomputed in the backward: its modules' inputs, once more (before the module runs,
        so also for the one at which an early-stopping recomputation stops)."""
        if self.forward or module not in self.calls or module in self.x or not inputs:
            return
        self.x[module] = inputs[0].detach()
        self._ready(module)

    def hook(self, module, inputs, out):
        if not self.forward:  # a recomputation: the pre-hook took its input
            return
        x = inputs[0].detach()
        kind = self.kinds[module]
        self.calls[module] = self.calls.get(module, 0) + 1
        if self.calls[module] > 1:
            raise ValueError(
                f"--algo.advantage.opob_norm full: module {self.names[module]} is called more than once per forward, "
                f"so its parameters' per-trajectory gradient is not the sum of per-call norms. {REFUSE_HINT}"
            )
        self.shapes[module] = tuple(x.shape)
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            return  # its output does not reach the objective: no gradient
        self.out_nodes[module] = out.grad_fn
        if kind == "embedding":
            self.embedded.append((module, x, out))
            self.ids[id(module.weight)] = (module, x)
            return
        if self.inside[0] == 0:  # not recomputed later: keep it now
            self.x[module] = x
        out.register_hook(functools.partial(self._on_grad, module))

    def _on_grad(self, module, g):
        self.g[module] = g.detach()
        self._ready(module)

    def _ready(self, module):
        if module not in self.x or module not in self.g:
            return
        x, g = self.x.pop(module), self.g.pop(module)
        kind = self.kinds[module]
        bias = getattr(module, "bias", None) is not None and module.bias.requires_grad
        if kind == "linear":
            self.total.append(opob.linear_sq_grad_norms(x, g, bias).to(torch.float64))
            if id(module.weight) in self.tied:  # the head part of a tied matrix, read at the lookup's rows
                _, ids = self.ids[id(module.weight)]
                self.projections[id(module.weight)] = opob.tied_head_projection(ids, x, g)
        else:
            xhat = _normalized(module, x, _scale_form(module))
            self.total.append(opob.scale_sq_grad_norms(xhat, g, bias).to(torch.float64))

    def check_forward(self, f: torch.Tensor) -> None:
        """After the forward: every row-wise shape, and every parameter entering the graph once per use by its
        module (a weight used twice, or used outside the module that holds it, is refused, not summed wrongly)."""
        rows = f.shape[0]
        for module, shape in self.shapes.items():
            want = 2 if self.kinds[module] == "embedding" else 3
            if len(shape) < want or shape[0] != rows:
                raise ValueError(
                    f"--algo.advantage.opob_norm full: module {self.names[module]} receives an input of shape "
                    f"{list(shape)}, not one row per trajectory ({rows} rows, then positions): its per-trajectory "
                    f"gradient cannot be read from it. {REFUSE_HINT}"
                )
        params = {}
        for module, kind in self.kinds.items():
            for p in module.parameters(recurse=False):
                if p.requires_grad:
                    params.setdefault(id(p), [p, []])[1].append(module)
        uses, reached = _graph_uses(f, params)
        for pid, (p, modules) in params.items():
            expected = sum(1 for m in modules if self.out_nodes.get(m) in reached)
            if uses.get(pid, 0) != expected:
                where = ", ".join(self.names[m] for m in modules)
                raise ValueError(
                    f"--algo.advantage.opob_norm full: a parameter of {where} enters the forward {uses.get(pid, 0)} "
                    f"time(s) where its module(s) used it {expected} time(s): it is used twice, or outside the "
                    f"module that holds it, and its per-trajectory norm would be summed wrongly. {REFUSE_HINT}"
                )

    def finish(self, grads) -> torch.Tensor:
        if self.g:  # a checkpoint that recomputed less than its layer would leave these out silently
            raise RuntimeError(
                "--algo.advantage.opob_norm full: the backward reached the output of "
                f"{', '.join(sorted(self.names[m] for m in self.g))} but no recomputation gave its input; "
                "this is a bug."
            )
        for (module, ids, _), g in zip(self.embedded, grads):
            if module.padding_idx is not None:  # the padding row gets no gradient from a lookup (nn.Embedding)
                g = g.masked_fill((ids == module.padding_idx)[..., None], 0)
            if _embedding_scale(module) == "scaled":  # e_t = s·E[x_t]: ∂/∂E[x_t] = s·g_t
                g = g * module.embed_scale.to(device=g.device, dtype=module.weight.dtype)
            self.total.append(opob.embedding_sq_grad_norms(ids, g).to(torch.float64))
            projection = self.projections.get(id(module.weight))
            if projection is not None:  # 2⟨lookup part, head part⟩ of the tied matrix
                cross = 2 * (projection * g.to(projection.dtype)).sum((1, 2))
                self.total.append(cross.to(torch.float64))
        return torch.stack(self.total).sum(0)


def model_sq_grad_norms(model: torch.nn.Module, score: Callable[[], torch.Tensor]) -> torch.Tensor:
    r"""‖∇_θ f_i‖² over **every** trainable parameter θ of ``model`` for each row i of ``score()`` (B,) f_i (here
    f_i = log π_θ(τ_i) = Σ_t m_t log π_θ(y_t | s_t)), from one forward with autograd and one backward that takes
    no parameter gradient: forward hooks take each layer's input, hooks on its output take ∂F/∂y for
    F = Σ_i f_i, and the per-row norm of each parameter's gradient comes from those two (models/opob.py: linear
    and embedding ghost norms, RMSNorm/LayerNorm scales reduced over every dimension but the row, a tied
    embedding's cross term). Rows are independent (a row's activations depend on its own tokens only), so ∂F/∂y
    restricted to row i is ∂f_i/∂y. Every trainable parameter must reach the hooks exactly once per use
    (:class:`_NormPass`'s ``check_forward``) or the pass refuses.

    The backward runs to the input embeddings' outputs only (``torch.autograd.grad``), so no ``.grad`` is written
    and no optimizer state is touched: ZeRO 0–3 gather parameters for it through their own module hooks, as for
    any backward. Gradient checkpointing stays on (made non-re-entrant, which ``autograd.grad`` needs, with torch's
    early stop, as a training step's): a checkpointed layer's inputs are not kept from the forward but taken again
    from the backward's recomputation, which runs each linear as often as a training step's does.

    Memory: what a training micro-batch of the same rows holds under the same checkpointing (docs/opob.md has the
    formula), plus, while one layer's backward runs, its modules' inputs and output gradients and two T × T fp32
    matrices or one ≤ 64 MiB block per module.
    """
    state = _NormPass(norm_plan(model))
    handles = [m.register_forward_hook(state.hook) for _, m, _ in state.plan]
    handles += [m.register_forward_pre_hook(state.pre_hook) for _, m, _ in state.plan]
    try:
        with torch.enable_grad(), _non_reentrant_checkpoints(model, state.inside):
            f = score()
            state.forward = False
            if not state.embedded:
                raise ValueError("--algo.advantage.opob_norm full: the model's forward used no trainable embedding")
            state.check_forward(f)
            grads = torch.autograd.grad(f.sum(), [out for _, _, out in state.embedded])
    finally:
        for h in handles:
            h.remove()
    return state.finish(grads)


BLOCK_BYTES = 64 << 20  # linear_sq_grad_norms' default block of gradient rows


def pass_extra_bytes(tokens: int, rows: int, hidden: int) -> int:
    """Device bytes the whole-model norm pass holds beyond a training micro-batch of ``rows`` rows of ``tokens``
    under the same gradient checkpointing (docs/opob.md, memory): one module's norm products, one row at a time
    (two T × T fp32 matrices, or a ≤ 64 MiB fp32 block of its gradient and its 16-bit product), and over the rows
    four B × T × W fp32 tensors (a norm's x̂, g and their product; a tied head's projection, kept to the end).
    ``hidden``: W, the widest normed activation (:func:`norm_width`)."""
    return max(8 * tokens * tokens, 2 * BLOCK_BYTES) + 4 * 4 * rows * tokens * hidden


def norm_width(config) -> int:
    """The widest activation a norm of the model acts on, the W of :func:`pass_extra_bytes`: the hidden size H, or
    heads × head_dim where per-head norms (Qwen3's, Gemma3's q/k norms on (B, T, heads, head_dim)) see a wider one
    (Qwen3-0.6B: 16 × 128 = 2,048 against H = 1,024). 0 for a config without a hidden size."""
    hidden = getattr(config, "hidden_size", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 0
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
    return max(hidden, heads * head_dim)


def pass_tokens(args) -> int:
    """The most tokens (rows × padded length) one norm pass takes: ``--algo.advantage.opob_pass_tokens``, or by
    default (0) ``--train.micro_batch_size`` × ``--data.max_len``, the most a training micro-batch holds."""
    budget = getattr(args.algo.advantage, "opob_pass_tokens", 0)
    return budget if budget > 0 else args.train.micro_batch_size * args.data.max_len


def kept_columns(attention_mask: torch.Tensor, action_mask: torch.Tensor) -> Tuple[int, int]:
    """[lo, hi): the columns of a (B, S) batch that some row uses: the leading columns that are padding in every row
    (left-padded prompts) and the trailing ones (responses ended early) fall outside. Trimming them changes no
    token's log-prob: upstream's ``Actor`` takes positions from the attention mask's running sum, and padding is
    masked out of attention. At least the last prompt column and the first action column are kept."""
    width, n_actions = attention_mask.shape[1], action_mask.shape[1]
    used = attention_mask.bool().any(0)
    used[width - n_actions :] |= action_mask.bool().any(0)
    cols = used.nonzero()
    first_action = width - n_actions
    if cols.numel() == 0:
        return max(first_action - 1, 0), width
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    return min(lo, max(first_action - 1, 0)), max(hi, first_action + 1)


def rows_per_pass(tokens: int, rows: int, max_tokens: int) -> int:
    """How many rows of ``tokens`` columns a pass of at most ``max_tokens`` tokens takes, between 1 and ``rows``."""
    return max(1, min(rows, max_tokens // max(tokens, 1)))


def passes_on_every_rank(model: torch.nn.Module) -> Callable[[int], int]:
    """The number of passes a rank makes, from the number it needs: under ZeRO-3 the most any rank needs (each
    pass gathers every layer's parameters on every rank, so the ranks' passes must match), else its own."""
    from openrlhf_ess import distributed
    from openrlhf_ess.trainer import prox

    if not prox.is_partitioned(model):
        return lambda passes: passes
    return lambda passes: int(distributed.all_reduce_max([passes])[0])


def full_norms(
    actor,
    sequences,
    action_mask,
    attention_mask,
    max_tokens: Optional[int] = None,
    agree: Optional[Callable[[int], int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """θ's action log-probs (B, A) and (B,) ‖∇_θ log π_θ(τ_i)‖² over all of the actor's parameters
    (``--algo.advantage.opob_norm full``), at the actor's current weights, from the pass's own forward: the
    log-probs are what upstream's no-grad forward returns (``Actor.forward``, evaluation-mode dropout), so that
    forward need not run as well.

    Rows per pass: as many as ``max_tokens`` allows (rows × the micro-batch's length once the columns that are
    padding in every row are trimmed; at least one row; default: the whole micro-batch), so each layer's
    parameters are gathered once per pass and the pass holds what a training micro-batch of as many tokens
    holds (docs/opob.md, memory). Each pass's rows are trimmed again; the log-probs of trimmed action columns
    are 0, as upstream's masked ones are.

    ``agree``: the passes every rank makes for this call from the number this rank needs
    (:func:`passes_on_every_rank`); a rank with fewer rows repeats its first row and discards the result, so
    ZeRO-3's parameter gathers stay matched across ranks. ``actor``: upstream's ``Actor`` (its forward gives the
    action log-probs at its temperature), run in training mode as for a training step (its gradient checkpointing
    on) with its dropout modules off."""
    from openrlhf_ess import upstream
    from openrlhf_ess.trainer import prox

    model = prox.causal_lm(actor.model)
    n, width = sequences.shape
    n_actions = action_mask.shape[1]
    lo, hi = kept_columns(attention_mask, action_mask)
    rows = n if max_tokens is None else rows_per_pass(hi - lo, n, max_tokens)
    passes = -(-n // rows)
    passes = max(passes, agree(passes) if agree is not None else passes)
    log_probs, norms = [], []
    was_training = actor.training
    actor.train()
    try:
        with _dropout_off(model):
            for k in range(passes):
                part = slice(k * rows, min((k + 1) * rows, n)) if k * rows < n else slice(0, 1)  # past them: a filler
                lo, hi = kept_columns(attention_mask[part], action_mask[part])
                kept = hi - (width - n_actions)  # action columns left
                seq, att, mask = sequences[part, lo:hi], attention_mask[part, lo:hi], action_mask[part, :kept]
                got: List[torch.Tensor] = []

                def score(seq=seq, att=att, mask=mask, got=got):
                    lp = actor(seq, mask, att)
                    got.append(lp.detach())
                    return (lp * mask.to(lp.dtype)).sum(-1)

                with upstream.actor_past_its_engine(actor):
                    sq = model_sq_grad_norms(model, score)
                if k * rows < n:
                    log_probs.append(torch.nn.functional.pad(got[0], (0, n_actions - kept)))
                    norms.append(sq)
    finally:
        actor.train(was_training)
    return torch.cat(log_probs), torch.cat(norms).float().cpu()


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
