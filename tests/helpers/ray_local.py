"""A private Ray instance for one test: 127.0.0.1, its own temp dir, our worker set-up hook; the /dev/shm files its
processes leave (vLLM's psm_* queues: Ray ends the engine's processes with signals, so vLLM never unlinks them) are
removed when it ends, with the package's own watch (openrlhf_ess/runtime/shm_cleanup.py)."""

import contextlib
import os
import shutil
import tempfile


@contextlib.contextmanager
def local_ray(num_gpus: int = 2, num_cpus: int = 4):
    import ray

    from openrlhf_ess.runtime import shm_cleanup

    temp_dir = tempfile.mkdtemp(prefix="ray_t_", dir="/tmp")
    # before ray.init: Ray's processes inherit the run's token; the files this test process maps itself are not Ray's
    watch = shm_cleanup.ShmWatch(root_files=False).start()
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        _temp_dir=temp_dir,
        runtime_env={"env_vars": env, "worker_process_setup_hook": "openrlhf_ess.runtime.cpu_compat.apply"},
    )
    try:
        yield ray
    finally:
        watch.sample()  # files made since the last look, before Ray ends the processes
        ray.shutdown()
        watch.cleanup(wait_s=10.0)
        shutil.rmtree(temp_dir, ignore_errors=True)
        os.environ.pop("RAY_ADDRESS", None)
