"""`tiny-tools`: a tiny model that calls tools in Qwen2.5's format from its first step.

The default tiny model has no tool-call format, so a function-calling agent gets nothing from it.
`trainer.policy.model.path=tiny-tools` builds, once into `$SKYRL_CACHE`, a tiny Qwen2 model with:
- Qwen2.5's own chat template (its tools system section; `<tool_call>` and `<tool_response>` tags as
  single tokens), so vLLM's `hermes` tool parser reads its calls;
- a tokenizer whose merges are also learnt from rendered calculator conversations (a prompt with the
  tools section is about 220 tokens instead of about 520);
- a warm start: a few supervised steps on calculator conversations (a call, the tool's result, an
  answer) in that format. It learns the format, not the arithmetic: it starts where a small instruct
  model starts on a GPU, writing calls, and RL has the rest to learn.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from skyrl.envs.calculator import CALCULATOR_TOOL, make_dataset
from skyrl.train.utils.tiny_model import (
    CORPUS,
    DEFAULT_INITIALIZER_RANGE,
    build_tokenizer,
    cached_model,
    create_tiny_model,
)

TINY_TOOLS_VERSION = "tiny-tools-v1"
QWEN25_TEMPLATE = Path(__file__).with_name("qwen2_5_chat_template.jinja")
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
WARM_START_STEPS, WARM_START_BATCH, WARM_START_LR = 120, 16, 5e-3


def calculator_conversation(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A calculator row's prompt, then a call with its expression, the tool's result and the answer."""
    expression = row["prompt"][-1]["content"]
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": expression}},
    }
    return [
        *row["prompt"],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": row["answer"]},
        {"role": "assistant", "content": f"<answer>{row['answer']}</answer>"},
    ]


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    generation_prompt: bool = False,
) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
    )


def supervised_example(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> tuple[list[int], list[int]]:
    """The conversation's ids and a mask of its assistant turns' ids (each up to and with `<|im_end|>`)."""
    ids = render(tokenizer, messages, tools)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(render(tokenizer, messages[:i], tools, generation_prompt=True))
            end = len(render(tokenizer, messages[: i + 1], tools)) - 1  # not the newline after <|im_end|>
            mask[start:end] = [1] * (end - start)
    return ids, mask


def warm_start(
    path: Path,
    examples: list[tuple[list[int], list[int]]],
    steps: int = WARM_START_STEPS,
    lr: float = WARM_START_LR,
    seed: int = 0,
) -> None:
    """`steps` Adam steps of `WARM_START_BATCH` random `examples` (ids, loss mask) for the model at
    `path`, saved in place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pad = AutoTokenizer.from_pretrained(path).pad_token_id
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for _ in range(steps):
        batch = rng.sample(examples, WARM_START_BATCH)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch])
        attention = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        logits = model(ids, attention_mask=attention).logits[:, :-1]
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (losses * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)


def create_tiny_tools_model(path: str | os.PathLike, seed: int = 0) -> Path:
    """Write the `tiny-tools` model (see the module docstring) to `path`; returns the path."""
    template = QWEN25_TEMPLATE.read_text()
    plain = build_tokenizer(512, template, TOOL_TAGS)
    rendered = [
        plain.apply_chat_template(calculator_conversation(row), tools=[CALCULATOR_TOOL], tokenize=False)
        for row in make_dataset(200, seed + 2, function_calling=True)
    ]
    create_tiny_model(
        path,
        vocab_size=1024,
        initializer_range=DEFAULT_INITIALIZER_RANGE,
        chat_template=template,
        added_tokens=TOOL_TAGS,
        corpus=[*CORPUS, *rendered],
        seed=seed,
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    examples = [
        supervised_example(tokenizer, calculator_conversation(row), [CALCULATOR_TOOL])
        for row in make_dataset(WARM_START_STEPS * WARM_START_BATCH // 4, seed + 1, function_calling=True)
    ]
    warm_start(Path(path), examples, seed=seed)
    return Path(path)


def tiny_tools_model_path() -> Path:
    """The `tiny-tools` model's directory under `$SKYRL_CACHE`, created once."""
    return cached_model(TINY_TOOLS_VERSION, create_tiny_tools_model)
