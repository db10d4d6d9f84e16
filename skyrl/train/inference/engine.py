"""The inference engine contract: token-in / token-out generation, weight updates, lifecycle.

Every backend (`hf`, `vllm`) implements `InferenceEngine` and runs inside a Ray
actor; `InferenceEngineClient` talks to the actors. Responses are token ids, never
text, so what the trainer sees is exactly what the engine sampled.

Logprobs: `GenerationOutput.logprobs[t]` is the log-probability of the sampled
token under the distribution it was sampled from: `log_softmax(logits / temperature)`
after top-k / top-p truncation (tokens outside the kept set renormalised away),
and `log_softmax(logits)` for greedy (temperature 0). With top_k / top_p off this
is exactly what the trainer computes with the same temperature. vLLM is run with
`logprobs_mode="processed_logprobs"` to return this; its default (`raw_logprobs`)
ignores the temperature. `allowed_token_ids` and a `grammar` mask the logits
before the temperature, so the logprobs are renormalised over the tokens allowed.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from skyrl.train.inference.shared_weights import SharedGroup
from skyrl.train.inference.weight_sync import WeightSyncGroup
from skyrl.train.inference.weights import StreamSpec

StopReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response.

    `temperature=0` is greedy. `top_k=None` and `top_p=1.0` disable truncation.
    A response ends with stop reason `stop` at an eos token, at one of
    `stop_token_ids`, or at the token whose text completes one of the `stop`
    strings (that token is the last response token, as in vLLM); with `length`
    after `max_tokens` tokens or at the engine's maximum model length. `seed`
    makes a request reproducible on vLLM; the `hf` engine seeds each batch with
    the first seed in it, so a seeded request is reproducible when it runs alone. Raises `ValueError` naming the field for out-of-range values.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = True
    seed: int | None = None
    allowed_token_ids: tuple[int, ...] = ()  # non-empty: sample only these tokens (logprobs renormalised)
    # An xgrammar EBNF grammar the response's text must match; once it is complete only a stop token
    # (eos or `stop_token_ids`) may follow. An invalid grammar is a ValueError when the request arrives.
    grammar: str | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples so params stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 disables nucleus sampling).")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1, or None to disable top-k.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={list(self.stop)!r} must hold non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={list(self.stop_token_ids)!r} must hold token ids (ints >= 0).")
        if any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
            raise ValueError(
                f"allowed_token_ids={list(self.allowed_token_ids)!r} must hold token ids (ints >= 0)."
            )


@dataclass
class GenerationOutput:
    """One response: generated token ids only (never the prompt).

    `logprobs` is None when the request asked for none; otherwise one float per
    response token (see the module docstring for the distribution). An aborted
    request (`stop_reason="abort"`) has no tokens. `weight_version` is the
    engine's weight version when the request was submitted.
    """

    response_ids: list[int]
    logprobs: list[float] | None
    stop_reason: StopReason
    weight_version: int


@dataclass
class EngineHealth:
    """What an engine reports about itself; `error` is set once the engine can no longer serve."""

    backend: str
    model: str
    weight_version: int
    num_in_flight: int
    num_served: int
    asleep: bool
    dtype: str  # of the engine's weights (float32, bfloat16, ...): what weight syncs should send
    error: str | None = None


class InferenceEngine(abc.ABC):
    """One model replica. Methods are coroutines; instances live in Ray actors."""

    @abc.abstractmethod
    async def generate(
        self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams
    ) -> GenerationOutput:
        """Sample one response. Raises `ValueError` for an invalid prompt (empty, a token id
        outside the vocabulary, or not shorter than the maximum model length) and
        `RuntimeError` while the engine is asleep or after it failed."""

    async def generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling_params: Sequence[SamplingParams], flush: bool = False
    ) -> list[GenerationOutput | Exception]:
        """`generate` for many requests in one call (one Ray round trip instead of one per request);
        the slot of a request that failed holds its exception. `flush`: the caller's hint that these are
        all it sends until some return (see `flush`); it travels with them because Ray may start an async
        actor's calls out of order. An engine that starts requests at once ignores it."""
        return await asyncio.gather(
            *(self.generate(p, s) for p, s in zip(prompts, sampling_params, strict=True)),
            return_exceptions=True,
        )

    async def flush(self) -> None:  # noqa: B027 (engines that start requests at once need nothing)
        """No request follows until some in flight return: start the queued ones now rather than wait for
        more (the `hf` engine's batching window). A hint; requests are served either way."""

    @abc.abstractmethod
    async def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights (checkpoint names, e.g. `model.layers.0.self_attn.q_proj.weight`).

        The update is validated against the model first (see `weights.validate_weight_update`);
        a bad one raises `WeightUpdateError` and changes nothing. Then the prefix
        cache is reset and the engine's weight version becomes `version`.
        Requests in flight finish under the new weights.
        """

    @abc.abstractmethod
    async def init_weight_sync(self, group: WeightSyncGroup, rank_offset: int) -> None:
        """Join the weight-sync process group; the engine's workers take ranks `rank_offset,
        rank_offset + 1, ...`. Blocks until every rank joined."""

    @abc.abstractmethod
    async def check_weight_spec(self, spec: StreamSpec) -> None:
        """Raise `WeightUpdateError` unless streaming the groups of `spec` (by `receive_weights` or
        `load_shared_weights`) would be a valid update; nothing is loaded."""

    @abc.abstractmethod
    async def receive_weights(self, spec: StreamSpec, version: int) -> None:
        """Receive the groups of `spec` broadcast by rank 0 and load each as it arrives; then the prefix
        cache is reset and the weight version becomes `version`. Call `check_weight_spec` first: an
        update rejected here would leave the sender waiting."""

    @abc.abstractmethod
    async def load_shared_weights(self, group: SharedGroup, version: int | None) -> None:
        """Load one weight group shared by a process on this node (see `shared_weights`), validated
        like `update_weights`; the group's memory is only read during the call. With `version` (the
        last group of an update) the prefix cache is then reset and the weight version becomes `version`."""

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks so no later request reuses state computed with old weights."""

    @abc.abstractmethod
    async def sleep(self) -> None:
        """Abort requests in flight (they return `stop_reason="abort"`) and stop serving until
        `wake_up`; free accelerator memory where the backend can (a no-op on CPU)."""

    @abc.abstractmethod
    async def wake_up(self) -> None:
        """Restore what `sleep` freed and serve again."""

    @abc.abstractmethod
    async def health(self) -> EngineHealth:
        """The engine's state; cheap enough to poll."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Abort requests, release the model and reap any child processes."""


def validate_prompt(
    prompt_token_ids: Sequence[int],
    vocab_size: int,
    max_model_len: int,
    allowed_token_ids: Sequence[int] = (),
) -> list[int]:
    """Return the prompt as a list of ints; `ValueError` naming the problem if no engine could serve it."""
    outside = [t for t in allowed_token_ids if t >= vocab_size]
    if outside:
        raise ValueError(
            f"allowed_token_ids holds ids outside the vocabulary [0, {vocab_size}): {outside[:5]}."
        )
    prompt = list(prompt_token_ids)
    if not prompt:
        raise ValueError("prompt_token_ids is empty; a prompt needs at least one token.")
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}.")
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens, not fewer than the maximum model length {max_model_len}; "
            "shorten the prompt or raise max_model_len."
        )
    return prompt
