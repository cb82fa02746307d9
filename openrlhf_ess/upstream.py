"""The one module that touches OpenRLHF internals.

Everything that depends on how upstream is laid out lives here, so an upgrade is one pin bump plus
``tests/test_upstream_contract.py``:

- the pinned version and a check of it,
- upstream's CLI parser and its post-parse validation, taken from upstream's own source
  (``openrlhf/cli/train_ppo_ray.py`` builds them inline under ``if __name__ == "__main__"``; we run
  those statements rather than copying them, so every upstream flag is accepted as upstream does),
- running upstream's ``train(args)`` with some of its collaborators replaced by our subclasses,
  without mutating upstream modules (the function is re-bound to a copy of its globals),
- unwrapping Ray actor classes so we can subclass them.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import functools
import importlib
import inspect
import types
from typing import Any, Callable, Dict, Iterator, Optional

PINNED_OPENRLHF = "0.11.2"
UPSTREAM_CLI = "openrlhf.cli.train_ppo_ray"


def check_version() -> None:
    """Fail loudly when the installed openrlhf is not the pinned one."""
    from importlib.metadata import version

    found = version("openrlhf")
    if found != PINNED_OPENRLHF:
        raise RuntimeError(
            f"openrlhf-ess is pinned to openrlhf=={PINNED_OPENRLHF} but {found} is installed. "
            f"Install the pinned version: pip install --no-deps openrlhf=={PINNED_OPENRLHF}"
        )


def ray_actor_class(remote_cls: Any) -> type:
    """The plain Python class behind a ``@ray.remote`` class, for subclassing."""
    return getattr(remote_cls, "__ray_actor_class__", remote_cls)


# ---- upstream's CLI ---------------------------------------------------------------------------


def _main_block(module: types.ModuleType) -> list:
    tree = ast.parse(inspect.getsource(module))
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
        ):
            return node.body
    raise RuntimeError(f"{module.__name__}: no `if __name__ == '__main__'` block; the upstream CLI changed")


def _is_parse_args(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Assign)
        and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.Attribute)
        and stmt.value.func.attr == "parse_args"
    )


def _is_train_call(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.Name)
        and stmt.value.func.id == "train"
    )


def _split_main_block(module: types.ModuleType):
    body = _main_block(module)
    cut = [i for i, stmt in enumerate(body) if _is_parse_args(stmt)]
    if len(cut) != 1 or not _is_train_call(body[-1]):
        raise RuntimeError(
            f"{module.__name__}: expected one `args = parser.parse_args()` and a final `train(args)`; "
            "the upstream CLI changed"
        )
    return body[: cut[0]], body[cut[0] + 1 : -1]


def _exec(stmts: list, namespace: dict, filename: str) -> None:
    code = compile(ast.fix_missing_locations(ast.Module(body=stmts, type_ignores=[])), filename, "exec")
    exec(code, namespace)  # noqa: S102 - upstream's own statements, run as upstream runs them


def upstream_cli_module() -> types.ModuleType:
    return importlib.import_module(UPSTREAM_CLI)


def build_parser() -> argparse.ArgumentParser:
    """Upstream's ``train_ppo_ray`` parser with every upstream flag, built by upstream's own code."""
    module = upstream_cli_module()
    head, _ = _split_main_block(module)
    namespace = dict(vars(module))
    namespace["__name__"] = module.__name__
    _exec(head, namespace, module.__file__)
    parser = namespace["parser"]
    parser.prog = "openrlhf_ess.cli.train_ppo_ray"
    return parser


def finish_args(flat_args: argparse.Namespace) -> types.SimpleNamespace:
    """Run upstream's post-parse statements (hierarchize + its validation) on parsed flags.

    Returns the hierarchical namespace upstream's ``train(args)`` expects. Upstream's own
    ``train(args)`` call is not run: :func:`run_train` does that with our substitutions.
    """
    module = upstream_cli_module()
    _, tail = _split_main_block(module)
    namespace = dict(vars(module))
    namespace["args"] = flat_args
    _exec(tail, namespace, module.__file__)
    return namespace["args"]


def extend_choices(parser: argparse.ArgumentParser, dest: str, *extra: str) -> None:
    """Add values to an upstream flag's ``choices`` (e.g. ``fp32`` to ``--ds.param_dtype``)."""
    for action in parser._actions:
        if action.dest == dest:
            action.choices = list(action.choices) + [c for c in extra if c not in action.choices]
            return
    raise KeyError(f"upstream parser has no flag with dest {dest!r}")


# ---- running upstream code with our classes ---------------------------------------------------


def rebind(
    func: Callable,
    globals_override: Optional[Dict[str, Any]] = None,
    import_override: Optional[Dict[str, Dict[str, Any]]] = None,
) -> Callable:
    """A copy of ``func`` that sees some of its module globals (and local imports) replaced.

    ``globals_override`` replaces names looked up in the function's module; ``import_override``
    maps a module name to attribute replacements for ``from module import name`` statements run
    inside the function. Upstream modules are never mutated, so the original function and every
    other caller keep their behaviour.
    """
    namespace = dict(func.__globals__)
    namespace.update(globals_override or {})
    if import_override:
        real_import = builtins.__import__

        def _import(name, globals=None, locals=None, fromlist=(), level=0):
            module = real_import(name, globals, locals, fromlist, level)
            if name in import_override and fromlist:
                proxy = types.ModuleType(module.__name__)
                proxy.__dict__.update(vars(module))
                proxy.__dict__.update(import_override[name])
                return proxy
            return module

        namespace["__builtins__"] = dict(vars(builtins), __import__=_import)
    return types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__)


def run_train(args: types.SimpleNamespace, classes: Dict[str, Any]) -> None:
    """Run upstream's ``train(args)`` (the whole Ray job) with our classes substituted.

    ``classes`` may hold ``PolicyModelActor``, ``ReferenceModelActor``, ``CriticModelActor``, ``RewardModelActor``,
    ``create_vllm_engines``, ``PPOTrainer`` and ``PPOTrainerAsync``; missing keys keep upstream's.
    """
    module = upstream_cli_module()
    trainer_overrides = {}
    if "PPOTrainer" in classes:
        trainer_overrides["openrlhf.trainer.ppo_trainer"] = {"PPOTrainer": classes["PPOTrainer"]}
    if "PPOTrainerAsync" in classes:
        trainer_overrides["openrlhf.trainer.ppo_trainer_async"] = {"PPOTrainerAsync": classes["PPOTrainerAsync"]}
    globals_override = {
        k: v
        for k, v in classes.items()
        if k
        in ("PolicyModelActor", "ReferenceModelActor", "CriticModelActor", "RewardModelActor", "create_vllm_engines")
    }
    rebind(module.train, globals_override, trainer_overrides)(args)


def vllm_sync_group_init_drawing(draw_port: Callable[[], int]) -> Callable:
    """Upstream's ``ActorPPOTrainer._init_vllm_sync_group`` (the weight-sync group of rank 0 and every engine
    worker: the order of its remote calls, its ranks, its NCCL or Ray-collective group) with its port drawn by
    ``draw_port()`` where upstream binds ``("", 0)`` and releases the port for the group's store to bind again."""
    import socket

    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    class DrawnPortSocket(socket.socket):
        def bind(self, address):
            host, port = address
            return super().bind((host, draw_port() if port == 0 else port))

    return rebind(ActorPPOTrainer._init_vllm_sync_group, {"socket": types.SimpleNamespace(socket=DrawnPortSocket)})


def create_vllm_engines_with(actor_cls: Any) -> Callable:
    """Upstream's ``create_vllm_engines`` (placement, scheduling, kwargs) building ``actor_cls``."""
    from openrlhf.trainer.ray import vllm_engine

    return rebind(vllm_engine.create_vllm_engines, {"RolloutRayActor": actor_cls})


def rollout_actor_init_with(executor_factory: Callable) -> Callable:
    """Upstream's ``RolloutRayActor.__init__`` building its single-turn executor (the one that calls the reward
    function of ``--reward.remote_url``) with ``executor_factory(remote_rm_url)`` instead of upstream's
    ``SingleTurnAgentExecutor`` (``openrlhf_ess/utils/agent.py``: the bounded reward call)."""
    from openrlhf.trainer.ray import vllm_engine

    init = ray_actor_class(vllm_engine.RolloutRayActor).__init__
    if "SingleTurnAgentExecutor" not in init.__code__.co_names:
        raise RuntimeError(
            "upstream's RolloutRayActor.__init__ no longer builds SingleTurnAgentExecutor; see upstream.py"
        )
    return rebind(init, {"SingleTurnAgentExecutor": executor_factory})


def with_actor_trainer(init: Callable, trainer_cls: type) -> Callable:
    """``PolicyModelActor.init_model_from_pretrained`` building ``trainer_cls`` as its trainer."""
    return rebind(init, {"ActorPPOTrainer": trainer_cls})


def controller_groups(controller_args: tuple) -> Dict[str, Optional[list]]:
    """The trainer roles' actor handles from the positional arguments upstream's ``train()`` passes to the
    controller (``PPOTrainer.remote(pretrain, strategy, actor, critic, reward, reference, vllm_engines, ...)``):
    role -> handles in rank order, None for a role the run does not have."""
    names = {"actor": 2, "critic": 3, "reward": 4, "reference": 5}
    out: Dict[str, Optional[list]] = {}
    for role, index in names.items():
        group = controller_args[index] if len(controller_args) > index else None
        out[role] = group_actors(group) if group is not None else None
    return out


def group_actors(group: Any) -> list:
    """The Ray actor handles of one of upstream's ``RayActorGroup`` (one per rank, in rank order)."""
    return list(group._actor_handlers)


def actor_forward_with_log_probs(log_probs_fn: Callable) -> Callable:
    """Upstream's ``Actor.forward`` computing its token log-probs with ``log_probs_fn`` (same signature as
    ``openrlhf.models.utils.log_probs_from_logits``, which it receives the temperature-scaled fp32 logits
    and the rolled labels in; the sampling mask's seam, ``trainer/sampling_mask.py``)."""
    from openrlhf.models.actor import Actor

    return rebind(Actor.forward, {"log_probs_from_logits": log_probs_fn})


@functools.lru_cache(maxsize=None)
def train_step_with_balance(balance: Callable) -> Callable:
    """Upstream's ``BasePPOTrainer.train_step`` (unbound) balancing its experiences across DP ranks
    (``--train.dynamic_batch_enable``) with ``balance`` instead of ``balance_experiences``, a module global of
    ``openrlhf/trainer/ppo_trainer.py`` (``trainer/carried.py``: upstream's drops our per-sample attributes).
    One copy per ``balance``."""
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    step = BasePPOTrainer.train_step
    if "balance_experiences" not in step.__code__.co_names or "balance_experiences" not in step.__globals__:
        raise RuntimeError("upstream's BasePPOTrainer.train_step no longer calls balance_experiences; see upstream.py")
    return rebind(step, {"balance_experiences": balance})


def packed_layout(per_token: Any, attention_mask: Any) -> Any:
    """[B, S, ...] → [1, N, ...], N = Σ lengths: the layout upstream's packed ``Actor.forward``
    (``--ds.packing_samples``) gives the HF model and its labels. ``ring_attn_utils.unpad_and_slice_tensor`` keeps
    flash-attn's ``unpad_input`` order: the attention mask's nonzero positions, row-major (ring slicing not
    covered)."""
    keep = attention_mask.to(per_token.device).reshape(-1).nonzero().squeeze(-1)
    return per_token.reshape(-1, *per_token.shape[2:])[keep].unsqueeze(0)


def upstream_log_probs_from_logits() -> Callable:
    from openrlhf.models.utils import log_probs_from_logits

    return log_probs_from_logits


def reference_actor_class() -> type:
    """The plain class behind upstream's ``ReferenceModelActor`` (for subclassing)."""
    from openrlhf.trainer.ray.launcher import ReferenceModelActor

    return ray_actor_class(ReferenceModelActor)


def critic_actor_class() -> type:
    """The plain class behind upstream's ``CriticModelActor`` (for subclassing)."""
    from openrlhf.trainer.ray.ppo_critic import CriticModelActor

    return ray_actor_class(CriticModelActor)


def reward_actor_class() -> type:
    """The plain class behind upstream's ``RewardModelActor`` (for subclassing)."""
    from openrlhf.trainer.ray.launcher import RewardModelActor

    return ray_actor_class(RewardModelActor)


def save_model_barrier() -> None:
    """The barrier every rank reaches at the end of upstream's ``DeepspeedStrategy.save_model``, after rank 0 wrote
    (``trainer/saving.py``: rank 0 joins it itself when its write raised)."""
    from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync

    torch_dist_barrier_and_cuda_sync()


@contextlib.contextmanager
def actor_past_its_engine(actor: Any) -> Iterator[Any]:
    """Within the block, upstream's ``Actor`` forwards through the module its DeepSpeed engine wraps, not the engine:
    a backward of that forward is then not a training backward to DeepSpeed (no gradient reduction, no epilogue, no
    step state), while ZeRO-3 still gathers each layer's parameters through its module hooks. Yields the actor."""
    import torch

    engine = actor.model
    inner = getattr(engine, "module", None)
    if not isinstance(inner, torch.nn.Module):
        yield actor
        return
    actor.model = inner
    try:
        yield actor
    finally:
        actor.model = engine
