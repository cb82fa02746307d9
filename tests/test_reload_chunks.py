"""The ``reload`` weight sync in bounded messages (``vllm_worker_wrap.weight_messages`` / ``StagedWeights``).

vLLM msgpack-encodes the arguments of every call into its engine core and msgspec refuses a bytes object of 4 GiB
or more, so the trainer cuts the weights into safetensors messages of at most ``RELOAD_MESSAGE_BYTES``. Here the
bound is lowered to a few KiB: the pure tests check every message against it and the reassembled tensors byte for
byte against the originals (parsed from the messages by this file's own reader, not by the code under test); the
engine test sends a tiny model through a real vLLM CPU engine (our Ray engine actor, its engine core in its own
process, so every message crosses vLLM's msgpack client) and checks what the engine then holds.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load

from openrlhf_ess.trainer.ray import vllm_worker_wrap as wire
from tests.helpers.ray_local import local_ray

BOUND = 4096


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "small": torch.randn(3, 5, generator=g),
        "big": torch.randn(40, 33, generator=g),  # 5280 bytes: more than one message
        "empty": torch.zeros(0, 7),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "half": torch.randn(700, generator=g).to(torch.bfloat16),
        "ids": torch.arange(300, dtype=torch.int64).reshape(30, 10),  # 2400 bytes: never split, may start a message
        "mask": torch.rand(17, generator=g) > 0.5,
        "huge": torch.randn(3, 1000, generator=g),  # 12000 bytes: split over at least three messages
    }


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, dtype-agnostic (NaN-safe, and bf16 and bool alike)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _own_reassembly(messages):
    """The tensors, put together by this test from the safetensors headers alone (independent of StagedWeights):
    a piece's bytes are placed at its first element times the element size, in a buffer of the full size."""
    out, shapes, dtypes = {}, {}, {}
    for blob in messages:
        n = int.from_bytes(blob[:8], "little")
        split = json.loads(json.loads(blob[8 : 8 + n])["__metadata__"]["split"])
        for name, t in load(blob).items():
            if name not in split:
                assert name not in out
                out[name], shapes[name], dtypes[name] = bytearray(_raw(t)), list(t.shape), t.dtype
                continue
            shape, start = split[name]
            numel = 1
            for d in shape:
                numel *= d
            buf = out.setdefault(name, bytearray(numel * t.element_size()))
            shapes[name], dtypes[name] = shape, t.dtype
            buf[start * t.element_size() : start * t.element_size() + len(_raw(t))] = _raw(t)
    return out, shapes, dtypes


def test_every_message_within_the_bound_and_the_tensors_come_back_bit_identical():
    tensors = _tensors()
    messages = list(wire.weight_messages(tensors.items(), BOUND))
    assert [last for _, last in messages] == [False] * (len(messages) - 1) + [True]
    blobs = [blob for blob, _ in messages]
    assert len(blobs) >= 5 and all(len(b) <= BOUND for b in blobs), [len(b) for b in blobs]
    holders = {name: sum(name in load(b) for b in blobs) for name in tensors}
    assert holders["huge"] >= 3 and holders["big"] >= 2, holders  # larger than a message: split
    assert all(holders[n] == 1 for n in ("small", "empty", "scalar", "half", "ids", "mask")), holders

    own, shapes, dtypes = _own_reassembly(blobs)
    staged = wire.assemble(blobs)
    assert sorted(own) == sorted(staged) == sorted(tensors)
    for name, t in tensors.items():
        assert bytes(own[name]) == _raw(t) and shapes[name] == list(t.shape) and dtypes[name] == t.dtype, name
        got = staged[name]
        assert got.dtype == t.dtype and got.shape == t.shape and _raw(got) == _raw(t), name


def test_the_plan_covers_every_tensor_once_in_order_within_the_bound():
    entries = [(name, tuple(t.shape), t.element_size()) for name, t in _tensors().items()]
    plan = wire.plan_messages(entries, BOUND)
    sizes = {name: (s, e) for name, s, e in entries}
    for message in plan:
        data = sum((end - start) * sizes[name][1] for name, start, end in message)
        assert data <= BOUND
    covered = {}
    for message in plan:
        for name, start, end in message:
            covered.setdefault(name, []).append((start, end))
    for name, shape, _ in entries:
        numel = int(torch.Size(shape).numel())
        ranges = covered[name]
        assert ranges[0][0] == 0 and ranges[-1][1] == numel, (name, ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (name, ranges)
    # the plan is the packing weight_messages uses
    blobs = [b for b, _ in wire.weight_messages(_tensors().items(), BOUND)]
    assert [sorted(n for n, _, _ in m) for m in plan] == [sorted(load(b)) for b in blobs]


def test_a_model_under_the_bound_is_one_plain_safetensors_message():
    tensors = _tensors()
    ((blob, last),) = list(wire.weight_messages(tensors.items(), 1 << 20))
    assert last and sorted(load(blob)) == sorted(tensors)  # what any safetensors reader takes


def test_staging_refuses_an_interrupted_sync():
    blobs = [b for b, _ in wire.weight_messages(_tensors().items(), BOUND)]
    staged = wire.StagedWeights()
    with pytest.raises(RuntimeError, match="interrupted"):
        staged.add(blobs[1])  # part 1 without part 0
    staged = wire.StagedWeights()
    for blob in blobs[:-1]:
        staged.add(blob)
    with pytest.raises(RuntimeError, match="never arrived"):
        staged.complete()  # the last piece of "huge" is in the last message
    staged.add(blobs[0])  # a new sync starts over: the earlier one's pieces are gone
    assert set(staged.tensors) == set(load(blobs[0]))


def test_a_bound_too_small_for_one_element_is_refused():
    with pytest.raises(ValueError, match="cannot hold one element"):
        list(wire.weight_messages([("x" * 200, torch.zeros(600))], 900))


# ---- through a real vLLM CPU engine


def _sums(t: torch.Tensor):
    """(Σx, Σx², n) in float64, written here independently of sync_check."""
    x = t.detach().double().reshape(-1)
    return float(x.sum()), float((x * x).sum()), x.numel()


def _expected_engine_sums(state):
    """What the engine must hold after loading ``state``, by its parameter names, as this test reads vLLM's layout:
    q/k/v parts of ``qkv_proj`` by part, gate/up fused, the vocabulary zero-padded (padding adds nothing)."""
    out = {}
    for name, t in state.items():
        for part in "qkv":
            name = name.replace(f".{part}_proj.weight", f".qkv_proj.weight[{part}]")
            name = name.replace(f".{part}_proj.bias", f".qkv_proj.bias[{part}]")
        if ".gate_proj." in name or ".up_proj." in name:
            name = name.replace(".gate_proj.", ".gate_up_proj.").replace(".up_proj.", ".gate_up_proj.")
            s, ss, n = out.get(name, (0.0, 0.0, 0))
            a, b, c = _sums(t)
            out[name] = (s + a, ss + b, n + c)
            continue
        out[name] = _sums(t)
    return out


@pytest.mark.stack
def test_a_model_larger_than_the_bound_reaches_a_real_engine(tiny_world, monkeypatch):
    """Bound 8 KiB: the tiny model (~0.4 MB) goes in dozens of messages, its embedding, LM head and attention
    projections split, through our engine actor's stage/load calls. The engine's weights that hold data must have
    the sums of the sent tensors (fp32 on both sides: to float64 rounding), its repacked linears must compute the
    sent model (prompt log-probs against HF's forward of the sent weights), and neither may match the old ones."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(wire, "RELOAD_MESSAGE_BYTES", 8192)
    # the engine core in a process of its own (what GPU users get): every call into it is msgpack-encoded
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    model_dir = tiny_world["model"]
    old = load_file(os.path.join(model_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    new = {k: t + 0.05 * torch.randn(t.shape, generator=g) for k, t in old.items()}
    messages = list(wire.weight_messages(new.items()))
    assert len(messages) > 20 and all(len(b) <= 8192 for b, _ in messages)
    assert any(len(json.loads(wire._header(b)["split"])) for b, _ in messages)  # some tensor split

    ids = [5, 17, 30, 41, 12, 9, 60, 33, 21, 8, 44, 3, 27]
    with local_ray() as ray:
        from openrlhf_ess.trainer.ray.vllm_engine import WORKER_EXTENSION, RolloutRayActor

        engine = RolloutRayActor.options(num_cpus=1, num_gpus=0).remote(
            model=model_dir,
            dtype="float32",
            seed=0,
            max_model_len=128,
            enforce_eager=True,
            worker_extension_cls=WORKER_EXTENSION,
            kv_cache_memory_bytes=64 << 20,
            distributed_executor_backend="uni",
            num_gpus=0,
        )
        try:
            for blob, last in messages[:-1]:
                counts = ray.get(engine.stage_weights_from_safetensors.remote(blob))
                assert counts == [len(load(blob))]
            loaded = ray.get(engine.load_weights_from_safetensors.remote(messages[-1][0], True))
            engine_lp = torch.tensor(ray.get(engine.prompt_log_probs.remote(ids)))
        finally:
            ray.kill(engine)

    assert loaded["counts"] == [len(new)]
    dtype, theirs = loaded["checksums"]
    expected, stale = _expected_engine_sums(new), _expected_engine_sums(old)
    assert dtype == "torch.float32" and set(theirs) <= set(expected), sorted(set(theirs) - set(expected))
    assert any(n.endswith("qkv_proj.bias[k]") for n in theirs)  # a real engine's q/k/v parts, by name
    for name, (s, ss, n) in theirs.items():
        es, ess, _ = expected[name]
        assert abs(s - es) <= 1e-9 * (n * ess) ** 0.5 and abs(ss - ess) <= 1e-9 * ess, name
        assert abs(ss - stale[name][1]) > 1e-6 * ess, name  # the old weights would not pass

    def hf_log_probs(state):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf.load_state_dict(state)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, :-1].float()
        return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]

    assert (engine_lp - hf_log_probs(new)).abs().max().item() < 1e-4  # fp32 engine vs HF: ~1e-5
    assert (engine_lp - hf_log_probs(old)).abs().max().item() > 1e-2
