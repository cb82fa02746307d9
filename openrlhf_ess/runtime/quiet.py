"""Known-harmless warnings that would otherwise be printed at every step, filtered precisely.

vLLM's layer-wise reload (``reload_weights``, which our ``reload`` weight sync calls at every sync) warns
``RotaryEmbedding: Failed to load weights`` (vllm/model_executor/model_loader/reload/layerwise.py,
``finalize_layerwise_processing``). The rotary embedding's only tensor is ``cos_sin_cache``, a non-persistent
buffer vLLM computes from the model config (rope theta, maximum positions): no checkpoint holds it, so a reload
never loads it, and vLLM puts the engine's existing cache back (``_place_kernel_tensors``). Nothing is lost: the
cache does not depend on the trained weights. The filter drops that record for rotary-embedding layers only; a
layer with real weights that a sync failed to load still warns (and the sync check compares every tensor).
"""

from __future__ import annotations

import logging

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_MESSAGE = "%s: Failed to load weights"


class RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "<X>RotaryEmbedding: Failed to load weights" reload warning; passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != RELOAD_MESSAGE or not record.args:
            return True
        layer = record.args[0] if isinstance(record.args, tuple) else record.args
        return not str(layer).endswith("RotaryEmbedding")


def filter_vllm_reload_warning() -> None:
    """Install :class:`RotaryReloadFilter` on vLLM's reload logger (idempotent; call in the engine's worker)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(RotaryReloadFilter())
