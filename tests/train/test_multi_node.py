"""Multi-node placement on one box: two Ray nodes with their own CPUs and object stores."""

import json
import subprocess
import sys

import pytest

from tests.train.test_trainer import ROOT, SMALL, run

# greedy rollouts (reproducible), one per prompt, with shaped rewards and batch-whitened advantages
TWO_RANKS = [
    *SMALL,
    "placement=disaggregated",
    "algorithm=reinforce_pp",
    "generator.sampling.temperature=0",
    "generator.n_samples_per_prompt=1",
    "trainer.train_batch_size=8",
    "trainer.policy_mini_batch_size=4",
    "environment.config.guess_number.shaped=true",
    "trainer.placement.policy_num_nodes=2",
    "trainer.placement.cpus_per_worker=2",
    "trainer.total_steps=2",
]


def test_policy_ranks_on_two_nodes_train_like_one_node(ray_cluster, tiny_model_path, tmp_path):
    """Node A holds 2 CPUs and node B 3, a policy rank takes 2 and the engine 1: the ranks land on
    both nodes and the engine on B, so the rendezvous, the gloo collectives and the weights sent to
    the engine cross nodes. The two steps equal those of the same run on one node."""
    one_node = run(TWO_RANKS, tmp_path / "one", tiny_model_path)
    out = tmp_path / "two.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.train.two_nodes",
            str(out),
            str(tmp_path / "two"),
            str(tiny_model_path),
            *TWO_RANKS,
        ],
        cwd=ROOT,
        check=True,
        timeout=600,
    )
    result = json.loads(out.read_text())
    assert sorted(result["placement"]["policy"]) == ["node_a", "node_b"]
    assert result["placement"]["engines"] == ["node_b"]
    for a, b in zip(one_node, result["history"], strict=True):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["policy/loss"] == pytest.approx(b["policy/loss"], rel=1e-4, abs=1e-6)
        assert a["policy/grad_norm"] == pytest.approx(b["policy/grad_norm"], rel=1e-4, abs=1e-6)
    assert all(m["policy/grad_norm"] > 0 for m in one_node)
