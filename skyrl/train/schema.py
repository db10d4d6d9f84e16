"""The config tree: every setting of a run, declared once, with its one default.

Each component's config is a dataclass here and the tree (`SkyRLConfig`, Hydra's
schema behind `skyrl/configs/`) composes them; a component receives its own
section of the tree, never a copy. Standard library only, so loading the schema
starts nothing (no Ray, no torch): validation lives in `skyrl.train.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------------------
# trainer.*: the FSDP workers (policy, ref, critic), the algorithm and the loop
# ---------------------------------------------------------------------------


ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "varlen")
PACKED_ATTENTION = ("flash_attention_2", "varlen")  # micro-batches as packed sequences, no padding


@dataclass
class ModelConfig:
    """`path`: a local directory or HF hub name loaded with from_pretrained; `tiny` builds the
    default tiny model locally (no network) and loads it from its cache directory. The reference
    and critic default to null: the policy's model. `gradient_checkpointing` recomputes each
    decoder layer's activations in the backward pass (less memory, ~1/3 more compute; trained
    models only). `attn_implementation`: one of `ATTN_IMPLEMENTATIONS`; `varlen` (torch's own
    variable-length flash attention on a GPU, per-sequence sdpa on the CPU) and `flash_attention_2`
    (GPU, the flash-attn package) compute micro-batches as packed sequences without padding, the
    others right-pad each micro-batch to its own longest sequence. `compile` runs each decoder
    layer and the LM head's logprob chunks through `torch.compile` (fused elementwise kernels; the
    first steps pay the compilation)."""

    path: str | None = "tiny"
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    compile: bool = False


@dataclass
class OptimizerConfig:
    """AdamW and its learning-rate schedule; one optimizer step per mini-batch."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # <= 0 disables clipping
    scheduler: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    total_steps: int = (
        0  # optimizer steps of the schedule; 0: those of the run (TrainerConfig.optimizer_steps)
    )
    min_lr_ratio: float = 0.0


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    """Low-rank adapters (through peft): `rank` 0 trains every parameter (the default); above 0 the
    model is frozen and only rank-`rank` adapters on `target_modules` (module names, e.g. q_proj; the
    default: the attention and MLP projections) train, scaled by `alpha / rank`. `dropout` applies to
    the adapters' inputs (above 0 the compute layouts no longer give identical gradients).
    `modules_to_save` (peft's name) train in full beside the adapters: module names or their
    endings, e.g. `model.norm` or `lm_head` (weights sync merged only)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    modules_to_save: list[str] = field(default_factory=list)


@dataclass
class PolicyConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    bf16: bool = True  # GPU only, every worker (policy, ref, critic); CPU trains in fp32
    cpu_offload: bool = False  # GPU only
    # Ulysses sequence parallelism: this many ranks compute each sequence together (see workers/sequence_parallel.py)
    sequence_parallel_size: int = 1


@dataclass
class RefConfig:
    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(path=None)
    )  # null: the policy's initial weights
    cpu_offload: bool = False  # GPU only
    # Ulysses sequence parallelism: this many ranks compute each sequence together (see workers/sequence_parallel.py)
    sequence_parallel_size: int = 1


@dataclass
class CriticConfig:
    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(path=None)
    )  # null: the policy's, fresh value head
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=5e-6))
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # the value head always trains in full
    cpu_offload: bool = False  # GPU only
    # Ulysses sequence parallelism: this many ranks compute each sequence together (see workers/sequence_parallel.py)
    sequence_parallel_size: int = 1


ROLES = ("policy", "ref", "critic")


@dataclass
class PlacementConfig:
    """`colocate_all`: policy, reference, critic and engines share the same bundles (fractions of
    each); otherwise every model gets bundles of its own. Sizes are nodes x GPUs (CPU bundles on CPU)."""

    colocate_all: bool = True
    policy_num_nodes: int = 1
    policy_num_gpus_per_node: int = 1
    critic_num_nodes: int = 1
    critic_num_gpus_per_node: int = 1
    ref_num_nodes: int = 1
    ref_num_gpus_per_node: int = 1
    cpus_per_worker: float = 1.0  # also each worker's torch CPU threads (at least 1)

    def ranks(self, role: str) -> int:
        """Worker ranks of `role` (one of `ROLES`): colocated, every model has one rank per policy bundle;
        otherwise `<role>_num_nodes * <role>_num_gpus_per_node`. Its data-parallel size is that over its
        `sequence_parallel_size`."""
        assert role in ROLES, f"role {role!r} is not one of {ROLES}"
        owner = "policy" if self.colocate_all else role
        return getattr(self, f"{owner}_num_nodes") * getattr(self, f"{owner}_num_gpus_per_node")


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class AlgorithmConfig:
    """Advantage estimator and losses; names are registry names or `package.module:function`.
    The trainer reads the advantage and reward settings, the workers the loss settings."""

    advantage_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    lambd: float = 1.0
    group_baseline: bool = False  # reinforce++ only
    policy_loss: str = "regular"
    loss_reduction: str = "token_mean"
    max_seq_len: int | None = None  # seq_mean_token_sum_norm's fixed length
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    clip_ratio_c: float = 3.0
    value_clip: float | None = 0.2
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_estimator: str = "k3"
    use_kl_in_reward: bool = False
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    entropy_coeff: float = 0.0
    # engine vs trainer logprobs: none | tis | mis | seq_tis | seq_mis (see algorithms.off_policy_correction)
    off_policy_correction: str = "none"
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    dynamic_sampling: str | None = None  # filter: drop prompt groups whose rewards are all equal, draw more
    max_sample_batches: int = 4  # draws per step with dynamic sampling
    zero_variance_filter: bool = False  # train only on prompt groups with reward variance


@dataclass
class AsyncTrainingConfig:
    """Generation overlapped with training. `max_staleness` s bounds how many policy versions an
    episode's oldest turn may lag the policy that trains on it: 0 is the synchronous loop (generate,
    train, sync); with s >= 1 the next s batches are generated while the workers train, and weights
    go to the engines as soon as a step ends (engines need devices of their own:
    placement=disaggregated). See `skyrl.train.generator.stream`."""

    max_staleness: int = 0


@dataclass
class TrainerConfig:
    """The loop's settings; every FSDP worker receives this section (its role's `policy` / `ref` /
    `critic` part, `algorithm`'s loss settings, micro-batch sizes, seed, placement threads)."""

    seed: int = 42
    total_steps: int = 100  # 0 with eval_before_train: evaluate only
    train_batch_size: int = 16  # prompts per step
    policy_mini_batch_size: int = 4  # prompts per optimizer step
    critic_mini_batch_size: int = 4
    micro_train_batch_size_per_gpu: int = 8  # sequences
    micro_forward_batch_size_per_gpu: int = 16
    # tokens per micro-batch (forward and train), balanced by token count; null: the sizes above
    max_tokens_per_micro_batch: int | None = None
    # compute the steps of a trajectory as one sequence when each extends the previous one
    stepwise_prefix_sharing: bool = True
    logprob_chunk_tokens: int = 1024  # tokens per LM-head chunk: [chunk, vocab] logits at a time
    update_epochs_per_batch: int = 1
    balance_dp: bool = False  # assign prefix groups to DP ranks by attention-aware workload (KK + swaps)
    delay_split_by_dp: bool = False
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    project_name: str = "skyrl"
    run_name: str | None = None
    eval_interval: int = 0  # steps; 0 disables
    eval_before_train: bool = False
    eval_n_samples: int = 4
    ckpt_interval: int = 50  # steps; 0 disables
    max_ckpts_to_keep: int = 2
    resume_mode: str = "latest"  # latest | none | a checkpoint path
    hf_save_interval: int = 0  # steps between HF exports; the final policy is always exported
    # with policy LoRA an export is the adapter (peft format); also write the merged model (export/merged)
    export_merged: bool = False
    # optimizer steps with a non-finite loss or gradient are skipped; more than this many in a row end the run
    max_consecutive_skipped_steps: int = 5
    rpc_timeout_s: float = 1800.0  # the longest a call into the workers may take (a step, a checkpoint)
    # a dead policy / ref / critic rank: rebuild the workers from the last checkpoint, this often per run
    max_restarts: int = 3
    # SIGTERM (or Ctrl-C) stops `python -m skyrl.train` at the next step boundary with a checkpoint, if the
    # step ends within this many seconds (else it is abandoned: the last complete checkpoint stays); the
    # default leaves the checkpoint's write room inside a scheduler's usual 30-120 s grace
    preemption_grace_s: float = 15.0

    def optimizer_steps(self, mini_batch_size: int) -> int:
        """Optimizer steps of the whole run for a model trained on `mini_batch_size`-prompt mini-batches;
        at least 1, so an eval-only run (total_steps=0) can still build a schedule."""
        per_step = (self.train_batch_size // mini_batch_size) * self.update_epochs_per_batch
        return max(1, self.total_steps * per_step)


# ---------------------------------------------------------------------------
# generator.*: the rollout manager and the inference engines
# ---------------------------------------------------------------------------


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None


LORA_SYNCS = ("merged", "adapter")


@dataclass
class InferenceEngineConfig:
    """Engines and the client that routes to them.

    backend: `vllm`, `hf` (transformers generate), or `auto` (vLLM when installed).
    device: `cpu`, `cuda`, or `auto` (cuda when the Ray cluster has GPUs).
    dtype: `auto` is float32 on CPU and the checkpoint's dtype on GPU.
    kv_cache_memory_bytes: vLLM KV cache size; None means `gpu_memory_utilization`
    on GPU and 1 GiB on CPU. enforce_eager: None means True on CPU, False on GPU.
    max_model_len: None means the model's maximum positions.
    max_num_seqs: sequences one engine runs in one batch (vLLM scheduler, hf batch).
    hf_batch_wait_s: the `hf` engine keeps collecting requests while they keep
    arriving within this window before it starts a batch.
    max_concurrent_requests: requests the client has in flight over all engines.
    weight_sync: how the trainer sends (merged) policy weights to the engines: `object_store`
    (full state dict through Ray), `broadcast` (a process group from policy rank 0
    to the engines: NCCL on GPU, gloo on CPU; engines need GPUs of their own), `ipc`
    (colocated engines only: each policy rank hands its engine one layer at a time
    through CUDA IPC on GPU, /dev/shm on CPU), or `auto` (on GPU, ipc when colocated
    and broadcast when not; object_store on CPU).
    weight_sync_timeout_s: how long a broadcast rank waits for the others.
    """

    backend: str = "auto"
    num_engines: int = 1
    tensor_parallel_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.8
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = False  # colocated engines on GPU always sleep while the workers train
    seed: int = 0
    # disaggregated only (and an hf engine's torch threads on CPU); colocated engines take a share of a
    # bundle and, taking turns with the workers, use its cpus_per_worker threads
    num_cpus_per_engine: float = 1.0
    hf_batch_wait_s: float = 0.005
    max_concurrent_requests: int = 1024
    weight_sync: str = "auto"
    weight_sync_timeout_s: float = 600.0
    # an engine that does not serve within this many seconds (no GPU free, a hang) stops the run
    start_timeout_s: float = 1800.0
    # with policy LoRA: `merged` sends base + scale * B @ A by `weight_sync`; `adapter` only the adapters
    # (through the object store), which the engines serve as a LoRA adapter (a new one per version)
    lora_sync: str = "merged"
    max_lora_rank: int | None = None  # adapter sync: the largest rank the engines serve; null: the policy's


@dataclass
class OpenAIServerConfig:
    """The OpenAI-compatible HTTP endpoint over the engines (`OpenAIServer`), `generator.http_endpoint`
    in the tree: with `enabled` the trainer serves the engines for the whole run.

    port 0 picks a free port. api_key None serves without authentication;
    otherwise requests need `Authorization: Bearer <api_key>`. served_model_name
    None means the model path. default_max_tokens applies when a request sets none.
    tool_parser: vLLM's tool-call parser for requests with `tools` (e.g. hermes for Qwen2.5); auto:
    hermes when the chat template writes `<tool_call>` tags, else none (such requests get a 400).
    reasoning_parser: vLLM's reasoning parser (e.g. qwen3, deepseek_r1): answers carry the thinking as
    `message.reasoning`, apart from `content`; none: the text as generated (`inference.reasoning`).
    Both parsers serve env episodes too: an env's `step` gets the content and the calls parsed from it.
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    default_max_tokens: int = 512
    tool_parser: str = "auto"
    reasoning_parser: str = "none"


ENV_FAILURE_MODES = ("mask", "zero_reward")
ENV_EXECUTORS = ("thread", "process")


@dataclass
class GeneratorConfig:
    """The rollout manager's settings (it receives this section) and the engines' (`inference_engine`).

    `max_input_length` bounds an episode's whole context, `max_generate_length` one turn.
    `env_failure`: what an episode whose environment (or agent) raised trains on: `mask` (its turns
    get loss mask 0) or `zero_reward` (reward 0, trained on like any other episode).

    Who runs the episodes: the env-based rollout manager by default; `agent`
    (`package.module:function`) runs the user's agent against the HTTP endpoint, one call per
    prompt x sample, each given `agent_timeout_s`; `generator_class` (`package.module:Class`)
    is a whole rollout system of the user's (`skyrl.train.generator.Generator`).
    """

    n_samples_per_prompt: int = 8
    max_turns: int = 1
    max_input_length: int = 1024
    max_generate_length: int = 512
    step_wise: bool = True
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval_sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    inference_engine: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    # the run serves the engines over HTTP (0: a free port, written to http_endpoint.json in the run directory)
    http_endpoint: OpenAIServerConfig = field(default_factory=lambda: OpenAIServerConfig(port=0))
    env_workers: int = 8  # threads (or processes) that run environment calls
    # one of ENV_EXECUTORS: `process` runs envs in worker processes, so a segfault or hang fails only their episodes
    env_executor: str = "thread"
    max_env_failure_fraction: float = 0.5
    env_failure: str = "mask"  # one of ENV_FAILURE_MODES
    # asynchronous training: a weight sync lands while episodes are in progress, which continue on
    # the new weights (partial rollouts); off, a sync waits for them
    inflight_weight_updates: bool = False
    max_engine_restarts: int = (
        3  # dead engines restarted (with the current weights) per run, requests re-issued
    )
    agent: str | None = None
    agent_timeout_s: float = 600.0
    generator_class: str | None = None


# ---------------------------------------------------------------------------
# environment.*, data.*, ray.* and the whole tree
# ---------------------------------------------------------------------------


@dataclass
class EnvironmentConfig:
    """`env_class`: a registered env or `package.module:ClassName`; a dataset row's `env_class`
    column overrides it. `config[name]` is passed to env `name` as its env_config. An env's
    action space is `config[name].allowed_tokens` (a list, each entry one token of the model's
    tokenizer): the model may only generate these while `env_class` is `name`, so another env
    never inherits it."""

    env_class: str = "guess_number"
    config: dict[str, Any] = field(
        default_factory=lambda: {
            "guess_number": {"min_value": 1, "max_value": 8, "max_turns": 4, "shaped": False},
            "calculator": {"max_turns": 4},
            "math": {},
        }
    )
    timeout_s: float = 600.0  # per env call (constructor, init, step, close); past it the episode fails


REWARD_TYPES = ("env", "function", "judge", "model")


@dataclass
class RewardSourceConfig:
    """One source of `reward.sources.<name>` (`<name>` names its metrics, `reward/<name>_mean`).

    `type`: one of `REWARD_TYPES`: `env`, the environment's (or agent's) rewards per turn as given;
    `function`, a scorer over a batch of finished responses: `function` (`pkg.module:fn`, sync or
    async) or `url` (the batch POSTed as JSON); `judge`, an LLM asked to rate each response: the chat
    completions endpoint at `url` (OpenAI-compatible, ending in /v1) serving `model`, or with no `url`
    engines of the judge's own on `model` (a path or hub name; never weight-synced), started by the
    run with `engine`'s `InferenceEngineConfig` settings (e.g. {backend: hf, num_engines: 1}), with `template`
    (null: a 0-10 rating, `skyrl.train.rewards.JUDGE_TEMPLATE`), sampled at `temperature` for at most
    `max_tokens` tokens, `concurrency` requests at a time, the key in the environment variable
    `api_key_env` (if any); the first match of `score_pattern` in its answer (its first group, if it
    has one) is the score, or with `function` (`pkg.module:fn(answer) -> float | None`) what it parses. `model`: a scalar reward model (`AutoModelForSequenceClassification`, 1 label,
    e.g. a Bradley-Terry model) at the path or hub name `model`, in a forward-only FSDP2 worker group:
    colocated, on the policy's bundles (a share of each); otherwise on `num_nodes` x `num_gpus_per_node`
    bundles of its own; `sequence_parallel_size` of its ranks compute each sequence together.
    HTTP calls are retried `max_retries` times on connection errors and 5xx; each call gets `timeout_s`.
    `weight`: its factor in the sum an episode trains on. A scorer scores the last turn of an episode in
    its full context, or every turn with `per_turn`; `normalize` standardises its scores by their running
    mean and std over the run (kept in checkpoints), then `clip` bounds them to [-clip, clip]."""

    type: str = "env"
    weight: float = 1.0
    per_turn: bool = False
    normalize: bool = False
    clip: float | None = None
    function: str | None = None
    url: str | None = None
    timeout_s: float = 60.0
    max_retries: int = 2
    model: str | None = None
    template: str | None = None
    score_pattern: str = r"-?\d+(?:\.\d+)?"
    temperature: float = 0.0
    max_tokens: int = 16
    concurrency: int = 16
    api_key_env: str | None = None
    engine: dict[str, Any] | None = None
    num_nodes: int = 1
    num_gpus_per_node: int = 1
    sequence_parallel_size: int = 1


@dataclass
class RewardConfig:
    """What an episode trains on: the weighted sum of its `sources` (`skyrl.train.rewards`), by default
    the environment's rewards alone. Each entry is a `RewardSourceConfig`'s fields by name (a mapping, so
    the command line can add one: `+reward.sources.judge={type: function, function: pkg.mod:fn}`)."""

    sources: dict[str, Any] = field(default_factory=lambda: {"env": {"type": "env", "weight": 1.0}})


@dataclass
class DataConfig:
    """`train_path` / `eval_path`: parquet or jsonl files (or HF dataset names); null generates
    prompts for the environment when it has a generator (guess_number, calculator)."""

    train_path: str | None = None
    eval_path: str | None = None
    num_generated_train_prompts: int = 4096
    num_generated_eval_prompts: int = 64
    max_prompt_length: int = 256
    shuffle: bool = True


@dataclass
class RayConfig:
    address: str | None = None  # null: RAY_ADDRESS if set, else start a local cluster
    num_cpus: int | None = None  # local cluster only; null: max(4, cores)
    # local cluster only: Ray's dashboard (http://127.0.0.1:8265); off, it costs start-up time and CPU
    include_dashboard: bool = False


@dataclass
class SkyRLConfig:
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ray: RayConfig = field(default_factory=RayConfig)
