"""Memory of the trainer's truncated log-probs (--algo.sampling_mask keep), measured, not inferred.

Under ``keep`` the actor's seam computes every log-prob with ``models/sampling_mask.truncated_log_probs`` instead
of upstream's ``log_probs_from_logits``. Contract: the forward keeps no logits-sized tensor beyond what upstream's
keeps, and the backward allocates ONE logits-sized gradient (plus chunk temporaries), where the previous seam added
a second dense [N, V] gradient (``torch.zeros_like(logits)``) on top of upstream's: ~10 GB at micro-batch 4 x
T = 4096 x V = 151,936 in fp32.

The bytes are every allocation and free torch.profiler records (``profile_memory``) while the forward or the
backward runs: peak = max over time of (allocated − freed) since its start, so temporaries count, not only the
tensors autograd saves. Units: L = the logits' bytes. Upstream's CPU path (no flash-attn) peaks at ~1 L in its
forward (exp(x − max) of a 1,024-row chunk) and ~3 L in its backward (the exp term, its product with the
gradient, and the zero-filled buffers of its gather and slice backward); with flash-attn on GPU its backward
allocates ~1 L.
"""

import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

from openrlhf.models.utils import log_probs_from_logits  # noqa: E402

from benchmarks.common import peak_allocated_bytes  # noqa: E402
from openrlhf_ess.models import sampling_mask as maths  # noqa: E402

BATCH, SEQ, VOCAB = 4, 256, 8192  # 1,024 rows: L = 32 MiB; the backward chunk's bool temporary is L / 32


def _batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=g) * 3
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    kept = torch.randint(1, 300, (BATCH, SEQ), generator=g)  # top-p-like supports, all three search paths
    kept[:, :64] = 0  # prompt positions
    kept[:, 64] = -kept[:, 64]  # first response token: stop token banned
    kept[0, 100:110] = 3000  # flat rows (top-k of the row)
    weights = torch.randn(BATCH, SEQ, generator=g)
    return logits, labels, kept, weights


def measure(log_probs_fn):
    """(forward peak, backward peak) in units of the logits' bytes, for ``log_probs_fn(x, labels, kept)`` -> [B, S]
    differentiable log-probs, with a fixed weighted sum as the loss."""
    logits, labels, kept, weights = _batch()
    x = logits.clone().requires_grad_(True)
    held = {}
    forward = peak_allocated_bytes(lambda: held.update(out=log_probs_fn(x, labels, kept)))
    loss = (held.pop("out") * weights).sum()
    backward = peak_allocated_bytes(loss.backward)
    assert x.grad is not None and x.grad.shape == x.shape
    size = logits.numel() * logits.element_size()
    return forward / size, backward / size


def upstream_fn(x, labels, kept):
    return log_probs_from_logits(x, labels)


def seam_fn(x, labels, kept):
    """What the actor's seam runs inside ``sampling_mask.applied`` (trainer/sampling_mask.py)."""
    return maths.truncated_log_probs(x, labels, kept, (2,))[0]


def replace_rows_fn(x, labels, kept):
    """Upstream's log-probs, then the truncated rows replaced (``apply_to_log_probs``, the at-sync scorer's API, and
    the shape of the previous seam): two autograd paths into the logits, so two [N, V] gradients."""
    return maths.apply_to_log_probs(x, labels, log_probs_from_logits(x, labels), kept, (2,))[0]


@pytest.fixture(scope="module")
def upstream_peaks():
    return measure(upstream_fn)


def test_seam_backward_holds_one_logits_sized_gradient(upstream_peaks):
    up_fwd, up_bwd = upstream_peaks
    fwd, bwd = measure(seam_fn)
    # one gradient (1 L) + CHUNK_ROWS rows of temporaries (a bool mask: 256 / 1024 / 4 = 0.06 L here)
    assert bwd <= 1.15, f"backward peak {bwd:.2f} L"
    assert bwd <= up_bwd, (bwd, up_bwd)  # never more than upstream's own backward (~3 L on this CPU path)
    assert fwd <= up_fwd + 0.1, (fwd, up_fwd)  # upstream's logsumexp temporaries and nothing logits-sized more


def test_the_measure_sees_a_second_gradient(upstream_peaks):
    """Control: replacing rows of upstream's log-probs (the previous seam's shape) costs upstream's backward plus a
    second [N, V] gradient, and the measure shows it (the previous seam measured 4.0 L here)."""
    _, up_bwd = upstream_peaks
    _, bwd = measure(replace_rows_fn)
    assert bwd >= up_bwd + 0.9, (bwd, up_bwd)
    assert bwd > 1.15 + 1  # so the bound above would catch it
