"""What a ``reward_func`` returned, counted as upstream uses it: shared by the pre-flight dry call
(``checks/preflight/reward.py``) and every call during the run (``utils/agent.py``). Imports nothing heavy: it runs
in the engine actors too."""

from __future__ import annotations

from typing import Any, Optional, Tuple


def describe_count(value: Any) -> Tuple[str, Optional[int]]:
    """(type name, number of values) of a returned reward, as upstream turns it into ``torch.tensor([value])``."""
    kind = type(value).__name__
    if value is None or isinstance(value, (str, bytes, dict)):
        return kind, None
    if isinstance(value, (bool, int, float)):
        return kind, 1
    numel = getattr(value, "numel", None)
    if callable(numel):  # torch tensor
        return kind, int(numel())
    if hasattr(value, "size") and hasattr(value, "shape"):  # numpy array / scalar
        return kind, int(value.size)
    try:
        return kind, len(value)
    except TypeError:
        return kind, None


def count_problem(out: Any, n_queries: int) -> Optional[str]:
    """Why ``out`` (one ``reward_func`` call's return) is not one reward per query, or None: a dict whose
    'rewards' (and 'scores', if present) hold ``n_queries`` values each."""
    if not isinstance(out, dict):
        return f"returned a {type(out).__name__}, not a dict with 'rewards'"
    if "rewards" not in out:
        return "returned a dict without 'rewards'"
    for key in ("rewards", "scores"):
        if key in out and out[key] is not None:
            kind, count = describe_count(out[key])
            if count != n_queries:
                got = f"{count} values" if count is not None else f"a {kind}"
                return f"returned {got} as '{key}' for {n_queries} quer{'y' if n_queries == 1 else 'ies'}"
    return None


def nonfinite_problem(out: dict) -> Optional[str]:
    """Why a well-counted return (:func:`count_problem` is None) holds a NaN or infinite reward, or None."""
    import math

    for key in ("rewards", "scores"):
        value = out.get(key)
        if value is None:
            continue
        if hasattr(value, "detach"):  # torch tensor
            values = value.detach().float().reshape(-1).tolist()
        elif hasattr(value, "tolist"):  # numpy
            values = list(value.reshape(-1).tolist()) if hasattr(value, "reshape") else [value.tolist()]
        elif isinstance(value, (list, tuple)):
            values = list(value)
        else:
            values = [value]
        bad = [v for v in values if isinstance(v, (int, float)) and not math.isfinite(v)]
        if bad:
            return f"returned a non-finite {key[:-1]} ({bad[0]})"
    return None
