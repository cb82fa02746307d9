"""The trained model survives an unwritable or full output folder; every write failure of a save (each errno, bare or
wrapped by torch or safetensors, torch's errno-less full-disk error, a real full tmpfs) names its cause, what is
kept and the fix (openrlhf_ess/trainer/saving.py; docs/faults.md, sections 8 and 13).

A real permission failure needs a user that permission bits apply to: as root (CI, containers) the write runs in a
forked child that switched to ``nobody``; otherwise in-process. The CLI run with a failure injected at the final
save is in tests/test_outputs_e2e.py.
"""

import errno
import gc
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
    save_pretrained, after the gather (the test launcher's fault, tests/helpers/fault_injection.py, here on a
    stand-in model class). Rank 0 joins the barrier the other ranks wait in, the model is written to the fallback,
    and the error names the target, the cause and the fallback; the target holds no partial model."""
    from tests.helpers import fault_injection

    monkeypatch.setenv(fault_injection.FINAL_SAVE_ENV, "EACCES")
    target, fallback = tmp_path / "out", tmp_path / "fallback"
    os.makedirs(target)

    class Model:
        def save_pretrained(self, folder):
            _fake_save(folder)

    model, original = Model(), Model.save_pretrained

    def save(folder):  # upstream's save_model: rank 0 calls the model's save_pretrained
        model.save_pretrained(folder)

    save_final_model = fault_injection.failing_final_save(saving.save_final_model, model_class=Model)
    kwargs, calls = _one_rank(fallbacks=[str(fallback)])
    with pytest.raises(saving.OutputWriteError) as info:
        save_final_model(save, str(target), **kwargs)
    message = str(info.value)
    assert (
        f"could not be written to --ckpt.output_dir {target} (Permission denied (injected by "
        f"{fault_injection.FINAL_SAVE_ENV})" in message
    ), message
    assert f"it was written to {fallback} instead" in message
    assert sorted(os.listdir(fallback)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert os.listdir(target) == [] and calls["barrier"] == 1
    assert Model.save_pretrained is original  # the fault lasted one write

    # unset: the product's own save, into place
    monkeypatch.delenv(fault_injection.FINAL_SAVE_ENV)
    assert save_final_model(save, str(target), **kwargs) == str(target)
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors", "tokenizer.json"]


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
        parent = RuntimeError(f"Parent directory {folder} does not exist.")  # torch's other wording: same diagnosis
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


# ---- every write failure of a save gets our message ----------------------------------------------------------------

# What the message must say for each cause: the cause in the OS's words, and the fix (written out here, not taken
# from the module).
CAUSES = {
    "ENOSPC": ("No space left on device", "Free space on that filesystem (or move --ckpt.path"),
    "EDQUOT": ("Disk quota exceeded", "Free space within your disk quota there, or have it raised"),
    "EROFS": ("Read-only file system", "The filesystem is mounted read-only: remount it read-write"),
    "EIO": ("Input/output error", "The storage reported an I/O error: check it (dmesg"),
    "EACCES": ("Permission denied", "Make the folder writable by the user the run is started as"),
}
TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 380480 vs 380368"


def _torch_full_disk_error():
    """torch.save's error on a full disk, as torch 2.13 raises it: no errno, its stream's error as the context."""
    try:
        try:
            raise RuntimeError("basic_ios::clear: iostream error")
        except RuntimeError:
            raise RuntimeError(TORCH_FULL_DISK)
    except RuntimeError as e:
        return e


def _assert_ours(ours, folder, ckpt, cause, fix):
    assert isinstance(ours, saving.OutputWriteError), ours
    message = str(ours)
    assert message.startswith(
        f"the checkpoint global_step2 could not be written to {folder} (--ckpt.path {ckpt}): {cause}"
    ), message
    assert f"the checkpoints written before are kept under {ckpt}/_actor (a resume skips the incomplete" in message
    assert f"{fix}" in message and message.endswith(
        "then run the same command with --ckpt.load_enable to continue from the last one."
    ), message


@pytest.mark.parametrize("name", sorted(CAUSES))
@pytest.mark.parametrize("wrapped", ["bare", "cause", "context"])
def test_every_write_errno_gets_our_message(tmp_path, name, wrapped):
    """An OSError of each write errno, bare or wrapped in a RuntimeError (raised from it, or while handling it),
    is named by its errno, not by its wording (the wrapper's text here says nothing of a write)."""
    code = getattr(errno, name)
    ckpt = tmp_path / "ckpt"
    folder = ckpt / "_actor" / "global_step2"
    os.makedirs(folder)
    error = OSError(code, os.strerror(code), str(folder / "mp_rank_00_model_states.pt"))
    if wrapped != "bare":
        try:
            try:
                raise error
            except OSError as inner:
                if wrapped == "cause":
                    raise RuntimeError("saving the engine states") from inner
                raise RuntimeError("saving the engine states")
        except RuntimeError as outer:
            error = outer
    cause, fix = CAUSES[name]
    _assert_ours(saving.checkpoint_write_error(error, str(ckpt), "global_step2"), folder, ckpt, cause, fix)


def _fake_statvfs(monkeypatch, under, free_blocks=0, flag=0):
    """os.statvfs reporting ``free_blocks`` free 4 KiB blocks (and ``flag``) for paths under ``under``."""
    real = os.statvfs

    def statvfs(path):
        st = real(path)
        if not str(path).startswith(str(under)):
            return st
        return os.statvfs_result(
            (4096, 4096, st.f_blocks, free_blocks, free_blocks, st.f_files, st.f_ffree, st.f_favail, flag, 255)
        )

    monkeypatch.setattr(os, "statvfs", statvfs)


def test_torchs_full_disk_error_is_named_a_full_disk(tmp_path, monkeypatch):
    """torch's inline_container error carries no errno: the target's filesystem, with 0 bytes free at the time of
    the error, names it."""
    ckpt = tmp_path / "ckpt"
    folder = ckpt / "_actor" / "global_step2"
    os.makedirs(folder)
    _fake_statvfs(monkeypatch, tmp_path)
    ours = saving.checkpoint_write_error(_torch_full_disk_error(), str(ckpt), "global_step2")
    _assert_ours(ours, folder, ckpt, f"No space left on device (the filesystem of {folder} is full: 0.0 MB free)", "")
    assert "Free space on that filesystem" in str(ours)
    assert f"(the save reported: RuntimeError: {TORCH_FULL_DISK})" in str(ours)


def test_torchs_error_on_a_read_only_filesystem_and_on_a_writable_one(tmp_path, monkeypatch):
    """The same error where statvfs says read-only: named read-only; where the folder is writable and has room
    (the cause went before it could be seen): still our message, with torch's words and the general fix."""
    ckpt = tmp_path / "ckpt"
    folder = ckpt / "_actor" / "global_step2"
    os.makedirs(folder)
    _fake_statvfs(monkeypatch, tmp_path, free_blocks=10**6)  # 3.8 GiB free, whatever this machine's /tmp has
    plain = saving.checkpoint_write_error(_torch_full_disk_error(), str(ckpt), "global_step2")
    _assert_ours(plain, folder, ckpt, f"RuntimeError: {TORCH_FULL_DISK}", "Make the folder writable (or free space)")
    _fake_statvfs(monkeypatch, tmp_path, free_blocks=10**6, flag=os.ST_RDONLY)
    ours = saving.checkpoint_write_error(_torch_full_disk_error(), str(ckpt), "global_step2")
    _assert_ours(ours, folder, ckpt, "Read-only file system", "remount it read-write")


def test_safetensors_errno_in_its_text_and_other_errors(tmp_path):
    """safetensors' SafetensorError carries the errno in its text only; an error that is not a write failure is
    left alone."""
    from safetensors import SafetensorError

    ckpt = tmp_path / "ckpt"
    folder = ckpt / "_actor" / "global_step2"
    os.makedirs(folder)
    error = SafetensorError("Error while serializing: I/O error: Disk quota exceeded (os error 122)")
    ours = saving.checkpoint_write_error(error, str(ckpt), "global_step2")
    _assert_ours(ours, folder, ckpt, *CAUSES["EDQUOT"])
    assert saving.checkpoint_write_error(RuntimeError("CUDA error: an illegal memory access"), str(ckpt), "x") is None
    assert saving.checkpoint_write_error(KeyError("model"), str(ckpt), "x") is None


def test_a_final_save_failing_in_torchs_words_on_a_full_disk_goes_to_the_fallback(tmp_path, monkeypatch):
    """The final save: torch's errno-less error is a write failure too (the model goes to the fallback), named a
    full disk."""
    target, fallback = tmp_path / "out", tmp_path / "fallback"
    os.makedirs(target)
    _fake_statvfs(monkeypatch, target)

    def save(folder):
        if folder.startswith(str(target)):
            raise _torch_full_disk_error()
        _fake_save(folder)

    kwargs, calls = _one_rank(fallbacks=[str(fallback)])
    with pytest.raises(saving.OutputWriteError) as info:
        saving.save_final_model(save, str(target), **kwargs)
    assert f"could not be written to --ckpt.output_dir {target} (No space left on device (the filesystem of " in str(
        info.value
    )
    assert f"it was written to {fallback} instead" in str(info.value) and calls["barrier"] == 1


@pytest.fixture
def tiny_filesystem():
    """A 512 KiB tmpfs (root only); skipped where it cannot be mounted, always unmounted."""
    import subprocess

    folder = tempfile.mkdtemp(prefix="ess_tmpfs_", dir="/tmp")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", folder], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        os.rmdir(folder)
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield pathlib.Path(folder)
    finally:
        gc.collect()  # a failed save's file, still open from a traceback, keeps the filesystem busy
        if subprocess.run(["umount", folder], check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", folder], check=False)  # detached now, freed once its files close
        os.rmdir(folder)


def test_a_real_full_disk_gets_our_message(tiny_filesystem, tmp_path):
    """torch.save of 1.2 MB into a 512 KiB filesystem: torch's bare inline_container error becomes ours, named a
    full disk; safetensors' write of the final model there sends it to the fallback, named a full disk."""
    import torch
    from safetensors.torch import save_file

    ckpt = tiny_filesystem / "ckpt"
    folder = ckpt / "_actor" / "global_step2"
    os.makedirs(folder)
    big = torch.zeros(300_000)
    with pytest.raises(RuntimeError) as raised:
        torch.save({"w": big}, str(folder / "mp_rank_00_model_states.pt"))
    assert "inline_container.cc" in str(raised.value)  # torch's own words: no errno
    ours = saving.checkpoint_write_error(raised.value, str(ckpt), "global_step2")
    _assert_ours(ours, folder, ckpt, "No space left on device", CAUSES["ENOSPC"][1])

    del raised, ours  # torch's partial file stays open (and full) while its traceback lives
    gc.collect()
    os.remove(folder / "mp_rank_00_model_states.pt")
    target, fallback = tiny_filesystem / "out", tmp_path / "fallback"
    kwargs, _ = _one_rank(fallbacks=[str(fallback)])
    with pytest.raises(saving.OutputWriteError) as info:
        saving.save_final_model(
            lambda place: save_file({"w": big}, os.path.join(place, "model.safetensors")), str(target), **kwargs
        )
    assert f"could not be written to --ckpt.output_dir {target} (No space left on device" in str(info.value)
    assert os.listdir(fallback) == ["model.safetensors"] and os.listdir(target) == []
