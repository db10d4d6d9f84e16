"""Every compute layout trains like the plain path: real Ray actors, gloo, FSDP2 on the tiny model.
The runs share the module's actor groups (`worker_pool`), reloaded for each."""

import pytest

from scripts.check_dp_equivalence import (
    COMPARISONS,
    WorkerPool,
    relative_differences,
    stepwise_batch,
    train_two_steps,
)
from skyrl.train.dataset.preprocess import layout_metrics


@pytest.fixture(scope="module")
def worker_pool(ray_cluster, tiny_model_path):
    """The runs' actor groups: the policy and the critic on 1 and on 2 ranks (6 of the cluster's CPUs
    while this module runs)."""
    pool = WorkerPool(str(tiny_model_path))
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def plain(worker_pool, tiny_model_path):
    """The plain path's run per (advantage estimator, loss reduction), trained once."""
    runs = {}

    def run(estimator="grpo", reduction="token_mean"):
        if (estimator, reduction) not in runs:
            runs[estimator, reduction] = train_two_steps(
                str(tiny_model_path), None, estimator, reduction, worker_pool
            )
        return runs[estimator, reduction]

    return run


def assert_equivalent(a, b):
    """Loss, gradients and every training metric (`METRICS`, the critic's too) agree."""
    diffs = relative_differences(a, b)
    assert diffs["loss"] < 1e-5 and diffs["grad_norm"] < 1e-5 and diffs["gradient"] < 1e-5, diffs
    assert diffs["forward"] < 1e-5, diffs  # the logprobs (and values) of the forward before training
    assert (
        max(diffs[k] for k in diffs if k not in ("loss", "grad_norm", "gradient", "param_update")) < 1e-4
    ), diffs
    assert diffs["param_update"] < 1e-4, diffs


def test_reference_run_actually_trains(plain):
    dp1 = plain()
    assert dp1.num_mini_batches == 2
    assert all(n > 0 for n in dp1.grad_norms)
    assert dp1.update.norm() > 0
    first, second = dp1.metrics
    # the first mini-batch trains the weights that made the old logprobs: every ratio is 1
    assert first["ratio_min"] == pytest.approx(1) and first["ratio_max"] == pytest.approx(1)
    assert first["approx_kl"] == pytest.approx(0, abs=1e-7)
    # the second comes after one optimizer step: the policy moved away from the old one
    assert second["ratio_min"] < 0.99 < 1.01 < second["ratio_max"]
    assert second["approx_kl"] > 1e-5
    # every compared metric is live, so the equivalence tests below compare something
    assert second["clip_frac"] > 0 and second["dual_clip_frac"] > 0 and second["kl_loss"] > 0
    assert all(m["critic/loss"] > 0 and m["critic/grad_norm"] > 0 for m in plain("gae").metrics)


@pytest.mark.parametrize(
    ("estimator", "reduction", "layout"), [c[1:] for c in COMPARISONS], ids=[c[0] for c in COMPARISONS]
)
def test_every_compute_layout_trains_like_the_plain_path(
    plain, worker_pool, tiny_model_path, estimator, reduction, layout
):
    """DP=2 (strided, balanced, delayed split), micro-batch and token-budget sizes, and prefix-shared
    step-wise rows give the plain path's losses, gradients, update and metrics, for every reduction and
    estimator (GAE with its critic)."""
    assert_equivalent(
        plain(estimator, reduction),
        train_two_steps(str(tiny_model_path), layout, estimator, reduction, worker_pool),
    )


def test_prefix_sharing_forwards_fewer_tokens_than_the_steps_hold():
    batch, _ = stepwise_batch(vocab_size=512, share_prefixes=True)
    metrics = layout_metrics(batch["prefix_group"], batch["attention_mask"], batch.metadata["trajectory_ids"])
    assert metrics["batch/prefix_shared_fraction"] == 1.0  # token-exact contexts: every trajectory
    assert metrics["batch/trained_tokens"] < 0.8 * metrics["batch/stepwise_tokens"]
