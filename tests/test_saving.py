"""The trained model survives an unwritable or full output folder; a checkpoint write failure names its cause
(openrlhf_ess/trainer/saving.py; issue 21, item 3; docs/faults.md §6).

A real permission failure needs a user that permission bits apply to: as root (CI, containers) the write runs in a
forked child that switched to ``nobody``; otherwise in-process. The CLI run with a failure injected at the final
save is in tests/test_outputs_e2e.py.
"""

import errno
import inspect
import os
import pathlib
import pickle
import shutil
import tempfile
import types

import pytest

from openrlhf_ess.trainer import saving

NOBODY = 65534


def _as_unprivileged(fn):
    """``fn()``'s result (or the exception it raised), run where permission bits apply."""
    if os.geteuid() != 0:
        try:
            return fn()
        except Exception as e:
            return e
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, run, send the outcome back
        os.close(read)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                out = fn()
            except Exception as e:
                out = e
            data = pickle.dumps(out)
        except BaseException as e:  # noqa: BLE001 - whatever happened, the parent must hear of it
            data = pickle.dumps(RuntimeError(f"child failed: {e!r}"))
        os.write(write, data)
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return pickle.loads(b"".join(chunks))


def _fake_save(folder):
    """What upstream's save_model writes on rank 0: weights, config, tokenizer."""
    for name, text in (("model.safetensors", "new weights"), ("config.json", "{}"), ("tokenizer.json", "{}")):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def _one_rank(**kwargs):
    calls = {"barrier": 0}

    def barrier():
        calls["barrier"] += 1

    return dict(rank0=True, agree=lambda ok: ok, barrier=barrier, **kwargs), calls


def test_the_final_model_goes_into_place_through_a_temporary_folder(tmp_path):
    """Written in full under a temporary name inside the target, then renamed file by file: an earlier save's weight
    shards go (as save_pretrained removes them), the lock file and the checkpoints folder stay."""
    target = tmp_path / "out"
    os.makedirs(target / "checkpoints" / "_actor")
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", ".openrlhf_ess.lock"):
        (target / name).write_text("old")
    seen = []

    def save(folder):
        seen.append(folder)
        assert os.listdir(target / saving.STAGING) == []  # fresh
        _fake_save(folder)

    kwargs, calls = _one_rank(fallbacks=[str(tmp_path / "fallback")])
    assert saving.save_final_model(save, str(target), **kwargs) == str(target)
    assert seen == [str(target / saving.STAGING)] and calls["barrier"] == 0
    assert sorted(os.listdir(target)) == [
        ".openrlhf_ess.lock",
        "checkpoints",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (target / "model.safetensors").read_text() == "new weights"
    assert not (tmp_path / "fallback").exists()


def test_a_write_failure_at_the_final_save_sends_the_model_to_the_fallback(tmp_path, monkeypatch):
    """The failure injected where a folder that became unwritable makes upstream's save fail: inside rank 0's
    save_pretrained, after the gather. Rank 0 joins the barrier the other ranks wait in, the model is written to
    the fallback, and the error names the target, the cause and the fallback; the target holds no partial model."""
    monkeypatch.setenv(saving.FAULT_ENV, "EACCES")
    target, fallback = tmp_path / "out", tmp_path / "fallback"
    os.makedirs(target)

    class Model:
        def save_pretrained(self, folder):
            _fake_save(folder)

    model = Model()

    def save(folder):  # upstream's save_model: rank 0 calls the model's save_pretrained
        model.save_pretrained(folder)

    kwargs, calls = _one_rank(fallbacks=[str(fallback)], fault=lambda: saving.injected_fault(model))
    with pytest.raises(saving.OutputWriteError) as info:
        saving.save_final_model(save, str(target), **kwargs)
    message = str(info.value)
    assert f"could not be written to --ckpt.output_dir {target} (Permission denied" in message, message
    assert f"it was written to {fallback} instead" in message
    assert sorted(os.listdir(fallback)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert os.listdir(target) == [] and calls["barrier"] == 1
    assert "save_pretrained" not in vars(model)


@pytest.fixture
def open_dir():
    """A folder every user may enter and write (pytest's own temp folders are private to their owner)."""
    folder = tempfile.mkdtemp(prefix="ess_saving_", dir="/tmp")
    os.chmod(folder, 0o777)
    yield pathlib.Path(folder)
    for root, dirs, _ in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
    shutil.rmtree(folder)


def test_an_unwritable_output_folder_really_sends_the_model_to_the_fallback(open_dir):
    """A real permission failure (a folder the writing user may not write, as after a chmod mid-run)."""
    target, fallback = open_dir / "out", open_dir / "fallback_parent"
    os.makedirs(target)
    os.makedirs(fallback)
    os.chmod(target, 0o555)
    os.chmod(fallback, 0o777)
    try:
        kwargs, _ = _one_rank(fallbacks=[str(fallback / "model")])
        outcome = _as_unprivileged(lambda: saving.save_final_model(_fake_save, str(target), **kwargs))
    finally:
        os.chmod(target, 0o755)
    assert isinstance(outcome, saving.OutputWriteError), outcome
    assert "(Permission denied" in str(outcome) and f"it was written to {fallback / 'model'} instead" in str(outcome)
    assert sorted(os.listdir(fallback / "model")) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_nowhere_to_write_says_so(tmp_path):
    def save(folder):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(folder, "model.safetensors"))

    kwargs, calls = _one_rank(fallbacks=[str(tmp_path / "f1")])
    with pytest.raises(saving.OutputWriteError, match="could not be written anywhere: .*No space left on device"):
        saving.save_final_model(save, str(tmp_path / "out"), **kwargs)
    assert calls["barrier"] == 2 and not (tmp_path / "f1").exists() and os.listdir(tmp_path / "out") == []


def test_other_ranks_follow_rank_0():
    """A rank other than 0 writes nothing itself; it follows the agreement to the place the model went."""
    agreements = iter([True, False, True, True])  # staging ready; the write failed on rank 0; fallback ready and ok
    places = []
    out = saving.save_final_model(
        places.append,
        "/nonexistent/out",
        rank0=False,
        agree=lambda ok: next(agreements),
        barrier=lambda: None,
        fallbacks=["/nonexistent/fallback"],
    )
    assert places == ["/nonexistent/out/" + saving.STAGING, "/nonexistent/fallback"] and out == "/nonexistent/fallback"


def test_a_checkpoint_that_cannot_be_written_names_the_cause(open_dir):
    """torch's own words for a file it cannot open ("open file failed", or "Parent directory ... does not exist"
    when it cannot see into the folder) hide the permission; the probe finds it."""
    import torch

    ckpt = open_dir / "ckpt"
    folder = ckpt / "_actor" / "global_step1"
    os.makedirs(folder)
    os.chmod(folder, 0o555)
    try:
        error = _as_unprivileged(lambda: torch.save({"w": 1}, str(folder / "mp_rank_00_model_states.pt")))
        assert isinstance(error, RuntimeError), error  # torch 2.13: "... open file failed with strerror: ..."
        ours = _as_unprivileged(lambda: saving.checkpoint_write_error(error, str(ckpt), "global_step1"))
        parent = RuntimeError(f"Parent directory {folder} does not exist.")  # the wording: same diagnosis
        ours_parent = _as_unprivileged(lambda: saving.checkpoint_write_error(parent, str(ckpt), "global_step1"))
    finally:
        os.chmod(folder, 0o755)
    message = str(ours)
    assert message.startswith(
        f"the checkpoint global_step1 could not be written to {folder} (--ckpt.path {ckpt}): Permission denied"
    ), message
    assert "run the same command with --ckpt.load_enable" in message
    assert saving.checkpoint_write_error(ValueError("a bug"), str(ckpt), "global_step1") is None
    assert ": Permission denied" in str(ours_parent) and "(the save reported: RuntimeError: Parent directory" in str(
        ours_parent
    )


def test_the_cli_ends_with_our_message(monkeypatch):
    from ray.exceptions import RayTaskError

    from openrlhf_ess.cli import train_ppo_ray as cli

    cause = saving.OutputWriteError("the trained model could not be written to --ckpt.output_dir /x (...)")
    exc = RayTaskError(
        "PolicyModelActorImpl.save_model", "Traceback ...", cause, proctitle="ray::x", pid=7, ip="127.0.0.1"
    ).as_instanceof_cause()
    err = cli.classify_failure(exc, types.SimpleNamespace(), started=True)
    assert isinstance(err, cli.OutputFailed) and str(err) == str(cause)


def test_upstream_saves_the_final_model_where_we_wrap_it():
    """The contract the wiring relies on: upstream's train() saves once through the policy actor's save_model after
    fit, and DeepspeedStrategy.save_model ends with the barrier rank 0 joins after a failed write."""
    from openrlhf.utils.deepspeed.deepspeed import DeepspeedStrategy

    from openrlhf_ess import upstream
    from openrlhf_ess.trainer.ray.ppo_actor import PolicyModelActorImpl

    train = inspect.getsource(upstream.upstream_cli_module().train)
    assert train.index("ppo_trainer.fit.remote()") < train.index("actor_model.async_save_model()")
    body = inspect.getsource(DeepspeedStrategy.save_model).rstrip().splitlines()
    assert body[-1].strip() == "torch_dist_barrier_and_cuda_sync()"
    assert "save_pretrained(output_dir" in "\n".join(body)
    assert "save_model" in vars(PolicyModelActorImpl)
