"""Rule-based reward for the tiny world, in the form ``--reward.remote_url <this file>`` expects.

reward = (number of digit characters in the response) / (number of characters in the response),
0 for an empty response. Special tokens are not characters of the response.
"""

import torch

_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def response_text(query: str, prompt: str) -> str:
    """The response part of a decoded ``prompt + response`` string, special tokens removed."""
    response = query[len(prompt) :] if query.startswith(prompt) else query
    for tok in _SPECIALS:
        response = response.replace(tok, "")
    return response


def digit_fraction(text: str) -> float:
    """Fraction of characters of ``text`` that are ASCII digits (0.0 for an empty text)."""
    if not text:
        return 0.0
    return sum(ch in "0123456789" for ch in text) / len(text)


def reward_func(queries, prompts, labels):
    """OpenRLHF's custom reward hook: one reward per query."""
    rewards = torch.tensor([digit_fraction(response_text(q, p)) for q, p in zip(queries, prompts)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"digit_fraction": rewards}}
