"""Per-sample attributes through upstream's rebuilds (openrlhf_ess/trainer/carried.py), CPU.

Runs upstream's real ``Experience``, ``balance_experiences`` and ``NaiveReplayBuffer``. Every sample has its own
tokens (none is 0, upstream's padding of step fields), so a balanced row is matched to its source sample by its
unpadded ``sequences``, and its kept counts / routes are checked against the values written for that sample.
"""

import types

import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

from openrlhf.trainer.ppo_utils import experience as upstream_experience  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer  # noqa: E402

from openrlhf_ess import upstream  # noqa: E402
from openrlhf_ess.models.sampling_mask import NOT_TRUNCATED  # noqa: E402
from openrlhf_ess.trainer import carried  # noqa: E402

PROMPT = 2
LENGTHS = ([5, 9, 3, 7], [4, 6, 5, 3])  # two experiences (widths 9 and 6), prompt + response per sample
LAYERS, TOP_K, SENTINEL = 2, 2, 255  # uint8 routes


def args(gpus: int = 2):
    """Upstream's args as balance_experiences reads them: 2 DP ranks."""
    return types.SimpleNamespace(
        actor=types.SimpleNamespace(num_nodes=1, num_gpus_per_node=gpus),
        ds=types.SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1),
        train=types.SimpleNamespace(dynamic_batch_enable=True),
        vllm=types.SimpleNamespace(max_restarts=0),
    )


def tokens(g: int, n: int) -> list:
    return [100 * g + j + 1 for j in range(n)]  # sample g's tokens, never 0


def kept(g: int, n: int) -> list:
    return [10 * g + j + 1 for j in range(n - 1)]  # one count per action column of sample g (n - 1 columns)


def routes(g: int, n: int) -> torch.Tensor:
    """[n, L, k] uint8: token j's route, the last token (never forwarded) the sentinel."""
    out = torch.arange(n * LAYERS * TOP_K, dtype=torch.uint8).reshape(n, LAYERS, TOP_K) + 7 * g
    out[-1] = SENTINEL
    return out


def experience(lengths, first: int, with_kept=True, with_routes=True) -> Experience:
    """Samples first.. of ``lengths``, right-padded as upstream's maker pads them (sequences/attention (B, S),
    action columns (B, S − 1)); the attributes padded with their own pad values."""
    b, s = len(lengths), max(lengths)
    exp = Experience(
        sequences=torch.zeros(b, s, dtype=torch.long),
        attention_mask=torch.zeros(b, s, dtype=torch.long),
        action_mask=torch.zeros(b, s - 1, dtype=torch.bool),
        action_log_probs=torch.zeros(b, s - 1),
        advantages=torch.zeros(b, s - 1),
        total_length=torch.tensor(lengths, dtype=torch.float),
        info={"reward": torch.arange(b, dtype=torch.float) + first, "response_length": [n - PROMPT for n in lengths]},
    )
    kept_rows = torch.full((b, s - 1), NOT_TRUNCATED, dtype=torch.long)
    route_rows = torch.full((b, s, LAYERS, TOP_K), SENTINEL, dtype=torch.uint8)
    for r, n in enumerate(lengths):
        g = first + r
        exp.sequences[r, :n] = torch.tensor(tokens(g, n))
        exp.attention_mask[r, :n] = 1
        exp.action_mask[r, PROMPT - 1 : n - 1] = True
        kept_rows[r, : n - 1] = torch.tensor(kept(g, n))
        route_rows[r, :n] = routes(g, n)
    if with_kept:
        exp.rollout_kept_counts = kept_rows
    if with_routes:
        exp.rollout_routes = route_rows
    return exp


def experiences(**kw) -> list:
    return [experience(LENGTHS[0], 0, **kw), experience(LENGTHS[1], len(LENGTHS[0]), **kw)]


def source(batch: Experience, b: int) -> int:
    """The global sample id of row b, from its unpadded tokens."""
    return source_of(batch.sequences[b], batch.attention_mask[b])


def source_of(sequence: torch.Tensor, attention_mask: torch.Tensor) -> int:
    row = sequence[attention_mask.bool()].tolist()
    for g, n in enumerate(LENGTHS[0] + LENGTHS[1]):
        if row == tokens(g, n):
            return g
    raise AssertionError(f"row {row} is no sample's")


def expected_kept(g: int, width: int) -> list:
    n = (LENGTHS[0] + LENGTHS[1])[g]
    return kept(g, n) + [NOT_TRUNCATED] * (width - (n - 1))


def expected_routes(g: int, width: int) -> torch.Tensor:
    n = (LENGTHS[0] + LENGTHS[1])[g]
    return torch.cat([routes(g, n), torch.full((width - n, LAYERS, TOP_K), SENTINEL, dtype=torch.uint8)])


def same_fields(a: Experience, b: Experience) -> bool:
    """Every dataclass field and info entry equal (tensors by value, lists element by element)."""

    def same(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, list):
            return isinstance(y, list) and len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
        if isinstance(x, dict):
            return isinstance(y, dict) and list(x) == list(y) and all(same(x[k], y[k]) for k in x)
        return x == y

    return all(same(getattr(a, f), getattr(b, f)) for f in Experience.__dataclass_fields__)


# ---- balance_experiences (--train.dynamic_batch_enable) ----------------------------------------------------------


def test_balance_keeps_each_samples_attributes():
    inputs = experiences()
    infos = [exp.info for exp in inputs]
    balanced = carried.balance_experiences(inputs, args())
    # lengths 9,7,6,5,5,4,3,3 over 2 ranks: batches {9,3,6,4} and {7,3,5,5}, each with a width-9 sample
    assert len(balanced) == 2 and all(len(batch.sequences) == 4 for batch in balanced)
    seen = []
    for batch in balanced:
        assert batch.rollout_kept_counts.shape == batch.action_mask.shape
        assert batch.rollout_routes.shape == (*batch.sequences.shape, LAYERS, TOP_K)
        for b in range(len(batch.sequences)):
            g = source(batch, b)
            seen.append(g)
            assert batch.rollout_kept_counts[b].tolist() == expected_kept(g, batch.action_mask.shape[-1])
            assert torch.equal(batch.rollout_routes[b], expected_routes(g, batch.sequences.shape[-1]))
        assert carried.ROW_ID not in batch.info
    assert sorted(seen) == list(range(8))
    # the inputs get their own info dicts back, without the row ids
    assert all(exp.info is info and carried.ROW_ID not in info for exp, info in zip(inputs, infos))


def test_balance_pads_short_samples_to_the_batch_width():
    balanced = carried.balance_experiences(experiences(), args())
    short = [(batch, b) for batch in balanced for b in range(4) if source(batch, b) >= 4]  # width-6 experience
    assert short and all(batch.sequences.shape[-1] == 9 for batch, _ in short)
    for batch, b in short:
        assert batch.rollout_routes[b, 6:].eq(SENTINEL).all()  # beyond its own experience's width
        assert batch.rollout_kept_counts[b, 5:].eq(NOT_TRUNCATED).all()


def test_balance_one_attribute_only():
    balanced = carried.balance_experiences(experiences(with_routes=False), args())
    for batch in balanced:
        assert not hasattr(batch, "rollout_routes")
        for b in range(4):
            assert batch.rollout_kept_counts[b].tolist() == expected_kept(source(batch, b), 8)


def test_balance_without_attributes_is_upstreams():
    ours = carried.balance_experiences(experiences(with_kept=False, with_routes=False), args())
    theirs = upstream_experience.balance_experiences(experiences(with_kept=False, with_routes=False), args())
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert same_fields(a, b) and list(a.info) == ["reward", "response_length"]
        assert not hasattr(a, "rollout_kept_counts") and not hasattr(a, "rollout_routes")


def test_balance_refuses_a_batch_mixing_samples_with_and_without():
    inputs = [experience(LENGTHS[0], 0), experience(LENGTHS[1], 4, with_kept=False, with_routes=False)]
    with pytest.raises(RuntimeError, match="mixes samples with and without rollout_kept_counts"):
        carried.balance_experiences(inputs, args())
    assert all(carried.ROW_ID not in exp.info for exp in inputs)


def test_balance_refuses_an_attribute_of_the_wrong_batch_size():
    inputs = experiences()
    inputs[1].rollout_routes = inputs[1].rollout_routes[:3]
    with pytest.raises(ValueError, match="rollout_routes has 3 rows for a batch of 4"):
        carried.balance_experiences(inputs, args())


# ---- the controller's train_step ------------------------------------------------------------------------------


def test_rebound_train_step_balances_with_ours():
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    step = upstream.train_step_with_balance(carried.balance_experiences)
    assert step.__code__ is BasePPOTrainer.train_step.__code__
    assert step.__globals__["balance_experiences"] is carried.balance_experiences
    # upstream's module is not touched
    assert BasePPOTrainer.train_step.__globals__["balance_experiences"] is upstream_experience.balance_experiences
    assert upstream.train_step_with_balance(carried.balance_experiences) is step  # built once


def test_base_train_step_is_the_one_our_controllers_replace():
    """OffPolicyControllerMixin.train_step runs upstream's BasePPOTrainer.train_step instead of super()'s under
    --train.dynamic_batch_enable: equivalent only while no class between them in the MRO defines one."""
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    from openrlhf_ess.trainer.ppo_trainer import OffPolicyControllerMixin, PPOTrainerImpl
    from openrlhf_ess.trainer.ppo_trainer_async import TrainingActorImpl

    for cls in (PPOTrainerImpl, TrainingActorImpl):
        mro = cls.__mro__
        after = mro[mro.index(OffPolicyControllerMixin) + 1 :]
        assert next(c for c in after if "train_step" in vars(c)) is BasePPOTrainer, cls


def test_controller_train_step_sends_balanced_attributes_to_the_actors(monkeypatch):
    """The mixin's train_step with --train.dynamic_batch_enable, upstream's train_step body and a stand-in for the
    Ray world: the experiences handed to the actors' ``append`` carry every sample's attributes."""
    import ray

    from openrlhf_ess.trainer.ppo_trainer import OffPolicyControllerMixin

    sent = {}

    class Group:
        def async_run_method_batch(self, method_name, experience):
            sent[method_name] = experience
            return []

    class Controller(OffPolicyControllerMixin):
        def __init__(self):
            self.args = args()
            self.experience_maker = types.SimpleNamespace(
                make_experience_batch=lambda s: experiences(), last_metrics={}
            )
            self.tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens: ["text"])
            self.actor_model_group, self.critic_model_group, self.vllm_engines = Group(), None, None

        def _compute_rollout_stats(self, experiences):
            return {}

        def ppo_train(self, global_step):
            return {}

    monkeypatch.setattr(ray, "get", lambda refs: refs)  # no Ray cluster: the refs are the empty list above
    status, step = Controller().train_step(rollout_samples=[], global_step=3)
    assert step == 4
    batches = sent["append"]
    assert len(batches) == 2
    for batch in batches:
        for b in range(4):
            g = source(batch, b)
            assert batch.rollout_kept_counts[b].tolist() == expected_kept(g, batch.action_mask.shape[-1])
            assert torch.equal(batch.rollout_routes[b], expected_routes(g, batch.sequences.shape[-1]))


# ---- the replay buffer ---------------------------------------------------------------------------------------


def test_balanced_batches_through_the_replay_buffer():
    """Controller → actor: a balanced batch appended to an adopted buffer and collated back keeps every row."""
    buffer = NaiveReplayBuffer(sample_batch_size=2, limit=0, cpu_offload=False)
    carried.adopt_replay_buffer(buffer)
    append = buffer.append
    carried.adopt_replay_buffer(buffer)  # both flags on: one wrapper, not two
    assert buffer.append is append
    batch = carried.balance_experiences(experiences(), args())[0]
    buffer.append(batch)
    for item in buffer.items:  # cut to the item's own width, as upstream cuts its step fields
        g = source_of(item.sequences, item.attention_mask)
        n = (LENGTHS[0] + LENGTHS[1])[g]
        assert item.rollout_kept_counts.tolist() == kept(g, n)
        assert torch.equal(item.rollout_routes, routes(g, n))
    collated = buffer.collate_fn(buffer.items[1:3])
    for b in range(2):
        g = source(collated, b)
        assert collated.rollout_kept_counts[b].tolist() == expected_kept(g, collated.action_mask.shape[-1])
        assert torch.equal(collated.rollout_routes[b], expected_routes(g, collated.sequences.shape[-1]))


def test_replay_buffer_without_attributes_is_upstreams():
    ours = carried.adopt_replay_buffer(NaiveReplayBuffer(sample_batch_size=2, limit=0, cpu_offload=False))
    theirs = NaiveReplayBuffer(sample_batch_size=2, limit=0, cpu_offload=False)
    for buffer in (ours, theirs):
        buffer.append(experience(LENGTHS[0], 0, with_kept=False, with_routes=False))
    a, b = ours.collate_fn(ours.items[:3]), theirs.collate_fn(theirs.items[:3])
    assert same_fields(a, b)
    assert not hasattr(a, "rollout_kept_counts") and not hasattr(a, "rollout_routes")
