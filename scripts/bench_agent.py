"""The agent path against the env path on the same game, engine and prompts, in the same run.

1. agent: `AgentGenerator` running `examples/openai_agent/agent.py` (the `openai` client) through
   the HTTP endpoint, which records every request;
2. env: the `RolloutManager` playing the same guess_number game (the default job's), no HTTP.

With `--tools`: the tool agent's recipe (`configs/tool_agent.yaml`, the `tiny-tools` model): the Agents
SDK agent of `examples/tool_agent/agent.py` calling the calculator through function calling, against
the calculator env with function calling (calls parsed by the same parser, no HTTP). It also prints
what parsing a call (vLLM's hermes parser) and streaming an answer with a call (`stream=true`'s chunks
and events, against the JSON body) add per request, timed in process.

Both go through one vLLM engine actor (the default job's engine settings); the timed batches
alternate (agent, env, env, agent, ...) after a warm-up of each, so a change in machine load hits
both alike. Prints seconds per batch and LLM requests per second (medians of `--repeats`) and the
ratio of the medians agent / env (seconds; the endpoint's and the HTTP client's cost per step).

Usage: python scripts/bench_agent.py [--tools] [--prompts 16] [--samples 8] [--repeats 5]   (from the repo root)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples.openai_agent.agent

from skyrl.envs.calculator import CALCULATOR_TOOL
from skyrl.train.config import compose_config
from skyrl.train.generator.agent import AgentGenerator
from skyrl.train.generator.rollout import RolloutManager
from skyrl.train.inference import InferenceEngineClient
from skyrl.train.inference.engine import GenerationOutput, SamplingParams
from skyrl.train.inference.openai_format import chat_choice, events, response_body, stream_chunks
from skyrl.train.inference.openai_server import OpenAIServer
from skyrl.train.inference.tools import ToolUse
from skyrl.train.sampler import load_datasets
from skyrl.train.utils.background_loop import BackgroundLoop
from skyrl.train.utils.tiny_model import create_tiny_model
from skyrl.train.utils.tiny_tools_model import create_tiny_tools_model

ROOT = Path(__file__).resolve().parents[1]
CALL = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}\n</tool_call><|im_end|>'
)


def per_request_ms(fn, n: int = 300) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def tool_costs(server: OpenAIServer, tools: list[dict]) -> tuple[float, float]:
    """Milliseconds per request that parsing a call and streaming the answer (against its JSON body) add."""
    ids = server.tokenizer.encode(CALL)
    out = GenerationOutput(ids, [0.0] * len(ids), "stop", 0)
    params = SamplingParams(max_tokens=64)
    parse = per_request_ms(lambda: server._answer(out, params, ToolUse(tools)))
    plain = per_request_ms(lambda: server._answer(out, params, None))
    answer = server._answer(out, params, ToolUse(tools))
    response = response_body(
        "chat.completion", "m", [0] * 200, [out], [chat_choice(server.tokenizer, 0, out, answer)]
    )

    async def drain() -> None:
        async for _ in events(stream_chunks(response, include_usage=True)):
            pass

    streamed = per_request_ms(lambda: asyncio.run(drain()))
    body = per_request_ms(lambda: json.dumps(response))
    no_loop = per_request_ms(lambda: asyncio.run(asyncio.sleep(0)))  # asyncio.run's own cost
    return parse - plain, streamed - no_loop - body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tools", action="store_true", help="the tool agent's recipe (function calling)")
    args = parser.parse_args()

    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    overrides = [
        f"generator.n_samples_per_prompt={args.samples}",
        "generator.inference_engine.kv_cache_memory_bytes=67108864",
    ]
    if args.tools:
        path = create_tiny_tools_model(Path(tempfile.mkdtemp()) / "tiny-tools")
        cfg = compose_config(overrides, ROOT / "configs", "tool_agent")
    else:
        path = create_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
        cfg = compose_config(["generator.agent=examples.openai_agent.agent:play", *overrides])
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = list(load_datasets(cfg, tokenizer)[0].rows)[: args.prompts]
    client = InferenceEngineClient.from_config(cfg.generator.inference_engine, str(path))
    loop = BackgroundLoop()
    server = OpenAIServer(client, str(path), cfg.generator.http_endpoint)
    loop.run(server.start())
    agent = AgentGenerator(server, tokenizer, cfg.generator, cfg.environment)
    env = RolloutManager(client, tokenizer, cfg.generator, cfg.environment)
    runs: dict[str, list[tuple[float, int]]] = {"agent": [], "env": []}
    try:
        for generator in (agent, env):  # warm-up
            loop.run(generator.agenerate(rows))
        for i in range(args.repeats):
            for name in ("agent", "env") if i % 2 == 0 else ("env", "agent"):
                start = time.perf_counter()
                out = loop.run((agent if name == "agent" else env).agenerate(rows))
                requests = sum(len(e.trajectory.turns) for e in out.episodes)
                runs[name].append((time.perf_counter() - start, requests))
        if args.tools:
            costs = tool_costs(server, [CALCULATOR_TOOL])
    finally:
        agent.close()
        loop.run(server.stop())
        loop.close()
        client.shutdown()
    seconds = {}
    for name, timed in runs.items():
        seconds[name] = statistics.median(s for s, _ in timed)
        rate = statistics.median(r / s for s, r in timed)
        print(
            f"{name:5s}: {seconds[name]:.3f} s per batch of {args.prompts}x{args.samples} episodes, {rate:.0f} requests/s"
        )
    print(f"ratio agent/env (seconds per batch): {seconds['agent'] / seconds['env']:.2f}")
    if args.tools:
        print(f"per request: parsing a call {costs[0]:.3f} ms, streaming the answer {costs[1]:.3f} ms")


if __name__ == "__main__":
    main()
