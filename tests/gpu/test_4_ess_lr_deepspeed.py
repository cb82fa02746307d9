"""Check 4: the DeepSpeed actor with ESS-LR (and with the k2 KL loss) on ``tests/helpers/ess_ds.py``'s fixed
rollouts, whose LR scale is known by hand (rho = 9/13, scale = sqrt(9/13)). Slow on the CPU."""

import math
import os
import sys
import tempfile

import pytest

from tests.gpu.conftest import expect, own_process
from tests.gpu.harness import _build_model_dir, missing_reason, torch_adam_on_cuda

pytestmark = pytest.mark.slow


K2_ARGS = ["--algo.kl.off_policy_k2_enable", "--algo.kl.use_loss", "--algo.kl.init_coef", "0.01"]


@pytest.fixture(autouse=True)
def _one_group_per_test():
    """ess_ds.main() leaves its process group (its own process ends there): destroyed after each test."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def test_ess_lr_deepspeed(check, args, deepspeed_stack, monkeypatch):
    _ess_ds(check, args, deepspeed_stack, monkeypatch, k2=False)


def test_ess_lr_k2_deepspeed(check, args, deepspeed_stack, monkeypatch):
    _ess_ds(check, args, deepspeed_stack, monkeypatch, k2=True)


def _ess_ds(check, args, notes, monkeypatch, k2: bool) -> None:
    cid = "4.ess_lr_k2_deepspeed" if k2 else "4.ess_lr_deepspeed"
    name = (
        "DeepSpeed actor, ESS-LR + k2 KL loss, ZeRO-3 bf16 (tests/helpers/ess_ds.py, ours_on)"
        if k2
        else "DeepSpeed actor, ESS-LR, ZeRO-3 bf16 (tests/helpers/ess_ds.py, ours_on)"
    )
    with check(cid, name) as e:
        e["notes"].extend(notes)
        try:
            import deepspeed  # noqa: F401
            import openrlhf  # noqa: F401

            import openrlhf_ess.trainer.ray.ppo_actor  # noqa: F401
            from tests.helpers import ess_ds
        except ImportError as err:
            pytest.skip(f"DeepSpeed and OpenRLHF must import: {missing_reason(err)}")
        own_process("check 4")
        import torch

        if args.device == "cuda":
            torch.cuda.set_device(0)
        adam = torch_adam_on_cuda(args)
        e["notes"] += [adam] if adam else []
        root = tempfile.mkdtemp(prefix="gpu_check_ess_")
        world = _build_model_dir(root, None)  # the tiny world's model
        if k2:
            build_actor, make_rollout = ess_ds.build_actor, ess_ds.make_rollout

            def build_actor_k2(*a, extra=(), **k):
                return build_actor(*a, extra=list(extra) + K2_ARGS, **k)  # later flags win

            def make_rollout_k2(seed, n):
                exp = make_rollout(seed, n)
                exp.base_action_log_probs = exp.action_log_probs - 0.25  # a reference policy for the KL term
                return exp

            monkeypatch.setattr(ess_ds, "build_actor", build_actor_k2)
            monkeypatch.setattr(ess_ds, "make_rollout", make_rollout_k2)
            from openrlhf_ess.models import corrections

            kl_loss_k2, k2_calls = corrections.kl_loss_k2, []

            def counting_kl_loss_k2(log_probs, *a, **k):  # reached only through kl_k2.off_policy_k2_kl
                k2_calls.append(str(log_probs.device))
                return kl_loss_k2(log_probs, *a, **k)

            monkeypatch.setattr(corrections, "kl_loss_k2", counting_kl_loss_k2)
            e["notes"].append(
                f"k2: {' '.join(K2_ARGS)}; ess_ds trains with kl_ctl = 0, so the k2 term is computed and reported "
                "('kl') but does not move the weights; its maths is covered by tests/test_corrections_kl.py"
            )
        out = os.path.join(root, "out.pt")
        argv = [world["model"], world["prompts"], out, "--zero_stage", "3", "--param_dtype", "bf16"]
        argv += ["--variant", "ours_on", "--rollouts", "2", "--scheduler", "cosine_with_min_lr"]
        e["notes"].append("python -m tests.helpers.ess_ds MODEL PROMPTS OUT " + " ".join(argv[3:]))
        monkeypatch.setattr(sys, "argv", ["ess_ds"] + argv)
        ess_ds.main()
        result = torch.load(out)
        statuses, lrs = result["statuses"], result["lrs"]
        scale = math.sqrt(9 / 13)
        e["numbers"].update(
            hand_rho=9 / 13,
            hand_lr_scale=scale,
            rho_ess=[s.get("rho_ess") for s in statuses],
            lr_scale=[s.get("lr_scale") for s in statuses],
            actor_lr=[s.get("actor_lr") for s in statuses],
            actor_lr_effective=[s.get("actor_lr_effective") for s in statuses],
            scheduler_lrs=lrs,
        )
        for i, s in enumerate(statuses):
            expect(e, abs(s.get("rho_ess", -1) - 9 / 13) <= 1e-6, f"rollout {i}: rho {s.get('rho_ess')} != 9/13")
            expect(e, abs(s.get("lr_scale", -1) - scale) <= 1e-6, f"rollout {i}: lr_scale {s.get('lr_scale')}")
            eff, lr = s.get("actor_lr_effective", -1), s.get("actor_lr", 0)
            expect(e, abs(eff - lr * scale) <= 1e-6 * lr, f"rollout {i}: effective LR {eff} != {lr} x scale")
            expect(e, s.get("ess_lr_missing") == 0 and s.get("ess_lr_nonfinite") == 0, f"rollout {i}: fallback")
        expect(e, len(statuses) == 2 and len(set(lrs)) == 2, f"scheduler LRs {lrs}: expected two distinct")
        finite = all(torch.isfinite(p).all().item() for p in result["params"].values())
        expect(e, finite, "non-finite parameters after training")
        if k2:
            kls = [s.get("kl") for s in statuses]
            e["numbers"].update(kl=kls, k2_loss_calls=len(k2_calls), k2_loss_devices=sorted(set(k2_calls)))
            want = "cuda:0" if args.device == "cuda" else "cpu"
            expect(e, k2_calls and set(k2_calls) == {want}, f"k2 KL loss calls {k2_calls}: expected some, on {want}")
            expect(e, all(k is not None and math.isfinite(k) and k != 0 for k in kls), f"k2 KL values {kls}")
        e["summary"] = (
            f"rho {[round(s.get('rho_ess', 0), 7) for s in statuses]} (9/13 = {9 / 13:.7f}), lr_scale "
            f"{[round(s.get('lr_scale', 0), 7) for s in statuses]} (sqrt(9/13) = {scale:.7f})"
            + (f", k2 kl {[k if k is None else round(k, 5) for k in e['numbers']['kl']]}" if k2 else "")
        )
