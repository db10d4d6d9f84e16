"""Convert a local GSM8K file (the `question` / `answer` jsonl or parquet you downloaded) to skyrl's format.

Each output row: `prompt` (system + user chat messages), `env_class: math`, and
`answer` (the number after `####` in GSM8K's solution), which the math env checks.

Usage: .venv/bin/python examples/gsm8k/prepare_data.py train.jsonl test.jsonl --out data/gsm8k
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SYSTEM = "Solve the problem step by step, then give the final answer after '####'."


def read(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def convert(rows: list[dict], source: Path) -> list[dict]:
    out = []
    for i, row in enumerate(rows, start=1):
        if "question" not in row or "####" not in row.get("answer", ""):
            raise ValueError(f"{source} row {i}: expected GSM8K 'question' and an 'answer' containing '####'")
        out.append(
            {
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": row["question"]},
                ],
                "env_class": "math",
                "answer": row["answer"].split("####")[-1].strip().replace(",", ""),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("train", type=Path)
    parser.add_argument("test", type=Path)
    parser.add_argument("--out", type=Path, default=Path("data/gsm8k"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, path in (("train", args.train), ("test", args.test)):
        try:
            rows = convert(read(path), path)
        except ValueError as e:
            sys.exit(f"prepare_data: {e}")
        pq.write_table(pa.Table.from_pylist(rows), args.out / f"{name}.parquet")
        print(f"{len(rows)} rows -> {args.out / f'{name}.parquet'}")


if __name__ == "__main__":
    main()
