"""The error of a failed engine contract, in a module of its own so that the engine actor
(``trainer/ray/vllm_engine.py``) and the checks it runs from other rooms (``trainer/routing_replay.py``) can both
import it without importing each other (that was the package's one import circle)."""


class EngineContractError(RuntimeError):
    """A GPU-path contract of the engine failed its start-up self-check (the message names contract and fix)."""
