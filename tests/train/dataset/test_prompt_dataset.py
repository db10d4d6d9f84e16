import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from skyrl.envs import guess_number
from skyrl.train.dataset.prompt_dataset import PromptDataset, PromptLoader, parse_rows

ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "env_class": "math", "answer": "4"},
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "answer": "hi",
    },
]


def test_parquet_and_jsonl_give_the_same_rows(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    for name in ("d.parquet", "d.jsonl"):
        ds = PromptDataset.from_path(str(tmp_path / name))
        assert len(ds) == 2
        assert ds[0].prompt == [{"role": "user", "content": "What is 2 + 2?"}]
        assert ds[0].env_class == "math" and ds[0].extras == {"answer": "4"}
        assert len(ds[1].prompt) == 2 and ds[1].env_class is None


def test_a_string_prompt_becomes_one_user_message():
    (row,) = parse_rows([{"prompt": "Say hi"}], "src")
    assert row.prompt == [{"role": "user", "content": "Say hi"}]


def test_a_row_without_a_usable_prompt_names_the_file_and_row(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(
        ValueError, match=r"bad.jsonl row 2 of 2 has no 'prompt' column \(columns: \['question'\]\)"
    ):
        PromptDataset.from_path(str(path))
    with pytest.raises(ValueError, match=r"src row 1 of 1: 'prompt' must be a non-empty string or a list"):
        parse_rows([{"prompt": [{"role": "user"}]}], "src")
    with pytest.raises(ValueError, match="src row 1 of 1: 'prompt' must be"):
        parse_rows([{"prompt": ""}], "src")


def test_invalid_json_line_is_named(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl line 2 is not valid JSON"):
        PromptDataset.from_path(str(path))


def test_missing_local_file_with_a_data_suffix_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"cannot read .*missing\.parquet"):
        PromptDataset.from_path(str(tmp_path / "missing.parquet"))


def test_over_long_prompts_are_filtered_and_counted(tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    records = [{"prompt": "hi"}, {"prompt": "hi " * 200}, {"prompt": "a b c"}, {"prompt": "a b c"}]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "a b c"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ds = PromptDataset.from_records(records, tokenizer, max_prompt_length=len(rendered))
    assert [r.index for r in ds.rows] == [0, 2, 3]
    assert ds.num_filtered == 1
    shorter = PromptDataset.from_records(records, tokenizer, max_prompt_length=len(rendered) - 1)
    assert [r.index for r in shorter.rows] == [0] and shorter.num_filtered == 3
    with pytest.raises(ValueError, match="no usable prompts"):
        PromptDataset.from_records(records[1:2], tokenizer, max_prompt_length=5)


def test_loader_shuffles_deterministically_and_resumes_exactly():
    ds = PromptDataset.from_records(guess_number.make_dataset(10, seed=0))
    straight = PromptLoader(ds, batch_size=4, seed=7)
    batches = [[r.index for r in straight.next_batch()] for _ in range(5)]
    assert len({i for b in batches[:2] for i in b}) == 8  # no repeats within an epoch
    resumed = PromptLoader(ds, batch_size=4, seed=7)
    for _ in range(3):
        resumed.next_batch()
    state = resumed.state_dict()
    fresh = PromptLoader(ds, batch_size=4, seed=7)
    fresh.load_state_dict(state)
    assert [[r.index for r in fresh.next_batch()] for _ in range(2)] == batches[3:]
    other_seed = PromptLoader(ds, batch_size=4, seed=8)
    assert [r.index for r in other_seed.next_batch()] != batches[0]


def test_loader_refuses_a_batch_larger_than_the_dataset():
    ds = PromptDataset.from_records(guess_number.make_dataset(3))
    with pytest.raises(ValueError, match="batch size 4 prompts is larger than the dataset"):
        PromptLoader(ds, batch_size=4)
