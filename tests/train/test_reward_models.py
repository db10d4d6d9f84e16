"""A scalar reward model as a reward source (`type: model`): a forward-only FSDP2 worker group whose score of
each response equals a plain Hugging Face forward of the same text, at DP=1 and at DP=2 under a token
budget, and with a policy whose tokenizer differs (the text rendered again with the reward model's); a
policy trained on its score alone learns to please it."""

import asyncio

import pytest
import ray
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from skyrl.train.cluster import WorkerGroups
from skyrl.train.config import compose_config
from skyrl.train.rewards import Rewards
from skyrl.train.schema import ModelConfig, RefConfig, RewardConfig, TrainerConfig
from skyrl.train.utils.tiny_model import create_tiny_model
from skyrl.train.workers.actor_group import ActorGroup, create_placement_group
from skyrl.train.workers.fsdp_worker import RewardModelWorker
from tests.metrics_reference import assert_documented

from .test_rewards import episode
from .test_trainer import FAST, SMALL, build

OTHER_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
RESPONSES = [["seven"], ["one", "two three four"], ["a much longer answer than the others, by far"]]


@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory):
    """The tiny model with a scalar head (seeded), saved as a sequence-classification model."""
    path = create_tiny_model(tmp_path_factory.mktemp("rm"))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def groups(ray_cluster, reward_model_path):
    """DP=1, and DP=2 with micro-batches of at most 24 tokens."""
    section = RefConfig(ModelConfig(path=str(reward_model_path)))
    made = {}
    for size, cfg in ((1, TrainerConfig()), (2, TrainerConfig(max_tokens_per_micro_batch=24))):
        pg = create_placement_group(size)
        made[size] = (
            ActorGroup(RewardModelWorker, cfg, str(reward_model_path), size, pg, wait=False, section=section),
            pg,
        )
    for group, _ in made.values():  # both started at once
        group.wait_until_ready()
    yield {size: group for size, (group, _) in made.items()}
    for group, pg in made.values():
        group.kill()
        ray.util.remove_placement_group(pg)


def scored(path, rm_group, policy_tokenizer) -> tuple[list[float], list]:
    """The reward model's score of each of RESPONSES' episodes (tokens of `policy_tokenizer`)."""
    workers = WorkerGroups(None, None, None, reward_models={"rm": rm_group})
    sources = {"env": {"type": "env", "weight": 0.0}, "rm": {"type": "model", "model": str(path)}}
    rewards = Rewards(RewardConfig(sources), policy_tokenizer, "mask", workers)
    episodes = [episode(policy_tokenizer, str(i), r, [0.0] * len(r)) for i, r in enumerate(RESPONSES)]
    asyncio.run(rewards.score(episodes))
    assert all(e.stop_reason == "done" for e in episodes), [e.error for e in episodes]
    assert [e.reward for e in episodes] == [e.scores["rm"] for e in episodes]  # weight 1, env weight 0
    return [e.scores["rm"] for e in episodes], episodes


def hf_scores(path, token_ids) -> list[float]:
    """A plain Hugging Face forward of each text: the score at its last token."""
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        return [float(model(torch.tensor([ids])).logits[0, 0]) for ids in token_ids]


def test_a_reward_model_scores_the_tokens_as_generated_like_a_plain_forward(reward_model_path, groups):
    """On one rank, two data-parallel ranks and two sequence-parallel ranks alike."""
    tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    scores, episodes = scored(reward_model_path, groups[1], tokenizer)
    last = [e.trajectory.turns[-1] for e in episodes]  # the last turn in its full context
    expected = hf_scores(reward_model_path, [t.context_ids + t.response_ids for t in last])
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == len(scores), "the texts score differently"
    dp2, _ = scored(reward_model_path, groups[2], tokenizer)  # two ranks, micro-batches of <= 24 tokens
    assert dp2 == pytest.approx(scores, abs=1e-5)
    # the same two ranks computing each sequence together (Ulysses sequence parallelism)
    model = ModelConfig(path=str(reward_model_path))
    budget = TrainerConfig(max_tokens_per_micro_batch=24)
    groups[2].reconfigure(budget, section=RefConfig(model, sequence_parallel_size=2))
    try:
        assert ray.get([a.__ray_call__.remote(lambda worker: worker.sp_size) for a in groups[2].actors]) == [
            2,
            2,
        ]
        sp2, _ = scored(reward_model_path, groups[2], tokenizer)
    finally:
        groups[2].reconfigure(budget, section=RefConfig(model))
    assert sp2 == pytest.approx(scores, abs=1e-5)


def test_a_policy_with_another_tokenizer_is_scored_on_the_text_rendered_again(
    reward_model_path, groups, tmp_path
):
    policy = AutoTokenizer.from_pretrained(
        create_tiny_model(tmp_path, vocab_size=384, chat_template=OTHER_TEMPLATE)
    )
    reward_tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    assert policy.get_vocab() != reward_tokenizer.get_vocab()
    scores, episodes = scored(reward_model_path, groups[1], policy)
    rendered = [
        reward_tokenizer.apply_chat_template(
            [
                *e.row.prompt,
                {"role": "assistant", "content": policy.decode(e.trajectory.turns[-1].response_ids)},
            ],
            tokenize=True,
            return_dict=False,
        )
        for e in episodes
    ]
    assert reward_tokenizer.decode(rendered[0]) == (
        "<|im_start|>user\nGuess a number.<|im_end|>\n<|im_start|>assistant\nseven<|im_end|>\n"
    )
    assert scores == pytest.approx(hf_scores(reward_model_path, rendered), abs=1e-5)


def test_a_policy_trained_on_the_reward_model_alone_learns_to_please_it(
    ray_cluster, tiny_model_path, reward_model_path, tmp_path
):
    """The one-turn task (the hidden number is always 3) with the environment's reward weighted 0: what the
    policy learns is the answer the reward model scores highest. Measured over 6 steps (seeds 0, 2-5): the
    mean of steps 5-6 is 3.3-6.5 above step 1's (seed 0 settles on a second-best answer); over 8 steps
    with a learning rate of ~0 (seeds 0, 1, 7) the same figure is -1.8..0.3."""
    sources = [
        "reward.sources.env.weight=0",
        f"+reward.sources.rm={{type: model, model: '{reward_model_path}'}}",
    ]
    overrides = [*SMALL, *FAST, *sources, "trainer.update_epochs_per_batch=4", "trainer.total_steps=6"]
    trainer = build(compose_config(overrides), tmp_path, tiny_model_path)
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    assert_documented(history)
    scores = [m["reward/rm_mean"] for m in history]
    assert [m["reward/mean"] for m in history] == scores, "the env's reward counts 0"
    assert sum(scores[-2:]) / 2 > scores[0] + 2.0, scores
