"""Pre-flight: every input of a run checked in seconds, before Ray starts or any model loads.

:func:`check` runs in the CLI right after flag parsing. Without it a bad input is found 25-60 s later, inside a
Ray actor, as a raw upstream/vLLM/datasets traceback (or never: ``--vllm.sync_check_tol nan`` turned the weight
check off). Each check raises :class:`openrlhf_ess.config.ConfigError` naming the flag, the value, what is wrong
and the fix; a file's first bad line is named with its 1-based number.

What is checked, cheapest first (folders are created last, so a run stopped by another check leaves none); one
module per input family, each with its own tests file (``tests/test_preflight_<module>.py``):

1. ``flags``: every float flag finite: NaN never (every comparison with NaN is false, so ``tol > 0`` silently
   turns a check off); +-inf only where it means "no bound" (:data:`flags.INF_MEANS_NO_BOUND`); step and sampling
   flags that upstream divides by or vLLM rejects mid-run (``--rollout.temperature 0``: the trainer divides logits
   by it, and mu of a greedy sample is degenerate; below vLLM's floor 0.01 the engine samples at 0.01);
2. ``engine``: the installed vLLM against the releases our engine patches were read against;
3. ``model``: model folders (config.json, weights, the tokenizer upstream loads) or hub ids (cache,
   HF_HUB_OFFLINE); no network access is attempted; ``--data.max_len`` within the context vLLM accepts;
   ``--algo.advantage.opob_norm full``: every module the norm pass must take, from the meta-device module tree;
4. ``data``: prompt files as upstream's ``blending_datasets`` reads them (.jsonl/.json/.csv/.parquet/.arrow,
   folders): they parse, every record has ``--data.input_key`` (and ``--data.label_key``), no prompt is empty.
   Streamed; each file is read up to ``--data.max_samples`` records (100k JSON lines take ~0.3 s);
5. ``reward``: the reward .py (``--reward.remote_url``): compiles, imports, defines ``reward_func`` callable as
   upstream calls it, and one dry call whose values training can use; the agent .py (``--train.agent_func_path``)
   compiles and defines ``AgentExecutor``;
6. ``outputs``: output, checkpoint and log folders: created, a probe file written and removed (the final save
   must not be the first write to its folder: an unwritable one would lose the trained model); none of them is,
   holds or lies inside a model, prompt, reward or agent path; a checkpoint folder the run saves into holds no
   earlier run's checkpoints (upstream's rotation would delete them); ``--ckpt.load_enable``: the checkpoint a
   resume would load was written with the same ZeRO layout (which one is loaded, and broken ones, are
   ``trainer/resume.py``'s); a notice says where each output goes and at which steps the evals run;
7. a torch extension build lock left by a run killed during a DeepSpeed op's JIT build (every later run would
   wait on it forever) is removed with a notice, or named (``openrlhf_ess/runtime/build_locks.py``).
"""

from __future__ import annotations

import os
import time
import types
from typing import List

from openrlhf_ess.checks.preflight import data, engine, flags, model, outputs, reward
from openrlhf_ess.runtime import build_locks


def check(args: types.SimpleNamespace) -> List[str]:
    """Check every input of the run; return notices for the user. Raises :class:`openrlhf_ess.config.ConfigError`."""
    start = time.perf_counter()
    notices: List[str] = []
    flags._check_floats(args)
    flags._check_steps(args)
    flags._check_training_flags(args, notices)
    address = getattr(getattr(args, "ray", None), "address", None) or os.environ.get("RAY_ADDRESS")
    flags._check_replacement_cluster(args, notices, address)
    flags._check_sampling(args)
    engine_line = engine._check_vllm_version(args, notices)
    tokenizer = model._check_models(args, notices)
    model._check_top_k(args)
    model._check_routing_replay(args)
    model._check_opob_norm(args, notices)
    model._check_max_len(args)
    prompts = data._check_prompt_datasets(args, tokenizer, notices)
    data._check_batches_fill(args, prompts, notices)
    reward_line = reward._check_reward_file(args, tokenizer, prompts.first, notices)
    reward._check_agent_file(args)
    outputs._check_eval_steps(args, prompts.train_records, notices)
    outputs._check_outputs_are_not_inputs(args)
    outputs._check_checkpoints_of_another_run(args)
    outputs._check_resume_checkpoint(args, notices)
    folders = outputs._check_writable_dirs(args)
    notices.append(outputs.outputs_notice(args))
    build_locks.clear_stale(notices)  # a lock left by a run killed during a DeepSpeed op's JIT build: a hang
    notices.append(
        f"pre-flight checks passed in {time.perf_counter() - start:.1f} s: {prompts.summary()}"
        f"{'; ' + reward_line if reward_line else ''}; {len(folders)} output folder(s) writable"
        f"{'; ' + engine_line if engine_line else ''}."
    )
    return notices
