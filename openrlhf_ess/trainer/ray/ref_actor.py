"""Reference model actor: upstream's ``ReferenceModelActor`` scoring over the kept support (--algo.sampling_mask).

Mirrors ``openrlhf/trainer/ray/launcher.py``. Used with ``--algo.sampling_mask keep`` and ``--algo.routing_replay``
(π_ref's MoE layers replay the engine's experts, ``trainer/routing_replay.py``). With the mask, log π_ref,
which enters the KL term (in the reward or the loss), is renormalised over the support each token was sampled
from, like π_θ and π_prox (``trainer/sampling_mask.py``), so the KL compares two distributions on the same
support instead of charging the truncation (log Z_t) as divergence.
"""

from __future__ import annotations

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

import ray  # noqa: E402

from openrlhf_ess import upstream  # noqa: E402
from openrlhf_ess.trainer import routing_replay, sampling_mask  # noqa: E402
from openrlhf_ess.trainer.ray.rendezvous import RendezvousPort  # noqa: E402


class ReferenceModelActorImpl(RendezvousPort, upstream.reference_actor_class()):
    def init_model_from_pretrained(self, strategy, pretrain):
        """Upstream's init, then the log-prob seam on its Actor and the engine's stop tokens."""
        super().init_model_from_pretrained(strategy, pretrain)
        sampling_mask.install(self.model)
        self.stop_ids = sampling_mask.stop_token_ids(pretrain)

    def forward(
        self,
        sequences,
        action_mask=None,
        attention_mask=None,
        return_output=False,
        packed_seq_lens=None,
        mm_train_inputs_list=None,
        rollout_kept_counts=None,
        rollout_routes=None,
    ):
        """Extends upstream's: with ``rollout_kept_counts``, log π_ref over each token's kept support; with
        ``rollout_routes`` (--algo.routing_replay), π_ref's MoE layers use the engine's experts."""
        with (
            routing_replay.applied(self.model, rollout_routes, attention_mask=attention_mask),
            sampling_mask.applied(rollout_kept_counts, sequences, attention_mask, self.stop_ids),
        ):
            return super().forward(
                sequences, action_mask, attention_mask, return_output, packed_seq_lens, mm_train_inputs_list
            )


ReferenceModelActor = ray.remote(num_gpus=1)(ReferenceModelActorImpl)
