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


# A script's start: `started(cfg)`, a policy worker in this process on the model at argv[1], and `batch`,
# the rows of one two-turn trajectory with every response token in the loss.
TWO_TURNS = textwrap.dedent(
    """
    import socket, sys
    import torch
    from skyrl.train.dataset.preprocess import Trajectory, Turn, collate_sequences, trajectories_to_sequences
    from skyrl.train.schema import TrainerConfig
    from skyrl.train.workers.fsdp_worker import PolicyWorker

    def started(cfg):
        worker = PolicyWorker(cfg, 0, 1, sys.argv[1])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        worker.init_process_group("127.0.0.1", port)
        return worker

    turns = [Turn([5, 6, 7], [8, 9], [0.0, 0.0], [1, 1], 1.0), Turn([5, 6, 7, 8, 9, 4], [3, 2], [0.0] * 2, [1, 1])]
    batch = collate_sequences(trajectories_to_sequences([Trajectory("p", "p/0", turns)], True), 0)
    batch["loss_mask"] = batch["response_mask"].float()
    """
)

ENTROPY_SCRIPT = TWO_TURNS + textwrap.dedent(
    """
    from transformers import AutoModelForCausalLM

    path, coeff = sys.argv[1], 0.5
    cfg = TrainerConfig()
    cfg.policy.optimizer.max_grad_norm = 0.0  # unclipped: the two gradients differ by the entropy term alone
    worker = started(cfg)
    batch["advantages"] = batch["response_mask"].float()

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


COMPILED_SCRIPT = textwrap.dedent(
    """
    import functools, socket, sys
    import torch
    from skyrl.train.dataset.preprocess import Trajectory, Turn, collate_sequences, trajectories_to_sequences
    from skyrl.train.dataset.preprocess import prefix_groups
    from skyrl.train.schema import TrainerConfig
    from skyrl.train.workers.fsdp_worker import PolicyWorker

    cfg = TrainerConfig()
    cfg.algorithm.entropy_coeff = 0.1  # the head's entropy in the compiled backward too
    cfg.max_tokens_per_micro_batch = 20  # two micro-batches
    worker = PolicyWorker(cfg, 0, 1, sys.argv[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker.init_process_group("127.0.0.1", port)
    episodes = []
    for t in range(3):  # several sequences packed into each micro-batch's one row
        context = [5 + t, 6, 7 + t]
        turns = [Turn(context, [8, 9 + t], [0.0] * 2, [1, 1]), Turn([*context, 8, 9 + t, 4], [3, 2, t], [0.0] * 3, [1] * 3)]
        episodes.append(Trajectory(f"p{t}", f"p{t}/0", turns))
    sequences = trajectories_to_sequences(episodes, True)
    batch = collate_sequences(sequences, 0)
    batch["prefix_group"] = torch.tensor(prefix_groups(sequences))
    batch["advantages"] = torch.linspace(-1, 1, batch["response_mask"].numel()).view_as(batch["response_mask"])
    batch["loss_mask"] = batch["response_mask"].float()

    def run(attn, compiled, old_logprobs=None):
        worker.cfg.policy.model.attn_implementation, worker.cfg.policy.model.compile = attn, compiled
        worker.init_model()
        logprobs = worker.forward(batch)["logprobs"] if old_logprobs is None else None
        batch["old_logprobs"] = logprobs if old_logprobs is None else old_logprobs
        metrics = worker.train_mini_batch(batch, keep_gradients=True)
        return logprobs, worker.gradient_vector(), metrics

    plain = run("sdpa", False)
    packed = run("varlen", False)
    assert worker.packed and len(worker._micro_batches(batch, 8)) == 2
    assert worker.model.config._attn_implementation == "skyrl_varlen"
    torch.testing.assert_close(packed[0], plain[0], rtol=1e-5, atol=1e-5)
    # compiled: traced by dynamo and differentiated by AOT autograd as on a GPU, but run without inductor's code
    # generation (tens of seconds of C++ compiles on a CPU; its kernels are torch's to test): the training step
    # only, from the plain old logprobs
    torch.compile = functools.partial(torch.compile, backend="aot_eager")
    compiled = run("sdpa", True, plain[0])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # the layers' and the head's
    for _, gradient, metrics in (packed, compiled):
        torch.testing.assert_close(gradient, plain[1], rtol=1e-4, atol=1e-6)
        for key in ("loss", "entropy", "approx_kl"):
            assert abs(metrics[key] - plain[2][key]) < 1e-5, (key, metrics[key], plain[2][key])
    print("varlen and compiled train like the plain path")
    """
)


def test_varlen_and_compiled_workers_train_like_the_plain_one(tiny_model_path):
    """`attn_implementation=varlen` (packed rows) and `model.compile` (decoder layers and LM-head chunks through
    torch.compile) each give the plain worker's logprobs, gradient (entropy term included) and metrics."""
    assert "varlen and compiled train like the plain path" in run_script(COMPILED_SCRIPT, tiny_model_path)


ONE_STEP_SCRIPT = TWO_TURNS + textwrap.dedent(
    """
    import math
    cfg = TrainerConfig()
    cfg.algorithm.use_kl_loss = True
    worker = started(cfg)
    batch["advantages"] = torch.linspace(-1, 1, batch["response_mask"].numel()).view_as(batch["response_mask"])

    def train(sent, attention_dropout=0.0):
        # sent: "old", a separate forward's old logprobs; "rollout", none but the engine's, 0.01 off on every token
        worker.init_model()
        for module in worker.model.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = attention_dropout
        data = batch.select([key for key in batch.keys() if key != "rollout_logprobs"])
        logprobs = worker.forward(data)["logprobs"]
        data["ref_logprobs"] = logprobs - 0.2 * data["loss_mask"]
        if sent == "old":
            data["old_logprobs"] = logprobs
        else:
            data["rollout_logprobs"] = logprobs + 0.01 * data["loss_mask"]
        torch.manual_seed(0)  # the same dropout in both
        (metrics,) = worker.train_mini_batches(data, keep_gradients=True)
        return worker.gradient_vector(), metrics

    separate, own = train("old"), train("rollout")
    torch.testing.assert_close(own[0], separate[0], rtol=1e-5, atol=1e-7)
    assert abs(own[1]["loss"] - separate[1]["loss"]) < 1e-6 and own[1]["ratio_max"] == 1.0
    assert "rollout_logprob_gap" not in separate[1] and abs(own[1]["rollout_logprob_gap"] - 0.01) < 1e-6
    # the KL penalty (k3) of the old logprobs against the reference, 0.2 below them on every token
    assert "old_kl" not in separate[1] and abs(own[1]["old_kl"] - (math.exp(-0.2) - 1 + 0.2)) < 1e-6
    # with dropout, training mode samples other logprobs: the worker's own forward in eval mode gives the old ones
    dropped_separate, dropped_own = train("old", 0.5), train("rollout", 0.5)
    assert (dropped_separate[0] - separate[0]).abs().max() > 1e-4  # the dropout changes the gradient
    torch.testing.assert_close(dropped_own[0], dropped_separate[0], rtol=1e-5, atol=1e-7)
    assert dropped_own[1]["ratio_max"] == dropped_separate[1]["ratio_max"] != 1.0
    print("one optimizer step trains on its own logprobs like on a separate forward's")

    def train_epochs(sent):
        # two mini-batches (a row each), two epochs: four optimizer steps in one call
        worker.init_model()
        data = batch.select([key for key in batch.keys() if key != "rollout_logprobs"])
        logprobs = worker.forward(data)["logprobs"]  # the driver's forward, of the rows in the same order
        data["ref_logprobs"] = logprobs - 0.2 * data["loss_mask"]
        if sent == "old":
            data["old_logprobs"] = logprobs
        else:
            data["rollout_logprobs"] = logprobs + 0.01 * data["loss_mask"]
        minis = [data.select_rows([0]), data.select_rows([1])]
        metrics = worker.train_mini_batches(minis, picks=[[(0, 0)], [(0, 1)]], epochs=2, keep_gradients=True)
        return worker.gradient_vector(), metrics

    separate, own = train_epochs("old"), train_epochs("rollout")
    assert len(own[1]) == 4 and own[1][0]["ratio_max"] == 1.0 and own[1][2]["ratio_max"] != 1.0
    assert torch.equal(own[0], separate[0])  # the last step's gradient: the same old logprobs throughout
    for theirs, ours in zip(separate[1], own[1], strict=True):
        assert ours["loss"] == theirs["loss"] and ours["ratio_max"] == theirs["ratio_max"]
        assert abs(ours["rollout_logprob_gap"] - 0.01) < 1e-6 and "rollout_logprob_gap" not in theirs
    print("a step's optimizer steps train on the worker's old logprobs like on a separate forward's")
    """
)


def test_mini_batches_sent_without_old_logprobs_train_like_ones_with_them(tiny_model_path):
    """Old logprobs the driver does not send (`PPOUpdate.old_logprobs_on_worker`): the step's only
    optimizer step takes its training forward's (a forward in eval mode first when its model has dropout);
    a step of several (mini-batches, epochs) gets them from one forward before its first, exactly the
    driver's. The worker reports the gap to the engine's logprobs, which it receives instead, and the
    old logprobs' KL."""
    out = run_script(ONE_STEP_SCRIPT, tiny_model_path)
    assert "one optimizer step trains on its own logprobs like on a separate forward's" in out
    assert "a step's optimizer steps train on the worker's old logprobs like on a separate forward's" in out
