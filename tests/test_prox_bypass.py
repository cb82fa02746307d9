"""--algo.prox_mode bypass (π_prox = μ): upstream's old-log-prob forward is skipped, μ stands in for it.

The maker tests run upstream's ``make_experience`` itself with fake model groups (Ray replaced by an
in-process stand-in), counting the forwards each group is asked for; the CLI test runs the real stack.
"""

import types

import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

import openrlhf.trainer.ppo_utils.experience_maker as upstream_maker_module  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker as UpstreamMaker  # noqa: E402

import openrlhf_ess.trainer.ppo_utils.experience_maker as our_maker_module  # noqa: E402
from openrlhf_ess.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402


class _Ref:
    def __init__(self, value):
        self.value = value


class _FakeRay:
    """ray.put / ray.get on the controller, in process."""

    @staticmethod
    def put(value):
        return _Ref(value)

    @classmethod
    def get(cls, ref):
        return [cls.get(r) for r in ref] if isinstance(ref, list) else ref.value


class _FakeGroup:
    """A model group with one rank whose forward returns ``fn(sequences)`` per micro-batch, counting calls."""

    def __init__(self, fn):
        self.fn, self.forwards = fn, 0

    def async_run_method_batch(self, method_name, **kwargs):
        assert method_name == "forward"
        self.forwards += 1
        return [_Ref([self.fn(seqs) for seqs in kwargs["sequences"]])]


def _actor_log_probs(seqs):  # what the actor's recompute forward would return: clearly not μ
    return torch.full((seqs.shape[0], 3), -7.0)


def _ref_log_probs(seqs):
    return torch.full((seqs.shape[0], 3), -1.5)


def _args(mode):
    ns = types.SimpleNamespace
    algo = ns(
        prox_mode=mode,
        max_version_lag=None,
        nonfinite_logprobs="drop",
        prox_missing="mask",
        prox_snapshots=4,
        tis_cap=None,
        tis_level="token",
        prox_audit_dir=None,
        kl=ns(use_loss=False, estimator="k1"),
        advantage=ns(estimator="reinforce", baseline="estimator"),
    )
    train = ns(colocate_all=False, colocate_actor_ref=False, colocate_critic_reward=False)
    return ns(algo=algo, train=train, ds=ns(ring_attn_size=1, tensor_parallel_size=1))


def _maker(monkeypatch, mode):
    monkeypatch.setattr(upstream_maker_module, "ray", _FakeRay)
    monkeypatch.setattr(our_maker_module, "ray", _FakeRay)
    base = UpstreamMaker.__new__(UpstreamMaker)
    args = _args(mode)
    base.strategy, base.args = types.SimpleNamespace(args=args), args
    base.actor_model_group, base.initial_model_group = _FakeGroup(_actor_log_probs), _FakeGroup(_ref_log_probs)
    base.critic_model_group = base.reward_model_group = None
    maker = RemoteExperienceMaker.from_upstream(base)
    maker.weight_version = 2
    return maker


def _samples(mu_rows):
    """Micro-batches of 2 samples, 3 action tokens, μ given per row; tokens of versions 2 (lag 0) and 1."""
    out = []
    for mu in mu_rows:
        exp = Experience(
            sequences=torch.tensor([[1, 2, 3, 4, 5], [1, 2, 6, 7, 8]]),
            attention_mask=torch.ones(2, 5, dtype=torch.long),
            action_mask=torch.tensor([[True, True, True], [True, True, False]]),
            rollout_log_probs=None if mu is None else torch.tensor(mu),
            rewards=torch.tensor([1.0, 0.0]),
            info={},
        )
        exp.rollout_versions = torch.tensor([[1, 2, 2], [2, 2, -1]])
        out.append(exp)
    return out


MU = [[[-0.5, -1.0, -2.0], [-0.25, -3.0, 0.0]], [[-0.1, -0.2, -0.3], [-4.0, -5.0, 0.0]]]


def test_bypass_uses_mu_as_prox_and_skips_the_actor_forward(monkeypatch):
    maker = _maker(monkeypatch, "bypass")
    samples = _samples(MU)
    experiences = maker.make_experience(samples)
    assert maker.actor_model_group.forwards == 0  # upstream's old-log-prob forward never dispatched
    assert maker.initial_model_group.forwards == 1  # the reference forward still runs, as upstream
    for exp, mu in zip(experiences, MU):
        assert torch.equal(exp.action_log_probs, torch.tensor(mu))  # π_prox = μ, per token, bit for bit
        assert exp.action_log_probs.data_ptr() != exp.rollout_log_probs.data_ptr()  # a copy, not μ itself
        # upstream's KL-in-reward, now log μ - log π_ref (k1), e.g. -0.5 - (-1.5) = 1.0 on the first token
        assert torch.allclose(exp.kl[exp.action_mask], (torch.tensor(mu) + 1.5)[exp.action_mask])
    m = maker.last_metrics
    assert m["prox/recompute_forwards"] == 0.0
    # the train/rollout mismatch is 0 by construction (π_prox = μ)
    assert m["mismatch/k1"] == 0.0 and m["mismatch/max_abs_log_ratio"] == 0.0


def test_recompute_runs_the_actor_forward_once(monkeypatch):
    """The contrast: the same batch under upstream's recompute gets the actor's forward (one dispatch)."""
    maker = _maker(monkeypatch, "loglinear")  # any mode but bypass: loglinear is recompute + interpolation
    maker.make_experience(_samples(MU))
    assert maker.actor_model_group.forwards == 1 and maker.initial_model_group.forwards == 1
    assert maker.last_metrics["prox/recompute_forwards"] == 1.0


def test_bypass_without_mu_is_an_error_not_a_guess(monkeypatch):
    maker = _maker(monkeypatch, "bypass")
    with pytest.raises(RuntimeError, match="without rollout log-probs"):
        maker.make_experience(_samples([MU[0], None]))
    assert maker.actor_model_group.forwards == 0


def test_bypass_duplicates_mu_for_ring_attention_copies(monkeypatch):
    """Upstream keeps every duplicate_factor-th result; each micro-batch's μ must land there."""
    from openrlhf_ess.trainer.ppo_utils.experience_maker import bypass_prox_results

    samples = _samples(MU)
    results = bypass_prox_results(samples, duplicate_factor=2)
    kept = [r[0] for r in results[::2]]
    assert len(results) == 4 and all(torch.equal(k, s.rollout_log_probs) for k, s in zip(kept, samples))


def test_bypass_flags(tiny_world):
    from openrlhf_ess.cli import train_ppo_ray as cli
    from tests.test_config import _base

    argv = _base(tiny_world) + ["--algo.prox_mode", "bypass"]
    args, notices = cli.parse_args(argv + ["--algo.ess_lr_enable", "--algo.tis_cap", "2"])
    assert any("ESS" in n or "rho_ess = 1" in n for n in notices)
    assert any("is exactly 1" in n for n in notices)  # TIS: allowed, announced as a no-op
    assert any("--vllm.dtype bfloat16" in n for n in notices)
    _, notices = cli.parse_args(argv + ["--vllm.dtype", "float32"])
    assert not any("bypass" in n for n in notices)  # the sound configuration: nothing to announce


def _hf_check(audit: str, model_dir: str):
    """For every response token of the audit trail: μ (= the π_prox the loss used) against HF's log-prob under
    the weights of the token's version. Returns (tokens, lag-0 tokens, worst |μ - HF| off the first response
    token, worst |μ - HF_no_eos| on the first response token, smallest |μ - HF| on the first token), where
    HF_no_eos is the log-prob renormalised without EOS: upstream samples the first token with min_tokens=1."""
    import glob

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    eos = AutoConfig.from_pretrained(model_dir).eos_token_id
    weights = {int(p.rsplit("_v", 1)[1].split(".")[0]): load_file(p) for p in glob.glob(f"{audit}/weights_v*")}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = lag0 = 0
    worst_rest = worst_first = 0.0
    first_gap = float("inf")
    for path in sorted(glob.glob(f"{audit}/batch_v*.pt")):
        batch = torch.load(path)
        for mb in batch["micro_batches"]:
            seqs, mask, versions = mb["sequences"], mb["action_mask"].bool(), mb["rollout_versions"]
            mu, n = mb["rollout_log_probs"], mb["action_mask"].shape[1]
            assert torch.equal(mb["action_log_probs"][mask], mu[mask])  # the loss's π_prox is μ, bit for bit
            first = torch.zeros_like(mask)
            first[torch.arange(mask.shape[0]), mask.int().argmax(-1)] = True
            first &= mask
            for v in sorted(set(versions[mask].tolist())):
                model.load_state_dict(weights[v])
                with torch.no_grad():
                    lp = model(seqs, attention_mask=mb["attention_mask"]).logits.float().log_softmax(-1)[:, :-1]
                hf = lp.gather(-1, seqs[:, 1:, None])[..., 0][:, -n:]
                no_eos = hf - torch.log1p(-lp[..., eos].exp())[:, -n:]  # log π(a) - log(1 - π(EOS))
                sel = mask & (versions == v)
                worst_rest = max(worst_rest, (mu - hf)[sel & ~first].abs().max().item())
                if (sel & first).any():
                    worst_first = max(worst_first, (mu - no_eos)[sel & first].abs().max().item())
                    first_gap = min(first_gap, (mu - hf)[sel & first].abs().min().item())
                tokens += int(sel.sum())
                lag0 += int(sel.sum()) if v == batch["weight_version"] else 0
    return tokens, lag0, worst_rest, worst_first, first_gap


@pytest.mark.stack
def test_bypass_through_the_cli_is_exact_at_lag_0_and_takes_the_baseline_over_whole_model_norms(tiny_world, tmp_path):
    """On the real stack (vLLM CPU fp32 + DeepSpeed fp32, async + partial rollouts): the
    π_prox the loss used is μ (no recompute forward in make-experience), and μ equals HF's log-prob of each
    sampled token under the weights of that token's version to 1e-4; for lag-0 tokens those are the weights
    the batch's first optimizer step starts from, so its PPO ratio π_θ/π_prox is 1 to 1e-4 per token.

    Except the first response token: upstream samples it with EOS banned (min_tokens=1), so μ there is the
    renormalised log π(a) - log(1 - π(EOS)) (checked to 1e-4) and the ratio is 1 - π(EOS), a truncated support
    that the sampling mask removes (docs/prox_modes.md, docs/sampling_mask.md).

    The same run takes the optimal baseline over every parameter's norm (``--algo.advantage.baseline opob
    --algo.advantage.opob_norm full``, GRPO's group_norm estimator): the actor's make-experience forward, which
    bypass otherwise skips, runs for the norms alone, so π_prox stays μ (no recompute forward counted, k1 = 0, μ
    exact above), and every step logs a baseline inside the rewards' range from positive, unequal norms. One run
    for both: an async CLI run costs the suite 75–78 s and 123–134 busy core-s, nearly all of it start-up
    (docs/tests.md)."""
    from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args

    run_dir, audit = str(tmp_path), str(tmp_path / "audit")
    args = tiny_args(tiny_world, run_dir, steps_prompts=16)
    for flag, value in (
        ("--rollout.max_new_tokens", "48"),
        ("--data.max_len", "80"),
        ("--algo.advantage.estimator", "group_norm"),
    ):
        args[args.index(flag) + 1] = value
    flags = ["--train.async_enable", "--train.partial_rollout_enable", "--ds.param_dtype", "fp32"]
    flags += ["--vllm.dtype", "float32", "--algo.prox_mode", "bypass", "--algo.prox_audit_dir", audit]
    flags += ["--algo.advantage.baseline", "opob", "--algo.advantage.opob_norm", "full"]
    rc, log = run_cli(args + flags, run_dir)
    assert rc == 0, log[-5000:]
    tb = read_tensorboard(run_dir)
    assert [v for _, v in tb["train/prox/recompute_forwards"]] == [0.0, 0.0]  # the forward was skipped
    assert [v for _, v in tb["train/mismatch/k1"]] == [0.0, 0.0]  # π_prox = μ by construction
    # the baseline over whole-model norms, from the norms-only forward
    assert len(tb["train/opob/baseline"]) == 2
    assert all(0 <= v <= 1 for _, v in tb["train/opob/baseline"])  # digit-fraction rewards are in [0, 1]
    assert all(v > 0 for _, v in tb["train/opob/grad_norm_mean"])
    assert all(v > 0 for _, v in tb["train/opob/grad_norm_rel_spread"])

    tokens, lag0, worst_rest, worst_first, first_gap = _hf_check(audit, tiny_world["model"])
    print(
        f"[bypass] {tokens} tokens ({lag0} at lag 0): worst |mu - HF(version)| {worst_rest:.1e}; first token: "
        f"|mu - HF_no_eos| {worst_first:.1e}, |mu - HF| >= {first_gap:.1e}"
    )
    assert tokens > 100 and lag0 > 100
    assert worst_rest < 1e-4, f"mu differs from the trainer's log-prob under its version by {worst_rest:.2e}"
    assert worst_first < 1e-4, f"first token: mu is not the EOS-banned log-prob ({worst_first:.2e})"
    assert first_gap > 1e-4  # the first token's gap is real (π(EOS) > 0): the check above could fail
