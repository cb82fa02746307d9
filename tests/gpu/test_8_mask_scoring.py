"""Check 8: the sampling mask's log-probs and backward (``apply_to_log_probs``, ``masked_log_probs``) and chunked
scoring (``prox.stream_log_probs``) at V = 151,936: float64 references, and peak device memory against stated
bounds (CUDA; on the CPU the memory entries SKIP, the CPU suite measures host allocations with the profiler)."""

import types

import pytest
import torch

from openrlhf_ess.models import sampling_mask
from openrlhf_ess.trainer import prox
from tests.gpu.conftest import expect

VOCAB = 151_936  # Qwen2's
STOP_IDS = (2, 151_643)
TEMPERATURE = 0.7
# kept counts k_t covering the mask's paths: 0 = full row, small / large k, banned stops (k < 0), k >= V, k = -(V-1)
KEPT_CYCLE = [0, 1, 5, 50, -3, -40, 300, 7000, -(VOCAB - 1), VOCAB + 5, 40000, 2, -1]
LP_TOL = dict(atol=1e-5, rtol=1e-6)  # fp32 against fp64 over V = 151,936: ~2e-6 measured on CPU
GRAD_TOL = dict(atol=1e-6, rtol=1e-5)


def _reference_support(z, labels, kept, stops=STOP_IDS):
    """[n, V] bool: the support S_t of each row of the fp32 scaled logits ``z`` as docs/sampling_mask.md states it,
    written out independently: stops dropped where k_t < 0, then every entry >= the |k_t|-th largest (ties kept;
    k_t = 0 or |k_t| >= V: the whole row), then the sampled token added."""
    import torch

    vocab = z.shape[-1]
    work = z.detach().clone()
    stop = torch.tensor(stops, device=z.device)
    banned = kept < 0
    work[:, stop] = torch.where(banned.to(z.device)[:, None], float("-inf"), work[:, stop])
    kth = torch.full((z.shape[0], 1), float("-inf"), device=z.device, dtype=z.dtype)
    count = kept.abs().to(z.device)
    for k in count.unique().tolist():
        if 0 < k < vocab:
            rows = (count == k).nonzero().squeeze(-1)
            kth[rows, 0] = torch.kthvalue(work[rows], vocab - k + 1, dim=-1).values  # the k-th largest
    support = (work >= kth) & (work > float("-inf"))
    support[torch.arange(len(labels), device=z.device), labels.to(z.device)] = True
    return support


def _reference_log_probs(z, labels, kept, weights):
    """log π̃(y) in float64 from the fp32 scaled logits ``z`` and its support, log Z_t, and the gradient of
    Σ weights · log π̃ with respect to ``z`` (float64 autograd)."""
    support = _reference_support(z, labels, kept)
    x = z.detach().double().requires_grad_()
    masked = x.masked_fill(~support, float("-inf")).logsumexp(-1)
    lp = x.gather(-1, labels[:, None].to(z.device))[:, 0] - masked
    (lp * weights.double()).sum().backward()
    log_z = (masked - x.detach().logsumexp(-1)).detach()
    return lp.detach(), log_z, x.grad


def _mask_case(n: int, device):
    """n rows of fp32 logits at V = 151,936 (N(0, 2²): not peaked, so the supports are wide; on rows with banned
    stops, the stops on top), labels (some outside the support: forced in; some a banned stop), the kept counts of
    KEPT_CYCLE, loss weights."""
    import torch

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, VOCAB, generator=g) * 2
    kept = torch.tensor([KEPT_CYCLE[i % len(KEPT_CYCLE)] for i in range(n)])
    labels = torch.randint(3, VOCAB - 400, (n,), generator=g)
    labels[::7] = logits[::7].argmin(-1)  # the row's lowest logit: outside any cut support, the mask adds it
    banned = (kept < 0).nonzero().squeeze(-1)
    # where the engine banned the stops they were often the likeliest tokens (min_tokens): make them the row's top,
    # so that a support which kept them would differ
    logits[banned[:, None], torch.tensor(STOP_IDS)] = logits[banned].amax(-1, keepdim=True) + 1
    labels[banned[::2]] = STOP_IDS[0]  # a stop token sampled where stops were banned: kept in its own support
    weights = torch.rand(n, generator=g) + 0.5
    return logits.to(device), labels.to(device), kept.to(device), weights.to(device)


def _max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _close(a, b, tol) -> bool:
    import torch

    return bool(torch.allclose(a.double(), b.double(), **tol))


def _tiny_qwen2(device):
    """tests/helpers/tiny_qwen2.py's model (tests/test_prox_scoring_memory.py's): Qwen2's full vocabulary, peaked
    next-token distributions, on ``device``."""
    from tests.helpers.tiny_qwen2 import tiny_qwen2

    return tiny_qwen2(VOCAB).to(device)


def _scoring_case(cuda: bool):
    """Token streams (right-padded per group by the scorer) and kept counts (0 on the first 3 prompt tokens)."""
    import torch

    g = torch.Generator().manual_seed(1)
    n, low, high = (16, 64, 160) if cuda else (5, 8, 30)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    streams = [torch.randint(3, VOCAB, (m,), generator=g).tolist() for m in lengths]
    cycle = len(KEPT_CYCLE)
    kept = [[0] * 3 + [KEPT_CYCLE[(i + t) % cycle] for t in range(len(s) - 3)] for i, s in enumerate(streams)]
    return streams, kept


def _scoring_reference(model, streams, kept, memory_mb):
    """fp64 log-probs of every stream: the same groups and right-padding as ``prox.stream_log_probs`` (so the same
    body forwards), the model's own full logits, / T in fp32, then the support and log-softmax in float64."""
    import torch

    from openrlhf_ess.trainer import prox

    device = next(model.parameters()).device
    groups = prox.stream_groups([len(s) for s in streams], model.config.hidden_size, memory_mb, prox.MICRO_BATCH)
    out = [None] * len(streams)
    for group in groups:
        width = max(len(streams[i]) for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(group):
            ids[row, : len(streams[i])], mask[row, : len(streams[i])] = torch.tensor(streams[i]), 1
        positions = torch.arange(width).expand(len(group), width)
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device))
            logits = logits.logits
        for row, i in enumerate(group):
            z = logits[row, : len(streams[i]) - 1].float() / TEMPERATURE
            y = torch.tensor(streams[i][1:], device=device)
            k = torch.tensor(kept[i][1:] if kept else [0] * len(y), device=device)
            lp, _, _ = _reference_log_probs(z, y, k, torch.ones(len(y), device=device))
            out[i] = lp.cpu()
        del logits
    return out


def _setup(args):
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here (the default; stated)
        torch.backends.cudnn.allow_tf32 = False
    n_rows = 1024 if cuda else 64
    rows_note = (
        f"{n_rows} rows of fp32 logits at V = {VOCAB:,} (sampling_mask.CHUNK_ROWS = "
        f"{getattr(sampling_mask, 'CHUNK_ROWS', '?')}), kept counts cycling {KEPT_CYCLE}, stop ids {STOP_IDS}, "
        f"T = {TEMPERATURE}"
    )
    return types.SimpleNamespace(
        cuda=cuda, device=device, n_rows=n_rows, rows_note=rows_note, budget_mb=64 if cuda else 4
    )


NO_PEAK = "CPU: torch has no peak-allocation counter for host memory (torch.cuda.max_memory_allocated); "
MiB = 1 << 20


def test_mask_log_probs(check, args, shared):
    s = _setup(args)
    device, n_rows, rows_note = s.device, s.n_rows, s.rows_note
    with check("8.mask_log_probs", "sampling_mask.apply_to_log_probs / masked_log_probs vs a float64 reference") as e:
        e["notes"].append(rows_note)
        e["notes"].append(
            "reference: the support written out here (kthvalue per row, stops dropped where k < 0, ties kept, the "
            "sampled token added), log-softmax over it in float64; apply_to_log_probs is given detached full "
            "log-probs (the scoring use), so its gradient is on the truncated rows only (zero elsewhere)"
        )
        case = shared["case"] = _mask_case(n_rows, device)
        logits, labels, kept, weights = case
        scaled = logits / TEMPERATURE  # the trainer's scaled logits (fp32)
        ref_lp, ref_log_z, ref_grad = _reference_log_probs(scaled, labels, kept, weights)
        ref_grad_raw = ref_grad / TEMPERATURE  # d/d logits = d/d scaled / T
        # apply_to_log_probs: the caller's full log-probs (detached), the truncated rows replaced
        x = scaled.detach().clone().requires_grad_()
        with torch.no_grad():
            full = x.gather(-1, labels[:, None])[:, 0] - x.logsumexp(-1)
        out, log_z, selected = sampling_mask.apply_to_log_probs(x, labels, full, kept, STOP_IDS)
        (out * weights).sum().backward()
        sel = selected.reshape(-1).to(device)
        d_sel, d_full = _max_diff(out[sel], ref_lp[sel]), _max_diff(out[~sel], ref_lp[~sel])
        d_log_z = _max_diff(log_z, ref_log_z[sel])
        d_grad = _max_diff(x.grad[sel], ref_grad[sel])
        grad_off = x.grad[~sel].abs().max().item() if bool((~sel).any()) else 0.0
        expect(e, _close(out[sel], ref_lp[sel], LP_TOL), f"apply_to_log_probs: truncated rows off by {d_sel:.2e}")
        expect(e, _close(out[~sel], ref_lp[~sel], LP_TOL), f"apply_to_log_probs: full rows off by {d_full:.2e}")
        expect(e, _close(log_z, ref_log_z[sel], LP_TOL), f"apply_to_log_probs: log Z off by {d_log_z:.2e}")
        expect(e, _close(x.grad[sel], ref_grad[sel], GRAD_TOL), f"apply_to_log_probs: gradient off by {d_grad:.2e}")
        expect(e, grad_off == 0.0, f"gradient {grad_off} on rows whose log-probs were given detached")
        del x, out, full
        # masked_log_probs (raw logits and T), rows grouped by k_t: its top-k runs up to the largest k of a call
        masked, grad = torch.empty(n_rows, device=device), torch.zeros_like(logits)
        for k in kept.unique().tolist():
            rows = (kept == k).nonzero().squeeze(-1)
            part = logits[rows].detach().requires_grad_()
            lp = sampling_mask.masked_log_probs(part, labels[rows], kept[rows], TEMPERATURE, STOP_IDS)
            (lp * weights[rows]).sum().backward()
            masked[rows], grad[rows] = lp.detach(), part.grad
        d_masked, d_masked_grad = _max_diff(masked, ref_lp), _max_diff(grad, ref_grad_raw)
        expect(e, _close(masked, ref_lp, LP_TOL), f"masked_log_probs off by {d_masked:.2e}")
        expect(e, _close(grad, ref_grad_raw, GRAD_TOL), f"masked_log_probs: gradient off by {d_masked_grad:.2e}")
        # the mask matters: log π̃ = log π - log Z differs from the full-vocabulary log-prob (the check could fail)
        gap = ref_log_z.abs().max().item()
        expect(e, gap > 1e-2, f"the truncated and full log-probs differ by {gap:.2e} only")
        del grad, ref_grad, ref_grad_raw
        e["numbers"].update(
            rows=n_rows,
            vocab=VOCAB,
            truncated_rows=int(sel.sum()),
            tolerance_log_probs=LP_TOL,
            tolerance_grad=GRAD_TOL,
            apply_max_abs_diff_truncated=d_sel,
            apply_max_abs_diff_full=d_full,
            apply_log_z_max_abs_diff=d_log_z,
            apply_grad_max_abs_diff=d_grad,
            masked_max_abs_diff=d_masked,
            masked_grad_max_abs_diff=d_masked_grad,
            truncation_effect_max=gap,
        )
        e["summary"] = (
            f"{n_rows} rows x V {VOCAB:,}: apply_to_log_probs |diff| {max(d_sel, d_full):.1e}, grad {d_grad:.1e}; "
            f"masked_log_probs {d_masked:.1e}, grad {d_masked_grad:.1e} (fp64 reference)"
        )


def test_mask_backward_memory(check, args, shared):
    s = _setup(args)
    cuda, rows_note = s.cuda, s.rows_note
    case = shared.pop("case", None)  # freed after this entry
    with check("8.mask_backward_memory", "apply_to_log_probs backward: one logits-size gradient, no second") as e:
        e["notes"].append(rows_note)
        if not cuda:
            pytest.skip(NO_PEAK + "the CPU suite measures host allocations with torch.profiler instead")
        if case is None:
            pytest.skip("no case: 8.mask_log_probs did not build it")
        logits, labels, kept, weights = case
        logits_bytes = logits.numel() * 4

        def backward_growth(make_loss):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = make_loss()
            torch.cuda.synchronize()
            forward = torch.cuda.max_memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            loss.backward()
            torch.cuda.synchronize()
            return forward, torch.cuda.max_memory_allocated() - before

        x = (logits / TEMPERATURE).detach().requires_grad_()
        with torch.no_grad():
            full = x.gather(-1, labels[:, None])[:, 0] - x.logsumexp(-1)

        def ours():
            out, _, _ = sampling_mask.apply_to_log_probs(x, labels, full, kept, STOP_IDS)
            return (out * weights).sum()

        fwd, grown = backward_growth(ours)
        x.grad = None
        y = logits.detach().clone().requires_grad_()
        fwd_naive, grown_naive = backward_growth(
            lambda: (sampling_mask.masked_log_probs(y, labels, kept, TEMPERATURE, STOP_IDS) * weights).sum()
        )
        x = y = None  # the two gradients and the logits copy freed
        torch.cuda.empty_cache()
        e["notes"].append(
            "bound: the backward's peak growth minus the logits' size (the one gradient it must write) < one "
            "logits-size tensor; control: masked_log_probs (the plain autograd formula) on the same logits shows a "
            "second one, so the instrument sees it"
        )
        e["numbers"].update(
            logits_bytes=logits_bytes,
            forward_peak_growth_bytes=fwd,
            backward_peak_growth_bytes=grown,
            backward_growth_in_logits=round(grown / logits_bytes, 3),
            control_forward_peak_growth_bytes=fwd_naive,
            control_backward_peak_growth_bytes=grown_naive,
            control_backward_growth_in_logits=round(grown_naive / logits_bytes, 3),
        )
        expect(
            e,
            grown - logits_bytes < logits_bytes,
            f"backward grew the peak by {grown} bytes = {grown / logits_bytes:.2f} logits sizes: a second "
            "logits-size tensor beside the gradient",
        )
        expect(
            e,
            grown_naive - logits_bytes >= logits_bytes,
            f"control: masked_log_probs' backward grew the peak by {grown_naive / logits_bytes:.2f} logits sizes "
            "only; the instrument cannot tell one from two",
        )
        e["summary"] = (
            f"logits {logits_bytes / MiB:,.0f} MiB: backward peak +{grown / logits_bytes:.2f} x logits (bound < 2); "
            f"control masked_log_probs +{grown_naive / logits_bytes:.2f} x"
        )


def test_prox_scoring(check, args, shared):
    s = _setup(args)
    cuda, device, budget_mb = s.cuda, s.device, s.budget_mb
    with check("8.prox_scoring", "prox.stream_log_probs in chunks at V = 151,936 vs a float64 reference") as e:
        model = shared["model"] = _tiny_qwen2(device)
        streams, kept_counts = shared["streams"] = _scoring_case(cuda)
        positions = sum(len(s) - 1 for s in streams)
        rows_plain = prox.rows_per_chunk(VOCAB, budget_mb)
        rows_masked = prox.rows_per_chunk(VOCAB, budget_mb, masked=True)
        scoring_note = shared["scoring_note"] = (
            f"tiny random Qwen2 (hidden 32, 2 layers, V = {VOCAB:,}, fp32); {len(streams)} streams, {positions} "
            f"scored positions; memory_mb {budget_mb}: {rows_plain} positions per LM-head chunk ({rows_masked} with "
            f"kept counts); T = {TEMPERATURE}, stop ids {STOP_IDS}"
        )
        e["notes"].append(scoring_note)
        e["notes"].append(
            "reference: the same groups and padding (prox.stream_groups), the model's own full logits, / T in fp32, "
            "log-softmax (over the support written out here, with kept counts) in float64"
        )
        diffs = {}
        results = {}
        for name, counts in (("plain", None), ("kept", kept_counts)):
            ours = prox.stream_log_probs(
                model, streams, TEMPERATURE, kept=counts, stop_ids=STOP_IDS, memory_mb=budget_mb
            )
            ref = _scoring_reference(model, streams, counts, budget_mb)
            expect(e, [len(lp) for lp in ours] == [len(s) - 1 for s in streams], f"{name}: wrong lengths")
            got, want = torch.cat(ours), torch.cat(ref)
            diffs[name] = _max_diff(got, want)
            results[name] = got
            expect(e, _close(got, want, LP_TOL), f"{name}: off the float64 reference by {diffs[name]:.2e}")
        effect = _max_diff(results["plain"], results["kept"])
        expect(e, effect > 1e-2, f"kept counts change the log-probs by {effect:.2e} only: the check could not fail")
        e["numbers"].update(
            streams=len(streams),
            positions=positions,
            memory_mb=budget_mb,
            rows_per_chunk=rows_plain,
            rows_per_chunk_kept=rows_masked,
            max_abs_diff=diffs,
            tolerance=LP_TOL,
            kept_effect_max=effect,
        )
        e["summary"] = (
            f"{positions} positions, {rows_plain} / {rows_masked} per chunk: |diff| vs fp64 {diffs['plain']:.1e} "
            f"(plain), {diffs['kept']:.1e} (kept counts)"
        )


def test_prox_scoring_memory(check, args, shared):
    s = _setup(args)
    cuda, budget_mb = s.cuda, s.budget_mb
    model, scoring_note = shared.get("model"), shared.get("scoring_note", "")
    streams, kept_counts = shared.get("streams", (None, None))
    with check("8.prox_scoring_memory", "prox.stream_log_probs: peak device memory within memory_mb") as e:
        e["notes"].append(scoring_note)
        if not cuda:
            pytest.skip(NO_PEAK + "tests/test_prox_scoring_memory.py measures host allocations with the profiler")
        if model is None:
            pytest.skip("no model: 8.prox_scoring did not build it")
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        groups = prox.stream_groups([len(s) for s in streams], 32, budget_mb, prox.MICRO_BATCH)
        g, width = max(len(r) for r in groups), max(len(s) for s in streams)
        hidden_bytes = g * width * 32 * 4
        last_logits = 2 * g * VOCAB * 4
        slack = 32 * MiB
        bound = budget_mb * MiB + hidden_bytes + last_logits + slack
        e["notes"].append(
            f"bound (peak growth over the resident model): memory_mb ({budget_mb} MiB) + the group's final hidden "
            f"states (g x W x 32 x 4 = {hidden_bytes} B) + the last position's logits twice (2 x g x V x 4 = "
            f"{last_logits} B) + {slack // MiB} MiB for one body forward's activations; control: memory_mb x 8"
        )

        def growth(memory_mb, counts=None):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            prox.stream_log_probs(model, streams, TEMPERATURE, kept=counts, stop_ids=STOP_IDS, memory_mb=memory_mb)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base, base

        prox.stream_log_probs(model, streams[:2], TEMPERATURE, memory_mb=budget_mb)  # warm-up: kernels, workspaces
        plain, resident = growth(budget_mb)
        masked, _ = growth(budget_mb, kept_counts)
        control, _ = growth(budget_mb * 8)
        positions = sum(len(s) - 1 for s in streams)
        e["numbers"].update(
            model_bytes=model_bytes,
            resident_bytes_before=resident,
            memory_mb=budget_mb,
            bound_bytes=bound,
            peak_growth_plain_bytes=plain,
            peak_growth_kept_bytes=masked,
            peak_absolute_plain_bytes=resident + plain,
            peak_absolute_kept_bytes=resident + masked,
            absolute_bound_bytes=resident + bound,
            control_memory_mb=budget_mb * 8,
            control_peak_growth_bytes=control,
            full_logits_bytes=positions * VOCAB * 4,
            old_scorer_bytes_estimate=3 * positions * VOCAB * 4,
        )
        expect(e, plain <= bound, f"plain scoring grew the peak by {plain / MiB:.1f} MiB, above {bound / MiB:.1f}")
        expect(
            e,
            masked <= bound,
            f"scoring with kept counts grew the peak by {masked / MiB:.1f} MiB, above {bound / MiB:.1f}",
        )
        expect(
            e,
            control > bound,
            f"control (memory_mb x 8) grew the peak by {control / MiB:.1f} MiB only, not "
            f"above {bound / MiB:.1f}: the measurement cannot see the budget",
        )
        e["summary"] = (
            f"peak +{plain / MiB:.1f} MiB plain, +{masked / MiB:.1f} MiB kept counts (bound {bound / MiB:.1f} MiB = "
            f"{budget_mb} MiB budget + {(bound - budget_mb * MiB) / MiB:.1f}); control x8 +{control / MiB:.1f} MiB; "
            f"full logits {positions * VOCAB * 4 / MiB:,.0f} MiB; model {model_bytes / MiB:.1f} MiB"
        )
