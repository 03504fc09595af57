"""What the host offers `laneserve up`: free ports, CPU cores and threads per worker, GPUs, and
the model prepared on disk before any worker starts, the children's environment, and the
broker told at once when a worker exits."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from laneserve.contracts import env as lsenv
from laneserve.gpu_worker import openmp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """Whether a listener could bind 127.0.0.1:`port` now. With SO_REUSEADDR, as the API's and
    the dashboard's own listeners bind: sockets of a stack that just stopped linger in
    TIME_WAIT for up to a minute and refuse a plain bind, but not theirs."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_worker(cores: int, workers: int) -> int:
    """torch threads for each worker: the cores split evenly between the workers, at least 1.

    The broker, API and jobs runner sleep on their sockets while the stack is idle and take little
    CPU while it serves, so a lone worker gets every core; libgomp's short spin
    (gpu_worker/openmp.py) gives a core back ~30 us after each parallel region. On a machine whose
    cores other busy processes share, fewer threads can be faster (an OpenMP team whose threads
    lose their core stalls at every barrier): set `--threads` there.
    """
    return max(1, cores // max(1, workers))


def gpu_count() -> int:
    """CUDA devices visible (0 without torch's CUDA build or a driver)."""
    if not (Path("/dev/nvidiactl").exists() or lsenv.get("CUDA_VISIBLE_DEVICES")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def prepare_model(model: str, weights: bool = False) -> None:
    """Pull the bundled model and convert a GGUF once (both file-locked and atomic), so the
    workers, the API and the jobs runner load it fast and never race to download it; with
    `weights`, the float32 copy the workers will read too (`convert_gguf`).

    Raises:
        gpu_worker.errors.ModelLoadError: unknown alias, download failure, bad file.
    """
    from laneserve.gpu_worker.model_files import (
        conversion_current,
        gguf_cache_dir,
        resolve_model_path,
    )

    path = resolve_model_path(model)  # pulls a bundled alias
    if (
        path.is_file()
        and path.suffix == ".gguf"
        and not conversion_current(gguf_cache_dir(path), path, weights)
    ):
        from laneserve.gpu_worker.model_loader import (
            convert_gguf,  # imports torch: only when converting
        )

        convert_gguf(path, weights=weights)


def child_env(home: Path, threads: int, api_key: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        LANESERVE_HOME=str(home),
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.update(openmp.policy_env())  # a short spin; an explicit setting of either is passed on
    env.pop("LANESERVE_DB_URL", None)  # every child gets --db explicitly
    if api_key:
        env["LANESERVE_API_KEY"] = api_key
    else:
        env.pop("LANESERVE_API_KEY", None)
    return env


def tell_broker(front: str, name: str, pid: int, code: int) -> None:
    """A worker exited: the broker requeues its requests now, not at its next failed heartbeat."""
    if name.startswith("worker-"):
        from laneserve.broker.client import notify_worker_exited

        notify_worker_exited(front, name, pid)
