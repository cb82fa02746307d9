"""The tiny RLVR task (openrlhf_ess/tiny/rlvr.py): exact-match reward by hand, a disjoint and deterministic
train/eval split, and a warm start that is built once and reused. No Ray; a few seconds."""

import json

import pytest

from openrlhf_ess.tiny import rlvr


def test_solve_and_prompt():
    assert rlvr.prompt_of(47, 38) == "47+38="
    assert rlvr.solve("47+38=") == "85"
    assert rlvr.solve("99+99=") == "198"
    with pytest.raises(ValueError):
        rlvr.solve("47+38")


def test_reward_exact_match_by_hand():
    p = "47+38="
    cases = {
        "85</s>": 1.0,  # right, then EOS
        "84</s>": 0.0,  # wrong number
        "085</s>": 0.0,  # leading zero: not the answer's digits
        "85 </s>": 0.0,  # extra text
        "85a</s>": 0.0,
        "8 5</s>": 0.0,
        "85</s></s>": 0.0,  # anything after EOS
        "85": 0.0,  # no EOS (truncated)
        "851": 0.0,
        "</s>": 0.0,  # empty answer
        "": 0.0,
    }
    queries = [p + r for r in cases]
    out = rlvr.reward_func(queries, [p] * len(cases), ["85"] * len(cases))
    assert out["rewards"].tolist() == list(cases.values())
    assert out["scores"].tolist() == list(cases.values())
    assert out["extra_logs"]["correct"].tolist() == list(cases.values())
    # well formed = a number then EOS, right or wrong
    assert out["extra_logs"]["well_formed"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_reward_falls_back_to_the_prompt_without_a_label():
    out = rlvr.reward_func(["12+30=42</s>", "12+30=43</s>"], ["12+30=", "12+30="], [None, ""])
    assert out["rewards"].tolist() == [1.0, 0.0]


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_train_and_eval_prompts_disjoint_and_deterministic(tmp_path):
    a = rlvr.build_prompts(str(tmp_path / "a" / "train.jsonl"), str(tmp_path / "a" / "eval.jsonl"), n_train=500)
    b = rlvr.build_prompts(str(tmp_path / "b" / "train.jsonl"), str(tmp_path / "b" / "eval.jsonl"), n_train=500)
    for x, y in zip(a, b):
        assert open(x).read() == open(y).read()  # same files every time
    train, held_out = _rows(a[0]), _rows(a[1])
    assert len(train) == 500 and len({r["input"] for r in train}) == 500
    assert all(r["label"] == rlvr.solve(r["input"]) for r in train + held_out)

    def unordered(rows):
        return {tuple(sorted(map(int, r["input"][:-1].split("+")))) for r in rows}

    assert not unordered(train) & unordered(held_out)  # not even b+a of an eval problem a+b is trained on
    assert len(unordered(held_out)) == 800  # the default eval set: 800 unordered pairs
    old = rlvr.build_prompts(str(tmp_path / "c" / "train.jsonl"), str(tmp_path / "c" / "eval.jsonl"), n_eval=100)
    assert len(unordered(_rows(old[1]))) == 100 and len(_rows(old[1])) == 197  # the earlier one, still built
    pool, ev = rlvr.split_pairs()
    assert not {tuple(sorted(p)) for p in pool} & {tuple(sorted(p)) for p in ev}
    assert len(pool) + len(ev) == 90 * 90  # every ordered pair of 10..99, once


def test_accuracy_counts_exact_answers(tmp_path):
    """The warm start's accuracy measure agrees with the reward: a stand-in model that spells the right answer
    then EOS scores 1, one that spells the answer plus one scores 0, greedy or sampled."""
    import torch

    from openrlhf_ess.tiny.world import build_tokenizer

    tok = build_tokenizer(str(tmp_path / "tok"))

    class Spell(torch.nn.Module):
        def __init__(self, off):
            super().__init__()
            self.off = off

        def forward(self, x):
            logits = torch.full((x.shape[0], x.shape[1], len(tok)), -1e4)
            for i, row in enumerate(x.tolist()):
                prompt, done = tok.decode(row[:6]), tok.decode(row[6:])
                text = str(int(rlvr.solve(prompt)) + self.off) + "</s>"
                nxt = tok.convert_tokens_to_ids(text[len(done)]) if len(done) < len(text) - 4 else tok.eos_token_id
                logits[i, -1, nxt] = 0.0
            return type("Out", (), {"logits": logits})

    pairs = [(10, 10), (47, 38), (99, 99)]
    assert rlvr.accuracy(Spell(0), tok, pairs) == 1.0
    assert rlvr.accuracy(Spell(0), tok, pairs, temperature=1.0) == 1.0
    assert rlvr.accuracy(Spell(1), tok, pairs) == 0.0


def test_warm_start_is_cached(tmp_path, monkeypatch):
    warm = rlvr.WarmStart(target_acc=1.0, max_steps=2, batch_size=8, check_every=1, n_dev=16)
    first = rlvr.build_rlvr(str(tmp_path), seed=3, n_train=64, n_eval=10, warm=warm)
    assert not first["cached"] and first["warm_start"]["steps"] == 2 and not first["warm_start"]["reached_target"]
    assert len(_rows(first["prompts"])) == 64 and len(_rows(first["eval"])) >= 10

    def no_training(*a, **k):
        raise AssertionError("the cached warm start was trained again")

    monkeypatch.setattr(rlvr, "warm_start", no_training)
    second = rlvr.build_rlvr(str(tmp_path), seed=3, n_train=32, n_eval=10, warm=warm)  # more prompts: same model
    assert second["cached"] and second["model"] == first["model"]
    assert second["warm_start"] == first["warm_start"]
    assert len(_rows(second["prompts"])) == 32
    # another seed or another warm-start setting is another model
    assert rlvr.cache_key(4, rlvr.TinyModelSpec(), warm, 10) != rlvr.cache_key(3, rlvr.TinyModelSpec(), warm, 10)
    other = rlvr.WarmStart(target_acc=0.5, max_steps=2, batch_size=8, check_every=1, n_dev=16)
    assert rlvr.cache_key(3, rlvr.TinyModelSpec(), other, 10) != rlvr.cache_key(3, rlvr.TinyModelSpec(), warm, 10)
    with pytest.raises(AssertionError, match="trained again"):
        rlvr.build_rlvr(str(tmp_path), seed=4, n_train=32, n_eval=10, warm=warm)
