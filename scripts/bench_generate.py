"""Generation throughput through an engine actor + client, each next to the bare library in the same run.

1. vllm: `InferenceEngineClient` over one vLLM engine actor, against a bare
   in-process `vllm.LLM.generate` with the same engine settings.
2. hf: `InferenceEngineClient` over one hf engine actor, against a bare
   `model.generate` on the same batch.

Same model, prompts and sampling for each pair: temperature 1, logprobs of the
sampled tokens on both sides, and on the hf pair seed 0 on both sides (the engine
seeds its batch with the first request's seed), so both sample the same tokens.
Both sides are warmed up, then their timed runs alternate (ours, bare, bare,
ours, ...) so a change in machine load hits both alike. Prints generated tokens/s
(median of `--repeats` timed runs per side) and the ratio of the medians
ours / bare (target >= 0.9); `--verbose` also prints every run.

Usage: python scripts/bench_generate.py [--backends vllm,hf] [--prompts 64] [--prompt-len 32]
       [--max-tokens 128] [--repeats 5] [--threads 1] [--model PATH] [--hidden-size 64 --layers 2]
       [--hf-batch-wait-s 0.005] [--verbose]
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

from skyrl.train.inference import InferenceEngineClient, InferenceEngineConfig, SamplingParams
from skyrl.train.utils.tiny_model import create_tiny_model

KV_CACHE_BYTES = 256 << 20


def interleaved_tokens_per_s(ours_run, bare_run, repeats: int) -> tuple[list[float], list[float]]:
    """Tokens/s of each timed run of each side; the runs alternate sides (and which goes first) after a
    warm-up of each, so a change in machine load hits both sides alike."""
    ours_run()
    bare_run()
    rates: dict[object, list[float]] = {ours_run: [], bare_run: []}
    for i in range(repeats):
        for run in (ours_run, bare_run) if i % 2 == 0 else (bare_run, ours_run):
            start = time.perf_counter()
            tokens = run()
            rates[run].append(tokens / (time.perf_counter() - start))
    return rates[ours_run], rates[bare_run]


def ours(client: InferenceEngineClient, prompts: list[list[int]], max_tokens: int):
    async def generate_all() -> int:
        outputs = await asyncio.gather(
            *(
                client.generate(p, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i))
                for i, p in enumerate(prompts)
            )
        )
        return sum(len(o.response_ids) for o in outputs)

    return lambda: asyncio.run(generate_all())


def bare_vllm(model_path: str, prompts: list[list[int]], max_tokens: int, threads: int):
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_path,
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        logprobs_mode="processed_logprobs",
        seed=0,
    )
    params = [
        VllmSamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i, logprobs=0)
        for i in range(len(prompts))
    ]
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run() -> int:
        outputs = llm.generate(token_prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return run


def bare_hf(model_path: str, prompts: list[list[int]], max_tokens: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    input_ids = torch.tensor(prompts)  # equal lengths: no padding
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        output_scores=True,
        return_dict_in_generate=True,
    )

    @torch.inference_mode()
    def run() -> int:
        torch.manual_seed(0)  # as the engine seeds its batch with the first request's seed (0)
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
        response = out.sequences[:, input_ids.shape[1] :]
        logprobs = (
            torch.stack(out.scores, 1).log_softmax(-1).gather(-1, response[..., None])
        )  # same work as ours
        done = (response == tokenizer.eos_token_id).cumsum(1)
        lengths = (done == 0).sum(1) + (done[:, -1] > 0).long()  # tokens up to and including eos
        assert logprobs.shape[1] == response.shape[1]
        return int(lengths.sum())

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="vllm,hf")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="model directory (default: a tiny Qwen2 built locally)")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads for each side (engine actor and bare)"
    )
    parser.add_argument(
        "--hf-batch-wait-s",
        type=float,
        default=InferenceEngineConfig.hf_batch_wait_s,
        help="the hf engine's batching window (default: the config default)",
    )
    parser.add_argument("--verbose", action="store_true", help="also print the rate of every timed run")
    args = parser.parse_args()

    threads = args.threads
    # Ray sets OMP_NUM_THREADS=num_cpus in the actor; the bare side gets the same (vLLM then keeps it).
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    model_path = args.model or str(
        create_tiny_model(
            tempfile.mkdtemp(prefix="bench-model-"), hidden_size=args.hidden_size, num_layers=args.layers
        )
    )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 500, (args.prompts, args.prompt_len), generator=gen).tolist()
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray.init(num_cpus=2 * threads, include_dashboard=False, logging_level="warning")
    print(
        f"model {model_path}, {args.prompts} prompts x {args.prompt_len} tokens, up to {args.max_tokens} new tokens, "
        f"temperature 1, logprobs on, {threads} CPU threads per side"
    )
    for backend in args.backends.split(","):
        cfg = InferenceEngineConfig(
            backend=backend,
            device="cpu",
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            num_cpus_per_engine=threads,
            max_num_seqs=max(256, args.prompts),
            hf_batch_wait_s=args.hf_batch_wait_s,
        )
        client = InferenceEngineClient.from_config(cfg, model_path)
        if backend == "vllm":
            bare_run = bare_vllm(model_path, prompts, args.max_tokens, threads)
            bare_name = "vllm.LLM.generate"
        else:
            bare_run = bare_hf(model_path, prompts, args.max_tokens)
            bare_name = "model.generate"
        ours_rates, bare_rates = interleaved_tokens_per_s(
            ours(client, prompts, args.max_tokens), bare_run, args.repeats
        )
        client.shutdown()
        del bare_run
        if args.verbose:
            print(
                f"{backend:5s} runs, tok/s: ours {[round(r) for r in ours_rates]} bare {[round(r) for r in bare_rates]}"
            )
        ours_rate, bare_rate = statistics.median(ours_rates), statistics.median(bare_rates)
        print(
            f"{backend:5s} actor+client {ours_rate:9.1f} tok/s | bare {bare_name} {bare_rate:9.1f} tok/s | "
            f"ratio {ours_rate / bare_rate:.3f}"
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
