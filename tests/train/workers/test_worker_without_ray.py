"""A worker is a plain class: it imports and trains in a bare process where Ray cannot be imported."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent(
    """
    import socket, sys

    class BlockRay:  # any import of ray fails, as on a machine without it
        def find_spec(self, name, path=None, target=None):
            if name == "ray" or name.startswith("ray."):
                raise ImportError("ray is not available here")

    sys.meta_path.insert(0, BlockRay())
    from skyrl.train.dataset.preprocess import Trajectory, Turn, collate_sequences, trajectories_to_sequences
    from skyrl.train.schema import TrainerConfig
    from skyrl.train.workers.fsdp_worker import PolicyWorker

    cfg = TrainerConfig()
    cfg.policy.optimizer.lr = 1e-3
    worker = PolicyWorker(cfg, 0, 1, sys.argv[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker.init_process_group("127.0.0.1", port)
    worker.init_model()
    turns = [Turn([5, 6, 7], [8, 9], [0.0, 0.0], [1, 1], 1.0), Turn([5, 6, 7, 8, 9, 4], [3], [0.0], [1])]
    batch = collate_sequences(trajectories_to_sequences([Trajectory("p", "p/0", turns)], True), 0)
    batch["advantages"] = batch["response_mask"].float()
    batch["old_logprobs"] = worker.forward(batch)["logprobs"]
    metrics = worker.train_mini_batch(batch)
    assert metrics["grad_norm"] > 0, metrics
    assert "ray" not in sys.modules
    print("trained without ray")
    """
)


def test_fsdp_worker_imports_and_trains_without_ray(tiny_model_path):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained without ray" in result.stdout


def test_gpu_workers_reduce_cpu_tensors_over_gloo_and_cuda_tensors_over_nccl():
    """With cpu_offload the sharded parameters and gradients stay on CPU: NCCL alone cannot reduce them."""
    from skyrl.train.workers.fsdp_worker import process_group_backend

    assert process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cpu") == "gloo"
