"""Weight sync from the policy worker to an inference engine: every path next to bare torch.distributed.

1. object_store: `client.update_weights(policy.full_state_dict(), v)` (gather to rank 0,
   `ray.put`, the engine fetches, validates and loads).
2. broadcast: `client.broadcast_weights(spec, v, send)` (gloo on CPU; policy rank 0
   gathers and broadcasts one decoder layer at a time, the engine receives and loads).
3. ipc: `client.share_weights(spec, v, send)` (/dev/shm on CPU; the policy rank packs one
   decoder layer at a time into a shared buffer, the engine maps it and loads).
4. bare: two plain processes; rank 0 broadcasts the same state dict with
   `torch.distributed` (gloo) and rank 1 copies it into its model (`load_state_dict`).

Prints the median seconds per sync of each (after one warm-up) and the ratio
bare / ours (1.0: no overhead over the raw transfer).

Usage: python scripts/bench_weight_sync.py [--backend hf|vllm] [--hidden 512] [--layers 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from skyrl.train.inference import InferenceEngineClient, InferenceEngineConfig
from skyrl.train.inference.weight_sync import WeightSyncGroup
from skyrl.train.schema import TrainerConfig
from skyrl.train.utils.tiny_model import create_tiny_model
from skyrl.train.workers.actor_group import ActorGroup, create_placement_group, node_free_port
from skyrl.train.workers.fsdp_worker import PolicyWorker


def median_seconds(sync, repeats: int) -> float:
    sync()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bare_rank(rank: int, port: int, model_path: str, repeats: int, result: mp.Queue) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    state = model.state_dict()

    def sync() -> None:
        if rank == 0:
            for tensor in state.values():
                dist.broadcast(tensor, 0)
        else:
            received = {name: torch.empty_like(t) for name, t in state.items()}
            for tensor in received.values():
                dist.broadcast(tensor, 0)
            model.load_state_dict(received)
        dist.barrier()

    seconds = median_seconds(sync, repeats)
    if rank == 1:
        result.put(seconds)
    dist.destroy_process_group()


def bare_seconds(model_path: str, repeats: int) -> float:
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    _, port = node_free_port()
    procs = [ctx.Process(target=_bare_rank, args=(r, port, model_path, repeats, result)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = result.get()
    for p in procs:
        p.join()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model_path = str(
        create_tiny_model(
            tempfile.mkdtemp(prefix="bench-sync-"),
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            intermediate_size=4 * args.hidden,
            vocab_size=512,
        )
    )
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    # one torch thread (placement.cpus_per_worker=1, the default)
    policy = ActorGroup(PolicyWorker, TrainerConfig(), model_path, 1, create_placement_group(1))
    engine_cfg = InferenceEngineConfig(backend=args.backend, device="cpu", kv_cache_memory_bytes=256 << 20)
    client = InferenceEngineClient.from_config(engine_cfg, model_path)
    num_params = sum(t.numel() for t in policy.full_state_dict().values())
    version = iter(range(1, 10_000))

    def object_store() -> None:
        asyncio.run(client.update_weights(policy.rank0_ref("full_state_dict"), next(version)))

    group = WeightSyncGroup(*policy.rank0_free_port(), client.weight_sync_world_size, "gloo", timeout_s=120)

    asyncio.run(client.init_weight_sync(group, lambda: policy.run_async("init_weight_sync", group)))
    spec = policy.run("weight_stream_spec")[0]

    def broadcast() -> None:
        asyncio.run(
            client.broadcast_weights(spec, next(version), lambda: policy.run_async("broadcast_weights"))
        )

    def ipc() -> None:
        v = next(version)
        asyncio.run(
            client.share_weights(spec, v, lambda engines: policy.run_async("share_weights", engines, v))
        )

    times = {"object_store": median_seconds(object_store, args.repeats)}
    times["broadcast"] = median_seconds(broadcast, args.repeats)
    times["ipc"] = median_seconds(ipc, args.repeats)
    client.shutdown()
    policy.kill()
    ray.shutdown()
    bare = bare_seconds(model_path, args.repeats)
    print(
        f"model {args.hidden} hidden x {args.layers} layers, {num_params / 1e6:.1f}M params (fp32), {args.backend} engine"
    )
    for name, seconds in times.items():
        print(
            f"{name:12s} {seconds:7.3f} s/sync | bare torch.distributed broadcast {bare:7.3f} s | ratio {bare / seconds:.3f}"
        )


if __name__ == "__main__":
    main()
