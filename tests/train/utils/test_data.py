import copy

import pytest
import torch

from skyrl.train.utils.data import split_train_data_by_dp


def rollout(n: int = 6) -> dict:
    lengths = [3 + (i * 5) % 7 for i in range(n)]
    response = [min(2 + i % 3, length) for i, length in enumerate(lengths)]
    return {
        "tokens": [list(range(length)) for length in lengths],
        "response_lengths": response,
        "rewards": [float(i) for i in range(n)],
        "loss_masks": [[1] * r for r in response],
        "rollout_log_probs": [torch.full((r,), -0.5) for r in response],
        "sample_indices": list(range(n)),
        "raw_reward": [float(i) for i in range(n)],
        "dynamic_global_batch_size": n,
    }


def test_strided_split_slices_per_sample_keys_and_copies_shared_ones():
    data = rollout(6)
    parts = split_train_data_by_dp(data, 2)
    assert [p["partition"] for p in parts] == [[0, 2, 4], [1, 3, 5]]
    assert parts[1]["rewards"] == [1.0, 3.0, 5.0]
    assert parts[1]["tokens"] == [data["tokens"][i] for i in (1, 3, 5)]
    for p in parts:
        assert p["raw_reward"] == data["raw_reward"]
        assert p["dynamic_global_batch_size"] == 6
        assert p["total_lengths"] == [len(t) for t in data["tokens"]]


def test_balanced_split_uses_equal_size_partitions_over_token_counts():
    data = rollout(7)
    parts = split_train_data_by_dp(data, 3, balance=True)
    assert sorted(i for p in parts for i in p["partition"]) == list(range(7))
    assert sorted(len(p["partition"]) for p in parts) == [2, 2, 3]
    token_loads = [sum(p["total_lengths"][i] for i in p["partition"]) for p in parts]
    strided_loads = [sum(len(data["tokens"][i]) for i in range(r, 7, 3)) for r in range(3)]
    assert max(token_loads) <= max(strided_loads)
    for p in parts:
        assert p["sample_indices"] == p["partition"]


def test_split_never_mutates_input():
    data = rollout(5)
    before = copy.deepcopy(data)
    parts = split_train_data_by_dp(data, 2, balance=True)
    parts[0]["raw_reward"].append(99.0)
    parts[0]["rewards"].append(99.0)
    assert data.keys() == before.keys()
    for key, value in before.items():
        if key == "rollout_log_probs":
            assert all(torch.equal(a, b) for a, b in zip(data[key], value, strict=True))
        else:
            assert data[key] == value, key


def test_per_sample_list_length_mismatch_names_the_key():
    data = rollout(4)
    data["rewards"] = data["rewards"][:3]
    with pytest.raises(ValueError, match="'rewards' has 3 entries but 'tokens' has 4 samples"):
        split_train_data_by_dp(data, 2)


def test_per_token_shape_mismatch_names_key_and_index():
    data = rollout(4)
    data["rollout_log_probs"][2] = torch.zeros(9)
    with pytest.raises(
        ValueError, match=r"sample 2: rollout_log_probs\[2\] has 9 entries .* response length"
    ):
        split_train_data_by_dp(data, 2)


def test_response_length_longer_than_tokens_is_reported():
    data = rollout(3)
    data["response_lengths"][1] = 100
    with pytest.raises(ValueError, match=r"response_lengths\[1\]=100 exceeds"):
        split_train_data_by_dp(data, 1)


def test_unknown_key_and_too_few_samples_and_bad_dp_size_are_reported():
    data = rollout(3)
    with pytest.raises(ValueError, match=r"unknown rollout keys \['advantage'\]"):
        split_train_data_by_dp({**data, "advantage": [0, 0, 0]}, 1)
    with pytest.raises(ValueError, match="cannot split 3 samples over dp_size=4"):
        split_train_data_by_dp(data, 4)
    with pytest.raises(ValueError, match="dp_size must be positive"):
        split_train_data_by_dp(data, 0)
