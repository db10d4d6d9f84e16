import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl.train.dataset.preprocess import (
    Trajectory,
    Turn,
    collate_sequences,
    compute_prompt_mini_batch_boundaries,
    trajectories_to_sequences,
)


def episode(uid: str, tid: str, n_turns: int, reward: float = 1.0) -> Trajectory:
    """A multi-turn episode whose contexts grow by response + a 2-token observation."""
    context = [1, 2, 3]
    turns = []
    for k in range(n_turns):
        response = [10 + k, 20 + k]
        turns.append(
            Turn(list(context), response, [-0.5, -0.25], [1, 1], reward if k == n_turns - 1 else 0.0)
        )
        context = context + response + [90 + k, 91 + k]
    return Trajectory(uid, tid, turns)


# ---- step-wise decomposition ----


def test_stepwise_gives_one_sequence_per_turn_with_keys():
    seqs = trajectories_to_sequences([episode("p0", "a", 3), episode("p0", "b", 1)], step_wise=True)
    assert [(s.trajectory_id, s.step_id, s.is_last_step) for s in seqs] == [
        ("a", 0, False),
        ("a", 1, False),
        ("a", 2, True),
        ("b", 0, True),
    ]
    assert seqs[1].prompt_ids == [1, 2, 3, 10, 20, 90, 91]
    assert seqs[1].response_ids == [11, 21]
    assert seqs[2].rewards == [0.0, 1.0]
    assert seqs[1].rewards == [0.0, 0.0]


def test_sequences_of_one_uid_are_contiguous_in_first_appearance_order():
    trajs = [episode("p1", "x", 1), episode("p0", "y", 2), episode("p1", "z", 2), episode("p0", "w", 1)]
    seqs = trajectories_to_sequences(trajs, step_wise=True)
    assert [s.uid for s in seqs] == ["p1", "p1", "p1", "p0", "p0", "p0"]
    assert [s.trajectory_id for s in seqs] == ["x", "z", "z", "y", "y", "w"]


def test_non_stepwise_joins_turns_with_observations_masked_out():
    (seq,) = trajectories_to_sequences([episode("p0", "a", 2)], step_wise=False)
    assert seq.prompt_ids == [1, 2, 3]
    assert seq.response_ids == [10, 20, 90, 91, 11, 21]
    assert seq.loss_mask == [1, 1, 0, 0, 1, 1]
    assert seq.logprobs == [-0.5, -0.25, 0.0, 0.0, -0.5, -0.25]
    assert seq.rewards == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert seq.is_last_step


def test_non_stepwise_refuses_a_context_that_is_not_a_prefix_extension():
    traj = episode("p0", "a", 2)
    traj.turns[1].context_ids[3] = 77  # the model's own response was re-tokenised differently
    with pytest.raises(ValueError, match=r"trajectory 'a' \(uid 'p0'\) turn 1.*generator.step_wise=true"):
        trajectories_to_sequences([traj], step_wise=False)


def test_malformed_turns_are_named():
    empty = Trajectory("p0", "e", [])
    with pytest.raises(ValueError, match=r"trajectory 'e' .* has no turns"):
        trajectories_to_sequences([empty], step_wise=True)
    bad = episode("p0", "b", 2)
    bad.turns[1].logprobs = [-1.0]
    with pytest.raises(ValueError, match=r"'b' \(uid 'p0'\) turn 1: response has 2 tokens but 1 logprobs"):
        trajectories_to_sequences([bad], step_wise=True)
    silent = episode("p0", "s", 1)
    silent.turns[0] = Turn([1], [], [], [], 0.0)
    with pytest.raises(ValueError, match="no response tokens"):
        trajectories_to_sequences([silent], step_wise=True)


# ---- collation ----


def test_collate_left_pads_prompts_right_pads_responses():
    seqs = trajectories_to_sequences([episode("p0", "a", 2), episode("p1", "b", 1)], step_wise=True)
    batch = collate_sequences(seqs, pad_token_id=0)
    # prompts: 3, 7, 3 tokens -> P = 7; responses all 2 -> R = 2
    assert batch["sequences"].tolist() == [
        [0, 0, 0, 0, 1, 2, 3, 10, 20],
        [1, 2, 3, 10, 20, 90, 91, 11, 21],
        [0, 0, 0, 0, 1, 2, 3, 10, 20],
    ]
    assert batch["attention_mask"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert batch["rewards"].tolist() == [[0.0, 0.0], [0.0, 1.0], [0.0, 1.0]]
    assert batch["rollout_logprobs"][1].tolist() == [-0.5, -0.25]
    assert batch.metadata["uids"] == ["p0", "p0", "p1"]
    assert batch.metadata["step_ids"] == [0, 1, 0]
    assert batch.metadata["is_last_step"] == [False, True, True]


def test_collate_masks_response_padding_and_observations():
    seqs = trajectories_to_sequences([episode("p0", "a", 2), episode("p1", "b", 1)], step_wise=False)
    batch = collate_sequences(seqs, pad_token_id=0)
    assert batch["response_mask"].tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert batch["sequences"].shape == (2, 3 + 6)
    assert batch["loss_mask"].dtype == torch.float32


# ---- mini-batch boundaries ----


def test_boundaries_example_from_the_design():
    uids = ["p0"] * 4 + ["p1"] * 2 + ["p2"] * 3 + ["p3"] * 2
    assert compute_prompt_mini_batch_boundaries(uids, 2, 4, True, 2) == [(0, 6), (6, 11)]


def test_boundaries_non_stepwise_are_fixed_size():
    uids = [f"p{i // 3}" for i in range(12)]
    assert compute_prompt_mini_batch_boundaries(uids, 2, 4, False, 3) == [(0, 6), (6, 12)]


def test_boundaries_reappearing_uid_names_it():
    with pytest.raises(ValueError, match=r"uid 'p0' reappears at row 3 .* started at row 0"):
        compute_prompt_mini_batch_boundaries(["p0", "p0", "p1", "p0"], 1, 3, True, 2)


def test_boundaries_prompt_count_must_match_train_batch_size():
    with pytest.raises(ValueError, match=r"holds 3 prompts \(5 rows\) but train_batch_size=4"):
        compute_prompt_mini_batch_boundaries(["a", "a", "b", "c", "c"], 2, 4, True, 2)


def test_boundaries_train_batch_must_be_multiple_of_mini_batch():
    with pytest.raises(ValueError, match="train_batch_size=6 is not a multiple of mini_batch_size=4"):
        compute_prompt_mini_batch_boundaries(["a"] * 6, 4, 6, True, 1)
    with pytest.raises(ValueError, match="must both be positive"):
        compute_prompt_mini_batch_boundaries(["a"], 0, 1, True, 1)


def test_boundaries_non_stepwise_checks_rows_per_slice():
    uids = ["a", "a", "b", "c", "c", "d", "d"]
    with pytest.raises(ValueError, match=r"mini-batch 0 holds 3 rows .* 2 \* 2 = 4"):
        compute_prompt_mini_batch_boundaries(uids, 2, 4, False, 2)


@st.composite
def stepwise_layouts(draw):
    mini = draw(st.integers(1, 4))
    train = mini * draw(st.integers(1, 5))
    rows_per_prompt = draw(st.lists(st.integers(1, 8), min_size=train, max_size=train))
    uids = [f"p{i}" for i, rows in enumerate(rows_per_prompt) for _ in range(rows)]
    return uids, mini, train


@settings(max_examples=200, deadline=None)
@given(stepwise_layouts())
def test_boundaries_tile_rows_with_exactly_mini_batch_prompts(layout):
    uids, mini, train = layout
    bounds = compute_prompt_mini_batch_boundaries(uids, mini, train, True, 1)
    assert len(bounds) == train // mini
    assert bounds[0][0] == 0 and bounds[-1][1] == len(uids)
    assert all(end == next_start for (_, end), (next_start, _) in itertools.pairwise(bounds))
    for start, end in bounds:
        assert len(set(uids[start:end])) == mini
        assert start == 0 or uids[start - 1] != uids[start]  # never cuts a prompt
