"""A trainer's surroundings in one process, for the tests that drive our ``ActorPPOTrainer`` around a tiny torch model
(``tests/test_sync_sleep.py``, ``tests/test_replacement_broadcast.py``): a one-rank gloo group on 127.0.0.1 (what
``torch.distributed.get_rank()`` and the syncs' barriers need), an HF-like causal LM, the DeepSpeed engine's
``.module`` around it, and an actor handle whose calls run at once."""

from types import SimpleNamespace

import torch

from tests.helpers.ports import free_port


def gloo_single_process():
    """A module-scoped fixture's body (``pytest.fixture(scope="module", autouse=True)(gloo_single_process)``): a
    one-rank gloo group for the module's tests, unless one is there already."""
    if torch.distributed.is_initialized():
        yield
        return
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


class TinyLM(torch.nn.Module):
    """An HF-like causal LM: ``config.vocab_size``, ``model(input_ids=, attention_mask=).logits``."""

    def __init__(self, vocab=16, hidden=8):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.head(torch.tanh(self.embed(input_ids))))


class DeepSpeedLike(torch.nn.Module):
    """What ``actor.model`` is in the trainer: a DeepSpeed engine, whose ``.module`` is the HF model."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


class RemoteHandle:
    """``actor.method.remote(...)`` runs the method at once (with a stand-in ``ray.get`` that returns what it is
    given)."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        return SimpleNamespace(remote=getattr(self._obj, name))
