"""The config tree: every setting of a run, declared once, with its one default and its description.

Each component's config is a dataclass here and the tree (`SkyRLConfig`, Hydra's
schema behind `skyrl/configs/`) composes them; a component receives its own
section of the tree, never a copy. Each field's description is the string under it
(`field_docs`); `scripts/config_reference.py` writes them to `docs/reference/config.md`.
Standard library only, so loading the schema starts nothing (no Ray, no torch):
validation lives in `skyrl.train.config`.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import textwrap
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------------------
# trainer.*: the FSDP workers (policy, ref, critic), the algorithm and the loop
# ---------------------------------------------------------------------------


ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "varlen")
PACKED_ATTENTION = ("flash_attention_2", "varlen")  # micro-batches as packed sequences, no padding


@dataclass
class ModelConfig:
    """A model a worker group loads and how it computes."""

    path: str | None = "tiny"
    """A local directory or Hugging Face hub name (loaded with `from_pretrained`); `tiny` builds the
    default tiny model locally (no network). For the reference and critic, null: the policy's."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass: less memory, ~1/3 more compute
    (trained models only)."""
    attn_implementation: str = "sdpa"
    """`varlen` (torch's variable-length flash attention on a GPU, per-sequence sdpa on the CPU) and
    `flash_attention_2` (GPU, the flash-attn package) compute micro-batches as packed sequences without
    padding; `sdpa` and `eager` right-pad each micro-batch to its own longest sequence."""
    compile: bool = False
    """Run each decoder layer and the LM head's logprob chunks through `torch.compile` (fused elementwise
    kernels; the first steps pay the compilation)."""


@dataclass
class OptimizerConfig:
    """AdamW and its learning-rate schedule; one optimizer step per mini-batch."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decay rates."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    max_grad_norm: float = 1.0
    """Clip the gradient's global norm to this; <= 0 disables clipping."""
    scheduler: str = "constant"
    """The learning-rate schedule after warm-up: `constant` or `cosine`."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to `lr`."""
    total_steps: int = 0
    """Optimizer steps of the schedule; 0: those of the run (`TrainerConfig.optimizer_steps`)."""
    min_lr_ratio: float = 0.0
    """`cosine`: the learning rate it decays to, as a fraction of `lr`."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    """Low-rank adapters (through peft) instead of training every parameter."""

    rank: int = 0
    """0 trains every parameter; above 0 the model is frozen and only rank-`rank` adapters train."""
    alpha: float = 16.0
    """The adapters' output is scaled by `alpha / rank`."""
    dropout: float = 0.0
    """Dropout on the adapters' inputs (above 0 the compute layouts no longer give identical gradients)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Module names that get adapters (default: the attention and MLP projections)."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (peft's name): names or their endings, e.g.
    `model.norm` or `lm_head` (weights then sync merged only)."""


@dataclass
class PolicyConfig:
    """The policy: the model that generates and trains."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy's model."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The policy's optimizer."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """The policy's LoRA adapters (rank 0: none)."""
    bf16: bool = True
    """GPU only, every worker (policy, ref, critic): compute in bfloat16; the CPU trains in fp32."""
    cpu_offload: bool = False
    """GPU only: FSDP keeps the parameters, gradients and optimizer state in CPU memory."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: this many ranks compute each sequence together (it divides the
    role's ranks and the model's attention heads); the data-parallel size is the ranks over it."""


@dataclass
class RefConfig:
    """The reference model: frozen, its logprobs feed the KL penalty."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=None))
    """The reference's model; path null: the policy's initial weights."""
    cpu_offload: bool = False
    """GPU only: FSDP keeps the parameters in CPU memory."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: this many ranks compute each sequence together."""


@dataclass
class CriticConfig:
    """The critic (with `gae`): the backbone with a scalar value head."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=None))
    """The critic's model; path null: the policy's, with a fresh value head."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=5e-6))
    """The critic's optimizer."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """The critic's LoRA adapters (rank 0: none); the value head always trains in full."""
    cpu_offload: bool = False
    """GPU only: FSDP keeps the parameters, gradients and optimizer state in CPU memory."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: this many ranks compute each sequence together."""


ROLES = ("policy", "ref", "critic")


@dataclass
class PlacementConfig:
    """Where the workers and engines run: bundles of nodes x GPUs (CPU bundles on CPU)."""

    colocate_all: bool = True
    """Policy, reference, critic and engines share the same bundles (a fraction of each); false: every
    model gets bundles of its own."""
    policy_num_nodes: int = 1
    """Nodes of the policy's ranks (colocated: of every model's)."""
    policy_num_gpus_per_node: int = 1
    """Ranks (GPUs, or CPU bundles) of the policy per node (colocated: of every model's)."""
    critic_num_nodes: int = 1
    """Disaggregated: nodes of the critic's ranks."""
    critic_num_gpus_per_node: int = 1
    """Disaggregated: the critic's ranks per node."""
    ref_num_nodes: int = 1
    """Disaggregated: nodes of the reference's ranks."""
    ref_num_gpus_per_node: int = 1
    """Disaggregated: the reference's ranks per node."""
    cpus_per_worker: float = 1.0
    """CPUs of each bundle; also each worker's torch CPU threads (at least 1)."""

    def ranks(self, role: str) -> int:
        """Worker ranks of `role` (one of `ROLES`): colocated, every model has one rank per policy bundle;
        otherwise `<role>_num_nodes * <role>_num_gpus_per_node`. Its data-parallel size is that over its
        `sequence_parallel_size`."""
        assert role in ROLES, f"role {role!r} is not one of {ROLES}"
        owner = "policy" if self.colocate_all else role
        return getattr(self, f"{owner}_num_nodes") * getattr(self, f"{owner}_num_gpus_per_node")


@dataclass
class KLControlConfig:
    """The coefficient of the KL penalty in the reward (`use_kl_in_reward`)."""

    type: str = "fixed"
    """`fixed`, or `adaptive`: steered towards `target_kl` (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """The (initial) coefficient."""
    target_kl: float = 0.1
    """`adaptive`: the KL it steers towards."""
    horizon: int = 10000
    """`adaptive`: how fast it steers (samples over which the coefficient may change by 20%)."""


@dataclass
class AlgorithmConfig:
    """Advantage estimator and losses; names are registry names or `package.module:function`.
    The trainer reads the advantage and reward settings, the workers the loss settings."""

    advantage_estimator: str = "grpo"
    """How rewards become advantages: a registered estimator or `package.module:function`."""
    norm_adv_by_std_in_grpo: bool = True
    """`grpo`: divide by the group's reward std (false: Dr. GRPO, centring only)."""
    gamma: float = 1.0
    """Discount factor (`gae`, `reinforce_pp`)."""
    lambd: float = 1.0
    """`gae`: the lambda of generalised advantage estimation."""
    group_baseline: bool = False
    """`reinforce_pp` only: subtract each prompt group's mean score first (REINFORCE++-baseline)."""
    policy_loss: str = "regular"
    """The policy's loss: a registered loss (e.g. `regular` PPO-clip, `dual_clip`, `gspo`, `cispo`) or
    `package.module:function`."""
    loss_reduction: str = "token_mean"
    """How per-token losses reduce to the mini-batch's loss."""
    max_seq_len: int | None = None
    """`seq_mean_token_sum_norm`: the fixed length each sequence's token sum is divided by."""
    eps_clip_low: float = 0.2
    """PPO-clip's lower bound: the ratio is clipped at 1 - eps_clip_low."""
    eps_clip_high: float = 0.2
    """PPO-clip's upper bound: the ratio is clipped at 1 + eps_clip_high."""
    clip_ratio_c: float = 3.0
    """`dual_clip`: the bound on the loss of negative-advantage tokens (a multiple of the advantage)."""
    value_clip: float | None = 0.2
    """The critic's clipped value loss: values move at most this far from the old ones; null: no clip."""
    use_kl_loss: bool = False
    """Add `kl_loss_coef` x KL(policy, reference) to the policy's loss."""
    kl_loss_coef: float = 0.001
    """The KL loss's coefficient."""
    kl_estimator: str = "k3"
    """The per-token KL estimator (loss and reward penalty)."""
    use_kl_in_reward: bool = False
    """Subtract the KL penalty (`kl_ctrl`) from the rewards before the advantages."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """The KL-in-reward coefficient."""
    entropy_coeff: float = 0.0
    """Subtract this x the policy's token entropy from the loss (an entropy bonus)."""
    off_policy_correction: str = "none"
    """Engine vs trainer logprobs: `none`, truncated (`tis`, `seq_tis`) or masked (`mis`, `seq_mis`)
    importance sampling, per token or per sequence (`skyrl.train.algorithms.losses`)."""
    tis_cap: float = 2.0
    """`tis` / `seq_tis`: the importance weight's cap."""
    mis_low: float = 0.5
    """`mis` / `seq_mis`: tokens (sequences) with a weight below this are masked."""
    mis_high: float = 2.0
    """`mis` / `seq_mis`: tokens (sequences) with a weight above this are masked."""
    dynamic_sampling: str | None = None
    """`filter`: drop prompt groups whose rewards are all equal and draw more prompts; null: off."""
    max_sample_batches: int = 4
    """`dynamic_sampling`: draws per step at most."""
    zero_variance_filter: bool = False
    """Mask prompt groups whose rewards are all equal (train only on groups with reward variance)."""


@dataclass
class AsyncTrainingConfig:
    """Generation overlapped with training (`skyrl.train.generator.stream`)."""

    max_staleness: int = 0
    """How many policy versions an episode's oldest turn may lag the policy that trains on it: 0 is the
    synchronous loop (generate, train, sync); with s >= 1 the next s batches are generated while the
    workers train, and weights go to the engines as soon as a step ends (engines need devices of their
    own: placement=disaggregated)."""


@dataclass
class TrainerConfig:
    """The loop's settings; every FSDP worker receives this section (its role's `policy` / `ref` /
    `critic` part, `algorithm`'s loss settings, micro-batch sizes, seed, placement threads)."""

    seed: int = 42
    """Seeds the workers (a fresh value head or adapters, dropout) and the order of the prompts."""
    total_steps: int = 100
    """Training steps (batches) of the run; 0 with `eval_before_train`: evaluate only."""
    train_batch_size: int = 16
    """Prompts per step."""
    policy_mini_batch_size: int = 4
    """Prompts per policy optimizer step (with all their samples and turns)."""
    critic_mini_batch_size: int = 4
    """Prompts per critic optimizer step."""
    micro_train_batch_size_per_gpu: int = 8
    """Sequences per training micro-batch on one rank (without `max_tokens_per_micro_batch`)."""
    micro_forward_batch_size_per_gpu: int = 16
    """Sequences per forward-only micro-batch on one rank (without `max_tokens_per_micro_batch`)."""
    max_tokens_per_micro_batch: int | None = None
    """Tokens per micro-batch (forward and train), balanced by token count; null: the sizes above."""
    stepwise_prefix_sharing: bool = True
    """Compute the steps of a trajectory as one sequence when each extends the previous one."""
    logprob_chunk_tokens: int = 1024
    """Tokens per LM-head chunk: [chunk, vocab] logits exist at a time."""
    update_epochs_per_batch: int = 1
    """Passes over each step's batch (each pass: one optimizer step per mini-batch)."""
    balance_dp: bool = False
    """Assign prefix groups to data-parallel ranks by attention-aware workload (Karmarkar-Karp + swaps)."""
    delay_split_by_dp: bool = False
    """Every rank receives the whole mini-batch and takes its own part (the driver does not split it)."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The policy."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference model (used with a KL loss or KL in the reward)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The critic (used with `gae`)."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Where the workers and engines run."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and losses."""
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """Generation overlapped with training."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Where metrics go."""
    project_name: str = "skyrl"
    """The trackers' project name (e.g. wandb's)."""
    run_name: str | None = None
    """The trackers' run name; null: the run directory's name (`hydra.run.dir`, by default
    outputs/DATE/TIME)."""
    eval_interval: int = 0
    """Steps between evaluations; 0 disables."""
    eval_before_train: bool = False
    """Evaluate once before the first step."""
    eval_n_samples: int = 4
    """Sampled answers per eval prompt (beside one greedy answer)."""
    ckpt_interval: int = 50
    """Steps between checkpoints; 0 disables."""
    max_ckpts_to_keep: int = 2
    """The newest complete checkpoints kept; older ones are deleted."""
    resume_mode: str = "latest"
    """`latest` (the newest complete checkpoint of the run, if any), `none`, or a checkpoint's path."""
    hf_save_interval: int = 0
    """Steps between Hugging Face exports of the policy; the final policy is always exported."""
    export_merged: bool = False
    """With policy LoRA an export is the adapter (peft format); also write the merged model
    (export/merged)."""
    max_consecutive_skipped_steps: int = 5
    """Optimizer steps with a non-finite loss or gradient are skipped; more than this many in a row end
    the run."""
    rpc_timeout_s: float = 1800.0
    """The longest a call into the workers may take (a step, a checkpoint)."""
    max_restarts: int = 3
    """A dead policy / ref / critic rank: rebuild the workers from the last checkpoint, this often per
    run."""
    preemption_grace_s: float = 15.0
    """SIGTERM (or Ctrl-C) stops the run at the next step boundary with a checkpoint if the step ends
    within this many seconds (else it is abandoned: the last complete checkpoint stays); the default
    leaves the checkpoint's write room inside a scheduler's usual 30-120 s grace."""

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
    """How the engines sample."""

    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens with this much probability."""
    top_k: int | None = None
    """Sample among the k most likely tokens; null: all."""


LORA_SYNCS = ("merged", "adapter")


@dataclass
class InferenceEngineConfig:
    """Engines and the client that routes to them."""

    backend: str = "auto"
    """`vllm`, `hf` (transformers generate), or `auto` (vLLM when installed)."""
    num_engines: int = 1
    """Engines (Ray actors), each serving the whole model."""
    tensor_parallel_size: int = 1
    """GPUs per engine (vLLM tensor parallelism)."""
    device: str = "auto"
    """`cpu`, `cuda`, or `auto` (cuda when the Ray cluster has GPUs)."""
    dtype: str = "auto"
    """`auto`: float32 on CPU, the checkpoint's dtype on GPU."""
    gpu_memory_utilization: float = 0.8
    """vLLM on GPU: the fraction of the GPU's memory it may take."""
    kv_cache_memory_bytes: int | None = None
    """vLLM's KV cache size; null: `gpu_memory_utilization` on GPU and 1 GiB on CPU."""
    enforce_eager: bool | None = None
    """vLLM without CUDA graphs; null: true on CPU, false on GPU."""
    max_model_len: int | None = None
    """The longest context an engine serves; null: the model's maximum positions."""
    max_num_seqs: int = 256
    """Sequences one engine runs in one batch (vLLM's scheduler, the hf engine's batch)."""
    enable_prefix_caching: bool = True
    """vLLM reuses the KV cache of shared prefixes (multi-turn contexts, samples of one prompt)."""
    enable_sleep_mode: bool = False
    """Engines free their GPU memory while the workers train; colocated engines on GPU always do."""
    seed: int = 0
    """The engines' sampling seed."""
    num_cpus_per_engine: float = 1.0
    """Disaggregated only (and an hf engine's torch threads on CPU); colocated engines take a share of a
    bundle and, taking turns with the workers, use its `cpus_per_worker` threads."""
    hf_batch_wait_s: float = 0.005
    """The `hf` engine starts a batch once no request has arrived for this long, so that requests
    arriving together become one batch (at once when a rollout's running episodes all wait for it)."""
    max_concurrent_requests: int = 1024
    """Requests the client has in flight over all engines."""
    weight_sync: str = "auto"
    """How the trainer sends (merged) policy weights to the engines: `object_store` (the full state dict
    through Ray), `broadcast` (a process group from policy rank 0 to the engines: NCCL on GPU, gloo on
    CPU; engines need GPUs of their own), `ipc` (colocated only: each policy rank hands its engine one
    layer at a time through CUDA IPC on GPU, /dev/shm on CPU), or `auto` (on GPU ipc when colocated and
    broadcast when not; object_store on CPU)."""
    weight_sync_timeout_s: float = 600.0
    """How long a broadcast rank waits for the others."""
    start_timeout_s: float = 1800.0
    """An engine that does not serve within this many seconds (no GPU free, a hang) stops the run."""
    lora_sync: str = "merged"
    """With policy LoRA: `merged` sends base + scale x B @ A by `weight_sync`; `adapter` only the adapters
    (through the object store), which the engines serve as a LoRA adapter (a new one per version)."""
    max_lora_rank: int | None = None
    """Adapter sync: the largest rank the engines serve; null: the policy's."""


@dataclass
class OpenAIServerConfig:
    """The OpenAI-compatible HTTP endpoint over the engines (`OpenAIServer`)."""

    enabled: bool = False
    """Serve the engines for the whole run (with `generator.agent` it is served anyway)."""
    host: str = "127.0.0.1"
    """The address it listens on."""
    port: int = 8000
    """Its port; 0 picks a free one, written to http_endpoint.json in the run directory."""
    api_key: str | None = None
    """Requests need `Authorization: Bearer <api_key>`; null: no authentication."""
    served_model_name: str | None = None
    """The model name it answers to; null: the model path."""
    default_max_tokens: int = 512
    """Tokens a completion may generate when the request sets none."""
    tool_parser: str = "auto"
    """vLLM's tool-call parser for requests with `tools` (e.g. hermes for Qwen2.5); `auto`: hermes when
    the chat template writes `<tool_call>` tags, else none (such requests get a 400). It serves env
    episodes too: an env's `step` gets the content and the calls parsed from it."""
    reasoning_parser: str = "none"
    """vLLM's reasoning parser (e.g. qwen3, deepseek_r1): answers carry the thinking as
    `message.reasoning`, apart from `content`; `none`: the text as generated."""


ENV_FAILURE_MODES = ("mask", "zero_reward")
ENV_EXECUTORS = ("thread", "process")


@dataclass
class GeneratorConfig:
    """The rollout manager's settings (it receives this section) and the engines' (`inference_engine`).
    Who runs the episodes: the env-based rollout manager by default, the user's `agent`, or a whole
    rollout system of the user's (`generator_class`)."""

    n_samples_per_prompt: int = 8
    """Episodes per prompt (a GRPO group)."""
    max_turns: int = 1
    """Turns per episode at most (an env may end it sooner, or set its own)."""
    max_input_length: int = 1024
    """Tokens of an episode's whole context at most."""
    max_generate_length: int = 512
    """Tokens one turn may generate."""
    step_wise: bool = True
    """One training sequence per LLM turn (false: one per episode, the turns concatenated)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How training episodes sample."""
    eval_sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    """How evaluation's greedy answers sample."""
    inference_engine: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    """The engines."""
    http_endpoint: OpenAIServerConfig = field(default_factory=lambda: OpenAIServerConfig(port=0))
    """The run's OpenAI-compatible endpoint over the engines."""
    env_workers: int = 8
    """Threads (or processes) that run environment calls."""
    env_executor: str = "thread"
    """`process` runs envs in worker processes, so a segfault or hang fails only their episodes."""
    max_env_failure_fraction: float = 0.5
    """A batch in which more than this fraction of episodes failed in their environment stops the run."""
    env_failure: str = "mask"
    """What an episode whose environment (or agent) raised trains on: `mask` (its turns get loss mask 0)
    or `zero_reward` (reward 0, trained on like any other episode)."""
    inflight_weight_updates: bool = False
    """Asynchronous training: a weight sync lands while episodes are in progress, which continue on the
    new weights (partial rollouts); false: a sync waits for them."""
    max_engine_restarts: int = 3
    """Dead engines restarted (with the current weights) per run; their requests are re-issued."""
    agent: str | None = None
    """`package.module:function`: the user's agent runs each prompt x sample against the HTTP endpoint."""
    agent_timeout_s: float = 600.0
    """Seconds one agent call may take."""
    generator_class: str | None = None
    """`package.module:Class`: a whole rollout system of the user's (`skyrl.train.generator.Generator`)."""


# ---------------------------------------------------------------------------
# environment.*, data.*, ray.* and the whole tree
# ---------------------------------------------------------------------------


@dataclass
class EnvironmentConfig:
    """The environment episodes run against."""

    env_class: str = "guess_number"
    """A registered env or `package.module:ClassName`; a dataset row's `env_class` column overrides it."""
    config: dict[str, Any] = field(
        default_factory=lambda: {
            "guess_number": {"min_value": 1, "max_value": 8, "max_turns": 4, "shaped": False},
            "calculator": {"max_turns": 4},
            "math": {},
        }
    )
    """`config.<name>` is env `name`'s env_config. Its `allowed_tokens` (a list, each one token of the
    model's tokenizer) is the env's action space: the model may only generate these in its episodes."""
    timeout_s: float = 600.0
    """Seconds per env call (constructor, init, step, close); past it the episode fails."""


REWARD_TYPES = ("env", "function", "judge", "model")


@dataclass
class RewardSourceConfig:
    """One source of `reward.sources.<name>` (`<name>` names its metrics, `reward/<name>_mean`)."""

    type: str = "env"
    """`env`: the environment's (or agent's) rewards per turn as given; `function`: a scorer over a batch
    of finished responses; `judge`: an LLM asked to rate each response; `model`: a scalar reward model
    (`AutoModelForSequenceClassification`, 1 label, e.g. a Bradley-Terry model)."""
    weight: float = 1.0
    """Its factor in the sum an episode trains on."""
    per_turn: bool = False
    """Score every turn (in its context); false: the last turn of an episode in its full context."""
    normalize: bool = False
    """Standardise its scores by their running mean and std over the run (kept in checkpoints)."""
    clip: float | None = None
    """Bound its (normalised) scores to [-clip, clip]; null: no bound."""
    function: str | None = None
    """`function`: the scorer (`pkg.module:fn`, sync or async); `judge`: `pkg.module:fn(answer)`, which
    parses the judge's answer into a score (a float, or None for none)."""
    url: str | None = None
    """`function`: the batch is POSTed there as JSON; `judge`: an OpenAI-compatible endpoint (ending in
    /v1) serving `model`."""
    timeout_s: float = 60.0
    """Seconds per HTTP call."""
    max_retries: int = 2
    """HTTP calls are retried this often on connection errors and 5xx."""
    model: str | None = None
    """`judge`: the judge's model (served at `url`, or with no `url` by engines of its own, never
    weight-synced); `model`: the reward model's path or hub name."""
    template: str | None = None
    """`judge`: the prompt, with `{prompt}` and `{response}`; null: a 0-10 rating
    (`skyrl.train.rewards.JUDGE_TEMPLATE`)."""
    score_pattern: str = r"-?\d+(?:\.\d+)?"
    """`judge`: the first match in its answer (its first group, if it has one) is the score."""
    temperature: float = 0.0
    """`judge`: its sampling temperature."""
    max_tokens: int = 16
    """`judge`: tokens its answer may have."""
    concurrency: int = 16
    """`judge`: requests in flight at a time."""
    api_key_env: str | None = None
    """`judge`: the environment variable that holds the endpoint's API key."""
    engine: dict[str, Any] | None = None
    """`judge` without `url`: its engines' `InferenceEngineConfig` settings (e.g. {backend: hf,
    num_engines: 1})."""
    num_nodes: int = 1
    """`model`, disaggregated: nodes of its ranks (colocated: a share of the policy's bundles)."""
    num_gpus_per_node: int = 1
    """`model`, disaggregated: its ranks per node."""
    sequence_parallel_size: int = 1
    """`model`: this many of its ranks compute each sequence together (Ulysses)."""


@dataclass
class RewardConfig:
    """What an episode trains on: the weighted sum of its sources (`skyrl.train.rewards`)."""

    sources: dict[str, Any] = field(default_factory=lambda: {"env": {"type": "env", "weight": 1.0}})
    """Each entry is a `RewardSourceConfig`'s fields by name (a mapping, so the command line can add one:
    `+reward.sources.judge={type: function, function: pkg.mod:fn}`); by default the environment's
    rewards alone."""


@dataclass
class DataConfig:
    """The prompts: parquet or jsonl files, HF dataset names, or generated by the environment."""

    train_path: str | None = None
    """Training prompts; null: generated by the environment when it has a generator (guess_number,
    calculator)."""
    eval_path: str | None = None
    """Evaluation prompts; null: generated when the training prompts are (and evaluation is on), else
    none."""
    num_generated_train_prompts: int = 4096
    """Generated training prompts."""
    num_generated_eval_prompts: int = 64
    """Generated evaluation prompts."""
    max_prompt_length: int = 256
    """Tokens a prompt may have; longer prompts are dropped (with a warning that counts them)."""
    shuffle: bool = True
    """Shuffle the training prompts (seeded by `trainer.seed`)."""


@dataclass
class RayConfig:
    """The Ray cluster the run starts or joins."""

    address: str | None = None
    """A cluster to join; null: RAY_ADDRESS if set, else start a local cluster."""
    num_cpus: int | None = None
    """Local cluster only: its CPUs; null: max(4, cores)."""
    include_dashboard: bool = False
    """Local cluster only: Ray's dashboard (http://127.0.0.1:8265); it costs start-up time and CPU."""


@dataclass
class SkyRLConfig:
    """Every setting of a run."""

    data: DataConfig = field(default_factory=DataConfig)
    """The prompts."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The training loop and its workers."""
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    """Rollouts and engines."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """The environment."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward sources."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray cluster."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The description of each field of dataclass `cls`: the string literal under it (an attribute
    docstring, as Sphinx and IDEs read them), by field name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        node.target.id: inspect.cleandoc(doc.value.value)
        for node, doc in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
    }
