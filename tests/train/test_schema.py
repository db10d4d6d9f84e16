"""Every leaf key of the config tree: a non-default value given on the command line reaches the component
that uses it (an FSDP worker, the engines, the rollout manager, the trainer, or the entry point).

The trainer is built for real from `compose_config`; only Ray is replaced by recorders: its actor
groups construct the real (plain) worker classes in this process, as rank 0, and the engine client
records the engine config it is given. A key's arrival is checked by its effect where one is
observable without Ray (group sizes, model paths, the KL controller, ...); otherwise the value must be
in the section the component holds and the component's code must read that field.
"""

import ast
import dataclasses
import functools
import json
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from transformers import AutoTokenizer

import skyrl
import skyrl.train.__main__ as entry
from skyrl.envs import guess_number
from skyrl.train.algorithms import AdaptiveKLController
from skyrl.train.cluster import Factories
from skyrl.train.config import compose_config
from skyrl.train.dataset.prompt_dataset import PromptDataset
from skyrl.train.engines import Engines
from skyrl.train.generator.agent import AgentGenerator
from skyrl.train.sampler import load_datasets
from skyrl.train.schema import SkyRLConfig
from skyrl.train.trainer import Trainer
from skyrl.train.weight_sync import WeightSync

PACKAGE = Path(skyrl.__file__).parent


def leaf_keys(cls: type = SkyRLConfig, prefix: str = "") -> list[str]:
    """Dotted keys of the schema's values (a dict or a list is one value)."""
    keys = []
    for name, hint in typing.get_type_hints(cls).items():
        keys += leaf_keys(hint, f"{prefix}{name}.") if dataclasses.is_dataclass(hint) else [f"{prefix}{name}"]
    return keys


PPO, KL, APART = "algorithm=ppo", "trainer.algorithm.use_kl_loss=true", "placement=disaggregated"
AGENT = "examples.openai_agent.agent:play"

# key -> overrides: the first sets the key to a valid value that differs from the composed default,
# the others make that value valid or make the component that uses it exist
OVERRIDES: dict[str, tuple[str, ...]] = {
    "data.train_path": ("data.train_path={train_file}",),
    "data.eval_path": ("data.eval_path={eval_file}", "data.num_generated_train_prompts=20"),
    "data.num_generated_train_prompts": ("data.num_generated_train_prompts=20",),
    "data.num_generated_eval_prompts": (
        "data.num_generated_eval_prompts=10",
        "trainer.eval_interval=5",
        "data.num_generated_train_prompts=20",
    ),
    "data.max_prompt_length": ("data.max_prompt_length=100",),
    "data.shuffle": ("data.shuffle=false",),
    "trainer.seed": ("trainer.seed=7",),
    "trainer.total_steps": ("trainer.total_steps=7",),
    "trainer.train_batch_size": ("trainer.train_batch_size=32",),
    "trainer.policy_mini_batch_size": ("trainer.policy_mini_batch_size=8",),
    "trainer.critic_mini_batch_size": ("trainer.critic_mini_batch_size=8", PPO),
    "trainer.micro_train_batch_size_per_gpu": ("trainer.micro_train_batch_size_per_gpu=4",),
    "trainer.micro_forward_batch_size_per_gpu": ("trainer.micro_forward_batch_size_per_gpu=4",),
    "trainer.max_tokens_per_micro_batch": ("trainer.max_tokens_per_micro_batch=4096",),
    "trainer.stepwise_prefix_sharing": ("trainer.stepwise_prefix_sharing=false",),
    "trainer.logprob_chunk_tokens": ("trainer.logprob_chunk_tokens=256",),
    "trainer.update_epochs_per_batch": ("trainer.update_epochs_per_batch=3",),
    "trainer.balance_dp": ("trainer.balance_dp=true",),
    "trainer.delay_split_by_dp": ("trainer.delay_split_by_dp=true",),
    "trainer.policy.model.path": ("trainer.policy.model.path=/models/policy",),
    "trainer.policy.model.gradient_checkpointing": ("trainer.policy.model.gradient_checkpointing=true",),
    "trainer.policy.model.attn_implementation": ("trainer.policy.model.attn_implementation=eager",),
    "trainer.policy.model.compile": ("trainer.policy.model.compile=true",),
    "trainer.policy.optimizer.lr": ("trainer.policy.optimizer.lr=1e-4",),
    "trainer.policy.optimizer.weight_decay": ("trainer.policy.optimizer.weight_decay=0.01",),
    "trainer.policy.optimizer.betas": ("trainer.policy.optimizer.betas=[0.8,0.95]",),
    "trainer.policy.optimizer.eps": ("trainer.policy.optimizer.eps=1e-6",),
    "trainer.policy.optimizer.max_grad_norm": ("trainer.policy.optimizer.max_grad_norm=0.5",),
    "trainer.policy.optimizer.scheduler": ("trainer.policy.optimizer.scheduler=constant",),
    "trainer.policy.optimizer.warmup_steps": ("trainer.policy.optimizer.warmup_steps=2",),
    "trainer.policy.optimizer.total_steps": ("trainer.policy.optimizer.total_steps=50",),
    "trainer.policy.optimizer.min_lr_ratio": ("trainer.policy.optimizer.min_lr_ratio=0.2",),
    "trainer.policy.lora.rank": ("trainer.policy.lora.rank=8",),
    "trainer.policy.lora.alpha": ("trainer.policy.lora.alpha=8",),
    "trainer.policy.lora.dropout": ("trainer.policy.lora.dropout=0.1",),
    "trainer.policy.lora.target_modules": ("trainer.policy.lora.target_modules=[q_proj]",),
    "trainer.policy.lora.modules_to_save": ("trainer.policy.lora.modules_to_save=[model.norm]",),
    "trainer.policy.bf16": ("trainer.policy.bf16=false",),
    "trainer.policy.cpu_offload": ("trainer.policy.cpu_offload=true",),
    "trainer.policy.sequence_parallel_size": (
        "trainer.policy.sequence_parallel_size=2",
        "trainer.placement.policy_num_gpus_per_node=2",
    ),
    "trainer.ref.model.path": ("trainer.ref.model.path=/models/ref", KL),
    "trainer.ref.model.gradient_checkpointing": ("trainer.ref.model.gradient_checkpointing=true", KL),
    "trainer.ref.model.attn_implementation": ("trainer.ref.model.attn_implementation=eager", KL),
    "trainer.ref.model.compile": ("trainer.ref.model.compile=true", KL),
    "trainer.ref.cpu_offload": ("trainer.ref.cpu_offload=true", KL),
    "trainer.ref.sequence_parallel_size": (
        "trainer.ref.sequence_parallel_size=2",
        "trainer.placement.policy_num_gpus_per_node=2",
        KL,
    ),
    "trainer.critic.model.path": ("trainer.critic.model.path=/models/critic", PPO),
    "trainer.critic.model.gradient_checkpointing": ("trainer.critic.model.gradient_checkpointing=true", PPO),
    "trainer.critic.model.attn_implementation": ("trainer.critic.model.attn_implementation=eager", PPO),
    "trainer.critic.model.compile": ("trainer.critic.model.compile=true", PPO),
    "trainer.critic.optimizer.lr": ("trainer.critic.optimizer.lr=1e-4", PPO),
    "trainer.critic.optimizer.weight_decay": ("trainer.critic.optimizer.weight_decay=0.01", PPO),
    "trainer.critic.optimizer.betas": ("trainer.critic.optimizer.betas=[0.8,0.95]", PPO),
    "trainer.critic.optimizer.eps": ("trainer.critic.optimizer.eps=1e-6", PPO),
    "trainer.critic.optimizer.max_grad_norm": ("trainer.critic.optimizer.max_grad_norm=0.5", PPO),
    "trainer.critic.optimizer.scheduler": ("trainer.critic.optimizer.scheduler=cosine", PPO),
    "trainer.critic.optimizer.warmup_steps": ("trainer.critic.optimizer.warmup_steps=2", PPO),
    "trainer.critic.optimizer.total_steps": ("trainer.critic.optimizer.total_steps=50", PPO),
    "trainer.critic.optimizer.min_lr_ratio": ("trainer.critic.optimizer.min_lr_ratio=0.2", PPO),
    "trainer.critic.lora.rank": ("trainer.critic.lora.rank=8", PPO),
    "trainer.critic.lora.alpha": ("trainer.critic.lora.alpha=8", PPO),
    "trainer.critic.lora.dropout": ("trainer.critic.lora.dropout=0.1", PPO),
    "trainer.critic.lora.target_modules": ("trainer.critic.lora.target_modules=[q_proj]", PPO),
    "trainer.critic.lora.modules_to_save": ("trainer.critic.lora.modules_to_save=[model.norm]", PPO),
    "trainer.critic.cpu_offload": ("trainer.critic.cpu_offload=true", PPO),
    "trainer.critic.sequence_parallel_size": (
        "trainer.critic.sequence_parallel_size=2",
        "trainer.placement.policy_num_gpus_per_node=2",
        PPO,
    ),
    "trainer.placement.colocate_all": (APART,),
    "trainer.placement.policy_num_nodes": ("trainer.placement.policy_num_nodes=2",),
    "trainer.placement.policy_num_gpus_per_node": ("trainer.placement.policy_num_gpus_per_node=2",),
    "trainer.placement.critic_num_nodes": ("trainer.placement.critic_num_nodes=2", PPO, APART),
    "trainer.placement.critic_num_gpus_per_node": (
        "trainer.placement.critic_num_gpus_per_node=2",
        PPO,
        APART,
    ),
    "trainer.placement.ref_num_nodes": ("trainer.placement.ref_num_nodes=2", KL, APART),
    "trainer.placement.ref_num_gpus_per_node": ("trainer.placement.ref_num_gpus_per_node=2", KL, APART),
    "trainer.placement.cpus_per_worker": ("trainer.placement.cpus_per_worker=3",),
    "trainer.algorithm.advantage_estimator": ("trainer.algorithm.advantage_estimator=rloo",),
    "trainer.algorithm.norm_adv_by_std_in_grpo": ("trainer.algorithm.norm_adv_by_std_in_grpo=false",),
    "trainer.algorithm.gamma": ("trainer.algorithm.gamma=0.9",),
    "trainer.algorithm.lambd": ("trainer.algorithm.lambd=0.9",),
    "trainer.algorithm.group_baseline": ("trainer.algorithm.group_baseline=true",),
    "trainer.algorithm.policy_loss": ("trainer.algorithm.policy_loss=dual_clip",),
    "trainer.algorithm.loss_reduction": (
        "trainer.algorithm.loss_reduction=seq_mean_token_sum_norm",
        "trainer.algorithm.max_seq_len=512",
    ),
    "trainer.algorithm.max_seq_len": ("trainer.algorithm.max_seq_len=512",),
    "trainer.algorithm.eps_clip_low": ("trainer.algorithm.eps_clip_low=0.1",),
    "trainer.algorithm.eps_clip_high": ("trainer.algorithm.eps_clip_high=0.3",),
    "trainer.algorithm.clip_ratio_c": ("trainer.algorithm.clip_ratio_c=2.0",),
    "trainer.algorithm.value_clip": ("trainer.algorithm.value_clip=0.5", PPO),
    "trainer.algorithm.use_kl_loss": (KL,),
    "trainer.algorithm.kl_loss_coef": ("trainer.algorithm.kl_loss_coef=0.01", KL),
    "trainer.algorithm.kl_estimator": ("trainer.algorithm.kl_estimator=k1", KL),
    "trainer.algorithm.use_kl_in_reward": ("trainer.algorithm.use_kl_in_reward=true",),
    "trainer.algorithm.kl_ctrl.type": ("trainer.algorithm.kl_ctrl.type=adaptive",),
    "trainer.algorithm.kl_ctrl.kl_coef": ("trainer.algorithm.kl_ctrl.kl_coef=0.01",),
    "trainer.algorithm.kl_ctrl.target_kl": (
        "trainer.algorithm.kl_ctrl.target_kl=0.2",
        "trainer.algorithm.kl_ctrl.type=adaptive",
    ),
    "trainer.algorithm.kl_ctrl.horizon": (
        "trainer.algorithm.kl_ctrl.horizon=500",
        "trainer.algorithm.kl_ctrl.type=adaptive",
    ),
    "trainer.algorithm.entropy_coeff": ("trainer.algorithm.entropy_coeff=0.01",),
    "trainer.algorithm.off_policy_correction": ("trainer.algorithm.off_policy_correction=tis",),
    "trainer.algorithm.tis_cap": ("trainer.algorithm.tis_cap=3.0",),
    "trainer.algorithm.mis_low": ("trainer.algorithm.mis_low=0.2",),
    "trainer.algorithm.mis_high": ("trainer.algorithm.mis_high=5.0",),
    "trainer.algorithm.dynamic_sampling": ("trainer.algorithm.dynamic_sampling=filter",),
    "trainer.algorithm.max_sample_batches": ("trainer.algorithm.max_sample_batches=2",),
    "trainer.algorithm.zero_variance_filter": ("trainer.algorithm.zero_variance_filter=true",),
    "trainer.async_training.max_staleness": ("trainer.async_training.max_staleness=1", APART),
    "trainer.logger": ("trainer.logger=[jsonl]",),
    "trainer.project_name": ("trainer.project_name=proj",),
    "trainer.run_name": ("trainer.run_name=run",),
    "trainer.eval_interval": ("trainer.eval_interval=5",),
    "trainer.eval_before_train": ("trainer.eval_before_train=true",),
    "trainer.eval_n_samples": ("trainer.eval_n_samples=2",),
    "trainer.ckpt_interval": ("trainer.ckpt_interval=5",),
    "trainer.max_ckpts_to_keep": ("trainer.max_ckpts_to_keep=3",),
    "trainer.resume_mode": ("trainer.resume_mode=none",),
    "trainer.hf_save_interval": ("trainer.hf_save_interval=5",),
    "trainer.export_merged": ("trainer.export_merged=true", "trainer.policy.lora.rank=8"),
    "trainer.max_consecutive_skipped_steps": ("trainer.max_consecutive_skipped_steps=2",),
    "trainer.rpc_timeout_s": ("trainer.rpc_timeout_s=60",),
    "trainer.max_restarts": ("trainer.max_restarts=1",),
    "trainer.preemption_grace_s": ("trainer.preemption_grace_s=60",),
    "generator.n_samples_per_prompt": ("generator.n_samples_per_prompt=4",),
    "generator.max_turns": ("generator.max_turns=2",),
    "generator.max_input_length": ("generator.max_input_length=300",),
    "generator.max_generate_length": ("generator.max_generate_length=2",),
    "generator.step_wise": ("generator.step_wise=false", "trainer.micro_train_batch_size_per_gpu=8"),
    "generator.sampling.temperature": ("generator.sampling.temperature=0.5",),
    "generator.sampling.top_p": ("generator.sampling.top_p=0.9",),
    "generator.sampling.top_k": ("generator.sampling.top_k=5",),
    "generator.eval_sampling.temperature": ("generator.eval_sampling.temperature=0.7",),
    "generator.eval_sampling.top_p": ("generator.eval_sampling.top_p=0.9",),
    "generator.eval_sampling.top_k": ("generator.eval_sampling.top_k=5",),
    "generator.inference_engine.backend": ("generator.inference_engine.backend=hf",),
    "generator.inference_engine.num_engines": ("generator.inference_engine.num_engines=2", APART),
    "generator.inference_engine.tensor_parallel_size": (
        "generator.inference_engine.tensor_parallel_size=2",
        APART,
    ),
    "generator.inference_engine.device": ("generator.inference_engine.device=cpu",),
    "generator.inference_engine.dtype": ("generator.inference_engine.dtype=float32",),
    "generator.inference_engine.gpu_memory_utilization": (
        "generator.inference_engine.gpu_memory_utilization=0.5",
    ),
    "generator.inference_engine.kv_cache_memory_bytes": (
        "generator.inference_engine.kv_cache_memory_bytes=1048576",
    ),
    "generator.inference_engine.enforce_eager": ("generator.inference_engine.enforce_eager=true",),
    "generator.inference_engine.max_model_len": ("generator.inference_engine.max_model_len=512",),
    "generator.inference_engine.max_num_seqs": ("generator.inference_engine.max_num_seqs=16",),
    "generator.inference_engine.enable_prefix_caching": (
        "generator.inference_engine.enable_prefix_caching=false",
    ),
    "generator.inference_engine.enable_sleep_mode": ("generator.inference_engine.enable_sleep_mode=true",),
    "generator.inference_engine.seed": ("generator.inference_engine.seed=3",),
    "generator.inference_engine.num_cpus_per_engine": (
        "generator.inference_engine.num_cpus_per_engine=2",
        APART,
    ),
    "generator.inference_engine.hf_batch_wait_s": ("generator.inference_engine.hf_batch_wait_s=0.01",),
    "generator.inference_engine.max_concurrent_requests": (
        "generator.inference_engine.max_concurrent_requests=16",
    ),
    "generator.inference_engine.weight_sync": ("generator.inference_engine.weight_sync=object_store",),
    "generator.inference_engine.weight_sync_timeout_s": (
        "generator.inference_engine.weight_sync_timeout_s=60",
    ),
    "generator.inference_engine.start_timeout_s": ("generator.inference_engine.start_timeout_s=60",),
    "generator.inference_engine.lora_sync": (
        "generator.inference_engine.lora_sync=adapter",
        "trainer.policy.lora.rank=8",
    ),
    "generator.inference_engine.max_lora_rank": (
        "generator.inference_engine.max_lora_rank=16",
        "trainer.policy.lora.rank=8",
        "generator.inference_engine.lora_sync=adapter",
    ),
    "generator.http_endpoint.enabled": ("generator.http_endpoint.enabled=true",),
    "generator.http_endpoint.host": ("generator.http_endpoint.host=0.0.0.0",),
    "generator.http_endpoint.port": ("generator.http_endpoint.port=8123",),
    "generator.http_endpoint.api_key": ("generator.http_endpoint.api_key=secret",),
    "generator.http_endpoint.served_model_name": ("generator.http_endpoint.served_model_name=agent",),
    "generator.http_endpoint.default_max_tokens": ("generator.http_endpoint.default_max_tokens=64",),
    "generator.http_endpoint.tool_parser": ("generator.http_endpoint.tool_parser=none",),
    "generator.http_endpoint.reasoning_parser": ("generator.http_endpoint.reasoning_parser=qwen3",),
    "generator.env_workers": ("generator.env_workers=2",),
    "generator.env_executor": ("generator.env_executor=process",),
    "generator.max_env_failure_fraction": ("generator.max_env_failure_fraction=0.25",),
    "generator.env_failure": ("generator.env_failure=zero_reward",),
    "generator.inflight_weight_updates": (
        "generator.inflight_weight_updates=true",
        "trainer.async_training.max_staleness=1",
        APART,
    ),
    "generator.max_engine_restarts": ("generator.max_engine_restarts=1",),
    "generator.agent": (f"generator.agent={AGENT}",),
    "generator.agent_timeout_s": ("generator.agent_timeout_s=30", f"generator.agent={AGENT}"),
    "generator.generator_class": ("generator.generator_class=tests.train.generator.user_generators:OneTurn",),
    "environment.env_class": ("environment.env_class=calculator",),
    "environment.config": ("environment.config.guess_number.max_value=6",),
    "environment.timeout_s": ("environment.timeout_s=30",),
    "reward.sources": ("reward.sources.env.weight=2.0",),
    "ray.address": ("ray.address=10.0.0.1:6379",),
    "ray.num_cpus": ("ray.num_cpus=3",),
    "ray.include_dashboard": ("ray.include_dashboard=true",),
}

# trainer.algorithm keys the workers' losses read (the trainer reads the others)
LOSS_KEYS = {
    "policy_loss",
    "loss_reduction",
    "max_seq_len",
    "eps_clip_low",
    "eps_clip_high",
    "clip_ratio_c",
    "use_kl_loss",
    "kl_loss_coef",
    "kl_estimator",
    "entropy_coeff",
}

# where a component's code reads its settings
CODE = {
    "policy": [
        "train/workers/fsdp_worker.py",
        "train/workers/lora.py",
        "train/workers/persistence.py",
        "train/workers/weight_export.py",
    ],
    "ref": ["train/workers/fsdp_worker.py"],
    "critic": ["train/workers/fsdp_worker.py", "train/workers/lora.py", "train/workers/persistence.py"],
    "engine": ["train/inference/client.py", "train/inference/hf_engine.py", "train/inference/vllm_engine.py"],
    "rollout": ["train/generator/rollout.py", "train/generator/agent.py", "train/generator/base.py"],
    "server": ["train/inference/openai_server.py", "train/trainer.py", "train/engines.py"],
    "environment": ["train/generator/rollout.py"],
    "trainer": [
        "train/trainer.py",
        "train/checkpoints.py",
        "train/cluster.py",
        "train/config.py",
        "train/engines.py",
        "train/recovery.py",
        "train/weight_sync.py",
        "train/ppo_update.py",
        "train/sampler.py",
        "train/step_batch.py",
        "train/workers/actor_group.py",
    ],
    "entry": ["train/__main__.py", "train/trainer.py", "train/sampler.py"],
}


def user(key: str) -> str:
    """The component that uses `key`, by the section it lives in."""
    parts = key.split(".")
    if key == "trainer.policy.model.path" or parts[0] in ("data", "ray"):
        return "entry"  # __main__ resolves the policy model, loads the data and starts Ray
    if parts[0] == "environment":
        return "environment"
    if parts[:2] == ["trainer", "algorithm"]:
        return "critic" if parts[2] == "value_clip" else "policy" if parts[2] in LOSS_KEYS else "trainer"
    if parts[0] == "trainer" and parts[1] in ("policy", "ref", "critic"):
        return parts[1]
    if key in (
        "trainer.seed",
        "trainer.micro_train_batch_size_per_gpu",
        "trainer.micro_forward_batch_size_per_gpu",
        "trainer.max_tokens_per_micro_batch",
        "trainer.logprob_chunk_tokens",
    ):
        return "policy"
    if parts[:2] == ["generator", "http_endpoint"]:
        return "server"
    if parts[:2] == ["generator", "inference_engine"] and not parts[2].startswith("weight_sync"):
        return "engine"
    if parts[0] == "generator" and parts[1] not in (
        "step_wise",
        "inference_engine",
        "inflight_weight_updates",
        "max_engine_restarts",
    ):
        return "rollout"
    return "trainer"


def select(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


@dataclasses.dataclass
class Built:
    """What the trainer handed each component, recorded instead of starting Ray."""

    trainer: Trainer
    workers: dict[str, Any]  # role -> the real worker object (rank 0)
    sizes: dict[str, int]  # role -> data-parallel ranks
    bundle_cpus: list[float]
    engine: dict[str, Any]  # cfg, strategies, resources given to InferenceEngineClient.from_config
    tracker: tuple

    def held(self, component: str, key: str) -> Any:
        """The value of `key` in the config object `component` received."""
        if component in ("policy", "ref", "critic"):
            return select(self.workers[component].cfg, key.removeprefix("trainer."))
        if component == "engine":
            return select(self.engine["cfg"], key.removeprefix("generator.inference_engine."))
        if component == "rollout":
            return select(self.trainer.rollout.cfg, key.removeprefix("generator."))
        if component == "environment":
            return select(self.trainer.rollout.env, key.removeprefix("environment."))
        return select(self.trainer.cfg, key)


# key -> its effect, observed where the component uses it (compared with the key's value)
EFFECTS = {
    "trainer.ref.model.path": lambda b: b.workers["ref"].model_path,
    "trainer.critic.model.path": lambda b: b.workers["critic"].model_path,
    "trainer.placement.colocate_all": lambda b: b.engine["strategies"] is not None,
    "trainer.placement.policy_num_nodes": lambda b: b.sizes["policy"],
    "trainer.placement.policy_num_gpus_per_node": lambda b: b.sizes["policy"],
    "trainer.placement.critic_num_nodes": lambda b: b.sizes["critic"],
    "trainer.placement.critic_num_gpus_per_node": lambda b: b.sizes["critic"],
    "trainer.placement.ref_num_nodes": lambda b: b.sizes["ref"],
    "trainer.placement.ref_num_gpus_per_node": lambda b: b.sizes["ref"],
    "trainer.placement.cpus_per_worker": lambda b: b.bundle_cpus[0],
    "trainer.algorithm.use_kl_in_reward": lambda b: "ref" in b.workers,
    "trainer.algorithm.kl_ctrl.type": lambda b: (
        "adaptive" if isinstance(b.trainer.update.kl_ctrl, AdaptiveKLController) else "fixed"
    ),
    "trainer.algorithm.kl_ctrl.kl_coef": lambda b: b.trainer.update.kl_ctrl.value,
    "trainer.algorithm.kl_ctrl.target_kl": lambda b: b.trainer.update.kl_ctrl.target_kl,
    "trainer.algorithm.kl_ctrl.horizon": lambda b: b.trainer.update.kl_ctrl.horizon,
    "trainer.logger": lambda b: b.tracker[0],
    "trainer.project_name": lambda b: b.tracker[2],
    "trainer.run_name": lambda b: b.tracker[3],
    "trainer.train_batch_size": lambda b: b.trainer.sampler.loader.batch_size,
    "generator.sampling.temperature": lambda b: b.workers["policy"].temperature,
    "generator.inference_engine.weight_sync": lambda b: b.trainer.weight_sync.name,
    "generator.http_endpoint.enabled": lambda b: b.trainer.server is not None,
    "generator.max_engine_restarts": lambda b: b.engine["max_restarts"],
    "generator.agent": lambda b: f"{b.trainer.rollout.agent.__module__}:{b.trainer.rollout.agent.__name__}",
    "generator.generator_class": lambda b: (
        f"{type(b.trainer.rollout).__module__}:{type(b.trainer.rollout).__name__}"
    ),
    "data.shuffle": lambda b: b.trainer.sampler.loader.shuffle,
    "reward.sources": lambda b: {"env": {"type": "env", "weight": b.trainer.sampler.rewards.env_weight}},
}

# entry-point keys: key -> its effect on start_ray's ray.init call or on load_datasets
ENTRY_EFFECTS = {
    "ray.address": lambda ray_init, data: ray_init["address"],
    "ray.num_cpus": lambda ray_init, data: ray_init["num_cpus"],
    "ray.include_dashboard": lambda ray_init, data: ray_init["include_dashboard"],
    "data.train_path": lambda ray_init, data: data[0].source,
    "data.eval_path": lambda ray_init, data: data[1].source,
    "data.num_generated_train_prompts": lambda ray_init, data: len(data[0]),
    "data.num_generated_eval_prompts": lambda ray_init, data: len(data[1]),
}


def read_attributes(files: list[str]) -> set[str]:
    """Attribute names read in `files` (under the package)."""
    names = set()
    for name in files:
        for node in ast.walk(ast.parse((PACKAGE / name).read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
    return names


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompts")
    paths = {"train_file": folder / "train.jsonl", "eval_file": folder / "eval.jsonl"}
    for seed, path in enumerate(paths.values()):
        path.write_text("".join(json.dumps(r) + "\n" for r in guess_number.make_dataset(8, seed)))
    return {name: str(path) for name, path in paths.items()}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return PromptDataset.from_records(guess_number.make_dataset(64, 0), tokenizer, 128)


@pytest.fixture
def build(monkeypatch, tmp_path, tiny_model_path, prompts):
    """`build(cfg)`: a real `Trainer` over recorders of what it hands the workers, engines and tracker."""
    threads = torch.get_num_threads()

    def make(cfg: SkyRLConfig) -> Built:
        workers, sizes, bundle_cpus, engine, tracker = {}, {}, [], {}, []

        def actor_group(
            worker_cls, cfg, model_path, num_workers, pg, resource_fraction=1.0, wait=True, **kwargs
        ):
            workers[worker_cls.role] = worker_cls(cfg, 0, num_workers, model_path, **kwargs)
            sizes[worker_cls.role] = num_workers

        def placement_group(n, cpus_per_bundle, gpus_per_bundle):
            bundle_cpus.append(cpus_per_bundle)

        def from_config(cfg, model_path, strategies=None, resources=None, max_restarts=0, wait=True, **hooks):
            engine.update(cfg=cfg, strategies=strategies, resources=resources, max_restarts=max_restarts)
            return types.SimpleNamespace(wait_until_serving=lambda: None, engines=())

        factories = Factories(
            actor_group=actor_group,
            placement_group=placement_group,
            bundle_strategy=dict,
            resources=lambda: {"CPU": 8.0},
            pin_to_cores=lambda actors, cores: None,
            engine_client=from_config,
            tracker=lambda *args: tracker.extend(args),
        )
        monkeypatch.setattr(WeightSync, "start", lambda self, engines: None)
        served = types.SimpleNamespace(
            url="http://127.0.0.1:1", cfg=cfg.generator.http_endpoint, model_name="m"
        )
        monkeypatch.setattr(Engines, "serve", lambda self, *args: setattr(self, "server", served))
        trainer = Trainer(cfg, tmp_path, str(tiny_model_path), (prompts, None), factories)
        trainers.append(trainer)
        return Built(trainer, workers, sizes, bundle_cpus, engine, tuple(tracker))

    trainers: list[Trainer] = []
    yield make
    torch.set_num_threads(threads)  # the workers set this process's threads
    for trainer in trainers:
        if isinstance(trainer.rollout, AgentGenerator):
            trainer.rollout.close()  # its agents' loop


@functools.cache
def composed(overrides: tuple[str, ...]) -> SkyRLConfig:
    """`compose_config(overrides)`, read only: the 163 keys share 15 sets of preconditions."""
    return compose_config(list(overrides))


def test_the_table_covers_every_leaf_key_of_the_schema():
    assert list(OVERRIDES) == leaf_keys()


@pytest.mark.parametrize("key", leaf_keys())
def test_a_non_default_value_reaches_the_component_that_uses_it(key, build, files, tokenizer, monkeypatch):
    overrides = [o.format(**files) for o in OVERRIDES[key]]
    cfg, default = compose_config(overrides), composed(tuple(overrides[1:]))
    value = select(cfg, key)
    assert value != select(default, key), f"{overrides[0]} is the default"
    component = user(key)
    if component == "entry":
        ray_init = {}
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        monkeypatch.setattr(ray, "init", lambda **kwargs: ray_init.update(kwargs))
        monkeypatch.setattr("skyrl.train.utils.reaper.reap_descendants_on_exit", lambda: None)
        entry.start_ray(cfg)
        if key in ENTRY_EFFECTS:
            assert ENTRY_EFFECTS[key](ray_init, load_datasets(cfg, tokenizer)) == value
            return
    built = build(cfg)
    if key in EFFECTS:
        assert EFFECTS[key](built) == value
        return
    held = select(cfg, key) if component == "entry" else built.held(component, key)
    assert held == value, f"{key}: {component} holds {held!r}"
    assert key.rsplit(".", 1)[1] in read_attributes(CODE[component]), f"{key}: no {component} code reads it"


def test_loading_the_schema_starts_nothing():
    """The schema module and the config checks load without Ray, torch or an engine."""
    code = (
        "import sys, skyrl.train.schema, skyrl.train.config; "
        "print(sorted(m for m in ('ray', 'torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_default_run_checkpoints_periodically():
    """A first long run that crashes can resume (the final export is checked by the custom-env example's
    test, which leaves `hf_save_interval` at its default)."""
    cfg = compose_config([])
    assert 0 < cfg.trainer.ckpt_interval <= cfg.trainer.total_steps
    assert cfg.trainer.hf_save_interval == 0
