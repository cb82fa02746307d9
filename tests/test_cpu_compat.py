"""Every CPU patch still targets code that exists in the pinned upstream, and is still needed here.

If an upgrade removes the CUDA call a patch works around, ``applies`` fails; if torch or DeepSpeed
start handling it themselves, ``needed`` fails. Either way the patch gets reviewed, not left dead.
"""

import subprocess
import sys

import pytest

from openrlhf_ess.runtime import cpu_compat

pytestmark = pytest.mark.skipif(cpu_compat.cuda_available(), reason="CPU patches are inert where CUDA exists")


@pytest.fixture(autouse=True)
def _importable_upstream():
    # Reading upstream's source imports its modules, which import flash_attn: the shim must be there (in the
    # full suite an earlier test has installed it; run alone, this file would otherwise fail on import).
    cpu_compat._install_flash_attn_shim()


@pytest.mark.parametrize("patch", cpu_compat.PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_pinned_upstream(patch):
    assert patch.applies(), f"{patch.name}: the upstream code it works around is gone ({patch.why})"


@pytest.mark.parametrize("patch", cpu_compat.PATCHES, ids=lambda p: p.name)
def test_patch_is_still_needed(patch):
    assert patch.needed(), f"{patch.name}: no longer needed on this machine; remove it ({patch.why})"


def test_patched_calls_behave_on_cpu():
    import torch

    cpu_compat.apply()
    assert torch.cuda.current_device() == "cpu"
    assert torch.cuda.set_device(0) is None and torch.cuda.synchronize() is None
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
    from openrlhf.utils.utils import convert_to_torch_dtype

    assert NaiveReplayBuffer(4).target_device == torch.device("cpu")
    assert convert_to_torch_dtype("fp32") is torch.float32
    assert convert_to_torch_dtype("bf16") is torch.bfloat16  # upstream answers still pass through


def test_after_import_runs_once_the_module_has_run_before_its_importer_continues(tmp_path, monkeypatch):
    # A module and an importer that takes a name from it at import time: the callback runs after the module's code
    # (it sees the module's names), exactly once, and before the importer's `from ... import`, which gets the
    # patched name, as if the patch had been applied first.
    (tmp_path / "ess_lazy_target.py").write_text("def f():\n    return 1\n")
    (tmp_path / "ess_lazy_importer.py").write_text("from ess_lazy_target import f as g\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []

    def patch():
        target = sys.modules["ess_lazy_target"]
        calls.append(target.f())
        target.f = lambda: 2

    try:
        cpu_compat.after_import("ess_lazy_target", patch)
        assert calls == [] and "ess_lazy_target" not in sys.modules
        import ess_lazy_importer

        assert calls == [1] and ess_lazy_importer.g() == 2
        cpu_compat.after_import("ess_lazy_target", lambda: calls.append("now"))  # imported already: at once
        assert calls == [1, "now"] and "ess_lazy_target" not in cpu_compat._HOOK.pending
    finally:
        for name in ("ess_lazy_target", "ess_lazy_importer"):
            sys.modules.pop(name, None)


@pytest.mark.engine
def test_upstream_modules_import_only_with_the_shim():
    # One fresh process (each import of the stack costs ~9 s of CPU): the bare import fails on flash_attn, then the
    # same import after apply() succeeds (a failed import leaves no half-made module behind to pass by accident).
    code = (
        "import sys\n"
        "try:\n"
        "    import openrlhf.models.ring_attn_utils\n"
        "except ImportError as e:\n"
        "    print('BARE', type(e).__name__, e.name)\n"
        "else:\n"
        "    print('BARE imported')\n"
        "assert 'openrlhf.models.ring_attn_utils' not in sys.modules\n"
        "from openrlhf_ess.runtime import cpu_compat\n"
        "cpu_compat.apply()\n"
        "import openrlhf.models.ring_attn_utils\n"
        "print('SHIMMED imported')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    ours = [line for line in run.stdout.splitlines() if line.startswith(("BARE", "SHIMMED"))]  # not the libraries'
    assert ours == ["BARE ModuleNotFoundError flash_attn", "SHIMMED imported"], run.stdout


def test_noop_when_cuda_is_available():
    # A CUDA run (the driver's decision, forwarded to every worker): apply() leaves torch.cuda and sys.modules
    # untouched. tests/test_worker_hook.py covers an undecided GPU node (NVML) and that no CUDA call is made.
    code = (
        "import os, sys, torch\n"
        "os.environ['OPENRLHF_ESS_DEVICE'] = 'cuda'\n"
        "before = torch.cuda.set_device, torch.cuda.current_device, torch.cuda.synchronize\n"
        "from openrlhf_ess.runtime import cpu_compat\n"
        "cpu_compat.apply()\n"
        "after = torch.cuda.set_device, torch.cuda.current_device, torch.cuda.synchronize\n"
        "assert before == after, 'torch.cuda was patched'\n"
        "assert 'flash_attn' not in sys.modules, 'flash_attn shim installed'\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
