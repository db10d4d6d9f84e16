"""Prompt datasets: parquet / jsonl files (or HF `datasets` names), validated, filtered, shuffled.

A row has a `prompt` (chat messages, or a string that becomes one user message),
an optional `env_class`, and any other columns, which go to the environment as
`extras` (e.g. `answer`, `target`).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class PromptRow:
    index: int  # position in the source, for error messages and reproducibility
    prompt: list[dict[str, str]]
    env_class: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if isinstance(value, str) and value.strip():
        return [{"role": "user", "content": value}]
    if isinstance(value, (list, tuple)) and value:
        messages = []
        for m in value:
            if not (
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            ):
                break
            messages.append({"role": m["role"], "content": m["content"]})
        else:
            return messages
    raise ValueError(
        f"{where}: 'prompt' must be a non-empty string or a list of {{'role': str, 'content': str}} messages, "
        f"got {value!r:.200}"
    )


def parse_rows(records: Sequence[dict[str, Any]], source: str) -> list[PromptRow]:
    """Validated `PromptRow`s; a row without a usable prompt raises `ValueError` naming `source` and the row
    (counted from 1, as a reader counts the records of a file)."""
    rows = []
    for i, record in enumerate(records):
        where = f"{source} row {i + 1} of {len(records)}"
        if not isinstance(record, dict) or "prompt" not in record:
            raise ValueError(
                f"{where} has no 'prompt' column (columns: {sorted(record) if isinstance(record, dict) else record!r})"
            )
        extras = {k: v for k, v in record.items() if k not in ("prompt", "env_class")}
        env_class = record.get("env_class") or None
        rows.append(PromptRow(i, _messages(record["prompt"], where), env_class, extras))
    return rows


def read_records(path: str, split: str = "train") -> list[dict[str, Any]]:
    """Records of a local `.parquet` / `.jsonl` / `.json` file, or of a HF `datasets` name (needs network)."""
    p = Path(path)
    if p.suffix == ".parquet" and p.exists():
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if p.suffix in (".jsonl", ".json") and p.exists():
        records = []
        with p.open() as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {line_number} is not valid JSON: {e}") from e
        return records
    if p.exists() or p.suffix in (".parquet", ".jsonl", ".json"):
        raise ValueError(f"cannot read {path}: use an existing .parquet or .jsonl file, or a HF dataset name")
    import datasets

    return list(datasets.load_dataset(path, split=split))


class PromptDataset:
    """Validated prompts, with over-long ones filtered out (counted and logged, never truncated)."""

    def __init__(
        self,
        rows: Sequence[PromptRow],
        tokenizer: Any = None,
        max_prompt_length: int | None = None,
        source: str = "dataset",
    ):
        self.source = source
        self.num_filtered = 0
        kept = list(rows)
        if tokenizer is not None and max_prompt_length is not None:
            lengths = prompt_lengths(tokenizer, [r.prompt for r in rows])
            kept = [r for r, length in zip(rows, lengths, strict=True) if length <= max_prompt_length]
            self.num_filtered = len(rows) - len(kept)
            if self.num_filtered:
                logger.warning(
                    "%s: %d of %d prompts are longer than max_prompt_length=%d tokens and were dropped",
                    source,
                    self.num_filtered,
                    len(rows),
                    max_prompt_length,
                )
        if not kept:
            raise ValueError(f"{source}: no usable prompts ({len(rows)} rows, {self.num_filtered} too long)")
        self.rows = kept

    @classmethod
    def from_path(
        cls, path: str, tokenizer: Any = None, max_prompt_length: int | None = None, split: str = "train"
    ) -> PromptDataset:
        return cls(parse_rows(read_records(path, split), path), tokenizer, max_prompt_length, path)

    @classmethod
    def from_records(
        cls,
        records: Sequence[dict[str, Any]],
        tokenizer: Any = None,
        max_prompt_length: int | None = None,
        source: str = "records",
    ) -> PromptDataset:
        return cls(parse_rows(records, source), tokenizer, max_prompt_length, source)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]


def prompt_lengths(tokenizer: Any, prompts: Sequence[list[dict[str, str]]]) -> list[int]:
    """Tokens of each rendered prompt, generation prompt included, as `apply_chat_template` tokenizes it
    (without special tokens). Each distinct text is tokenized once, in one batch: a generated dataset
    repeats a few prompts thousands of times (4,096 one at a time took 0.5 s of every run's start)."""
    if not prompts:
        return []
    texts = tokenizer.apply_chat_template(list(prompts), add_generation_prompt=True, tokenize=False)
    distinct = list(dict.fromkeys(texts))
    ids = tokenizer(distinct, add_special_tokens=False)["input_ids"]
    lengths = {text: len(tokens) for text, tokens in zip(distinct, ids, strict=True)}
    return [lengths[text] for text in texts]


class PromptLoader:
    """Batches of `batch_size` prompts, reshuffled each epoch from `seed`; resumable.

    The order depends only on (seed, epoch), so `state_dict()` = {epoch, position}
    is enough to continue exactly where a run stopped. A last partial batch is dropped.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int = 42, shuffle: bool = True):
        if batch_size > len(dataset):
            raise ValueError(
                f"batch size {batch_size} prompts is larger than the dataset ({len(dataset)} prompts from "
                f"{dataset.source}); lower trainer.train_batch_size or add prompts"
            )
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.dataset) // self.batch_size

    def _order(self) -> list[int]:
        if self.epoch not in self._orders:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
            self._orders = {self.epoch: order}
        return self._orders[self.epoch]

    def next_batch(self) -> list[PromptRow]:
        if self.position + self.batch_size > len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order()
        batch = [self.dataset[i] for i in order[self.position : self.position + self.batch_size]]
        self.position += self.batch_size
        return batch

    def __iter__(self) -> Iterator[list[PromptRow]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
