"""Configuration rules checked before anything starts, and the composed config.

The tree itself is `skyrl.train.schema`. `validate_config` checks a whole tree
(`validate_batch_sizes` holds every rule between batch sizes, sample counts and
data-parallel sizes); each failure is one `ConfigError` naming the config keys,
their values and a valid nearby setting. `compose_config` builds the validated
tree for command-line overrides, as `python -m skyrl.train` does.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl.train.inference.config import check_action_space
from skyrl.train.overrides import check_config_name, check_overrides, describe
from skyrl.train.schema import (
    ATTN_IMPLEMENTATIONS,
    ENV_EXECUTORS,
    ENV_FAILURE_MODES,
    ROLES,
    AlgorithmConfig,
    GeneratorConfig,
    ModelConfig,
    SkyRLConfig,
    TrainerConfig,
)
from skyrl.train.utils.errors import ConfigError


@dataclass(frozen=True)
class BatchSizes:
    """The batch-size settings of a run, named as in the config tree.

    Units: `train_batch_size` and the mini-batch sizes count prompts; micro-batch
    sizes count sequences per data-parallel rank. `critic_mini_batch_size=None`
    means the run has no critic.
    """

    train_batch_size: int
    policy_mini_batch_size: int
    micro_train_batch_size_per_gpu: int
    micro_forward_batch_size_per_gpu: int
    n_samples_per_prompt: int
    policy_dp_size: int
    step_wise: bool = False
    critic_mini_batch_size: int | None = None
    critic_dp_size: int = 1


KEYS = {
    "train_batch_size": "trainer.train_batch_size",
    "policy_mini_batch_size": "trainer.policy_mini_batch_size",
    "critic_mini_batch_size": "trainer.critic_mini_batch_size",
    "micro_train_batch_size_per_gpu": "trainer.micro_train_batch_size_per_gpu",
    "micro_forward_batch_size_per_gpu": "trainer.micro_forward_batch_size_per_gpu",
    "n_samples_per_prompt": "generator.n_samples_per_prompt",
    "policy_dp_size": "policy data-parallel size (trainer.placement.policy_num_nodes * policy_num_gpus_per_node)",
    "critic_dp_size": "critic data-parallel size (trainer.placement.critic_num_nodes * critic_num_gpus_per_node)",
}


def _nearest(target: int, candidates: list[int]) -> int | None:
    return min(candidates, key=lambda c: (abs(c - target), c)) if candidates else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_model(cfg: BatchSizes, role: str, mini: int, dp: int) -> None:
    mini_key, dp_key = KEYS[f"{role}_mini_batch_size"], KEYS[f"{role}_dp_size"]
    train, n = cfg.train_batch_size, cfg.n_samples_per_prompt
    if mini > train:
        raise ConfigError(
            f"{mini_key}={mini} is larger than {KEYS['train_batch_size']}={train}; "
            f"a mini-batch is a part of the training batch, e.g. {mini_key}={train}."
        )
    if train % mini != 0:
        raise ConfigError(
            f"{KEYS['train_batch_size']}={train} is not divisible by {mini_key}={mini} (both count prompts, "
            f"so every mini-batch holds the same prompts); use e.g. {mini_key}={_nearest(mini, _divisors(train))}."
        )
    if mini * n < dp:
        raise ConfigError(
            f"{mini_key}={mini} prompts x {KEYS['n_samples_per_prompt']}={n} samples = {mini * n} sequences "
            f"per mini-batch is fewer than the {dp_key}={dp}, so some ranks would train on padding only; "
            f"raise {mini_key} or {KEYS['n_samples_per_prompt']}, or use fewer ranks."
        )
    if cfg.step_wise:
        return  # sequences per mini-batch vary with turns: padding and ragged micro-batches absorb it
    if (mini * n) % dp != 0:
        valid = [m for m in _divisors(train) if (m * n) % dp == 0]
        fix = (
            f"e.g. {mini_key}={_nearest(mini, valid)}" if valid else f"change {KEYS['n_samples_per_prompt']}"
        )
        raise ConfigError(
            f"{mini_key}={mini} x {KEYS['n_samples_per_prompt']}={n} = {mini * n} sequences per mini-batch "
            f"cannot be split evenly over the {dp_key}={dp}; {fix}."
        )
    per_rank, micro = mini * n // dp, cfg.micro_train_batch_size_per_gpu
    if per_rank % micro != 0:
        raise ConfigError(
            f"each {role} rank gets {per_rank} sequences per mini-batch ({mini_key}={mini} x "
            f"{KEYS['n_samples_per_prompt']}={n} / {dp} ranks), not divisible by "
            f"{KEYS['micro_train_batch_size_per_gpu']}={micro}; use e.g. "
            f"{KEYS['micro_train_batch_size_per_gpu']}={_nearest(micro, _divisors(per_rank))} "
            "(or generator.step_wise=true, where the last micro-batch may be smaller)."
        )


def validate_batch_sizes(cfg: BatchSizes) -> None:
    """Raise `ConfigError` for the first batch-size rule `cfg` breaks.

    Rules: every size is positive; mini-batch sizes divide `train_batch_size`
    and are not larger than it; a mini-batch has at least one sequence per DP
    rank; outside step-wise training a mini-batch's sequences split evenly over
    the DP ranks and each rank's share splits evenly into micro-batches. Step-wise
    training relaxes the last two, since sequence counts depend on turns.
    """
    positive = [
        "train_batch_size",
        "policy_mini_batch_size",
        "micro_train_batch_size_per_gpu",
        "micro_forward_batch_size_per_gpu",
        "n_samples_per_prompt",
        "policy_dp_size",
    ]
    if cfg.critic_mini_batch_size is not None:
        positive += ["critic_mini_batch_size", "critic_dp_size"]
    for name in positive:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{KEYS[name]}={value!r} must be a positive integer, e.g. {KEYS[name]}=1.")
    _check_model(cfg, "policy", cfg.policy_mini_batch_size, cfg.policy_dp_size)
    if cfg.critic_mini_batch_size is not None:
        _check_model(cfg, "critic", cfg.critic_mini_batch_size, cfg.critic_dp_size)


# ---------------------------------------------------------------------------
# Validation of the whole tree, before Ray starts.
# ---------------------------------------------------------------------------


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _require_key(ok: bool, key: str, value: Any, rule: str, example: Any) -> None:
    """`_require` for one key's own range: the message names the key, its value, the rule, a valid value
    and what the key sets (its description in `schema.py`)."""
    _require(ok, f"{key}={value} {rule}, e.g. {key}={example}. {key}: {describe(key)}.")


def _known(key: str, value: str, resolve: Any) -> None:
    try:
        resolve(value)
    except ValueError as e:
        raise ConfigError(f"{key}={value!r}: {e}") from None


def batch_sizes(cfg: SkyRLConfig) -> BatchSizes:
    """The batch-size settings of `cfg`, with the data-parallel sizes its placement gives."""
    trainer, placement = cfg.trainer, cfg.trainer.placement
    critic = trainer.algorithm.advantage_estimator == "gae"
    return BatchSizes(
        train_batch_size=trainer.train_batch_size,
        policy_mini_batch_size=trainer.policy_mini_batch_size,
        micro_train_batch_size_per_gpu=trainer.micro_train_batch_size_per_gpu,
        micro_forward_batch_size_per_gpu=trainer.micro_forward_batch_size_per_gpu,
        n_samples_per_prompt=cfg.generator.n_samples_per_prompt,
        policy_dp_size=placement.ranks("policy") // trainer.policy.sequence_parallel_size,
        step_wise=cfg.generator.step_wise,
        critic_mini_batch_size=trainer.critic_mini_batch_size if critic else None,
        critic_dp_size=placement.ranks("critic") // trainer.critic.sequence_parallel_size,
    )


def validate_config(cfg: SkyRLConfig) -> None:
    """Raise `ConfigError` for the first rule `cfg` breaks; every message names key, value and a fix.
    Each section's own rules first, then the rules across sections."""
    from skyrl.train.rewards import validate_rewards

    _check_models(cfg.trainer)
    _check_trainer(cfg.trainer)
    _check_algorithm(cfg.trainer.algorithm)
    _check_generator(cfg.generator)
    _check_data_and_environment(cfg)
    validate_rewards(cfg.reward)
    _check_reward_models(cfg)
    _check_lora(cfg)
    _check_across_sections(cfg)


def _check_trainer(trainer: TrainerConfig) -> None:
    """The `trainer` section's loop, checkpoints, logging and fault-tolerance settings (the models are
    `_check_models`', `trainer.algorithm` `_check_algorithm`'s)."""
    from skyrl.train.utils.tracking import BACKENDS

    placement = trainer.placement
    for key, value in [
        ("trainer.update_epochs_per_batch", trainer.update_epochs_per_batch),
        ("trainer.placement.policy_num_nodes", placement.policy_num_nodes),
        ("trainer.placement.policy_num_gpus_per_node", placement.policy_num_gpus_per_node),
    ]:
        _require_key(value > 0, key, value, "must be positive", 1)
    _require_key(trainer.total_steps >= 0, "trainer.total_steps", trainer.total_steps, "must be >= 0", 100)
    for key, value in [
        ("trainer.eval_interval", trainer.eval_interval),
        ("trainer.ckpt_interval", trainer.ckpt_interval),
        ("trainer.hf_save_interval", trainer.hf_save_interval),
    ]:
        _require_key(value >= 0, key, value, "must be >= 0", 0)
    _require(
        trainer.resume_mode in ("latest", "none") or Path(trainer.resume_mode).is_dir(),
        f"trainer.resume_mode={trainer.resume_mode!r} must be 'latest', 'none' or an existing checkpoint "
        "directory.",
    )
    unknown = [b for b in trainer.logger if b not in BACKENDS]
    _require(
        not unknown,
        f"trainer.logger={list(trainer.logger)} has unknown backends {unknown}; choose from {list(BACKENDS)}.",
    )
    for key, value, example in [
        ("trainer.max_consecutive_skipped_steps", trainer.max_consecutive_skipped_steps, 5),
        ("trainer.max_restarts", trainer.max_restarts, 3),
        ("trainer.preemption_grace_s", trainer.preemption_grace_s, 15),
        ("trainer.async_training.max_staleness", trainer.async_training.max_staleness, 1),
    ]:
        _require_key(value >= 0, key, value, "must be >= 0", example)
    _require_key(
        trainer.rpc_timeout_s > 0, "trainer.rpc_timeout_s", trainer.rpc_timeout_s, "must be > 0", 1800
    )


def _check_models(trainer: TrainerConfig) -> None:
    """What the workers compute with: the policy's model, micro-batches, attention, the optimizers."""
    _require(
        bool(trainer.policy.model.path),
        f"trainer.policy.model.path={trainer.policy.model.path!r} must name a model directory or HF hub name "
        "(or tiny for the default tiny model), e.g. trainer.policy.model.path=tiny.",
    )
    budget = trainer.max_tokens_per_micro_batch
    _require_key(
        budget is None or budget > 0,
        "trainer.max_tokens_per_micro_batch",
        budget,
        "must be positive or null",
        8192,
    )
    chunk = trainer.logprob_chunk_tokens
    _require_key(chunk > 0, "trainer.logprob_chunk_tokens", chunk, "must be positive", 1024)
    for role in ROLES:
        implementation = getattr(trainer, role).model.attn_implementation
        _require(
            implementation in ATTN_IMPLEMENTATIONS,
            f"trainer.{role}.model.attn_implementation={implementation!r} is not one of "
            f"{list(ATTN_IMPLEMENTATIONS)}; sdpa works everywhere, varlen packs sequences without padding.",
        )
    for role in ROLES:
        section, owner = getattr(trainer, role), "policy" if trainer.placement.colocate_all else role
        _check_sequence_parallel(
            f"trainer.{role}",
            section.sequence_parallel_size,
            f"{role} ranks",
            trainer.placement.ranks(role),
            f"trainer.placement.{owner}_num_nodes x {owner}_num_gpus_per_node",
            section.model,
        )
    for key, opt in [
        ("trainer.policy.optimizer", trainer.policy.optimizer),
        ("trainer.critic.optimizer", trainer.critic.optimizer),
    ]:
        _require_key(opt.lr > 0, f"{key}.lr", opt.lr, "must be positive", 1e-6)
        _require(
            opt.scheduler in ("constant", "cosine"),
            f"{key}.scheduler={opt.scheduler!r} is not 'constant' or 'cosine'.",
        )


def _check_sequence_parallel(
    section: str, sp: Any, ranks_name: str, ranks: int, ranks_key: str, model: ModelConfig | None
) -> None:
    """`<section>.sequence_parallel_size` (`sp`) divides the `ranks` (set by `ranks_key`) of the worker
    group that `section` configures, with an attention it can wrap (`model`: `<section>.model`'s settings;
    None: the default sdpa)."""
    key = f"{section}.sequence_parallel_size"
    _require(
        isinstance(sp, int) and not isinstance(sp, bool) and sp >= 1,
        f"{key}={sp!r} must be a positive integer (1: no sequence parallelism), e.g. {key}=1.",
    )
    if sp == 1:
        return
    _require(
        ranks % sp == 0,
        f"{key}={sp} does not divide the {ranks} {ranks_name} ({ranks_key}); use one of {_divisors(ranks)}, "
        "or more ranks.",
    )
    if model is None:
        return
    implementation = model.attn_implementation
    _require(
        implementation in ("sdpa", "varlen"),
        f"{key}={sp} computes attention as sdpa or varlen over the whole sequence, but "
        f"{section}.model.attn_implementation={implementation!r}; use sdpa or varlen.",
    )
    _require(
        not model.compile,
        f"{key}={sp} with {section}.model.compile=true: compiled decoder layers cannot hold sequence "
        f"parallelism's all-to-all; set {section}.model.compile=false, or {key}=1.",
    )


def _check_reward_models(cfg: SkyRLConfig) -> None:
    """Each reward model's `sequence_parallel_size` divides its ranks: colocated, the policy's; otherwise
    its own `num_nodes` x `num_gpus_per_node`."""
    from skyrl.train.rewards import source_configs

    placement = cfg.trainer.placement
    for name, source in source_configs(cfg.reward).items():
        if source.type != "model":
            continue
        section = f"reward.sources.{name}"
        ranks, ranks_key = (
            (placement.ranks("policy"), "trainer.placement.policy_num_nodes x policy_num_gpus_per_node")
            if placement.colocate_all
            else (source.num_nodes * source.num_gpus_per_node, f"{section}.num_nodes x num_gpus_per_node")
        )
        _check_sequence_parallel(
            section, source.sequence_parallel_size, f"reward model {name} ranks", ranks, ranks_key, None
        )


def check_sequence_parallel_heads(key: str, sp: int, model_config: Any) -> None:
    """`key` (a `sequence_parallel_size`, `sp`) divides the attention heads of its model (`model_config`,
    its Hugging Face config); key/value heads it does not divide are repeated."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    _require(
        heads % sp == 0,
        f"{key}={sp} does not divide the model's {heads} attention heads ({kv_heads} key/value heads): each "
        f"rank attends with heads / sp of them; use one of {_divisors(heads)}.",
    )


def _check_algorithm(algorithm: AlgorithmConfig) -> None:
    """`trainer.algorithm`: estimator, loss and reduction, off-policy correction, KL, dynamic sampling."""
    from skyrl.train.algorithms import REDUCTIONS, get_advantage_estimator, get_policy_loss
    from skyrl.train.algorithms.losses import KL_ESTIMATORS, OFF_POLICY_CORRECTIONS

    key = "trainer.algorithm"
    _known(f"{key}.advantage_estimator", algorithm.advantage_estimator, get_advantage_estimator)
    _known(f"{key}.policy_loss", algorithm.policy_loss, get_policy_loss)
    _require(
        algorithm.loss_reduction in REDUCTIONS,
        f"{key}.loss_reduction={algorithm.loss_reduction!r} is not one of {list(REDUCTIONS)}.",
    )
    _require(
        algorithm.off_policy_correction in OFF_POLICY_CORRECTIONS,
        f"{key}.off_policy_correction={algorithm.off_policy_correction!r} is not one of "
        f"{list(OFF_POLICY_CORRECTIONS)}.",
    )
    tis_cap, mis_low, mis_high = algorithm.tis_cap, algorithm.mis_low, algorithm.mis_high
    _require(
        tis_cap > 0 and 0 <= mis_low < 1 < mis_high,
        f"{key}.tis_cap={tis_cap}, mis_low={mis_low}, mis_high={mis_high}: need tis_cap > 0 "
        "and mis_low < 1 < mis_high, e.g. tis_cap=2, mis_low=0.5, mis_high=2.",
    )
    _require(
        algorithm.kl_estimator in KL_ESTIMATORS,
        f"{key}.kl_estimator={algorithm.kl_estimator!r} is not one of {list(KL_ESTIMATORS)}.",
    )
    _require(
        algorithm.kl_ctrl.type in ("fixed", "adaptive"),
        f"{key}.kl_ctrl.type={algorithm.kl_ctrl.type!r} is not 'fixed' or 'adaptive'.",
    )
    _require(
        algorithm.dynamic_sampling in (None, "filter"),
        f"{key}.dynamic_sampling={algorithm.dynamic_sampling!r} must be null or 'filter'.",
    )
    _require(
        algorithm.max_sample_batches >= 1,
        f"{key}.max_sample_batches={algorithm.max_sample_batches} must be >= 1, e.g. 4.",
    )
    _require(
        algorithm.eps_clip_low >= 0 and algorithm.eps_clip_high >= 0,
        f"{key}.eps_clip_low={algorithm.eps_clip_low} / eps_clip_high={algorithm.eps_clip_high} must be >= 0, "
        "e.g. 0.2 / 0.28.",
    )


def _check_generator(generator: GeneratorConfig) -> None:
    """`generator`: lengths, sampling, environment failures, engines, the endpoint, who runs the episodes."""
    from skyrl.train.inference.config import validate_engine_config, validate_server_config

    for key, value in [
        ("generator.max_turns", generator.max_turns),
        ("generator.max_generate_length", generator.max_generate_length),
        ("generator.max_input_length", generator.max_input_length),
        ("generator.env_workers", generator.env_workers),
    ]:
        _require_key(value > 0, key, value, "must be positive", 1)
    for key, s in [
        ("generator.sampling", generator.sampling),
        ("generator.eval_sampling", generator.eval_sampling),
    ]:
        _require_key(s.temperature >= 0, f"{key}.temperature", s.temperature, "must be >= 0", 1.0)
        _require_key(0 < s.top_p <= 1, f"{key}.top_p", s.top_p, "must be in (0, 1]", 1.0)
    fraction = generator.max_env_failure_fraction
    _require_key(0 <= fraction <= 1, "generator.max_env_failure_fraction", fraction, "must be in [0, 1]", 0.5)
    _require(
        generator.env_failure in ENV_FAILURE_MODES,
        f"generator.env_failure={generator.env_failure!r} is not one of {list(ENV_FAILURE_MODES)}: mask leaves "
        "an episode whose environment raised out of the loss, zero_reward trains on it with reward 0.",
    )
    _require(
        generator.env_executor in ENV_EXECUTORS,
        f"generator.env_executor={generator.env_executor!r} is not one of {list(ENV_EXECUTORS)}: thread runs "
        "environments in threads of the driver, process in worker processes that an env's crash or hang "
        "cannot take down.",
    )
    validate_engine_config(generator.inference_engine)
    validate_server_config(generator.http_endpoint)
    restarts = generator.max_engine_restarts
    _require_key(restarts >= 0, "generator.max_engine_restarts", restarts, "must be >= 0", 3)
    _check_episode_runner(generator)


def _check_episode_runner(generator: GeneratorConfig) -> None:
    """Who runs the episodes: the env-based rollout manager, `generator.agent` or `generator.generator_class`."""
    from skyrl.train.generator.agent import load_agent
    from skyrl.train.generator.base import load_generator_class

    agent, generator_class = generator.agent, generator.generator_class
    _require(
        agent is None or generator_class is None,
        f"generator.agent={agent!r} and generator.generator_class={generator_class!r} both name who runs "
        "the episodes; set one of them (or neither, for the env-based rollout manager).",
    )
    if agent is not None:
        load_agent(agent)
        timeout = generator.agent_timeout_s
        _require_key(timeout > 0, "generator.agent_timeout_s", timeout, "must be > 0", 600)
        _require(
            generator.step_wise,
            f"generator.agent={agent!r} with generator.step_wise=false: an agent may re-render or rewrite "
            "its history, so its requests need not extend each other and train one sequence each; set "
            "generator.step_wise=true.",
        )
    if generator_class is not None:
        load_generator_class(generator_class)


def _check_data_and_environment(cfg: SkyRLConfig) -> None:
    """`data` and `environment`: the prompt length, the dataset files, the environment class and its actions."""
    from skyrl.envs import resolve as resolve_env

    data, env = cfg.data, cfg.environment
    _require_key(
        data.max_prompt_length > 0, "data.max_prompt_length", data.max_prompt_length, "must be positive", 512
    )
    _known("environment.env_class", env.env_class, resolve_env)
    _require_key(env.timeout_s > 0, "environment.timeout_s", env.timeout_s, "must be > 0", 600)
    action_space = (env.config.get(env.env_class) or {}).get("allowed_tokens")
    _require(
        action_space is None or (isinstance(action_space, list) and len(action_space) > 0),
        f"environment.config.{env.env_class}.allowed_tokens={action_space!r} must be a non-empty list of "
        'tokens, e.g. ["1", "2", "3"], or null (no restriction).',
    )
    for key, path in [("data.train_path", data.train_path), ("data.eval_path", data.eval_path)]:
        local = path is not None and Path(path).suffix in (".parquet", ".jsonl", ".json")
        _require(not local or Path(path).exists(), f"{key}={path!r} does not exist; give an existing file.")


def _check_across_sections(cfg: SkyRLConfig) -> None:
    """Rules that tie sections together: lengths, samples per prompt, batch sizes, placement, asynchrony."""
    trainer, algorithm, generator = cfg.trainer, cfg.trainer.algorithm, cfg.generator
    engine, placement = generator.inference_engine, trainer.placement
    prompt_length = cfg.data.max_prompt_length
    _require(
        generator.max_input_length > prompt_length,
        f"generator.max_input_length={generator.max_input_length} must exceed data.max_prompt_length="
        f"{prompt_length} so the first turn has room to generate, e.g. generator.max_input_length="
        f"{prompt_length + 256}.",
    )
    _require(
        algorithm.loss_reduction != "seq_mean_token_sum_norm" or (algorithm.max_seq_len or 0) > 0,
        "trainer.algorithm.loss_reduction=seq_mean_token_sum_norm needs trainer.algorithm.max_seq_len "
        f"(got {algorithm.max_seq_len}), e.g. trainer.algorithm.max_seq_len={generator.max_input_length}.",
    )
    _require(
        algorithm.advantage_estimator not in ("grpo", "rloo") or generator.n_samples_per_prompt >= 2,
        f"trainer.algorithm.advantage_estimator={algorithm.advantage_estimator} compares the samples of a "
        f"prompt, but generator.n_samples_per_prompt={generator.n_samples_per_prompt}; use at least 2, e.g. 8.",
    )
    validate_batch_sizes(batch_sizes(cfg))
    if placement.colocate_all:
        bundles = placement.ranks("policy")
        _require(
            engine.tensor_parallel_size == 1,
            f"generator.inference_engine.tensor_parallel_size={engine.tensor_parallel_size} with "
            "trainer.placement.colocate_all=true: a colocated engine shares one bundle with one policy rank; "
            "use tensor_parallel_size=1 or placement=disaggregated.",
        )
        _require(
            engine.num_engines <= bundles,
            f"generator.inference_engine.num_engines={engine.num_engines} exceeds the {bundles} policy bundles "
            "the colocated engines share (trainer.placement.policy_num_nodes x policy_num_gpus_per_node); "
            f"use num_engines<={bundles} or placement=disaggregated.",
        )
    staleness = trainer.async_training.max_staleness
    _require(
        staleness == 0 or not placement.colocate_all,
        f"trainer.async_training.max_staleness={staleness} generates while the workers train, so the "
        "engines need devices of their own, but trainer.placement.colocate_all=true; use "
        "placement=disaggregated (or max_staleness=0).",
    )
    _require(
        staleness >= 1 or not generator.inflight_weight_updates,
        "generator.inflight_weight_updates=true lands weight syncs in episodes in progress, but "
        "trainer.async_training.max_staleness=0 (the synchronous loop) syncs when none is; set "
        "trainer.async_training.max_staleness=1, or inflight_weight_updates=false.",
    )
    _require(
        engine.weight_sync != "ipc" or placement.colocate_all,
        "generator.inference_engine.weight_sync=ipc with trainer.placement.colocate_all=false: shared-memory "
        "sync needs each engine on its policy rank's node and GPU; use placement=colocated, or "
        "weight_sync=broadcast (or auto) for disaggregated engines.",
    )


def preflight(
    cfg: SkyRLConfig, resources: Mapping[str, float], num_allowed_tokens: int = 0, model_config: Any = None
) -> None:
    """The rules that need the Ray cluster's `resources` (`ray.cluster_resources()`) or the models' configs
    (`model_config`: the policy's), checked before any placement group or process starts: the layout fits
    the GPUs, NCCL broadcast gets GPUs of its own, flash-attention has a GPU and its package, the engines
    take the environment's `num_allowed_tokens`, sequence parallelism divides the attention heads."""
    from transformers import AutoConfig

    from skyrl.train.cluster import Roles, resolve_model_path
    from skyrl.train.inference.client import resolve_engine_config
    from skyrl.train.rewards import source_configs

    # the reference and critic load the policy's model unless they name their own
    sections = [(f"trainer.{role}", getattr(cfg.trainer, role)) for role in ROLES]
    parallel = [
        (key, s.sequence_parallel_size, s.model.path if key != "trainer.policy" else None)
        for key, s in sections
    ]
    parallel += [
        (f"reward.sources.{name}", s.sequence_parallel_size, s.model)
        for name, s in source_configs(cfg.reward).items()
        if s.type == "model"
    ]
    for section, sp, path in (p for p in parallel if p[1] > 1):
        own = AutoConfig.from_pretrained(resolve_model_path(path)) if path else model_config
        if own is not None:
            check_sequence_parallel_heads(f"{section}.sequence_parallel_size", sp, own)

    gpus = int(resources.get("GPU", 0))
    key = f"environment.config.{cfg.environment.env_class}.allowed_tokens"
    check_action_space(resolve_engine_config(cfg.generator.inference_engine, gpus), num_allowed_tokens, key)
    if gpus:  # a layout that cannot fit would wait for GPUs forever
        roles = Roles.of(cfg.trainer)
        check_gpu_budget(cfg, roles.ref, roles.critic, gpus)
    engine = cfg.generator.inference_engine
    _require(
        not (engine.weight_sync == "broadcast" and gpus and cfg.trainer.placement.colocate_all),
        "generator.inference_engine.weight_sync=broadcast needs engines on GPUs of their own (NCCL cannot "
        "join two ranks on one GPU), but trainer.placement.colocate_all=true; use weight_sync=ipc "
        "(or auto), or placement=disaggregated",
    )
    flash = importlib.util.find_spec("flash_attn") is not None
    for role in ROLES:
        implementation = getattr(cfg.trainer, role).model.attn_implementation
        _require(
            implementation != "flash_attention_2" or (gpus and flash),
            f"trainer.{role}.model.attn_implementation=flash_attention_2 needs a GPU and the flash-attn package "
            f"(the cluster has {gpus} GPUs; flash_attn is {'installed' if flash else 'missing'}); use varlen "
            "(torch's own flash attention over packed sequences) or sdpa",
        )


def check_gpu_budget(cfg: SkyRLConfig, use_ref: bool, use_critic: bool, cluster_gpus: int) -> None:
    """`ConfigError` naming each model's GPUs when the layout needs more than the cluster's `cluster_gpus`:
    colocated, the policy's bundles hold everything; disaggregated, the policy, reference and critic
    ranks and `num_engines x tensor_parallel_size` engine GPUs each need GPUs of their own, as do the
    reward models' ranks and the engines of a judge that has its own."""
    from skyrl.train.rewards import judge_engine_config, source_configs

    placement, engine = cfg.trainer.placement, cfg.generator.inference_engine
    roles = ["policy"] + (["ref"] * use_ref + ["critic"] * use_critic if not placement.colocate_all else [])
    needs = {f"{role} ({role}_num_nodes x {role}_num_gpus_per_node)": placement.ranks(role) for role in roles}
    if not placement.colocate_all:
        needs["engines (num_engines x tensor_parallel_size)"] = (
            engine.num_engines * engine.tensor_parallel_size
        )
    for name, source in source_configs(cfg.reward).items():  # judges on engines of their own
        if source.type == "model" and not placement.colocate_all:
            needs[f"reward model {name} (num_nodes x num_gpus_per_node)"] = (
                source.num_nodes * source.num_gpus_per_node
            )
        if source.type == "judge" and source.url is None:
            judge = judge_engine_config(f"reward.sources.{name}", source)
            if judge.device != "cpu":
                needs[f"judge {name} engines"] = judge.num_engines * judge.tensor_parallel_size
    if sum(needs.values()) > cluster_gpus:
        parts = ", ".join(f"{name} {n}" for name, n in needs.items())
        raise ConfigError(
            f"this layout needs {sum(needs.values())} GPUs ({parts}), the Ray cluster has {cluster_gpus}; "
            "use fewer ranks or engines, trainer.placement.colocate_all=true (placement=colocated), or a "
            "bigger cluster."
        )


CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def _check_lora(cfg: SkyRLConfig) -> None:
    """The LoRA settings of the trained models, the adapter sync and the merged export."""
    trainer, engine = cfg.trainer, cfg.generator.inference_engine
    for role in ("policy", "critic"):
        key, lora = f"trainer.{role}.lora", getattr(trainer, role).lora
        _require_key(lora.rank >= 0, f"{key}.rank", lora.rank, "must be >= 0", 16)
        if lora.rank:
            _require_key(lora.alpha > 0, f"{key}.alpha", lora.alpha, "must be positive", 2 * lora.rank)
            _require_key(0 <= lora.dropout < 1, f"{key}.dropout", lora.dropout, "must be in [0, 1)", 0)
            _require(
                bool(lora.target_modules),
                f"{key}.target_modules is empty; name the linear layers to adapt, e.g. [q_proj,v_proj].",
            )
    k, rank = "generator.inference_engine", trainer.policy.lora.rank
    if engine.lora_sync == "adapter":
        _require(
            rank > 0,
            f"{k}.lora_sync=adapter sends LoRA adapters, but trainer.policy.lora.rank=0 (full fine-tuning); "
            "set trainer.policy.lora.rank (e.g. 16) or lora_sync=merged.",
        )
        _require(
            engine.weight_sync in ("auto", "object_store"),
            f"{k}.lora_sync=adapter sends the adapters through the object store, so {k}.weight_sync="
            f"{engine.weight_sync} would not apply; set {k}.weight_sync=auto, or lora_sync=merged.",
        )
        _require(
            not trainer.policy.lora.modules_to_save,
            f"{k}.lora_sync=adapter sends LoRA adapters only, but trainer.policy.lora.modules_to_save="
            f"{list(trainer.policy.lora.modules_to_save)} train in full; use lora_sync=merged, or modules_to_save=[].",
        )
        _require(
            engine.max_lora_rank is None or engine.max_lora_rank >= rank,
            f"{k}.max_lora_rank={engine.max_lora_rank} is below trainer.policy.lora.rank={rank}; set it to null "
            "(the policy's rank) or higher.",
        )
    _require(
        not trainer.export_merged or rank > 0,
        "trainer.export_merged=true writes the merged model of a LoRA policy, but trainer.policy.lora.rank=0 "
        "(its exports are the full model already); set trainer.policy.lora.rank or export_merged=false.",
    )


@functools.cache
def register_schema() -> None:
    """Make the schema available to the YAML tree as `skyrl_schema` (once a process: storing it converts
    the whole dataclass tree, a third of a `compose_config` call)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="skyrl_schema", node=SkyRLConfig)


def compose_config(
    overrides: list[str],
    config_dir: str | Path | None = None,
    config_name: str = "config",
    validate: bool = True,
) -> SkyRLConfig:
    """The validated config for command-line style `overrides`, as `python -m skyrl.train` builds it;
    with `config_dir` (e.g. the repository's `configs/`) and `config_name` a recipe, as
    `python -m skyrl.train --config-dir DIR --config-name NAME` builds it. `validate=False` skips
    `validate_config` (e.g. to read a recipe whose data files are not on this machine)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    recipes = [Path(config_dir).resolve()] if config_dir is not None else []
    check_config_name(config_name, recipes[0] if recipes else None, CONFIG_DIR)
    check_overrides(overrides, CONFIG_DIR, *recipes)
    register_schema()
    # The recipe folder is the primary source, the package's tree (the recipes' `config`) is searched next;
    # the CLI's --config-dir searches them the other way round, the same files while no recipe shadows `config`.
    search = [f"hydra.searchpath=['file://{CONFIG_DIR}']"] if recipes else []
    with initialize_config_dir(config_dir=str(recipes[0] if recipes else CONFIG_DIR), version_base=None):
        cfg: SkyRLConfig = OmegaConf.to_object(compose(config_name, overrides=[*search, *overrides]))
    if validate:
        validate_config(cfg)
    return cfg
