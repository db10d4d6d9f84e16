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


def run_script(script: str, model_path) -> str:
    """`script`'s output, run in a fresh process (it starts its own process group) on `model_path`."""
    result = subprocess.run(
        [sys.executable, "-c", script, str(model_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_fsdp_worker_imports_and_trains_without_ray(tiny_model_path):
    assert "trained without ray" in run_script(SCRIPT, tiny_model_path)


def test_gpu_workers_reduce_cpu_tensors_over_gloo_and_cuda_tensors_over_nccl():
    """With cpu_offload the sharded parameters and gradients stay on CPU: NCCL alone cannot reduce them."""
    from skyrl.train.workers.fsdp_worker import process_group_backend

    assert process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cpu") == "gloo"


ENTROPY_SCRIPT = textwrap.dedent(
    """
    import socket, sys
    import torch
    from transformers import AutoModelForCausalLM
    from skyrl.train.dataset.preprocess import Trajectory, Turn, collate_sequences, trajectories_to_sequences
    from skyrl.train.schema import TrainerConfig
    from skyrl.train.workers.fsdp_worker import PolicyWorker

    path, coeff = sys.argv[1], 0.5
    cfg = TrainerConfig()
    cfg.policy.optimizer.max_grad_norm = 0.0  # unclipped: the two gradients differ by the entropy term alone
    worker = PolicyWorker(cfg, 0, 1, path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker.init_process_group("127.0.0.1", port)
    turns = [Turn([5, 6, 7], [8, 9], [0.0, 0.0], [1, 1], 1.0), Turn([5, 6, 7, 8, 9, 4], [3, 2], [0.0] * 2, [1, 1])]
    batch = collate_sequences(trajectories_to_sequences([Trajectory("p", "p/0", turns)], True), 0)
    batch["advantages"] = batch["response_mask"].float()
    batch["loss_mask"] = batch["response_mask"].float()

    def gradient(entropy_coeff):
        worker.cfg.algorithm.entropy_coeff = entropy_coeff
        worker.init_model()
        batch["old_logprobs"] = worker.forward(batch)["logprobs"]
        metrics = worker.train_mini_batch(batch, keep_gradients=True)
        return worker.gradient_vector(), metrics["entropy"]

    plain, entropy = gradient(0.0)
    with_term, _ = gradient(coeff)

    # the entropy term alone, on a plain HF forward of each row: -coeff * token-mean entropy
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    entropies = []
    for row in range(len(batch)):
        tokens = batch["sequences"][row][batch["attention_mask"][row].bool()]
        response = int(batch["response_mask"][row].sum())
        logp = model(tokens[None]).logits[0, -response - 1 : -1].float().log_softmax(-1)
        entropies.append(-(logp.exp() * logp).sum(-1))
    mean_entropy = torch.cat(entropies).mean()
    (-coeff * mean_entropy).backward()
    expected = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert abs(entropy - mean_entropy.item()) < 1e-5, (entropy, mean_entropy.item())
    torch.testing.assert_close(with_term - plain, expected, rtol=1e-4, atol=1e-6)
    assert expected.abs().max() > 1e-4  # the term moves the gradient
    print("entropy term in the gradient")
    """
)


def test_the_entropy_term_reaches_the_gradient_only_when_its_coefficient_is_set(tiny_model_path):
    """The entropy metric is computed outside autograd unless `entropy_coeff` puts it in the loss."""
    assert "entropy term in the gradient" in run_script(ENTROPY_SCRIPT, tiny_model_path)
