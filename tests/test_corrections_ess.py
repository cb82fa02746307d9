"""ESS maths (openrlhf_ess.models.corrections) against hand-derived values and a second formula."""

import math

import pytest
import torch

from openrlhf_ess.models import corrections as C


def _log_w(values):
    return torch.tensor(values, dtype=torch.float64), torch.ones(len(values), dtype=torch.bool)


def test_equal_weights_give_rho_one():
    log_w, valid = _log_w([0.3] * 7)
    assert C.ess_ratio(log_w, valid).item() == pytest.approx(1.0, abs=1e-12)


def test_weights_one_and_five():
    # ESS = (1+5)^2 / (1+25) = 36/26; rho = ESS/2 = 18/26 = 0.6923...
    log_w, valid = _log_w([0.0, math.log(5.0)])
    assert C.ess_ratio(log_w, valid).item() == pytest.approx(18 / 26, abs=1e-12)


def test_second_formula_for_two_weights():
    # For weights e^a, e^b: rho = (1+e^d)^2 / (2 (1+e^{2d})), d = b - a (independent of a).
    for a, b in [(-3.0, 2.0), (10.0, 10.5), (-700.0, -699.0)]:
        d = b - a
        expected = (1 + math.exp(d)) ** 2 / (2 * (1 + math.exp(2 * d)))
        assert C.ess_ratio(*_log_w([a, b])).item() == pytest.approx(expected, rel=1e-12)


def test_sequence_log_weights_forms_by_hand():
    prox = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
    mu = torch.tensor([[-1.5, -2.5, -3.0], [-2.0, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # last token of row 2 is padding
    geo, valid = C.sequence_log_weights(prox, mu, mask, "geo_mean")
    prod, _ = C.sequence_log_weights(prox, mu, mask, "seq_product")
    assert geo.tolist() == pytest.approx([(0.5 + 0.5 + 0) / 3, (1 + 1) / 2])
    assert prod.tolist() == pytest.approx([1.0, 2.0])
    assert valid.tolist() == [True, True]


def test_empty_response_is_excluded_from_b():
    prox = torch.tensor([[0.0, 0.0], [-1.0, -1.0], [5.0, 5.0]], dtype=torch.float64)
    mu = torch.tensor([[0.0, 0.0], [-1.0 - math.log(5.0)] * 2, [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])  # third trajectory has no response token
    log_w, valid = C.sequence_log_weights(prox, mu, mask)
    assert valid.tolist() == [True, True, False]
    # only weights 1 and 5 count: rho = 18/26, B = 2
    assert C.ess_ratio(log_w, valid).item() == pytest.approx(18 / 26, abs=1e-12)


def test_no_valid_trajectory_gives_nan():
    log_w, valid = C.sequence_log_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert math.isnan(C.ess_ratio(log_w, valid).item())


def test_long_responses_do_not_overflow():
    # seq_product over 32k tokens with log-ratio 0.1 each: w = e^3276.8, far beyond float64.
    T = 32768
    prox = torch.full((3, T), -1.0)
    mu = prox.clone()
    mu[0] -= 0.1
    mu[1] -= 0.1
    log_w, valid = C.sequence_log_weights(prox, mu, torch.ones(3, T), "seq_product")
    assert log_w[0].item() == pytest.approx(0.1 * T, rel=1e-6)
    assert torch.isinf(log_w.exp()[0])  # the naive weight overflows float64
    rho = C.ess_ratio(log_w, valid).item()
    # two equal huge weights and one negligible: ESS -> 2, rho -> 2/3
    assert rho == pytest.approx(2 / 3, abs=1e-12)


def test_shards_combine_to_the_full_batch():
    torch.manual_seed(0)
    log_w = torch.randn(10, dtype=torch.float64) * 3
    valid = torch.ones(10, dtype=torch.bool)
    valid[4] = False
    full = C.ess_ratio(log_w, valid)
    shards = torch.stack([C.ess_log_moments(log_w[s], valid[s]) for s in (slice(0, 3), slice(3, 7), slice(7, 10))])
    combined = C.ess_ratio_from_log_moments(C.combine_log_moments(shards))
    assert combined.item() == pytest.approx(full.item(), rel=1e-12)
    empty = C.ess_log_moments(log_w[:0], valid[:0])  # a rank with no samples changes nothing
    with_empty = C.combine_log_moments(torch.cat([shards, empty[None]]))
    assert C.ess_ratio_from_log_moments(with_empty).item() == pytest.approx(full.item(), rel=1e-12)


@pytest.mark.parametrize(
    "rho,floor,rule,expected",
    [
        (1.0, 0.1, "sqrt", 1.0),
        (0.25, 0.1, "sqrt", 0.5),
        (0.25, 0.1, "linear", 0.25),
        (0.0001, 0.1, "sqrt", 0.1),  # sqrt = 0.01, clamped up to the floor
        (0.0001, 0.1, "linear", 0.1),
        (1.0000001, 0.1, "linear", 1.0),  # rounding above 1 is capped
    ],
)
def test_lr_scale_rule_and_clamps(rho, floor, rule, expected):
    out = C.lr_scale_from_rho(torch.tensor(rho, dtype=torch.float64), floor, rule)
    assert out.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("floor", [0.0, -0.1, 1.5, float("nan")])
def test_bad_floor_rejected(floor):
    with pytest.raises(ValueError, match="floor"):
        C.lr_scale_from_rho(torch.tensor(0.5), floor)


def test_unknown_form_and_rule_rejected():
    with pytest.raises(ValueError, match="weight form"):
        C.sequence_log_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "arith")
    with pytest.raises(ValueError, match="rule"):
        C.lr_scale_from_rho(torch.tensor(0.5), 0.1, "cubic")
