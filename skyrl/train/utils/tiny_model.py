"""The default tiny model: a Qwen2-style causal LM and tokenizer built locally, no network.

It is written to a directory with `save_pretrained` and then loaded like any real
model (`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`,
vLLM), so every code path is the one a real checkpoint takes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Qwen-style chat format; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Byte-level BPE merges are learned from this text (repeats weigh a phrase up), so the chat
# roles, the built-in envs' words and small numbers are single tokens and contexts stay short.
CORPUS = [
    *["system\nuser\nassistant\ntool\nHigher.\nLower.\nGuess.\n"] * 50,
    *["Guess the hidden number between 1 and 8. Answer with a number. Guess. Higher. Lower."] * 50,
    *[
        "Compute the expression. Use the calculator tool: <tool>3 * (4 + 5)</tool>, then give the result as "
        "<answer>27</answer>. <result>27</result>"
    ]
    * 20,
    *["Solve the problem step by step, then give the final answer after #### 42 \\boxed{42}"] * 10,
    *["Say the word higher lower correct number guess answer. Play. Go. Start. Again."] * 10,
    " ".join(str(i) for i in range(101)),
]
TINY_MODEL_VERSION = "tiny-qwen2-v4"
# The default model's weight scale. With 0.02 LoRA cannot learn the default task (see
# `create_tiny_model`: 0.39 -> 0.48 in 100 steps at lr 3e-3, rank 16); with 0.2 the default job settles
# on a deterministic strategy near 0.5. With 0.1 both learn it (measured: full fine-tuning 0.36 -> 1.0,
# rank-16 LoRA at lr 3e-3 0.35 -> 0.86).
DEFAULT_INITIALIZER_RANGE = 0.1


def create_tiny_model(
    path: str | os.PathLike,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 512,
    seed: int = 0,
    initializer_range: float = 0.02,
    chat_template: str = CHAT_TEMPLATE,
    added_tokens: tuple[str, ...] = (),
    corpus: list[str] = CORPUS,
) -> Path:
    """Write a randomly initialised Qwen2 model and its tokenizer to `path`; returns the path.

    `initializer_range` is the weights' standard deviation; with 0.02 (HF's default) the logits of the
    tied embeddings stay within about +-1.3, so a model whose embeddings and final norm are frozen
    (LoRA) cannot make any token likelier than ~1%; 0.2 gives pretrained-like logit scales.

    head_dim = hidden_size / num_heads must be one vLLM's CPU attention supports
    (32, 64, 80, 96, 112, 128, ...); the default is 32. Deterministic for a seed. `added_tokens` become
    single (not special) tokens, as a real model's tool-call tags are; the tokenizer's merges are learnt
    from `corpus`.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    hf_tokenizer = build_tokenizer(vocab_size, chat_template, added_tokens, corpus)
    config = Qwen2Config(
        vocab_size=len(hf_tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        bos_token_id=hf_tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=hf_tokenizer.eos_token_id,
        pad_token_id=hf_tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = hf_tokenizer.eos_token_id
    model.generation_config.pad_token_id = hf_tokenizer.pad_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    hf_tokenizer.save_pretrained(path)
    return path


def build_tokenizer(
    vocab_size: int, chat_template: str, added_tokens: tuple[str, ...] = (), corpus: list[str] = CORPUS
) -> Any:
    """A byte-level BPE tokenizer learnt from `corpus` (Qwen's special tokens, `chat_template`), with
    `added_tokens` as single (not special) tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )
    hf_tokenizer.add_tokens(list(added_tokens))
    return hf_tokenizer


def default_tiny_model_path() -> Path:
    """The default model (weights at `DEFAULT_INITIALIZER_RANGE`): its directory under `$SKYRL_CACHE`
    (default `~/.cache/skyrl`), created once."""
    return cached_model(
        TINY_MODEL_VERSION, lambda path: create_tiny_model(path, initializer_range=DEFAULT_INITIALIZER_RANGE)
    )


def cached_model(name: str, create: Callable[[Path], Any]) -> Path:
    """`$SKYRL_CACHE/name` (default `~/.cache/skyrl`), written by `create(path)` on first use; concurrent
    creators race to an atomic rename and one wins."""
    root = Path(os.environ.get("SKYRL_CACHE", Path.home() / ".cache" / "skyrl"))
    path = root / name
    if not (path / "config.json").exists():
        tmp = root / f"{name}.tmp{os.getpid()}"
        create(tmp)
        try:
            tmp.rename(path)
        except OSError:
            shutil.rmtree(tmp)
    return path
