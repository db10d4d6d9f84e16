"""The training worker on one device with torch and transformers only (no Ray, vLLM or Hydra).

Runs the real `PolicyWorker` (world size 1) on step-wise, prefix-shared, token-budget
micro-batches and the CUDA IPC weight hand-off (`shared_weights`) to a second process,
so it runs on a bare CUDA box. On a GPU: NCCL, bf16, a Qwen2.5-0.5B-shaped model built
from its config (random weights), packed sequences through `--attn varlen` (torch's own
varlen flash attention; the default) or `flash_attention_2` (flash-attn installed), or
padded ones through `sdpa`. With `--tiny` (what CI runs, on CPU): the tiny model, gloo,
/dev/shm. Prints tokens/s, MFU (6 x parameters x tokens / time / the device's peak bf16
FLOP/s, from a table of cards or `--peak-tflops`), peak memory, the bf16-vs-fp32 logprob
agreement, the packed layout against the padded one (`sdpa`: logprob agreement and step time), and
whether the other process read the shared weights exactly. Then the paths the first
GPU run must prove: the device memory `init_model` peaks at against the fp32 model's size (the model
loads on the CPU and moves layer by layer as it is sharded), a training step with
`cpu_offload=true` (CPU shards reduced over gloo beside NCCL), a LoRA step (trainable parameters,
optimizer state, step time against the full step) and a weight group sent in bf16 (half the bytes).

`--profile` adds the operators that took most of one training step's device time and CPU time.
`--compile` measures the worker with `trainer.policy.model.compile=true` (decoder layers and LM
head chunks through `torch.compile`; compiled in the warm-up steps).

Usage: python scripts/gpu_check.py [--tiny] [--steps 3] [--attn varlen] [--peak-tflops 989] [--profile]
       [--compile]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import resource
import socket
import tempfile
import time

import torch

from skyrl.train.dataset.preprocess import (
    Trajectory,
    Turn,
    collate_sequences,
    layout_metrics,
    prefix_groups,
    trajectories_to_sequences,
)
from skyrl.train.schema import (
    ATTN_IMPLEMENTATIONS,
    LoRAConfig,
    ModelConfig,
    OptimizerConfig,
    PolicyConfig,
    TrainerConfig,
)
from skyrl.train.workers.fsdp_worker import PolicyWorker

# dense bf16 tensor-core peaks, TFLOP/s, by a substring of torch.cuda.get_device_name()
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}
QWEN_05B = {  # Qwen2.5-0.5B's shape
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}


def build_model(tmp: str, tiny: bool) -> str:
    if tiny:
        from skyrl.train.utils.tiny_model import create_tiny_model

        return str(create_tiny_model(tmp))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN_05B)).save_pretrained(tmp)
    return tmp


def agent_batch(vocab_size: int, trajectories: int, turns: int, tiny: bool):
    """Multi-turn traces (contexts extending each other token-exactly), one row per turn."""
    rng = random.Random(0)
    scale = 1 if not tiny else 8
    episodes = []
    for t in range(trajectories):
        context, steps = [rng.randrange(3, vocab_size) for _ in range(200 // scale)], []
        for _ in range(turns):
            response = [rng.randrange(3, vocab_size) for _ in range(rng.randint(50, 300) // scale)]
            steps.append(Turn(list(context), response, [0.0] * len(response), [1] * len(response)))
            context += response + [rng.randrange(3, vocab_size) for _ in range(rng.randint(20, 200) // scale)]
        episodes.append(Trajectory(f"p{t}", f"p{t}/0", steps))
    sequences = trajectories_to_sequences(episodes, step_wise=True)
    batch = collate_sequences(sequences, pad_token_id=0)
    batch["prefix_group"] = torch.tensor(prefix_groups(sequences))
    gen = torch.Generator().manual_seed(0)
    batch["loss_mask"] = batch["response_mask"].float()
    batch["advantages"] = torch.randn(batch["loss_mask"].shape, generator=gen) * batch["loss_mask"]
    return batch


def make_worker(
    path: str,
    bf16: bool,
    budget: int,
    attn: str,
    mesh=None,
    lora_rank: int = 0,
    cpu_offload: bool = False,
    compile: bool = False,
) -> PolicyWorker:
    cfg = TrainerConfig(
        policy=PolicyConfig(
            model=ModelConfig(attn_implementation=attn, compile=compile),
            optimizer=OptimizerConfig(lr=1e-5),
            bf16=bf16,
            lora=LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank),
            cpu_offload=cpu_offload,
        ),
        max_tokens_per_micro_batch=budget,
    )
    worker = PolicyWorker(cfg, 0, 1, path)
    if mesh is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        worker.init_process_group("127.0.0.1", port)
    else:
        worker.mesh = mesh  # a second model in the same process group
    worker.init_model()
    return worker


def read_shared(group, queue) -> None:
    """In another process: map the shared group and report each tensor's sum."""
    from skyrl.train.inference.shared_weights import open_shared

    queue.put({name: float(t.double().sum()) for name, t in open_shared(group)})


def ipc_handoff(worker: PolicyWorker) -> bool:
    """Hand the first decoder layer to another process through `SharedBuffer`; True when it read every
    tensor exactly."""
    from skyrl.train.inference.shared_weights import SharedBuffer, packed_nbytes

    group = next(worker.iter_weight_groups())
    expected = {name: float(t.double().sum()) for name, t in group.items()}
    device = next(worker.model.parameters()).device
    buffer = SharedBuffer(packed_nbytes(group.values()), device)
    try:
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        reader = context.Process(target=read_shared, args=(buffer.share(group), queue))
        reader.start()
        got = queue.get(timeout=300)
        reader.join(timeout=60)
    finally:
        buffer.close()
    return got == expected


def timed_step(worker: PolicyWorker, batch) -> tuple[float, dict[str, float]]:
    """Seconds of one optimizer step (after a warm-up) and its metrics."""
    worker.train_mini_batch(batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    metrics = worker.train_mini_batch(batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, metrics


def profile_step(worker: PolicyWorker, batch, on_gpu: bool) -> str:
    """The operators of one optimizer step, most device time first, then most CPU time with their children
    (on CPU: most CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        worker.train_mini_batch(batch)
        if on_gpu:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    keys = ["self_device_time_total", "cpu_time_total"] if on_gpu else ["self_cpu_time_total"]
    return "\n".join(averages.table(sort_by=key, row_limit=15, max_name_column_width=60) for key in keys)


def optimizer_bytes(worker: PolicyWorker) -> int:
    state = [t for s in worker.optimizer.state.values() for t in s.values() if t.dim() > 0]
    return sum(t.numel() * t.element_size() for t in state)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny model (the CPU check CI runs)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16384, help="tokens per micro-batch")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak bf16 TFLOP/s (default: by name)")
    parser.add_argument("--profile", action="store_true", help="print one step's costliest operators")
    parser.add_argument("--compile", action="store_true", help="the measured worker with model.compile=true")
    parser.add_argument("--attn", default="varlen", choices=ATTN_IMPLEMENTATIONS, help="attn_implementation")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    attn = args.attn
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(tmp, args.tiny)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        worker = make_worker(path, bf16=True, budget=args.max_tokens, attn=attn, compile=args.compile)
        init_peak = torch.cuda.max_memory_allocated() if on_gpu else None
        params = sum(p.numel() for p in worker.model.parameters())
        batch = agent_batch(worker.model.config.vocab_size, args.trajectories, args.turns, args.tiny)
        worker.forward(batch)  # warm-up
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        batch["old_logprobs"] = worker.forward(batch)["logprobs"]
        forward_seconds = time.perf_counter() - start  # the result is on the CPU: synchronised
        ids = batch.metadata["trajectory_ids"]
        trained = int(
            layout_metrics(batch["prefix_group"], batch["attention_mask"], ids)["batch/trained_tokens"]
        )
        worker.train_mini_batch(batch)  # warm-up
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(args.steps):
            metrics = worker.train_mini_batch(batch)
        if on_gpu:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
        table = profile_step(worker, batch, on_gpu) if args.profile else None
        peak = (
            torch.cuda.max_memory_allocated()
            if on_gpu
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        peak_tflops = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device), None)
        tokens_per_s = trained / seconds
        mfu = (
            f"{6 * params * tokens_per_s / (peak_tflops * 1e12):.1%}"
            if peak_tflops
            else "n/a (give --peak-tflops)"
        )
        print(
            f"device {device}, {params / 1e6:.1f}M parameters, attention {attn}, world size 1 ({worker.mesh.device_type})"
            + (", decoder layers and LM head compiled" if args.compile else "")
        )
        print(
            f"train step: {len(batch)} step-wise rows, {trained:,} tokens forwarded (prefix-shared), "
            f"{seconds:.3f} s/step, {tokens_per_s:,.0f} tokens/s, MFU {mfu}, grad_norm {metrics['grad_norm']:.3f}"
        )
        print(
            f"forward (no grad): {forward_seconds:.3f} s, {trained / forward_seconds:,.0f} tokens/s, MFU "
            + (
                f"{2 * params * trained / forward_seconds / (peak_tflops * 1e12):.1%}"
                if peak_tflops
                else "n/a"
            )
        )
        print(f"peak memory {peak / 2**30:.2f} GiB")
        if table is not None:
            print(table)
        reference = make_worker(path, bf16=False, budget=args.max_tokens, attn=attn, mesh=worker.mesh)
        fp32 = reference.forward(batch)["logprobs"]
        bf16 = batch["old_logprobs"]  # the same weights, before the steps
        mask = batch["response_mask"].bool()
        gap = (bf16 - fp32)[mask].abs()
        padded = make_worker(path, True, args.max_tokens, "sdpa", mesh=worker.mesh, compile=args.compile)
        layout_gap = (padded.forward(batch)["logprobs"] - bf16)[mask].abs()
        padded_seconds, _ = timed_step(padded, batch)
        handed_off = ipc_handoff(worker)
        full_seconds, _ = timed_step(worker, batch)
        lora = make_worker(path, True, args.max_tokens, attn, worker.mesh, lora_rank=16, compile=args.compile)
        lora_seconds, lora_metrics = timed_step(lora, batch)
        lora_params = sum(p.numel() for p in lora._trainable())
        offload = make_worker(path, True, args.max_tokens, attn, mesh=worker.mesh, cpu_offload=True)
        _, offload_metrics = timed_step(offload, batch)
        group = next(worker.iter_weight_groups("bfloat16"))
        fp32_group = next(worker.iter_weight_groups())
        bf16_bytes = sum(t.numel() * t.element_size() for t in group.values())
        fp32_bytes = sum(t.numel() * t.element_size() for t in fp32_group.values())
    print(f"bf16 vs fp32 logprobs: mean |diff| {gap.mean():.2e}, max {gap.max():.2e}")
    print(
        f"{attn} vs sdpa (padded to each micro-batch's longest) in bf16: logprobs mean |diff| "
        f"{layout_gap.mean():.2e}, max {layout_gap.max():.2e}; sdpa {padded_seconds:.3f} s/step"
    )
    print(f"IPC hand-off of a weight group to another process: {'exact' if handed_off else 'MISMATCH'}")
    model_bytes = 4 * params
    print(
        "init_model peak device memory "
        + (f"{init_peak / 2**30:.2f} GiB" if init_peak is not None else "n/a (cpu)")
        + f", the fp32 model {model_bytes / 2**30:.2f} GiB"
    )
    print(
        f"LoRA rank 16: {lora_params:,} trainable parameters, optimizer state {optimizer_bytes(lora) / 2**20:.1f} "
        f"MiB (full {optimizer_bytes(worker) / 2**20:.1f} MiB), {lora_seconds:.3f} s/step (full "
        f"{full_seconds:.3f}), grad_norm {lora_metrics['grad_norm']:.3f}"
    )
    print(
        f"cpu_offload step: grad_norm {offload_metrics['grad_norm']:.3f}"
        + ("" if on_gpu else " (cpu: nothing to offload)")
    )
    print(f"a weight group in bf16: {bf16_bytes:,} bytes, in fp32 {fp32_bytes:,}")
    finite = all(
        torch.isfinite(torch.tensor(m["grad_norm"])) for m in (metrics, lora_metrics, offload_metrics)
    )
    if not handed_off or not finite or 2 * bf16_bytes != fp32_bytes:
        raise SystemExit("gpu_check failed")


if __name__ == "__main__":
    main()
