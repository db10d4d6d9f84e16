"""A training run on a two-node Ray cluster on this box (`ray.cluster_utils.Cluster`), as a script:
a driver can join only one cluster, and the test session's driver has joined the local one.

    python -m tests.train.two_nodes OUT.json RUN_DIR MODEL_PATH key=value ...

The head node has no CPUs; node `node_a` and node `node_b` (custom resources of those names) have
their own CPUs and object stores. Writes the run's metrics and, for every policy rank and engine,
the custom resource of the node it ran on.
"""

import json
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from transformers import AutoTokenizer

from skyrl.train.config import compose_config
from skyrl.train.sampler import load_datasets
from skyrl.train.trainer import Trainer

NODES = {"node_a": 2, "node_b": 3}  # custom resource -> CPUs


def node_of(actor: ray.actor.ActorHandle, names: dict[str, str]) -> str:
    """The custom resource (`NODES`) of the node `actor` runs on."""
    node_id = ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))
    return names[node_id]


def main(out: str, run_dir: str, model_path: str, *overrides: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for name, cpus in NODES.items():
        cluster.add_node(num_cpus=cpus, resources={name: 1})
    ray.init(address=cluster.address, logging_level="warning")
    try:
        names = {
            n["NodeID"]: next(k for k in NODES if k in n["Resources"])
            for n in ray.nodes()
            if n["Alive"] and any(k in n["Resources"] for k in NODES)
        }
        cfg = compose_config(list(overrides))
        trainer = Trainer(
            cfg, run_dir, model_path, load_datasets(cfg, AutoTokenizer.from_pretrained(model_path))
        )
        try:
            history = trainer.fit()
            placement = {
                "policy": [node_of(a, names) for a in trainer.policy.actors],
                "engines": [node_of(e, names) for e in trainer.client.engines],
            }
        finally:
            trainer.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    Path(out).write_text(json.dumps({"history": history, "placement": placement}))


if __name__ == "__main__":
    main(*sys.argv[1:])
