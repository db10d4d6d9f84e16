import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from skyrl.envs import make
from skyrl.train.dataset.prompt_dataset import PromptDataset

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "gsm8k" / "prepare_data.py"
ROW = {"question": "Tom has 3 apples and buys 1,200 more. How many?", "answer": "3 + 1200 = 1203\n#### 1,203"}


def test_prepare_data_writes_prompts_the_math_env_scores(tmp_path):
    for name in ("train", "test"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(ROW) + "\n")
    out = tmp_path / "out"
    subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(tmp_path / "train.jsonl"),
            str(tmp_path / "test.jsonl"),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    (row,) = pq.read_table(out / "train.parquet").to_pylist()
    assert row["answer"] == "1203" and row["env_class"] == "math"
    prompt = PromptDataset.from_path(str(out / "train.parquet"))[0]
    assert prompt.prompt[-1]["content"] == ROW["question"]
    assert make("math", {}, prompt.extras).step("so #### 1203").reward == 1.0


def test_prepare_data_names_a_bad_row(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "no final answer"}) + "\n")
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(tmp_path / "train.jsonl"),
            str(tmp_path / "train.jsonl"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0 and "train.jsonl row 1:" in result.stderr  # counted from 1
    assert "Traceback" not in result.stderr
