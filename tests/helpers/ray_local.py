"""A private Ray instance for one test: 127.0.0.1, its own temp dir, our worker set-up hook."""

import contextlib
import os
import shutil
import tempfile


@contextlib.contextmanager
def local_ray(num_gpus: int = 2, num_cpus: int = 4):
    import ray

    temp_dir = tempfile.mkdtemp(prefix="ray_t_", dir="/tmp")
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        _temp_dir=temp_dir,
        runtime_env={"env_vars": env, "worker_process_setup_hook": "openrlhf_ess.cpu_compat.apply"},
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        os.environ.pop("RAY_ADDRESS", None)
