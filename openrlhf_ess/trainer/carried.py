"""Per-sample tensors that ride on upstream's ``Experience`` as instance attributes, kept through its rebuilds.

Three features carry a per-sample tensor next to upstream's dataclass fields (not as a field: upstream's class
is not touched):

- ``rollout_kept_counts`` (B, A), A = ``action_mask``'s width, padded with ``NOT_TRUNCATED``
  (``--algo.sampling_mask keep``, ``trainer/sampling_mask.py``);
- ``rollout_routes`` [B, S, L, k], S = ``sequences``' width, padded with the "no route" sentinel
  (``--algo.routing_replay``, ``trainer/routing_replay.py``);
- ``m2po_keep`` (B, A) bool, padded with True (``--algo.m2po_tau``, paper style, ``trainer/m2po.py``).

Upstream rebuilds Experiences from the dataclass fields only (``split_experience_batch`` /
``make_experience_batch``), so an attribute is silently dropped wherever it does. Two places do, and both
are handled here, once for every attribute of :data:`REGISTRY`:

- the actors' replay buffer (``append`` splits, ``collate_fn`` batches): :func:`adopt_replay_buffer`;
- the controller's ``balance_experiences`` (``--train.dynamic_batch_enable``: split, sort by length,
  interleave across DP ranks, batch again, before the actors' ``append``): :func:`balance_experiences`, which
  upstream's ``BasePPOTrainer.train_step`` calls in our controllers (``upstream.train_step_with_balance``).

Without any registered attribute both are upstream's behaviour, untouched. A batch mixing samples with and
without an attribute raises: the step would otherwise score some rows without it.

Imports only ``models/`` (the pad values), so ``trainer/sampling_mask.py`` and ``trainer/routing_replay.py``
can call in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

import torch  # noqa: E402
from openrlhf.trainer.ppo_utils import experience as upstream_experience  # noqa: E402

from openrlhf_ess.models import routing_replay as routes_seam  # noqa: E402
from openrlhf_ess.models.sampling_mask import NOT_TRUNCATED  # noqa: E402

# info key holding each row's global id through upstream's balance (its split/make carry info per row)
ROW_ID = "_openrlhf_ess_row"


def pad_rows(rows: Sequence[torch.Tensor], width: int, value: int) -> torch.Tensor:
    """(B, width, ...) from rows [n_i, ...]: row b at columns 0..n_b − 1 (right padding, as upstream pads its
    step fields), ``value`` after; rows longer than ``width`` are cut. On the first row's device and dtype."""
    first = rows[0]
    out = torch.full((len(rows), width, *first.shape[1:]), value, dtype=first.dtype, device=first.device)
    for b, row in enumerate(rows):
        n = min(row.shape[0], width)
        out[b, :n] = row[:n]
    return out


def pad_kept(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """(B, width) kept counts, right-padded with NOT_TRUNCATED like the action mask."""
    return pad_rows(rows, width, NOT_TRUNCATED)


def pad_keep(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """(B, width) M2PO keep mask, right-padded with True (padding is outside the action mask anyway)."""
    return pad_rows(rows, width, True)


def pad_routes(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """[B, width, L, k] routes, right-padded with the sentinel of their dtype like ``sequences``."""
    return pad_rows(rows, width, routes_seam.sentinel(rows[0].dtype))


@dataclass(frozen=True)
class Carried:
    """One per-sample attribute: its name on the Experience, the field whose last dim is its width, and how
    its rows are batched (rows [n_i, ...], width → (B, width, ...))."""

    name: str
    follows: str  # "action_mask" or "sequences"
    pad: Callable[[Sequence[torch.Tensor], int], torch.Tensor]
    flag: str  # the flag that carries it, named in errors

    def width(self, experience) -> int:
        return getattr(experience, self.follows).shape[-1]


KEPT_COUNTS = Carried("rollout_kept_counts", "action_mask", pad_kept, "--algo.sampling_mask keep")
ROUTES = Carried("rollout_routes", "sequences", pad_routes, routes_seam.FLAG)
M2PO_KEEP = Carried("m2po_keep", "action_mask", pad_keep, "--algo.m2po_tau")
REGISTRY = (KEPT_COUNTS, ROUTES, M2PO_KEEP)


def batch_rows(carried: Carried, rows: Sequence[Optional[torch.Tensor]], width: int) -> Optional[torch.Tensor]:
    """The padded batch of ``rows`` (None if no row has the attribute; raises if only some have it)."""
    if any(r is None for r in rows):
        if all(r is None for r in rows):
            return None
        raise RuntimeError(f"{carried.flag}: a batch mixes samples with and without {carried.name}")
    return carried.pad(rows, width)


def batched(carried: Carried, items, width: int) -> Optional[torch.Tensor]:
    """The attribute of single-sample Experiences (replay-buffer items) as one padded batch, see
    :func:`batch_rows`."""
    return batch_rows(carried, [getattr(item, carried.name, None) for item in items], width)


# ---- the replay buffer ------------------------------------------------------------------------------------


def adopt_replay_buffer(buffer):
    """Make upstream's replay buffer (this instance) keep every registered attribute: [n, ...] per item,
    (B, width, ...) per batch. Idempotent; returns the buffer.

    On ``append`` row i of the attribute goes to the i-th new item (the last ones, after upstream's ``limit``
    trimmed the oldest), cut to the item's width as upstream cuts its step fields; on ``collate_fn`` the rows are
    padded to the batch's width. The rows are read after upstream's ``append``, whose ``to_device`` (cpu_offload)
    moves instance attributes too. (Upstream's ``sample()`` is not used by its trainers, which read the buffer
    through a DataLoader with ``collate_fn``.) Instance attributes: upstream's class is not touched.
    """
    if getattr(buffer, "_openrlhf_ess_carried", False):
        return buffer
    append, collate = buffer.append, buffer.collate_fn

    def append_carrying(experience) -> None:
        append(experience)
        for carried in REGISTRY:
            rows = getattr(experience, carried.name, None)
            if rows is None:
                continue
            new = buffer.items[len(buffer.items) - min(len(rows), len(buffer.items)) :]
            for item, row in zip(new, rows[len(rows) - len(new) :]):
                setattr(item, carried.name, row[: carried.width(item)].clone())

    def collate_carrying(batch):
        experience = collate(batch)
        items = batch[0] if buffer.dynamic_batch else batch
        for carried in REGISTRY:
            rows = batched(carried, items, carried.width(experience))
            if rows is not None:
                setattr(experience, carried.name, rows)
        return experience

    buffer.append, buffer.collate_fn = append_carrying, collate_carrying
    buffer._openrlhf_ess_carried = True
    return buffer


# ---- the controller's balance across DP ranks (--train.dynamic_batch_enable) --------------------------------


def attribute_rows(experiences, carried: Carried) -> List[Optional[torch.Tensor]]:
    """The attribute's row of every sample, in the order of the experiences' rows (None for an experience
    without it); raises if an attribute's batch size is not its experience's."""
    out: List[Optional[torch.Tensor]] = []
    for exp in experiences:
        rows, n = getattr(exp, carried.name, None), len(exp.sequences)
        if rows is not None and len(rows) != n:
            raise ValueError(f"{carried.flag}: {carried.name} has {len(rows)} rows for a batch of {n} samples")
        out.extend([None] * n if rows is None else list(rows))
    return out


def balance_experiences(experiences, args):
    """Upstream's ``balance_experiences`` (same arguments and result), with every registered attribute
    re-attached to the balanced batches.

    Each row is tagged with its global id in ``info[ROW_ID]`` (upstream's split hands each item its 0-dim
    entry, its batching gathers them into a list); after upstream's call the id picks the row's attribute, padded
    to its batch's width. The key is removed from the outputs, and the inputs get their own ``info`` back.
    Without any registered attribute, upstream's result is returned untouched.
    """
    present = [c for c in REGISTRY if any(getattr(exp, c.name, None) is not None for exp in experiences)]
    if not present:
        return upstream_experience.balance_experiences(experiences, args)
    rows: Dict[str, List[Optional[torch.Tensor]]] = {c.name: attribute_rows(experiences, c) for c in present}
    infos = [exp.info for exp in experiences]
    start = 0
    for exp in experiences:
        n = len(exp.sequences)
        exp.info = {**exp.info, ROW_ID: torch.arange(start, start + n)}
        start += n
    try:
        balanced = upstream_experience.balance_experiences(experiences, args)
    finally:
        for exp, info in zip(experiences, infos):
            exp.info = info
    for batch in balanced:
        ids = [int(i) for i in batch.info.pop(ROW_ID)]
        for carried in present:
            attribute = batch_rows(carried, [rows[carried.name][i] for i in ids], carried.width(batch))
            if attribute is not None:
                setattr(batch, carried.name, attribute)
    return balanced
