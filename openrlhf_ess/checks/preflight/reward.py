"""Pre-flight, reward and agent files: the reward .py (``--reward.remote_url``) compiles, imports, defines
``reward_func`` callable as upstream calls it, and one dry call returns values training can use
(:func:`_dry_call_reward`); the agent .py (``--train.agent_func_path``) compiles and defines ``AgentExecutor``."""

from __future__ import annotations

import ast
import inspect
import multiprocessing
import os
import sys
import types
from typing import Any, List, Optional

from openrlhf_ess.checks.preflight.model import first_line
from openrlhf_ess.config import ConfigError
from openrlhf_ess.utils.reward_values import describe_count

REWARD_IMPORT_TIMEOUT_S = 10.0


REWARD_CALL_TIMEOUT_S = 5.0


def _defined_names(tree: ast.Module) -> Optional[set]:
    """Top-level names a module defines (descending into if/try/with blocks); None after ``import *``."""
    names: set = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []) or [])
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
    return names


def _compile_source(flag: str, path: str, name: str) -> ast.Module:
    """The file exists, is Python and compiles (without running it); its syntax tree."""
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file ({os.path.abspath(path)}).")
    try:
        with open(path, "rb") as f:
            source = f.read()
        tree = compile(source, path, "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
        compile(tree, path, "exec", dont_inherit=True)
    except SyntaxError as e:
        code = f": {e.text.strip()}" if e.text and e.text.strip() else ""
        raise ConfigError(
            f"{flag} {path} line {e.lineno}: syntax error ({e.msg}){code}. Upstream imports this file in every vLLM "
            f"engine, so the run would die at start-up; fix the line (python -m py_compile {path} checks it)."
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag} {path}: not a Python file ({first_line(e)}).") from None
    names = _defined_names(tree)
    if names is not None and name not in names:
        funcs = sorted(
            n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        )
        raise ConfigError(
            f"{flag} {path}: defines no {name} (it defines: {', '.join(funcs) or 'nothing'}). Upstream looks it up by "
            f"that name; rename your {'function' if name == 'reward_func' else 'class'} to {name}."
        )
    return tree


def _check_agent_file(args: types.SimpleNamespace) -> None:
    path = args.train.agent_func_path
    if not path:
        return
    if not path.endswith(".py"):
        raise ConfigError(f"--train.agent_func_path {path}: must be a Python file (.py) defining AgentExecutor.")
    _compile_source("--train.agent_func_path", path, "AgentExecutor")


def _check_reward_file(args: types.SimpleNamespace, tokenizer, first, notices: List[str]) -> Optional[str]:
    """--reward.remote_url as a .py file (upstream loads the first entry's reward_func when it ends in .py)."""
    urls = args.reward.remote_url
    if not urls or args.train.agent_func_path or not urls[0].endswith(".py"):
        return None
    flag, path = "--reward.remote_url", urls[0]
    _compile_source(flag, path, "reward_func")
    eos = (getattr(tokenizer, "eos_token", None) or "") if tokenizer is not None else ""
    if first is not None:
        prompt, label = first[0]["prompt"], first[0]["label"]
    else:
        prompt, label = "1 + 1 =", ("" if args.data.label_key is None else "2")
    return _dry_call_reward(flag, path, args, prompt + " 2" + eos, prompt, label, notices)


def _reward_probe(path: str, query: str, prompt: str, label: Any, conn) -> None:
    """In a forked child: import the file, check reward_func, call it once; send plain-data reports back."""
    import importlib.util
    import traceback

    def where(exc: BaseException) -> str:
        lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
        return f" line {lines[-1]}" if lines else ""

    try:
        spec = importlib.util.spec_from_file_location("reward_func", path)  # upstream's loading, verbatim
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as e:
        conn.send(("import", where(e), first_line(e)))
        return
    func = getattr(module, "reward_func", None)
    if not callable(func):
        conn.send(("missing", "", type(func).__name__))
        return
    if inspect.iscoroutinefunction(func):
        conn.send(("async", "", ""))
        return
    try:
        signature = inspect.signature(func)
        signature.bind([query], [prompt], [label])
    except TypeError as e:
        conn.send(("signature", str(signature), str(e)))
        return
    except ValueError:
        pass  # no introspectable signature (a builtin): the call tells
    conn.send(("imported", "", ""))
    try:
        out = func([query], [prompt], [label])  # upstream's call: one sample at a time, positional
    except BaseException as e:
        conn.send(("raised", where(e), first_line(e)))
        return
    if not isinstance(out, dict):
        conn.send(("returned", type(out).__name__, None))
        return
    # upstream reads out["scores"], or out["rewards"] when it is None or missing
    keys = [k for k in REWARD_KEYS if k in out and not (k == "scores" and out[k] is None)]
    detail = {k: (*describe_count(out[k]), _as_training_tensor(out[k]), repr(out[k])[:80]) for k in keys}
    detail["extra_logs"] = _extra_logs_error(out.get("extra_logs"))
    conn.send(("returned", "dict", detail))


REWARD_KEYS = ("rewards", "scores")


def _as_training_tensor(value: Any) -> Optional[str]:
    """What training does with a returned 'rewards'/'scores' value of one query: upstream's
    ``SamplesGenerator._process_response_into_experience`` builds ``torch.tensor([value])``; the error it raises
    (``ValueError: too many dimensions 'str'`` for a list of strings), or None if it works."""
    import torch

    try:
        torch.tensor([value])
    except Exception as e:
        return first_line(e)
    return None


def _extra_logs_error(extra: Any) -> Optional[str]:
    """Upstream logs each extra_logs value as ``torch.tensor([value])`` (a tensor's first element); its error."""
    if not extra:
        return None
    if not isinstance(extra, dict):
        return f"'extra_logs' is a {type(extra).__name__}, not a dict (upstream calls extra_logs.items())"
    import torch

    for key, value in extra.items():
        if isinstance(value, torch.Tensor):
            if value.numel() == 0:
                return f"extra_logs[{key!r}] is an empty tensor (upstream logs value.flatten()[0])"
            value = value.flatten()[0].item()
        error = _as_training_tensor(value)
        if error:
            return f"extra_logs[{key!r}] = {repr(value)[:60]}: torch.tensor([value]) fails with {error}"
    return None


def _dry_call_reward(flag, path, args, query, prompt, label, notices: List[str]) -> Optional[str]:
    """Import the reward file and call reward_func once, in a forked child process.

    A dry call can have side effects. In a child process (forked: the modules already imported here cost nothing)
    those on the process (globals, counters, signals, even killing itself) stay there, and a slow or hung function
    is killed at the timeout; effects outside the process (files, a reward server) are the function's own, as in
    every engine. The input is the first prompt as upstream preprocesses it, a 1-token response, and its label;
    the batch is one sample, as upstream calls it (``SingleTurnAgentExecutor._fetch_rewards_via_func``). Only the
    returned structure is checked: a dict whose 'rewards' (and 'scores') hold one value. An exception or a timeout
    is a notice, not an error: it may depend on the made-up response.
    """
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_reward_probe, args=(path, query, prompt, label, child), daemon=True)
    sys.stdout.flush()
    sys.stderr.flush()
    proc.start()
    child.close()
    report = None
    try:
        for timeout in (REWARD_IMPORT_TIMEOUT_S, REWARD_CALL_TIMEOUT_S):
            if not parent.poll(timeout):
                report = ("timeout", "import" if report is None else "call", timeout)
                break
            report = parent.recv()
            if report[0] != "imported":
                break
    except EOFError:  # the child died without a word
        proc.join(1)
        report = ("died", "", proc.exitcode)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(1)
        parent.close()
    return _reward_verdict(flag, path, args, report, notices)


def _reward_verdict(flag, path, args, report, notices: List[str]) -> Optional[str]:
    stage, where, detail = report
    upstream_call = "reward_func(queries, prompts, labels)"
    if stage == "import":
        raise ConfigError(
            f"{flag} {path}{where}: importing it fails: {detail}. Upstream imports this file in every vLLM engine, "
            "so the run would die at start-up; fix it (python -c \"import runpy; runpy.run_path('<file>')\" shows "
            "the traceback)."
        )
    if stage == "missing":
        raise ConfigError(f"{flag} {path}: reward_func is a {detail}, not a function; define {upstream_call}.")
    if stage == "async":
        raise ConfigError(
            f"{flag} {path}: reward_func is an async function; upstream calls it in a worker thread without awaiting "
            "it (the reward would be a coroutine). Make it a plain def."
        )
    if stage == "signature":
        raise ConfigError(
            f"{flag} {path}: reward_func{where} cannot be called as upstream calls it, {upstream_call} with three "
            f"positional lists ({detail}). Give it three parameters."
        )
    policy = args.reward.failure_policy
    if stage == "raised":
        if detail.split(":")[0] in ("SystemExit", "KeyboardInterrupt", "GeneratorExit"):  # not an Exception
            notices.append(
                f"{flag} {path}{where}: a dry call of reward_func on the first prompt with a made-up response raised "
                f"{detail}. A reward function reports a failure by raising an Exception, not with sys.exit() or "
                "another BaseException (upstream's engine loop would die of it); during the run such a call is a "
                + (
                    "failed reward, which stops the run naming this file (--reward.failure_policy drop would drop "
                    "the sample instead): raise an Exception or return the dict."
                    if policy != "drop"
                    else "failed reward and its sample is dropped (--reward.failure_policy drop)."
                )
            )
            return "reward_func dry call raised (see above)"
        notices.append(
            f"{flag} {path}{where}: a dry call of reward_func on the first prompt with a made-up response raised "
            f"{detail}. Upstream logs such a failure and leaves that sample's reward None"
            + (
                ", which crashes the run later with --reward.failure_policy off (the default): check the function."
                if policy == "off"
                else f" (--reward.failure_policy {policy} handles it)."
            )
        )
        return "reward_func dry call raised (see above)"
    if stage in ("timeout", "died"):
        what = (
            f"did not {'import' if where == 'import' else 'return'} within {detail:.0f} s"
            if stage == "timeout"
            else f"ended its process (exit code {detail})"
        )
        notices.append(f"{flag} {path}: a dry call of reward_func {what}; its output was not checked before start.")
        return "reward_func not dry-called"
    if where != "dict":
        raise ConfigError(
            f"{flag} {path}: reward_func returned a {where} on a dry call with one sample; upstream needs a dict "
            "{'rewards': ..., 'scores': ..., 'extra_logs': {...}} with one reward per query (openrlhf/utils/agent.py)."
        )
    if "rewards" not in detail:
        raise ConfigError(
            f"{flag} {path}: reward_func returned a dict without 'rewards' on a dry call; upstream reads "
            "out['rewards'] (one value per query; 'scores' defaults to it)."
        )
    extra_error = detail.pop("extra_logs", None)
    for key, (kind, count, tensor_error, shown) in detail.items():
        if count != 1:
            got = f"{count} values" if count is not None else f"a {kind}"
            raise ConfigError(
                f"{flag} {path}: reward_func returned {got} as '{key}' for 1 query on a dry call; upstream calls it "
                f"with one query at a time and needs exactly one number per query (torch.tensor([{key}]))."
            )
        if tensor_error:  # one value, but not a number: e.g. ['0.5'], which training cannot turn into a tensor
            raise ConfigError(
                f"{flag} {path}: reward_func returned {shown} as '{key}' on a dry call; training turns it into "
                f"torch.tensor([{key}]) (upstream's SamplesGenerator), which fails: {tensor_error}. Return one number "
                "per query (a float, or a torch tensor of one float)."
            )
    if extra_error:
        raise ConfigError(
            f"{flag} {path}: reward_func's {extra_error} on a dry call; training logs every extra_logs value as a "
            "number. Return numbers (floats or one-element tensors) in extra_logs."
        )
    return "reward_func dry call returned 1 reward for 1 query"
