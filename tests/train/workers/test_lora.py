"""LoRA on the FSDP workers: adapters only train, layouts stay equivalent, the disabled adapter is the
reference, checkpoints and exports hold what they should; engines serve merged weights and adapters alike."""

import asyncio
import socket

import pytest
import ray
import torch
from peft import LoraConfig, PeftModel, inject_adapter_in_model
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from scripts.check_dp_equivalence import (
    Layout,
    WorkerPool,
    relative_differences,
    stepwise_batch,
    train_two_steps,
)
from skyrl.train.inference import InferenceEngineClient, InferenceEngineConfig
from skyrl.train.inference.engine import SamplingParams
from skyrl.train.inference.weights import (
    WeightUpdateError,
    checkpoint_weight_spec,
    validate_adapter_update,
)
from skyrl.train.schema import LoRAConfig, OptimizerConfig, PolicyConfig, TrainerConfig
from skyrl.train.workers.fsdp_worker import PolicyWorker, RefWorker
from skyrl.train.workers.lora import adapter_tensors, merge_adapters, target_module_names

from .conftest import row_logprobs

RANK = 4


def lora_cfg(**overrides) -> TrainerConfig:
    return TrainerConfig(
        policy=PolicyConfig(
            optimizer=OptimizerConfig(lr=1e-2), lora=LoRAConfig(rank=RANK, alpha=8.0, **overrides)
        ),
        micro_train_batch_size_per_gpu=2,
        export_merged=True,
    )


def test_merged_weights_are_base_plus_scaled_b_times_a(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=8, target_modules=["q_proj", "down_proj"]), model)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_()  # peft starts B at 0: the merge would be the identity
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = model(ids).logits
    merged = merge_adapters(model.state_dict(), 8 / RANK)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, expected, atol=1e-5)
    adapters = adapter_tensors(model.state_dict(), 2.0)
    assert set(adapters) == {
        f"model.layers.{i}.{m}.lora_{x}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "mlp.down_proj")
        for x in "AB"
    }
    b = "model.layers.0.mlp.down_proj.lora_B"
    assert torch.equal(adapters[f"{b}.weight"], 2.0 * model.state_dict()[f"{b}.default.weight"])


def test_adapter_updates_are_checked_against_the_model(tiny_model_path):
    spec = checkpoint_weight_spec(str(tiny_model_path))
    module = "model.layers.0.self_attn.q_proj"
    good = {
        f"{module}.lora_A.weight": torch.zeros(RANK, 64),
        f"{module}.lora_B.weight": torch.zeros(64, RANK),
    }
    assert validate_adapter_update(good, spec) == RANK
    for bad, message in [
        ({f"{module}.lora_A.weight": torch.zeros(RANK, 64)}, "needs both lora_A and lora_B"),
        ({**good, f"{module}.lora_B.weight": torch.zeros(64, RANK + 1)}, "do not fit its weight"),
        ({"model.layers.0.nope.lora_A.weight": torch.zeros(RANK, 64)}, "not a linear layer"),
    ]:
        with pytest.raises(WeightUpdateError, match=message):
            validate_adapter_update(bad, spec)


def local_worker(cfg, model_path, cls=PolicyWorker):
    """A one-rank worker in this process (gloo), as `ActorGroup` builds it in an actor."""
    worker = cls(cfg, 0, 1, str(model_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker.init_process_group("127.0.0.1", port)
    return worker


def test_an_unknown_target_module_is_refused_naming_the_key_and_the_valid_ones(tiny_model_path):
    cfg = lora_cfg(target_modules=["q_proj", "qkv"])
    cfg.placement.cpus_per_worker = torch.get_num_threads()  # the worker sets this process's threads
    worker = local_worker(cfg, tiny_model_path)
    try:
        with pytest.raises(
            ValueError, match=r"trainer.policy.lora.target_modules=\['q_proj', 'qkv'\]: \['qkv'\]"
        ):
            worker.init_model()
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        assert target_module_names(model) == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
    finally:
        torch.distributed.destroy_process_group()


def test_modules_to_save_train_in_full_and_export_in_peft_format(tiny_model_path, tmp_path):
    cfg = lora_cfg(modules_to_save=["model.norm"])
    cfg.placement.cpus_per_worker = torch.get_num_threads()
    worker = local_worker(cfg, tiny_model_path)
    try:
        worker.init_model()
        trainable = {n for n, p in worker.model.named_parameters() if p.requires_grad}
        assert "model.norm.weight" in trainable and "model.layers.0.input_layernorm.weight" not in trainable
        batch, _ = stepwise_batch(512)
        batch["old_logprobs"] = worker.forward(batch)["logprobs"]
        for _ in range(2):
            worker.train_mini_batch(batch)
        worker.save_hf_model(str(tmp_path))
        expected = worker.forward(batch)["logprobs"]
        with pytest.raises(ValueError, match=r"modules_to_save=\['nope'\]: 'nope' is not a module"):
            bad = lora_cfg(modules_to_save=["nope"])
            bad.placement.cpus_per_worker = torch.get_num_threads()
            PolicyWorker(bad, 0, 1, str(tiny_model_path)).init_model()  # refused before sharding
    finally:
        torch.distributed.destroy_process_group()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), tmp_path)
    assert not torch.equal(
        model.base_model.model.model.norm.modules_to_save["default"].weight, torch.ones(64)
    )
    response = int(batch["response_mask"][0].sum())
    assert torch.allclose(row_logprobs(model, batch, 0), expected[0, :response], atol=1e-5)


@pytest.fixture(scope="module")
def worker_pool(ray_cluster, tiny_model_path):
    """The module's actor groups, reloaded for each run: the policy on 1 and on 2 ranks, the reference on
    1 (4 of the cluster's CPUs while this module runs; the engine test adds 2)."""
    pool = WorkerPool(str(tiny_model_path))
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def plain_lora(worker_pool, tiny_model_path):
    return train_two_steps(str(tiny_model_path), Layout(lora_rank=RANK), pool=worker_pool)


@pytest.mark.parametrize(
    "layout",
    [
        Layout(dp_size=2, lora_rank=RANK),
        Layout(dp_size=2, balance=True, share_prefixes=True, max_tokens=24, lora_rank=RANK),
    ],
    ids=["DP=2", "prefix-shared, DP=2, budget 24"],
)
def test_lora_layouts_train_like_the_plain_lora_path(plain_lora, worker_pool, tiny_model_path, layout):
    assert plain_lora.update.norm() > 0 and all(n > 0 for n in plain_lora.grad_norms)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    inject_adapter_in_model(LoraConfig(r=RANK, target_modules=target_module_names(model)), model)
    adapter_numel = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert plain_lora.gradients[0].numel() == adapter_numel  # only the adapters have gradients
    diffs = relative_differences(plain_lora, train_two_steps(str(tiny_model_path), layout, pool=worker_pool))
    assert diffs["loss"] < 1e-5 and diffs["grad_norm"] < 1e-5 and diffs["gradient"] < 1e-5, diffs
    assert diffs["param_update"] < 1e-4, diffs


@pytest.fixture(scope="module")
def lora_dp2(worker_pool):
    """The policy on 2 ranks after two LoRA steps, and a reference worker (the pool's; no test after these
    uses them)."""
    policy = worker_pool.group(PolicyWorker, 2, lora_cfg())
    ref = worker_pool.group(RefWorker, 1, lora_cfg())
    batch, bounds = stepwise_batch(512)
    staged = policy.stage(batch, bounds)
    batch["old_logprobs"] = policy.forward(staged)["logprobs"]
    trained = policy.stage(batch, bounds)
    policy.train(trained)
    policy.train(trained)  # the second step moves A too (B is 0 before the first)
    return policy, ref, batch, bounds


def test_only_the_adapters_have_optimizer_state(lora_dp2):
    policy, *_ = lora_dp2

    def inspect(worker):
        optimized = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
        names = {n for n, p in worker.model.named_parameters() if id(p) in optimized}
        return names, {n for n, p in worker.model.named_parameters() if p.requires_grad}

    names, trainable = ray.get(policy.actors[0].__ray_call__.remote(inspect))
    assert names == trainable and names and all(".lora_A." in n or ".lora_B." in n for n in names)


def test_the_disabled_adapter_gives_the_reference_workers_logprobs(lora_dp2):
    policy, ref, batch, bounds = lora_dp2
    with_adapters = policy.forward(policy.stage(batch, bounds))["logprobs"]
    without = policy.forward(policy.stage(batch, bounds), adapters=False)["logprobs"]
    reference = ref.forward(ref.stage(batch, bounds))["logprobs"]
    assert (with_adapters - reference).abs().max() > 1e-2  # the adapters moved the policy
    assert torch.allclose(without, reference, atol=1e-6)
    assert torch.allclose(
        policy.forward(policy.stage(batch, bounds))["logprobs"], with_adapters
    )  # re-enabled


def test_checkpoints_hold_the_adapters_and_their_optimizer_state_only(lora_dp2, tmp_path):
    policy, _, batch, bounds = lora_dp2
    policy.save_checkpoint(tmp_path / "ckpt")
    saved = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    tensors = {k: v.size.numel() for k, v in saved.items() if hasattr(v, "size") and v.size.numel() > 1}
    model_keys = [k for k in tensors if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    # the adapters and Adam's two moments of each: not the model's 176k parameters
    assert sum(tensors.values()) * 4 == 3 * policy.run("sync_nbytes", True)[0]
    staged = policy.stage(batch, bounds)
    after_save = policy.train(staged)
    policy.load_checkpoint(tmp_path / "ckpt")
    assert policy.train(staged) == after_save


def test_exports_load_with_from_pretrained_and_give_the_trainers_logprobs(
    lora_dp2, tiny_model_path, tmp_path
):
    policy, _, batch, bounds = lora_dp2
    policy.run("save_hf_model", str(tmp_path))
    expected = policy.forward(policy.stage(batch, bounds))["logprobs"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for model in (
        PeftModel.from_pretrained(base, tmp_path),
        AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32),
    ):
        for row in range(3):
            response = int(batch["response_mask"][row].sum())
            assert torch.allclose(row_logprobs(model, batch, row), expected[row, :response], atol=1e-5), row


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_merged_and_adapter_syncs_give_the_engine_the_same_logprobs(lora_dp2, tiny_model_path, backend):
    """The same policy sent both ways: greedy responses and their logprobs agree (1e-5), and differ from
    the base model's."""
    policy, *_ = lora_dp2
    config = InferenceEngineConfig(backend=backend, kv_cache_memory_bytes=64 << 20)
    merged = InferenceEngineClient.from_config(config, str(tiny_model_path), wait=False)
    adapter = InferenceEngineClient.from_config(
        InferenceEngineConfig(
            backend=backend, kv_cache_memory_bytes=64 << 20, lora_sync="adapter", max_lora_rank=RANK
        ),
        str(tiny_model_path),
        wait=False,
    )
    merged.wait_until_serving()  # both started at once
    adapter.wait_until_serving()
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    params = SamplingParams(temperature=0.0, max_tokens=6)

    async def sample(client):
        return await asyncio.gather(*(client.generate(p, params) for p in prompts))

    try:
        base = asyncio.run(sample(merged))
        asyncio.run(merged.update_weights(policy.rank0_ref("full_state_dict"), 1))
        asyncio.run(adapter.update_weights(policy.rank0_ref("adapter_state_dict"), 1))
        a, b = asyncio.run(sample(merged)), asyncio.run(sample(adapter))
    finally:
        merged.shutdown()
        adapter.shutdown()
    assert [o.response_ids for o in a] == [o.response_ids for o in b]
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
    assert any(
        x.response_ids != y.response_ids
        or not torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3)
        for x, y in zip(a, base, strict=True)
    )
