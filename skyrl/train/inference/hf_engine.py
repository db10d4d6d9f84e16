"""The `hf` backend: transformers `generate` over batches of concurrent requests.

Requests that arrive together are batched (left-padded); requests with equal
sampling settings share a `generate` call, each keeping its own `max_tokens`,
stop tokens and stop strings. The temperature / top-k / top-p warpers run inside
our own logits processor so the processed scores, the distribution that is
sampled, are what the logprobs are taken from; a request's `grammar` masks each
row's logits with its own xgrammar matcher before them. One thread owns the model,
so a weight update waits for the running batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from skyrl.train.inference.engine import (
    EngineHealth,
    GenerationOutput,
    InferenceEngine,
    SamplingParams,
    StopReason,
    validate_prompt,
)
from skyrl.train.inference.shared_weights import SharedGroup, open_shared
from skyrl.train.inference.weight_sync import WeightSyncGroup, init_sync_group, receive_group, sync_device
from skyrl.train.inference.weights import (
    StreamSpec,
    WeightUpdateError,
    adapter_modules,
    is_adapter_update,
    lora_target_names,
    validate_adapter_update,
    validate_stream_spec,
    validate_weight_update,
    weight_spec_from_model,
)
from skyrl.train.schema import InferenceEngineConfig


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    weight_version: int = 0


# Per-row stop codes inside one generate call; 0 means still running.
_STOP, _LENGTH, _ABORT = 1, 2, 3
_REASONS: dict[int, StopReason] = {_STOP: "stop", _LENGTH: "length", _ABORT: "abort"}


class _Processor:
    """The one logits processor: allowed tokens, then temperature / top-k / top-p, keeping the result.

    Its output is the distribution `generate` samples from, so the kept `scores` are what the
    logprobs are taken from. A single object, not a list of warpers: transformers inspects the
    signature of every logits processor at every step.
    """

    def __init__(self, warpers: list, keep: bool):
        self.warpers = warpers
        self.keep = keep
        self.scores: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        if self.keep:
            self.scores = scores
        return scores


def _warpers(params: SamplingParams) -> list:
    """The allowed-token mask, then (when sampling) temperature, top-k and top-p, as transformers' warpers."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers: list = [_AllowedTokens(params.allowed_token_ids)] if params.allowed_token_ids else []
    if params.temperature != 0:
        if params.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k is not None:
            warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(params.top_p))
    return warpers


class _RowTracker:
    """Per-row bookkeeping inside one `generate` call: stop conditions and sampled-token logprobs.

    Called as a stopping criterion after each new token. The per-step work stays on the model's
    device (no host sync) unless stop strings need the text of the newest tokens.
    """

    def __init__(
        self, prompt_lens, max_tokens, max_model_len, stop_ids, stop, tokenizer, abort, processor, device
    ):
        self.limit = torch.tensor(
            [min(m, max_model_len - p) for p, m in zip(prompt_lens, max_tokens, strict=True)], device=device
        )
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        self.stop = stop
        self.stop_tail = (
            max((len(s.encode()) for s in stop), default=0) + 1
        )  # tokens that can hold a stop string
        self.tokenizer = tokenizer
        self.abort = abort
        self.processor = processor  # holds the processed scores when logprobs are wanted, else None
        self.num_tokens = torch.zeros(len(prompt_lens), dtype=torch.long, device=device)
        self.code = torch.zeros(len(prompt_lens), dtype=torch.long, device=device)
        self.step_logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        new = input_ids[:, -1]
        if self.processor is not None:
            processed = self.processor.scores
            self.step_logprobs.append(processed.gather(-1, new[:, None])[:, 0] - processed.logsumexp(-1))
        running = self.code == 0
        self.num_tokens += running
        if self.abort.is_set():
            self.code.masked_fill_(running, _ABORT)
        else:
            stopped = torch.isin(new, self.stop_ids)
            if self.stop:
                stopped |= self._stop_strings(input_ids, running & ~stopped)
            ended = torch.where(stopped, _STOP, (self.num_tokens >= self.limit) * _LENGTH)
            self.code += running * ended
        return self.code != 0

    def _stop_strings(self, input_ids: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Rows among `candidates` whose newest tokens' text holds a stop string."""
        rows = candidates.nonzero()[:, 0].tolist()
        tails = input_ids[rows, -self.stop_tail :].tolist()
        hits = []
        for row, tail, n in zip(rows, tails, self.num_tokens[rows].tolist(), strict=True):
            text = self.tokenizer.decode(tail[-min(n, self.stop_tail) :], skip_special_tokens=True)
            if any(s in text for s in self.stop):
                hits.append(row)
        found = torch.zeros_like(candidates)
        found[hits] = True
        return found

    def results(self) -> tuple[list[int], list[int], list[list[float]] | None]:
        """Per row: the stop code, the number of response tokens and (if kept) the step logprobs."""
        logprobs = torch.stack(self.step_logprobs, 1).tolist() if self.step_logprobs else None
        return self.code.tolist(), self.num_tokens.tolist(), logprobs


class HFEngine(InferenceEngine):
    """An `InferenceEngine` over `AutoModelForCausalLM.generate`; construct it inside a Ray actor."""

    def __init__(self, cfg: InferenceEngineConfig, model_path: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self._cfg = cfg
        self._model_path = str(model_path)
        self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self._device.type == "cpu":
            torch.set_num_threads(max(1, int(cfg.num_cpus_per_engine)))
        if cfg.dtype == "auto":
            dtype = "auto" if self._device.type == "cuda" else torch.float32
        else:
            dtype = getattr(torch, cfg.dtype)
        model = AutoModelForCausalLM.from_pretrained(self._model_path, dtype=dtype)
        self._model = model.to(self._device).eval()
        self._tokenizer = AutoTokenizer.from_pretrained(self._model_path)
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self._tokenizer.eos_token_id is not None:
            eos_ids.add(self._tokenizer.eos_token_id)
        self._eos_ids = eos_ids
        self._pad_id = (
            self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else min(eos_ids)
        )
        # A checkpoint's sampling defaults (e.g. top_k=20) would otherwise apply to every request.
        self._model.generation_config = GenerationConfig(
            eos_token_id=sorted(eos_ids), pad_token_id=self._pad_id, bos_token_id=model.config.bos_token_id
        )
        self._max_model_len = cfg.max_model_len or model.config.max_position_embeddings
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._spec = weight_spec_from_model(model)
        self._adapter_layout: tuple[list[str], int] | None = None  # modules and rank of injected adapters
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._sync_group = None  # joined by init_weight_sync
        self._sync_device = self._device
        self._abort = threading.Event()
        self._queue: list[_Request] = []
        self._work: asyncio.Event | None = None  # set while requests are queued
        self._serving: asyncio.Task | None = None  # the loop that batches them
        self._flushing = asyncio.Event()  # set by `flush` while requests are queued
        self._last_arrival = 0.0  # the event loop's time of the newest request
        self._num_in_flight = 0
        self._weight_version = 0
        self._num_served = 0
        self._asleep = False

    def _check_serving(self) -> None:
        if self._asleep:
            raise RuntimeError(
                "the hf engine is asleep; call wake_up() before generating or updating weights."
            )

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams
    ) -> GenerationOutput:
        return await self._enqueue(prompt_token_ids, sampling_params)

    async def generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling_params: Sequence[SamplingParams], flush: bool = False
    ) -> list[GenerationOutput | Exception]:
        slots: list[asyncio.Future | Exception] = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            try:
                slots.append(self._enqueue(prompt, params))
            except Exception as exc:  # this request's slot, as `generate` would raise it
                slots.append(exc)
        if flush:
            await self.flush()
        futures = [slot for slot in slots if isinstance(slot, asyncio.Future)]
        try:
            if futures:
                await asyncio.wait(futures)
        except asyncio.CancelledError:  # the caller gave up: so do its requests (the batch skips them)
            for future in futures:
                future.cancel()
            raise
        return [slot if isinstance(slot, Exception) else slot.exception() or slot.result() for slot in slots]

    def _enqueue(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams) -> asyncio.Future:
        """Validate and queue one request; its future gets the output."""
        self._check_serving()
        prompt = validate_prompt(
            prompt_token_ids, self._vocab_size, self._max_model_len, sampling_params.allowed_token_ids
        )
        if sampling_params.grammar is not None:
            self._compiled(sampling_params.grammar)
        loop = asyncio.get_running_loop()
        request = _Request(prompt, sampling_params, loop.create_future(), self._weight_version)
        self._queue.append(request)
        self._last_arrival = loop.time()
        if self._work is None:
            self._work = asyncio.Event()
            self._serving = loop.create_task(self._serve_loop())
        self._work.set()
        self._num_in_flight += 1
        request.future.add_done_callback(self._request_done)
        return request.future

    def _request_done(self, _: asyncio.Future) -> None:
        self._num_in_flight -= 1

    async def _serve_loop(self) -> None:
        assert self._work is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._work.wait()
            # Keep collecting until no request has arrived for the window, so a burst becomes one batch,
            # unless `flush` says no more will come.
            while len(self._queue) < self._cfg.max_num_seqs and not self._flushing.is_set():
                quiet = loop.time() - self._last_arrival
                if quiet >= self._cfg.hf_batch_wait_s:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._flushing.wait(), self._cfg.hf_batch_wait_s - quiet)
            self._flushing.clear()
            batch = [r for r in self._queue[: self._cfg.max_num_seqs] if not r.future.done()]
            self._queue = self._queue[self._cfg.max_num_seqs :]
            if not self._queue:
                self._work.clear()
            groups: dict[SamplingParams, list[_Request]] = {}
            for request in batch:
                # max_tokens and seed are per request: one generate call serves them all.
                groups.setdefault(replace(request.params, max_tokens=1, seed=None), []).append(request)
            for group in groups.values():
                if self._asleep:  # sleep() came while an earlier group ran
                    results = [GenerationOutput([], None, "abort", r.weight_version) for r in group]
                else:
                    try:
                        results = await loop.run_in_executor(self._thread, self._generate_batch, group)
                    except Exception as exc:  # a failed batch fails its requests, not the engine
                        results = [exc] * len(group)
                for request, result in zip(group, results, strict=True):
                    if request.future.done():
                        continue
                    if isinstance(result, Exception):
                        request.future.set_exception(result)
                    else:
                        self._num_served += result.stop_reason != "abort"
                        request.future.set_result(result)

    @torch.inference_mode()
    def _generate_batch(self, group: list[_Request]) -> list[GenerationOutput]:
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        params = group[0].params
        prompt_lens = [len(r.prompt) for r in group]
        width = max(prompt_lens)
        input_ids = torch.tensor([[self._pad_id] * (width - len(r.prompt)) + r.prompt for r in group])
        attention_mask = torch.tensor([[0] * (width - n) + [1] * n for n in prompt_lens])
        max_tokens = [r.params.max_tokens for r in group]
        greedy = params.temperature == 0
        warpers = _warpers(params)
        if params.grammar is not None:
            stop_ids = sorted(self._eos_ids | set(params.stop_token_ids))
            warpers.insert(0, _GrammarMask(self._compiled(params.grammar), len(group), stop_ids))
        processor = _Processor(warpers, keep=params.logprobs) if warpers or params.logprobs else None
        tracker = _RowTracker(
            prompt_lens,
            max_tokens,
            self._max_model_len,
            self._eos_ids | set(params.stop_token_ids),
            params.stop,
            self._tokenizer,
            self._abort,
            processor if params.logprobs else None,
            self._device,
        )
        max_new_tokens = min(max(max_tokens), self._max_model_len - min(prompt_lens))
        if greedy:
            generation_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens)
        else:
            # Neutral settings: the warpers above do the sampling transforms.
            generation_config = GenerationConfig(
                do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens
            )
        seed = next((r.params.seed for r in group if r.params.seed is not None), None)
        if seed is not None:
            torch.manual_seed(seed)
        sequences = self._model.generate(
            input_ids=input_ids.to(self._device),
            attention_mask=attention_mask.to(self._device),
            generation_config=generation_config,
            logits_processor=LogitsProcessorList([processor] if processor else []),
            stopping_criteria=StoppingCriteriaList([tracker]),
        )
        responses = sequences[:, width:].tolist()
        codes, lengths, logprobs = tracker.results()
        outputs = []
        for row, request in enumerate(group):
            # A row still running when `generate` returned reached `max_new_tokens`.
            reason = _REASONS.get(codes[row], "length")
            if reason == "abort":
                outputs.append(GenerationOutput([], None, "abort", request.weight_version))
                continue
            n = lengths[row]
            row_logprobs = logprobs[row][:n] if logprobs is not None else None
            outputs.append(GenerationOutput(responses[row][:n], row_logprobs, reason, request.weight_version))
        return outputs

    @functools.cached_property
    def _grammar_compiler(self):
        try:
            import xgrammar as xgr
        except ImportError as exc:
            raise ValueError(
                "a grammar-constrained request needs xgrammar, which is not installed (it comes with vLLM: "
                "install the `cpu` or `vllm` extra)"
            ) from exc
        info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
        return xgr.GrammarCompiler(info)

    def _compiled(self, grammar: str):
        """`grammar` compiled for this tokenizer (cached by the compiler); ValueError when it is invalid."""
        try:
            return self._grammar_compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise ValueError(f"invalid grammar: {exc}") from exc

    async def _on_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Also takes LoRA adapters (`weights.is_adapter_update`), applied with peft on top of the
        checkpoint's weights (injected at the first adapter update; later ones must match its layout)."""
        self._check_serving()
        if is_adapter_update(named_tensors):
            layout = (adapter_modules(named_tensors), validate_adapter_update(named_tensors, self._spec))
            if self._adapter_layout not in (None, layout):
                raise WeightUpdateError(
                    f"rejected adapter update: rank {layout[1]} on {len(layout[0])} modules, but this engine "
                    f"serves rank {self._adapter_layout[1]} on {len(self._adapter_layout[0])} modules."
                )
            await self._on_thread(self._load_adapter, named_tensors, layout)
            self._weight_version = version
            return
        validate_weight_update(named_tensors, self._spec)
        await self._on_thread(self._model.load_state_dict, named_tensors, False)
        self._weight_version = version

    def _load_adapter(self, named_tensors: dict[str, torch.Tensor], layout: tuple[list[str], int]) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        modules, rank = layout
        if self._adapter_layout is None:  # B carries the scale: lora_alpha = rank
            config = LoraConfig(r=rank, lora_alpha=rank, target_modules=lora_target_names(modules))
            inject_adapter_in_model(config, self._model)
            self._adapter_layout = layout
        state = {name.replace(".weight", ".default.weight"): t for name, t in named_tensors.items()}
        unexpected = self._model.load_state_dict(state, strict=False).unexpected_keys
        assert not unexpected, f"adapter tensors the injected model lacks: {unexpected[:3]}"

    async def init_weight_sync(self, group: WeightSyncGroup, rank_offset: int) -> None:
        self._sync_group = await self._on_thread(init_sync_group, group, rank_offset)
        self._sync_device = sync_device(group.backend)

    async def check_weight_spec(self, spec: StreamSpec) -> None:
        self._check_serving()
        validate_stream_spec(spec, self._spec)

    async def receive_weights(self, spec: StreamSpec, version: int) -> None:
        if self._sync_group is None:
            raise RuntimeError("this engine has not joined a weight-sync group; call init_weight_sync first.")
        await self._on_thread(self._receive, spec)
        self._weight_version = version

    def _receive(self, spec: StreamSpec) -> None:
        for group in spec:
            self._model.load_state_dict(
                dict(receive_group(self._sync_group, group, self._sync_device)), strict=False
            )

    async def load_shared_weights(self, group: SharedGroup, version: int | None) -> None:
        self._check_serving()
        validate_stream_spec([group.spec()], self._spec)
        await self._on_thread(self._load_shared, group)
        if version is not None:
            self._weight_version = version

    def _load_shared(self, group: SharedGroup) -> None:
        self._model.load_state_dict(dict(open_shared(group)), strict=False)
        if group.gpu is not None:  # the copies out of the sender's buffer must end before it is reused
            torch.cuda.current_stream().synchronize()

    async def flush(self) -> None:
        if self._queue:  # else the queued requests have started: the next ones are a new burst
            self._flushing.set()

    async def reset_prefix_cache(self) -> None:
        """No-op: `generate` keeps no cache across requests."""

    def _abort_queued(self) -> None:
        for request in self._queue:
            if not request.future.done():
                request.future.set_result(GenerationOutput([], None, "abort", request.weight_version))
        self._queue = []

    async def sleep(self) -> None:
        self._asleep = True
        self._abort_queued()
        self._abort.set()
        try:
            # Runs after the batch in flight, whose unfinished rows have just been aborted.
            await self._on_thread(self._offload)
        finally:
            self._abort.clear()

    def _offload(self) -> None:
        if self._device.type == "cuda":
            self._model.to("cpu")
            torch.cuda.empty_cache()

    async def wake_up(self) -> None:
        if self._asleep and self._device.type == "cuda":
            await self._on_thread(self._model.to, self._device)
        self._asleep = False

    async def health(self) -> EngineHealth:
        return EngineHealth(
            backend="hf",
            model=self._model_path,
            weight_version=self._weight_version,
            num_in_flight=self._num_in_flight,
            num_served=self._num_served,
            asleep=self._asleep,
            dtype=str(self._model.dtype).removeprefix("torch."),
        )

    async def shutdown(self) -> None:
        self._abort_queued()
        self._abort.set()
        self._thread.shutdown(wait=True)


class _AllowedTokens:
    """Logits processor: every token outside `allowed` gets -inf, before temperature and truncation."""

    def __init__(self, allowed: tuple[int, ...]):
        self.allowed = list(allowed)
        self.outside: torch.Tensor | None = None  # built at the first step, on the scores' device

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.outside is None:
            self.outside = torch.ones(scores.shape[-1], dtype=torch.bool, device=scores.device)
            self.outside[self.allowed] = False
        return scores.masked_fill(self.outside, float("-inf"))


class _GrammarMask:
    """Logits processor: each row samples only the tokens its grammar allows next (one xgrammar matcher a
    row, advanced by the row's previous token; `stop_ids` may end it once complete), before temperature
    and truncation. A row whose grammar is complete, or that has ended otherwise (a stop string,
    `max_tokens`), is left unmasked: `generate` still samples for finished rows, and an all -inf row
    cannot be sampled."""

    def __init__(self, compiled, rows: int, stop_ids: list[int]):
        import xgrammar as xgr

        self.matchers = [xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids) for _ in range(rows)]
        self.bitmask = xgr.allocate_token_bitmask(rows, compiled.tokenizer_info.vocab_size)
        self.done = [False] * rows
        self.first = True  # at the first step the last input token is the prompt's

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import xgrammar as xgr

        previous = input_ids[:, -1].tolist()
        for row, matcher in enumerate(self.matchers):
            if not self.done[row] and not self.first:
                self.done[row] = not matcher.accept_token(previous[row]) or matcher.is_terminated()
            if self.done[row]:
                self.bitmask[row] = -1  # every bit set: all tokens allowed
            else:
                matcher.fill_next_token_bitmask(self.bitmask, row)
        self.first = False
        xgr.apply_token_bitmask_inplace(scores, self.bitmask.to(scores.device), vocab_size=scores.shape[-1])
        return scores
