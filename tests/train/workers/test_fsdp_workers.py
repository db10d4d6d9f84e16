"""Real Ray actors, real gloo process groups, FSDP2 on the tiny model."""

import math
import time
from dataclasses import replace

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from scripts.check_dp_equivalence import NUM_PROMPTS, stepwise_batch
from skyrl.train.checkpoints import Checkpoints, latest_checkpoint
from skyrl.train.dataset.preprocess import compute_prompt_mini_batch_boundaries
from skyrl.train.inference import InferenceEngineClient, InferenceEngineConfig
from skyrl.train.inference.weights import stream_spec
from skyrl.train.schema import AlgorithmConfig, CriticConfig, OptimizerConfig, PolicyConfig, TrainerConfig
from skyrl.train.utils.errors import ConfigError
from skyrl.train.workers.actor_group import ActorGroup, create_placement_group
from skyrl.train.workers.dispatch import MeshDispatch
from skyrl.train.workers.fsdp_worker import CriticWorker, PolicyWorker, RefWorker
from skyrl.train.workers.persistence import CHECKPOINT_DONE

from .conftest import row_logprobs


@pytest.fixture(scope="module")
def policy_dp2(ray_cluster, tiny_model_path):
    cfg = TrainerConfig(
        policy=PolicyConfig(optimizer=OptimizerConfig(lr=1e-3)), micro_train_batch_size_per_gpu=2
    )
    pg = create_placement_group(2)
    group = ActorGroup(PolicyWorker, cfg, str(tiny_model_path), 2, pg)
    yield group
    group.kill()
    ray.util.remove_placement_group(pg)


def global_step(group):
    return ray.get(group.actors[0].__ray_call__.remote(lambda worker: worker.global_step))


def test_delayed_split_gives_each_worker_the_rows_of_the_driver_side_split(policy_dp2):
    batch, bounds = stepwise_batch(512)
    for balance in (False, True):
        eager = MeshDispatch.stage_chunks(2, batch, bounds, balance)
        delayed = MeshDispatch.stage_chunks(2, batch, bounds, balance, delay_split=True)
        for mini_eager, mini_delayed in zip(eager, delayed, strict=True):
            staged, position = mini_delayed.slots(0)[0]
            refs = [
                actor.__ray_call__.remote(
                    lambda w, minis, b=balance, at=position: w._own_part(minis[at], 2, b), staged
                )
                for actor in policy_dp2.actors
            ]
            for rank, own in enumerate(ray.get(refs, timeout=120)):
                expected = mini_eager.fetch(rank)
                assert torch.equal(own["sequences"], expected["sequences"]), (balance, rank)
                assert torch.equal(own["advantages"], expected["advantages"]), (balance, rank)


def test_optimizer_steps_per_batch_are_prompt_mini_batches_times_epochs(policy_dp2, tiny_model_path):
    policy_dp2.run("init_model")
    batch, _ = stepwise_batch(512)
    bounds = compute_prompt_mini_batch_boundaries(batch.metadata["uids"], 1, NUM_PROMPTS, True, 2)
    batch["old_logprobs"] = policy_dp2.forward(policy_dp2.stage(batch, bounds))["logprobs"]
    epochs = 2
    for _ in range(epochs):
        policy_dp2.train(policy_dp2.stage(batch, bounds))
    assert global_step(policy_dp2) == NUM_PROMPTS // 1 * epochs
    assert len(batch) > NUM_PROMPTS * 2  # several turns per episode did not add steps


def sequence_parallel(group: ActorGroup, cfg: TrainerConfig, role: str) -> TrainerConfig:
    """`cfg` with the group's ranks computing each sequence together (`role`'s sequence_parallel_size)."""
    return replace(cfg, **{role: replace(getattr(cfg, role), sequence_parallel_size=group.num_workers)})


@pytest.mark.parametrize("layout", ["DP=2", "SP=2"])
def test_forward_logprobs_match_a_plain_hf_forward_of_each_unpadded_row(policy_dp2, tiny_model_path, layout):
    cfg = ray.get(policy_dp2.actors[0].__ray_call__.remote(lambda worker: worker.cfg))
    policy_dp2.reconfigure(sequence_parallel(policy_dp2, cfg, "policy") if layout == "SP=2" else cfg)
    batch, bounds = stepwise_batch(512)
    try:
        logprobs = policy_dp2.forward(policy_dp2.stage(batch, bounds, balance=True))["logprobs"]
    finally:
        policy_dp2.reconfigure(cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for i in (0, 3, len(batch) - 1):
        n = int(batch["response_mask"][i].sum())
        torch.testing.assert_close(logprobs[i, :n], row_logprobs(model, batch, i), rtol=1e-4, atol=1e-5)


def test_a_rank_with_fewer_micro_batches_runs_empty_ones_and_both_compute_their_rows(
    policy_dp2, tiny_model_path
):
    """Rank 0 holds one prefix group (one unit), rank 1 as many rows alone: at one row per micro-batch
    rank 0 pads its forwards and its optimizer step with empty micro-batches, as many as rank 1 runs."""
    cfg = ray.get(policy_dp2.actors[0].__ray_call__.remote(lambda worker: worker.cfg))
    batch, _ = stepwise_batch(512, share_prefixes=True)
    batch["old_logprobs"] = torch.zeros_like(batch["advantages"])
    groups = batch["prefix_group"].tolist()
    shared = max(set(groups), key=groups.count)
    group_rows = [i for i, g in enumerate(groups) if g == shared]
    alone = [groups.index(g) for g in dict.fromkeys(groups) if g != shared][: len(group_rows)]  # one a group
    assert len(group_rows) > 1 and len(alone) == len(group_rows)
    parts = [batch.select_rows(group_rows), batch.select_rows(alone)]

    def each_rank(method):  # every rank's call on its own rows
        calls = [getattr(actor, method).remote(p) for actor, p in zip(policy_dp2.actors, parts, strict=True)]
        return ray.get(calls, timeout=60)

    policy_dp2.reconfigure(replace(cfg, micro_forward_batch_size_per_gpu=1, micro_train_batch_size_per_gpu=1))
    try:
        outputs, metrics = each_rank("forward"), each_rank("train_mini_batch")
    except BaseException:
        policy_dp2.kill()  # a rank left waiting in a collective would hang the module's next calls
        raise
    policy_dp2.reconfigure(cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for part, output in zip(parts, outputs, strict=True):
        for i in range(len(part)):
            n = int(part["response_mask"][i].sum())
            expected = row_logprobs(model, part, i)
            torch.testing.assert_close(output["logprobs"][i, :n], expected, rtol=1e-4, atol=1e-5)
    assert metrics[0] == metrics[1] and math.isfinite(metrics[0]["loss"]) and metrics[0]["grad_norm"] > 0


def test_checkpoint_round_trip_resumes_exactly_and_skips_half_written(policy_dp2, tiny_model_path, tmp_path):
    policy_dp2.run("init_model")
    batch, bounds = stepwise_batch(512)
    batch["old_logprobs"] = policy_dp2.forward(policy_dp2.stage(batch, bounds))["logprobs"]
    policy_dp2.train(policy_dp2.stage(batch, bounds[:1]))
    policy_dp2.save_checkpoint(tmp_path / "global_step_1")
    (uninterrupted,) = policy_dp2.train(policy_dp2.stage(batch, bounds[1:]))
    expected = policy_dp2.full_state_dict()

    (tmp_path / "global_step_2.tmp").mkdir()  # a kill during the next save leaves this behind
    (tmp_path / "global_step_3").mkdir()  # ... or an unmarked directory
    resume_from = latest_checkpoint(tmp_path)
    assert resume_from == tmp_path / "global_step_1"
    assert (resume_from / CHECKPOINT_DONE).exists()

    cfg = TrainerConfig(
        policy=PolicyConfig(optimizer=OptimizerConfig(lr=1e-3)), micro_train_batch_size_per_gpu=2
    )
    pg = create_placement_group(2)
    fresh = ActorGroup(PolicyWorker, cfg, str(tiny_model_path), 2, pg)
    try:
        fresh.load_checkpoint(resume_from)
        assert global_step(fresh) == 1
        (resumed,) = fresh.train(fresh.stage(batch, bounds[1:]))
        actual = fresh.full_state_dict()
    finally:
        fresh.kill()
        ray.util.remove_placement_group(pg)
    assert resumed["loss"] == pytest.approx(uninterrupted["loss"], rel=1e-6)
    assert resumed["grad_norm"] == pytest.approx(uninterrupted["grad_norm"], rel=1e-6)
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=1e-6, atol=1e-7)


def optimizer_state(group):
    """Rank 0's AdamW state (its shards), copied."""

    def copy(worker):
        return {
            (i, k): (v.to_local() if hasattr(v, "to_local") else v).clone()
            for i, state in worker.optimizer.state_dict()["state"].items()
            for k, v in state.items()
        }

    return ray.get(group.actors[0].__ray_call__.remote(copy))


def test_a_non_finite_loss_skips_the_optimizer_step_and_changes_nothing(policy_dp2):
    policy_dp2.run("init_model")
    batch, bounds = stepwise_batch(512)
    batch["old_logprobs"] = policy_dp2.forward(policy_dp2.stage(batch, bounds))["logprobs"]
    (finite,) = policy_dp2.train(policy_dp2.stage(batch, bounds[:1]))  # the optimizer has state now
    assert finite["skipped_steps"] == 0
    weights, moments, step = (
        policy_dp2.full_state_dict(),
        optimizer_state(policy_dp2),
        global_step(policy_dp2),
    )
    poisoned = batch["advantages"].clone()
    poisoned[batch["loss_mask"].bool().nonzero()[0].tolist()] = float("nan")  # one loss token of row 0
    batch["advantages"] = poisoned
    (skipped,) = policy_dp2.train(policy_dp2.stage(batch, bounds[:1]))
    assert skipped["skipped_steps"] == 1 and not math.isfinite(skipped["loss"])
    assert global_step(policy_dp2) == step
    for name, tensor in policy_dp2.full_state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    after = optimizer_state(policy_dp2)
    assert after.keys() == moments.keys() and all(torch.equal(after[k], moments[k]) for k in moments)


def test_a_call_past_rpc_timeout_names_the_role_the_method_and_the_late_rank(policy_dp2, monkeypatch):
    monkeypatch.setattr(policy_dp2, "timeout_s", 1.0)
    with pytest.raises(
        RuntimeError, match=r"policy worker rank\(s\) \[1\] did not finish __ray_call__ within "
    ):
        policy_dp2.run("__ray_call__", lambda worker: time.sleep(3) if worker.rank == 1 else None)


def test_loading_an_incomplete_checkpoint_is_refused(policy_dp2, tmp_path):
    with pytest.raises(ray.exceptions.RayTaskError, match="not a complete checkpoint"):
        policy_dp2.load_checkpoint(tmp_path)


def test_hf_export_loads_with_from_pretrained(policy_dp2, tmp_path):
    policy_dp2.run("save_hf_model", str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    state = policy_dp2.full_state_dict()
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, state[name])
    assert (tmp_path / "hf" / "tokenizer.json").exists()


def test_weight_groups_stream_whole_layers_and_cover_every_parameter(policy_dp2):
    # a collective: every rank iterates
    refs = [actor.__ray_call__.remote(lambda w: list(w.iter_weight_groups())) for actor in policy_dp2.actors]
    groups = ray.get(refs, timeout=120)[0]
    layer0 = next(g for g in groups if "model.layers.0.self_attn.q_proj.weight" in g)
    assert {"model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= set(layer0)
    merged = {k: v for g in groups for k, v in g.items()}
    state = policy_dp2.full_state_dict()
    assert set(merged) == set(state)  # the tied lm_head too: vLLM keeps it apart from the embeddings
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, state[name])
    assert policy_dp2.run("weight_stream_spec")[0] == stream_spec(groups)  # what a broadcast sends
    from_store = ray.get(policy_dp2.rank0_ref("full_state_dict"))  # what the object-store sync sends
    assert set(from_store) == set(state)
    for name, tensor in from_store.items():
        torch.testing.assert_close(tensor, state[name])


def test_every_sync_path_sends_the_engines_dtype_and_gives_the_same_engine(policy_dp2, tiny_model_path):
    """bf16 engines: the object store, broadcast and ipc paths send bf16 tensors (half the bytes of the
    fp32 master weights) and leave the engines with identical weights: equal greedy logprobs, which
    differ from an engine left on the checkpoint's weights."""
    import asyncio

    from skyrl.train.inference.engine import SamplingParams
    from skyrl.train.inference.weight_sync import WeightSyncGroup

    batch, bounds = stepwise_batch(512)  # one step away from the checkpoint
    batch["old_logprobs"] = policy_dp2.forward(policy_dp2.stage(batch, bounds))["logprobs"]
    policy_dp2.train(policy_dp2.stage(batch, bounds)[:1])
    config = InferenceEngineConfig(backend="hf", device="cpu", dtype="bfloat16")
    clients = [InferenceEngineClient.from_config(config, str(tiny_model_path), wait=False) for _ in range(3)]
    for client in clients:  # started at once
        client.wait_until_serving()
    store, broadcast, ipc = clients
    spec = policy_dp2.run("weight_stream_spec", "bfloat16")[0]
    assert {dtype for group in spec for _, dtype, _ in group} == {"bfloat16"}
    assert 2 * policy_dp2.run("sync_nbytes", False, "bfloat16")[0] == policy_dp2.run("sync_nbytes", False)[0]
    group = WeightSyncGroup(*policy_dp2.rank0_free_port(), broadcast.weight_sync_world_size, "gloo", 120)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    params = SamplingParams(temperature=0.0, max_tokens=6)

    async def sample(client):
        return [o.logprobs for o in await asyncio.gather(*(client.generate(p, params) for p in prompts))]

    try:
        base = asyncio.run(sample(store))  # the checkpoint's weights
        asyncio.run(store.update_weights(policy_dp2.rank0_ref("full_state_dict", "bfloat16"), 1))
        asyncio.run(
            broadcast.init_weight_sync(group, lambda: policy_dp2.run_async("init_weight_sync", group))
        )
        send = lambda: policy_dp2.run_async("broadcast_weights", "bfloat16")  # noqa: E731
        asyncio.run(broadcast.broadcast_weights(spec, 1, send))
        hand = lambda engines: policy_dp2.run_async("share_weights", engines, 1, "bfloat16")  # noqa: E731
        asyncio.run(ipc.share_weights(spec, 1, hand))
        results = [asyncio.run(sample(client)) for client in clients]
    finally:
        for client in clients:
            client.shutdown()
    assert results[0] == results[1] == results[2]
    assert results[0] != base


def test_share_weights_with_a_dead_engine_fails_its_rank_and_leaves_no_rank_in_a_collective(
    policy_dp2, tiny_model_path
):
    client = InferenceEngineClient.from_config(
        InferenceEngineConfig(backend="hf", device="cpu"), str(tiny_model_path)
    )
    engine = client.engines[0]
    ray.kill(engine)
    refs = [actor.share_weights.remote((engine,), 1) for actor in policy_dp2.actors]
    assert ray.get(refs[1], timeout=60) is None  # rank 1 gathered every group although rank 0 failed
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(refs[0], timeout=120)
    state = policy_dp2.full_state_dict()  # the next collective runs: the ranks are still in step
    assert "lm_head.weight" in state


def test_reference_worker_gives_the_policy_logprobs_at_init(ray_cluster, policy_dp2, tiny_model_path):
    policy_dp2.run("init_model")
    batch, bounds = stepwise_batch(512)
    pg = create_placement_group(1)
    ref = ActorGroup(RefWorker, TrainerConfig(), str(tiny_model_path), 1, pg)
    try:
        ref_logprobs = ref.forward(ref.stage(batch, bounds))["logprobs"]
    finally:
        ref.kill()
        ray.util.remove_placement_group(pg)
    torch.testing.assert_close(
        ref_logprobs, policy_dp2.forward(policy_dp2.stage(batch, bounds))["logprobs"], rtol=1e-5, atol=1e-6
    )


def test_critic_fits_returns_with_the_clipped_value_loss(ray_cluster, tiny_model_path, tmp_path):
    """Its fresh values (DP=2, and SP=2 on the same ranks) equal a plain HF forward of each unpadded row;
    then it learns."""
    cfg = TrainerConfig(
        critic=CriticConfig(optimizer=OptimizerConfig(lr=3e-3)),
        algorithm=AlgorithmConfig(value_clip=None),
        micro_train_batch_size_per_gpu=4,
    )
    batch, bounds = stepwise_batch(512)
    batch["returns"] = batch["response_mask"].float()
    pg = create_placement_group(2)
    critic = ActorGroup(CriticWorker, cfg, str(tiny_model_path), 2, pg)
    try:
        fresh = critic.forward(critic.stage(batch, bounds))["values"]
        critic.run("save_hf_model", str(tmp_path / "critic"))
        critic.reconfigure(sequence_parallel(critic, cfg, "critic"))  # the same seed: the same fresh head
        torch.testing.assert_close(
            critic.forward(critic.stage(batch, bounds))["values"], fresh, rtol=0, atol=1e-5
        )
        critic.reconfigure(cfg)
        losses = []
        for _ in range(6):
            batch["old_values"] = critic.forward(critic.stage(batch, bounds))["values"]
            losses.append(critic.train(critic.stage(batch, bounds))[0]["loss"])
    finally:
        critic.kill()
        ray.util.remove_placement_group(pg)
    plain = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32)
    for i in (0, 3, len(batch) - 1):
        tokens, n = (
            batch["sequences"][i][batch["attention_mask"][i].bool()],
            int(batch["response_mask"][i].sum()),
        )
        with torch.no_grad():  # V at each response token: the head at the position that predicts it
            values = plain(tokens[None]).logits[0, -n - 1 : -1, 0]
        torch.testing.assert_close(fresh[i, :n], values, rtol=1e-4, atol=1e-5)
    assert batch["old_values"].shape == batch["response_mask"].shape
    assert losses[0] > 0.1  # the fresh value head is far from the returns
    assert losses[-1] < 0.2 * losses[0], losses


def test_placement_group_that_cannot_fit_names_the_missing_resources(ray_cluster):
    with pytest.raises(RuntimeError, match=r"could not place 100 bundles of \{'CPU': 1\}.*free"):
        create_placement_group(100, timeout_s=2)


def test_a_bundle_no_node_can_hold_fails_at_once_naming_the_largest_node(ray_cluster):
    with pytest.raises(RuntimeError, match=r"no node .* can hold one bundle of \{'CPU': 100\}.*largest has"):
        create_placement_group(1, cpus_per_bundle=100, timeout_s=600)


def test_off_policy_weights_scale_the_policy_gradient_term(policy_dp2):
    batch, bounds = stepwise_batch(512)
    policy_dp2.run("init_model")
    batch["old_logprobs"] = policy_dp2.forward(policy_dp2.stage(batch, bounds))["logprobs"]
    (plain,) = policy_dp2.train(policy_dp2.stage(batch, bounds[:1]))
    policy_dp2.run("init_model")
    batch["is_weights"] = torch.full_like(batch["loss_mask"], 0.5)
    (half,) = policy_dp2.train(policy_dp2.stage(batch, bounds[:1]))
    assert half["loss"] == pytest.approx(0.5 * plain["loss"], rel=1e-5)
    assert half["grad_norm"] == pytest.approx(0.5 * plain["grad_norm"], rel=1e-5)


def test_the_run_keeps_its_newest_complete_checkpoints_and_resumes_by_mode(policy_dp2, tmp_path):
    """`Checkpoints` owns the run's layout: step directories with each group's shards and the driver's
    state, pruned to `max_ckpts_to_keep`, found again by `resume_mode`."""
    cfg = TrainerConfig(max_ckpts_to_keep=2, resume_mode="latest")
    checkpoints = Checkpoints(tmp_path, cfg)
    policy_dp2.run("init_model")
    for step in (1, 2, 3):
        checkpoints.save(step, {"policy": policy_dp2}, ({"step": step}, {"rng": [step]}))
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2", "global_step_3"]
    assert (root / "global_step_3" / "policy" / CHECKPOINT_DONE).exists()
    assert checkpoints.to_resume() == root / "global_step_3"
    assert checkpoints.load(root / "global_step_3", {"policy": policy_dp2}) == ({"step": 3}, {"rng": [3]})
    cfg.resume_mode = str(root / "global_step_1")  # pruned
    with pytest.raises(FileNotFoundError, match="global_step_1 is not a complete checkpoint"):
        checkpoints.to_resume()
    cfg.resume_mode = "none"
    assert checkpoints.to_resume() is None
    with pytest.raises(ConfigError, match=r"resume_mode=none, but the run directory .* global_step_3"):
        checkpoints.check_fresh()
