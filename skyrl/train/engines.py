"""The inference engines as the trainer drives them: their client, the loop engine calls run on, the endpoint.

Engine-client calls are coroutines. Until something needs a long-lived event loop they run each
in a new one; once the HTTP endpoint or the rollout stream asks for `loop()`, every call runs on
that `BackgroundLoop`, so the client's state lives on one loop. The endpoint (`serve`) writes its
address to `ENDPOINT_FILE` in the run directory; `paused(call)` runs a call (sleep, weight sync)
while the endpoint holds new requests and after its requests in progress have finished.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from skyrl.train.inference import InferenceEngineClient
from skyrl.train.inference.openai_server import OpenAIServer
from skyrl.train.schema import OpenAIServerConfig, SkyRLConfig
from skyrl.train.utils.background_loop import BackgroundLoop, run_in_new_loop

ENDPOINT_FILE = "http_endpoint.json"  # the HTTP endpoint's base_url, model and whether it needs a key


class Engines:
    """The engines' client (`client`), the endpoint over it when one serves (`server`) and the loop."""

    def __init__(self, client: InferenceEngineClient):
        self.client = client
        self.server: OpenAIServer | None = None
        self._loop: BackgroundLoop | None = None

    @classmethod
    def start(
        cls,
        cfg: SkyRLConfig,
        model_path: str,
        placement: tuple[Sequence[Any] | None, Mapping[str, float] | None],
        start_client: Callable[..., InferenceEngineClient],
        **hooks: Any,
    ) -> Engines:
        """Start `generator.inference_engine` (`start_client`: `InferenceEngineClient.from_config`) without
        waiting for it to serve (`wait_until_serving`). `placement`: colocated, engine i's scheduling
        strategy and its share of a bundle (it may use all of the bundle's CPUs: engines and workers take
        turns; on GPUs it sleeps while the workers train); else (None, None). With adapter sync (LoRA) the
        engines serve adapters of the policy's rank unless set higher. A dead engine is restarted up to
        `generator.max_engine_restarts` times per run; `hooks` are the client's restart hooks."""
        engine, lora = cfg.generator.inference_engine, cfg.trainer.policy.lora
        if lora.rank and engine.lora_sync == "adapter":
            engine = replace(engine, max_lora_rank=engine.max_lora_rank or lora.rank)
        strategies, resources = placement
        if strategies is not None:
            engine = replace(engine, num_cpus_per_engine=cfg.trainer.placement.cpus_per_worker)
            if resources and resources["num_gpus"]:
                engine = replace(engine, enable_sleep_mode=True)
        restarts = cfg.generator.max_engine_restarts
        return cls(
            start_client(
                engine, model_path, strategies, resources, max_restarts=restarts, wait=False, **hooks
            )
        )

    def wait_until_serving(self) -> None:
        """Block until the engines serve (a `TimeoutError` past `start_timeout_s`)."""
        self.client.wait_until_serving()

    def loop(self) -> BackgroundLoop:
        """The background loop every engine call runs on from now on (started at the first call)."""
        if self._loop is None:
            self._loop = BackgroundLoop()
        return self._loop

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run an engine-client coroutine: on the background loop once there is one, else in a new loop."""
        return self._loop.run(coro) if self._loop else run_in_new_loop(coro)

    def serve(self, cfg: OpenAIServerConfig, model_path: str, run_dir: Path) -> None:
        """Serve the engines over HTTP for the whole run; the address goes to the console and to
        `ENDPOINT_FILE` in `run_dir`."""
        self.server = OpenAIServer(self.client, model_path, cfg)
        self.loop().run(self.server.start())
        endpoint = {"base_url": f"{self.server.url}/v1", "model": self.server.model_name}
        (run_dir / ENDPOINT_FILE).write_text(json.dumps({**endpoint, "api_key": bool(cfg.api_key)}))
        print(f"HTTP endpoint: {endpoint['base_url']} (model {endpoint['model']!r}), in {ENDPOINT_FILE}")

    async def paused(self, call: Callable[[], Awaitable[None]], resume: bool = True) -> None:
        """`call()`, with the endpoint (if any) holding new requests and its requests in progress finished;
        with `resume`, it serves again after."""
        if self.server is None:
            await call()
            return
        await self.server.pause()
        await call()
        if resume:
            await self.server.resume()

    def stop_serving(self) -> None:
        if self.server is not None:
            self.run(self.server.stop())

    def close(self) -> None:
        """Stop the loop and the engines (after `stop_serving` and whatever used the loop)."""
        if self._loop is not None:
            self._loop.close()
        self.client.shutdown()
