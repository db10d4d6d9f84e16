"""Compute layouts against the plain per-row forward of a real HF model (no Ray)."""

import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from skyrl.train.dataset.preprocess import (
    Trajectory,
    Turn,
    collate_sequences,
    layout_metrics,
    prefix_groups,
    trajectories_to_sequences,
)
from skyrl.train.training_batch import pad_training_input_batch, partition_rows
from skyrl.train.workers.attention import HF_NAME as VARLEN_HF_NAME
from skyrl.train.workers.attention import register_varlen
from skyrl.train.workers.layout import build_layout, plan_micro_batches, unit_tokens


def episodes(seed: int = 0, rewrite_last: bool = False) -> list[Trajectory]:
    """Multi-turn trajectories whose contexts extend each other token-exactly (optionally not the
    last turn of the first trajectory: a harness that rewrote its history)."""
    rng = random.Random(seed)
    trajectories = []
    for t in range(4):
        context, turns = [rng.randrange(3, 500) for _ in range(rng.randint(3, 8))], []
        for _ in range(rng.randint(1, 4)):
            response = [rng.randrange(3, 500) for _ in range(rng.randint(1, 5))]
            turns.append(Turn(list(context), response, [0.0] * len(response), [1] * len(response)))
            context += response + [rng.randrange(3, 500) for _ in range(rng.randint(1, 4))]
        trajectories.append(Trajectory(f"p{t // 2}", f"t{t}", turns))
    if rewrite_last:
        turns = trajectories[0].turns
        turns.append(Turn([7, *turns[-1].context_ids[1:]], [9, 9], [0.0, 0.0], [1, 1]))
    return trajectories


def batch_of(trajectories):
    sequences = trajectories_to_sequences(trajectories, step_wise=True)
    batch = collate_sequences(sequences, pad_token_id=0)
    batch["prefix_group"] = torch.tensor(prefix_groups(sequences))
    return batch


def test_steps_of_a_trajectory_share_a_group_while_each_extends_the_previous():
    trajectories = episodes(rewrite_last=True)
    batch = batch_of(trajectories)
    groups, ids = batch["prefix_group"].tolist(), batch.metadata["trajectory_ids"]
    steps = [len(t.turns) for t in trajectories]
    first = groups[: steps[0]]
    assert first[:-1] == [first[0]] * (steps[0] - 1) and first[-1] != first[0]  # the rewritten turn
    for trajectory in ("t1", "t2", "t3"):  # token-exact: one group each, none shared across trajectories
        assert len({g for g, i in zip(groups, ids, strict=True) if i == trajectory}) == 1
    assert len(set(groups)) == 5
    metrics = layout_metrics(batch["prefix_group"], batch["attention_mask"], ids)
    assert metrics["batch/prefix_shared_fraction"] == 3 / 4
    assert metrics["batch/trained_tokens"] < metrics["batch/stepwise_tokens"]


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def varlen_model(tiny_model_path):
    """The model with `attn_implementation=varlen`: packed sequences told apart by the layout's `cu_seqlens`."""
    register_varlen()
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_path, dtype=torch.float32, attn_implementation=VARLEN_HF_NAME
    ).eval()


def plain_logprobs(model, batch):
    """The per-row reference: each row alone, unpadded."""
    out = torch.zeros(batch["response_mask"].shape)
    for i in range(len(batch)):
        tokens = batch["sequences"][i][batch["attention_mask"][i].bool()]
        r = int(batch["response_mask"][i].sum())
        if not r:  # a pad row: no token to score
            continue
        logits = model(input_ids=tokens[None]).logits[0, -r - 1 : -1].float()
        out[i, :r] = logits.log_softmax(-1).gather(-1, tokens[-r:, None])[:, 0]
    return out


def layout_logprobs(model, layout):
    hidden = model.model(
        input_ids=layout.input_ids,
        position_ids=layout.position_ids,
        use_cache=False,
        **layout.attention_kwargs(),
    ).last_hidden_state
    logits = model.lm_head(hidden.flatten(0, 1)[layout.index]).float()
    return layout.scatter(logits.log_softmax(-1).gather(-1, layout.targets[:, None])[:, 0])


LAYOUTS = {"trimmed": (False, "model"), "packed": (True, "model"), "varlen": (True, "varlen_model")}


@pytest.mark.parametrize("compute", list(LAYOUTS))
@pytest.mark.parametrize("share", [True, False], ids=["prefix-shared", "per-step"])
@torch.no_grad()
def test_a_layout_gives_every_row_its_plain_logprobs(model, request, compute, share):
    """Padded rows (sdpa), packed rows (sdpa with a mask Hugging Face builds from the positions) and packed
    rows through `varlen` (the layout's sequence boundaries) give each row's own logprobs."""
    packed, computing = LAYOUTS[compute]
    batch = pad_training_input_batch(batch_of(episodes(rewrite_last=True)), 3)  # pad rows compute nothing
    group = batch["prefix_group"] if share else None
    layout = build_layout(batch["sequences"], batch["attention_mask"], batch["response_mask"], group, packed)
    torch.testing.assert_close(
        layout_logprobs(request.getfixturevalue(computing), layout),
        plain_logprobs(model, batch),
        rtol=1e-5,
        atol=1e-5,
    )
    assert layout.index.numel() == int(batch["response_mask"].sum())
    lengths = batch["attention_mask"][:-3].sum(-1)
    if packed:  # one row, no pad token at all
        real = layout_metrics(
            batch["prefix_group"], batch["attention_mask"], batch.metadata["trajectory_ids"]
        )
        expected = real["batch/trained_tokens"] if share else float(lengths.sum())
        assert layout.input_ids.shape == (1, expected)
        starts = (layout.position_ids[0] == 0).nonzero().flatten().tolist()  # each sequence's first token
        assert layout.cu_seqlens.tolist() == [*starts, expected]
        assert layout.max_length == max(b - a for a, b in itertools.pairwise(layout.cu_seqlens.tolist()))
    else:
        assert layout.cu_seqlens is None and layout.attention_kwargs() == {}


@pytest.mark.parametrize("computing", ["model", "varlen_model"], ids=["sdpa", "varlen"])
@torch.no_grad()
def test_packed_sequences_do_not_attend_to_each_other(request, computing):
    model = request.getfixturevalue(computing)
    batch = batch_of(episodes())
    args = (batch["attention_mask"], batch["response_mask"], batch["prefix_group"], True)
    before = layout_logprobs(model, build_layout(batch["sequences"], *args))
    # change the first trajectory, packed first: a causal mask alone would let the later ones see it
    first = batch.metadata["trajectory_ids"].count("t0")
    changed = batch["sequences"].clone()
    changed[:first] = torch.where(batch["attention_mask"][:first].bool(), (changed[:first] + 1) % 500, 0)
    after = layout_logprobs(model, build_layout(changed, *args))
    assert torch.equal(before[first:], after[first:])  # bit-identical
    assert not torch.equal(before[:first], after[:first])


def test_token_budget_micro_batches_keep_units_whole_and_within_budget():
    tokens, rows = [30, 5, 12, 40, 8, 8, 70], [3, 1, 2, 4, 1, 1, 2]
    plan = plan_micro_batches(tokens, rows, micro_batch_size=4, max_tokens=50)
    assert sorted(u for part in plan for u in part) == list(range(7))
    assert all(sum(tokens[u] for u in part) <= 50 or len(part) == 1 for part in plan)
    assert [6] in plan  # longer than the budget: alone
    assert len(plan) == 4  # the fewest for 173 tokens: ceil(173 / 50)
    assert len(plan_micro_batches(tokens, rows, 4, 50, count=7)) == 7  # as many as another rank needs
    fixed = plan_micro_batches(tokens, rows, micro_batch_size=4, max_tokens=None)
    assert fixed == [[0, 1], [2], [3], [4, 5, 6]]
    assert plan_micro_batches(tokens, rows, 4, None, count=6)[4:] == [[], []]


def test_dp_ranks_get_whole_prefix_groups():
    batch = batch_of(episodes(seed=3))
    batch = pad_training_input_batch(batch, (-len(batch)) % 2)
    for balance in (False, True):
        parts = partition_rows(batch, 2, balance)
        assert sorted(i for p in parts for i in p) == list(range(len(batch)))
        groups = batch["prefix_group"]
        assert not set(groups[parts[0]].tolist()) & set(groups[parts[1]].tolist())


def test_units_without_response_tokens_cost_nothing():
    batch = pad_training_input_batch(batch_of(episodes()), 2)
    units = [[i] for i in range(len(batch))]
    assert unit_tokens(batch["attention_mask"], batch["response_mask"], units)[-2:] == [0, 0]


def test_a_prefix_group_whose_row_is_not_a_prefix_of_its_longest_is_refused():
    batch = batch_of(episodes())
    first = batch.metadata["trajectory_ids"].count("t0")
    assert first > 1, "the first trajectory has several steps: one prefix group"
    changed = batch["sequences"].clone()
    real = batch["attention_mask"][0].bool().nonzero().flatten()
    changed[0, real[0]] = (changed[0, real[0]] + 1) % 500  # the first step's first token differs
    args = (batch["attention_mask"], batch["response_mask"], batch["prefix_group"], False)
    with pytest.raises(AssertionError, match="rows of a prefix group must be prefixes"):
        build_layout(changed, *args)


@pytest.mark.parametrize("packed", [False, True], ids=["trimmed", "packed"])
def test_an_empty_micro_batch_lays_out_one_pad_token_and_no_position(model, packed):
    """A rank with fewer micro-batches than another runs empty ones (every rank runs as many forwards)."""
    empty = torch.zeros(0, 7, dtype=torch.long)
    layout = build_layout(empty, empty, torch.zeros(0, 4, dtype=torch.long), None, packed)
    assert layout.input_ids.shape == (1, 1) and layout.index.numel() == 0
    assert layout_logprobs(model, layout).shape == (0, 4)


def test_a_row_attending_past_its_scored_response_tokens_is_refused():
    batch = batch_of(episodes())
    response_mask = batch["response_mask"].clone()
    row = int((response_mask.sum(-1) >= 2).nonzero()[0])
    response_mask[row, int(response_mask[row].sum()) - 1] = 0  # its last response token: attended, not scored
    with pytest.raises(AssertionError, match="attended tokens must end with its response tokens"):
        build_layout(batch["sequences"], batch["attention_mask"], response_mask, None, False)
