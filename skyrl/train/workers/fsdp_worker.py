"""FSDP2 training workers: policy, reference and critic, one process per data-parallel rank.

Each worker is a plain class; `ActorGroup` runs N of them as Ray actors. The
same code runs gloo + fp32 on CPU and NCCL + bf16 on GPU. Gradients are SUMMED
across ranks (never averaged) and every loss is pre-scaled by
`loss_scale_for_reduction` with mini-batch-wide counts, so any DP size and any
micro-batch size give the gradient of the same whole-mini-batch loss.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from skyrl.train.algorithms import (
    entropy_from_logprobs,
    get_policy_loss,
    kl_penalty,
    loss_scale_for_reduction,
    masked_mean,
    reduction_counts,
    rollout_logprob_gap,
    value_loss,
)
from skyrl.train.schema import (
    PACKED_ATTENTION,
    CriticConfig,
    LoRAConfig,
    OptimizerConfig,
    PolicyConfig,
    RefConfig,
    TrainerConfig,
)
from skyrl.train.training_batch import TrainingInputBatch, partition_rows, row_groups
from skyrl.train.utils.seqlen_balancing import attention_aware_cost, attention_cost_weight
from skyrl.train.workers import persistence, weight_export
from skyrl.train.workers.attention import HF_NAME as VARLEN_HF_NAME
from skyrl.train.workers.attention import register_varlen
from skyrl.train.workers.layout import TokenLayout, build_layout, plan_micro_batches, unit_tokens
from skyrl.train.workers.lora import (
    adapters_disabled,
    add_adapters,
)
from skyrl.train.workers.sequence_parallel import register_ulysses, shard_layout, use_group

if TYPE_CHECKING:  # the weight-sync helpers import Ray: a worker loads them only when it syncs
    from skyrl.train.inference.weight_sync import WeightSyncGroup
    from skyrl.train.inference.weights import StreamSpec

Metrics = dict[str, torch.Tensor]
logger = logging.getLogger(__name__)


class TokenModel(torch.nn.Module):
    """The FSDP root around a Hugging Face model: its backbone over a `TokenLayout`'s tokens, then a
    head only at the positions whose outputs are needed (`head` maps hidden states [K, H] to outputs).

    The root (not the HF model) is what FSDP wraps, so the head's weights are gathered for the head
    as for any layer; `model` keeps the HF model's parameter names (checkpoints, exports, weight sync).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, layout: TokenLayout, head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        hidden = self.model.base_model(
            input_ids=layout.input_ids,
            position_ids=layout.position_ids,
            use_cache=False,
            **layout.attention_kwargs(),
        ).last_hidden_state
        return head(hidden.flatten(0, 1).index_select(0, layout.index))


def head_chunk(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    excluded: torch.Tensor | None,
    with_entropy: bool,
    entropy_grad: bool,
) -> torch.Tensor:
    """One chunk of the LM head: [K, 1] logprobs of `targets` under softmax(logits / `temperature`) over
    the tokens not `excluded`, or [K, 2] with each position's entropy (differentiable when `entropy_grad`)."""
    # [K, vocab] float32 logits: each eager elementwise pass over them costs as much as a layer's matmuls
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    if excluded is not None:  # finite, so entropy's p * logit stays 0 (not nan) on excluded tokens
        logits = logits.masked_fill(excluded, -1e9)
    distribution = logits.log_softmax(-1)  # one fused pass; backward needs only its output
    logprobs = distribution.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return logprobs[:, None]
    entropy = entropy_from_logprobs(distribution if entropy_grad else distribution.detach())
    return torch.stack([logprobs, entropy], -1)


def process_group_backend(device_type: str) -> str:
    """The workers' process-group backend: gloo on CPU; on GPU NCCL for CUDA tensors and gloo for CPU
    ones, which `cpu_offload` leaves in collectives (the grad-norm reduction, `full_tensor` of weights)."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def _lr_lambda(cfg: OptimizerConfig, run_steps: int = 0):
    """The LR multiplier per optimizer step; cosine decays over `cfg.total_steps`, or `run_steps` when 0."""
    total_steps = cfg.total_steps or run_steps
    if cfg.scheduler == "constant":
        return lambda step: min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if cfg.scheduler == "cosine":
        if total_steps <= cfg.warmup_steps:
            raise ValueError(
                f"cosine schedule needs optimizer.total_steps > warmup_steps, got total_steps={total_steps}, "
                f"warmup_steps={cfg.warmup_steps}"
            )

        def cosine(step: int) -> float:
            if step < cfg.warmup_steps:
                return (step + 1) / cfg.warmup_steps
            progress = min(1.0, (step - cfg.warmup_steps) / (total_steps - cfg.warmup_steps))
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        return cosine
    raise ValueError(f"unknown optimizer.scheduler={cfg.scheduler!r}; choose 'constant' or 'cosine'")


class FSDPWorker:
    """One data-parallel rank: process group, sharded model, forward over micro-batches, checkpoints.

    `cfg` is the `trainer` section: the worker reads its role's part (`section`), the loss settings
    of `cfg.algorithm`, the micro-batch sizes, the seed and `cfg.placement.cpus_per_worker` (its
    torch CPU threads). `model_path` is the resolved model directory. Logprobs are of the
    distribution the engines sampled from: logits / `temperature`, renormalised over
    `allowed_token_ids` when given.
    """

    role: str  # the section of `trainer` this worker's model is configured by: policy | ref | critic
    full_heads: tuple[str, ...] = ()  # modules that train in full when the rest is frozen for LoRA

    def __init__(
        self,
        cfg: TrainerConfig,
        rank: int,
        world_size: int,
        model_path: str,
        temperature: float = 1.0,
        allowed_token_ids: Sequence[int] = (),
    ):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.model_path, self.temperature = model_path, temperature
        self.allowed_token_ids = list(allowed_token_ids)
        # colocated actors take turns, so each may use every core of its bundle
        torch.set_num_threads(max(1, int(cfg.placement.cpus_per_worker)))
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.device = self.device or torch.device("cpu")
        self.model: torch.nn.Module | None = None  # the HF model
        self.root: TokenModel | None = None  # the FSDP root that computes it
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.global_step = 0
        # the sequence-parallel and data-parallel groups (None: every rank), made for `_groups_sp_size`
        self.sp_group = self.dp_group = None
        self._groups_sp_size = 1

    @property
    def section(self) -> PolicyConfig | RefConfig | CriticConfig:
        """This worker's model section: `trainer.policy`, `trainer.ref` or `trainer.critic`."""
        return getattr(self.cfg, self.role)

    @property
    def lora(self) -> LoRAConfig | None:
        """This worker's LoRA settings when it trains adapters (`trainer.<role>.lora.rank` > 0), else None."""
        lora = getattr(self.section, "lora", None)
        return lora if lora is not None and lora.rank > 0 else None

    @property
    def lora_scaling(self) -> float:
        """What B @ A is multiplied by: alpha / rank."""
        assert self.lora is not None, "lora_scaling of a worker without LoRA"
        return self.lora.alpha / self.lora.rank

    # ---- setup ----
    def init_process_group(self, master_addr: str, master_port: int) -> None:
        dist.init_process_group(
            process_group_backend(self.device.type),
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
        )
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    def _make_parallel_groups(self) -> None:
        """FSDP shards over every rank; sequence-parallel groups are `sp_size` consecutive ranks, and the
        ranks with the same place in theirs form a data-parallel group (collective: every rank creates
        every group, in order). Made again when `sp_size` changed since (a reconfigured worker)."""
        if self._groups_sp_size == self.sp_size:
            return
        self._groups_sp_size, self.sp_group, self.dp_group = self.sp_size, None, None
        if self.sp_size > 1:
            for first in range(0, self.world_size, self.sp_size):
                group = dist.new_group(list(range(first, first + self.sp_size)))
                self.sp_group = group if first == self.rank - self.sp_rank else self.sp_group
            for offset in range(self.sp_size):
                group = dist.new_group(list(range(offset, self.world_size, self.sp_size)))
                self.dp_group = group if offset == self.sp_rank else self.dp_group
            use_group(self.sp_group)

    @property
    def sp_size(self) -> int:
        """The ranks that compute each sequence together (`sequence_parallel_size` of this worker's section)."""
        return self.section.sequence_parallel_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank: the sequence-parallel group it belongs to."""
        return self.rank // self.sp_size

    def reconfigure(self, cfg: TrainerConfig) -> None:
        """Start over with `cfg` as a new actor would (`ActorGroup.reconfigure`)."""
        self.cfg = cfg
        self.init_model()

    def _load_model(self, **kwargs: Any) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32, **kwargs)

    def init_model(self) -> None:
        """(Re)load the model from `model_path`, shard it, and build a fresh optimizer and schedule (and the
        sequence-parallel groups, when `sp_size` changed)."""
        torch.manual_seed(self.cfg.seed)
        self._make_parallel_groups()
        settings = self.section.model
        implementation = settings.attn_implementation
        self.packed = implementation in PACKED_ATTENTION  # varlen kernels: no padding at all
        if self.sp_size > 1:
            implementation = register_ulysses(implementation)
        elif implementation == "varlen":
            register_varlen()
            implementation = VARLEN_HF_NAME
        # loaded on the CPU: fully_shard moves each layer to the device as it shards it, so the GPU never
        # holds the whole fp32 model (colocated engines start after the workers and need the room)
        model = self._load_model(attn_implementation=implementation)
        if self.lora is not None:  # the same seed on every rank: every rank starts from the same adapters
            add_adapters(model, self.lora, f"trainer.{self.role}.lora", self.full_heads)
        if settings.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        root = TokenModel(model)
        on_gpu = self.device.type == "cuda"
        kwargs = {"mesh": self.mesh}
        if on_gpu and self.cfg.policy.bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if on_gpu and self.section.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        # one rank on CPU has nothing to shard, and FSDP's mixed precision and offload are GPU-only: FSDP
        # would only add its hooks and copies (about a third of a tiny model's optimizer step)
        self.sharded = self.world_size > 1 or on_gpu
        if self.sharded:
            for layer in model.base_model.layers:
                fully_shard(layer, **kwargs)
            fully_shard(root, **kwargs)
        for module in root.modules():
            if isinstance(module, FSDPModule):
                # sum, not average, across ranks (gloo has no PREMUL_SUM; the loss carries the scale)
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self._head_chunk = head_chunk
        if settings.compile:  # compiled at the first forward; FSDP's hooks stay outside the compiled code
            for layer in model.base_model.layers:
                layer.forward = torch.compile(layer.forward, dynamic=True)
            self._head_chunk = torch.compile(head_chunk, dynamic=True)
        self.model, self.root = model, root
        self.global_step = 0
        self._warned_long_unit = False
        self._release_cached_memory()

    def _release_cached_memory(self) -> None:
        """Hand the CUDA caching allocator's free blocks back, for the colocated engines (GPU only)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- forward ----
    def _micro_batches(
        self, data: TrainingInputBatch, micro_batch_size: int
    ) -> list[tuple[list[int], TrainingInputBatch]]:
        """This rank's rows per micro-batch (row indices, rows): whole prefix groups, `micro_batch_size`
        rows or `max_tokens_per_micro_batch` tokens each (balanced by attention-aware workload). Every
        rank gets as many micro-batches as the rank that needs most (collective: FSDP gathers weights
        per forward); extra ones may be empty."""
        units = row_groups(data.get("prefix_group"), len(data))
        tokens = unit_tokens(data["attention_mask"], data["response_mask"], units)
        rows = [len(unit) for unit in units]
        budget = self.cfg.max_tokens_per_micro_batch
        if budget is not None and max(tokens, default=0) > budget and not self._warned_long_unit:
            self._warned_long_unit = True
            logger.warning(
                "a sequence of %d tokens exceeds trainer.max_tokens_per_micro_batch=%d: it gets a micro-batch "
                "of its own (logged once)",
                max(tokens),
                budget,
            )
        cost = attention_aware_cost(attention_cost_weight(self.model.config.hidden_size))
        plan = plan_micro_batches(tokens, rows, micro_batch_size, budget, cost=cost)
        count = torch.tensor([len(plan)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if count.item() > len(plan):
            plan = plan_micro_batches(tokens, rows, micro_batch_size, budget, int(count.item()), cost)
        selected = [sorted(i for u in part for i in units[u]) for part in plan]
        return [(indices, data.select_rows(indices)) for indices in selected]

    def _layout(self, mb: TrainingInputBatch) -> TokenLayout:
        """The micro-batch's layout, built from its CPU rows, on the device. Callers take every micro-batch's
        before the first forward: a host-device copy waits for the device's queue to drain, so one between
        micro-batches would leave the device idle while the host prepares the next."""
        layout = build_layout(
            mb["sequences"], mb["attention_mask"], mb["response_mask"], mb.get("prefix_group"), self.packed
        ).to(self.device)
        return shard_layout(layout, self.sp_rank, self.sp_size, self.sp_group) if self.sp_size > 1 else layout

    def _logprobs(
        self, layout: TokenLayout, with_entropy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (and entropy) of every real response token in the rows' [n, R] layout, 0 elsewhere,
        of the distribution the engines sampled from; the LM head runs only at those tokens, one
        `logprob_chunk_tokens` chunk at a time (recomputed in backward), so [tokens, vocab] logits
        never exist whole."""
        head = self.model.get_output_embeddings()
        excluded = None
        if self.allowed_token_ids:
            excluded = torch.ones(head.out_features, dtype=torch.bool, device=self.device)
            excluded[self.allowed_token_ids] = False
        # entropy is a metric unless the loss has an entropy term: then no backward (nor recompute) through it
        settings = (self.temperature, excluded, with_entropy, bool(self.cfg.algorithm.entropy_coeff))

        def heads(hidden: torch.Tensor) -> torch.Tensor:
            size = self.cfg.logprob_chunk_tokens
            parts = zip(hidden.split(size), layout.targets.split(size), strict=True)
            if torch.is_grad_enabled():
                return torch.cat(
                    [
                        checkpoint(self._head_chunk, head, h, t, *settings, use_reentrant=False)
                        for h, t in parts
                    ]
                )
            return torch.cat([self._head_chunk(head, h, t, *settings) for h, t in parts])

        both = layout.scatter(self.root(layout, heads))  # one scatter (sequence parallel: one reduction)
        return both[..., 0], both[..., 1] if with_entropy else None

    def _output(self, layout: TokenLayout) -> dict[str, torch.Tensor]:
        logprobs, _ = self._logprobs(layout, with_entropy=False)
        return {"logprobs": logprobs}

    def forward(
        self,
        *parts: Any,
        picks: Sequence[Sequence[tuple[int, int]]] | None = None,
        dp_size: int | None = None,
        balance: bool = False,
        cost_weight: float | None = None,
        adapters: bool = True,
    ) -> TrainingInputBatch:
        """Per-row outputs (`logprobs`, or `values` for the critic) of this rank's rows of every mini-batch
        in `parts` (see `rank_rows`), in their order; micro-batches may span mini-batches.
        `adapters=False` computes the base model's outputs (LoRA: the reference policy).
        """
        data = TrainingInputBatch.cat(self.rank_rows(parts, picks, dp_size, balance, cost_weight))
        return self._forward_rows(data, adapters)

    @torch.no_grad()
    def _forward_rows(self, data: TrainingInputBatch, adapters: bool = True) -> TrainingInputBatch:
        """`forward`'s outputs of this rank's rows `data`."""
        self.model.eval()
        outputs: dict[str, torch.Tensor] = {}
        micro_batches = self._micro_batches(data, self.cfg.micro_forward_batch_size_per_gpu)
        # row indices too: a CPU index into a device tensor would be copied (and waited for) per micro-batch
        layouts = [
            (torch.tensor(rows, dtype=torch.long, device=self.device), self._layout(mb))
            for rows, mb in micro_batches
        ]
        with contextlib.nullcontext() if adapters or self.lora is None else adapters_disabled(self.model):
            for indices, layout in layouts:
                for key, value in self._output(layout).items():
                    outputs.setdefault(key, value.new_zeros(len(data), value.shape[1]))
                    outputs[key][indices] = value
        outputs = {key: value.cpu() for key, value in outputs.items()}  # one copy (and wait) at the end
        self._release_cached_memory()
        return TrainingInputBatch(outputs)

    def rank_rows(
        self,
        parts: Sequence[Any],
        picks: Sequence[Sequence[tuple[int, int]]] | None = None,
        dp_size: int | None = None,
        balance: bool = False,
        cost_weight: float | None = None,
    ) -> list[TrainingInputBatch]:
        """This rank's rows of each mini-batch. Without `picks`, `parts` are different fields of the same
        rows: one mini-batch. With `picks` (staged by `dispatch`), `parts` are staged lists of mini-batch
        parts and `picks[i]` the (list, position) of each group of fields of mini-batch i. With `dp_size`
        set each mini-batch is whole and this rank takes its part (the delayed split); otherwise the parts
        are already this rank's."""
        minis = [list(parts)] if picks is None else [[parts[i][at] for i, at in mini] for mini in picks]
        return [
            self._own_part(TrainingInputBatch.merge(mini), dp_size, balance, cost_weight) for mini in minis
        ]

    def _own_part(
        self, data: TrainingInputBatch, dp_size: int | None, balance: bool, cost_weight: float | None = None
    ) -> TrainingInputBatch:
        if dp_size is None:
            return data
        return data.select_rows(partition_rows(data, dp_size, balance, cost_weight)[self.dp_rank])

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # ---- weights for the engines (skyrl.train.workers.weight_export) ----
    def full_state_dict(self, dtype: str | None = None) -> dict[str, torch.Tensor] | None:
        """The whole model on rank 0, on CPU, under the checkpoint's names, LoRA merged, in `dtype` when
        given (collective; None elsewhere)."""
        return weight_export.full_state_dict(self, dtype)

    def adapter_state_dict(self, scaled: bool = True) -> dict[str, torch.Tensor] | None:
        """LoRA only: the adapters on rank 0, B times alpha / rank when `scaled` (collective; None elsewhere)."""
        return weight_export.adapter_state_dict(self, scaled)

    def sync_nbytes(self, adapters: bool, dtype: str | None = None) -> int:
        """Bytes one weight sync sends each engine: the adapters, or the weights in `dtype`."""
        return weight_export.sync_nbytes(self, adapters, dtype)

    def iter_weight_groups(self, dtype: str | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Full weights one decoder layer at a time, as engines take them (collective)."""
        return weight_export.iter_weight_groups(self, dtype)

    def weight_stream_spec(self, dtype: str | None = None) -> StreamSpec:
        """What `broadcast_weights(dtype)` and `share_weights(..., dtype)` send, in order."""
        return weight_export.weight_stream_spec(self, dtype)

    def init_weight_sync(self, group: WeightSyncGroup) -> None:
        """Rank 0 joins the engines' broadcast group as its sender."""
        weight_export.init_weight_sync(self, group)

    def broadcast_weights(self, dtype: str | None = None) -> None:
        """Rank 0 broadcasts the weights group by group to the engines' sync group (collective)."""
        weight_export.broadcast_weights(self, dtype)

    def share_weights(self, engines: Sequence[Any], version: int, dtype: str | None = None) -> None:
        """Rank i hands the weights group by group to colocated `engines[i]` through shared memory (collective)."""
        weight_export.share_weights(self, engines, version, dtype)

    # ---- persistence (skyrl.train.workers.persistence) ----
    def save_hf_model(self, path: str) -> None:
        """`save_pretrained` of the model (with LoRA: the adapter) and its tokenizer to `path` (collective)."""
        persistence.save_hf_model(self, path)

    def save_checkpoint(self, path: str) -> None:
        """This rank's shards of the model and optimizer, schedule and RNG into checkpoint `path` (collective)."""
        persistence.save_checkpoint(self, path)

    def load_checkpoint(self, path: str) -> None:
        """The model, optimizer, schedule and RNG from checkpoint `path` (collective)."""
        persistence.load_checkpoint(self, path)


class MetricTotals:
    """Training metrics accumulated over micro-batches, then reduced over the DP ranks.

    `loss` adds up (each micro-batch's loss is its share of the mini-batch loss), and
    so does `loss_tokens`; other metrics are per-micro-batch statistics over its loss
    tokens: means are weighted by those tokens, `*_max` / `*_min` take the extreme over
    micro-batches that have any. A mini-batch without loss tokens reports 0.
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None):
        self.device, self.group = device, group  # the data-parallel group (None: every rank)
        self.sums: dict[str, torch.Tensor] = {}
        self.extremes: dict[str, torch.Tensor] = {}  # max of x for *_max, of -x for *_min

    def add(self, loss: torch.Tensor, metrics: Metrics, loss_tokens: torch.Tensor) -> None:
        tokens = loss_tokens.detach().double()
        self._add("loss", loss.detach().double())
        self._add("loss_tokens", tokens)
        for key, value in metrics.items():
            value = value.detach().double()
            if key.endswith(("_max", "_min")):
                signed = value if key.endswith("_max") else -value
                best = self.extremes.get(  # a fill, not a host-device copy (which would wait for the device)
                    key, torch.full((), -math.inf, dtype=torch.float64, device=self.device)
                )
                self.extremes[key] = torch.where(tokens > 0, torch.maximum(best, signed), best)
            else:
                self._add(key, value * tokens)

    def _add(self, key: str, value: torch.Tensor) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def all_reduce(self) -> dict[str, float]:
        """The mini-batch's metrics over every data-parallel rank (collective: every rank of the group must
        call it); the ranks of a sequence-parallel group hold the same metrics, counted once."""
        sums = torch.stack(list(self.sums.values())).to(self.device)
        dist.all_reduce(sums, group=self.group)
        totals = dict(zip(self.sums, sums.tolist(), strict=True))
        tokens = totals["loss_tokens"]
        result = {k: v if k in ("loss", "loss_tokens") else v / max(tokens, 1.0) for k, v in totals.items()}
        if self.extremes:
            extremes = torch.stack(list(self.extremes.values())).to(self.device)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
            for key, value in zip(self.extremes, extremes.tolist(), strict=True):
                result[key] = (value if key.endswith("_max") else -value) if math.isfinite(value) else 0.0
        return result


class TrainableWorker(FSDPWorker, abc.ABC):
    """A worker with an optimizer: one optimizer step per mini-batch."""

    def init_model(self) -> None:
        super().init_model()
        opt = self.section.optimizer
        # On GPU one fused kernel for all parameters (foreach: ~10 passes over them, each a DTensor dispatch);
        # cpu_offload's shards and CPU runs take foreach: one dispatch per op for all parameters, the same
        # arithmetic as the per-parameter loop torch picks on CPU
        fused = self.device.type == "cuda" and not self.section.cpu_offload
        self.optimizer = torch.optim.AdamW(
            self._trainable(),
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            **({"fused": True} if fused else {"foreach": True}),
        )
        run_steps = self.cfg.optimizer_steps(getattr(self.cfg, f"{self.role}_mini_batch_size"))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(opt, run_steps))

    @abc.abstractmethod
    def _loss(
        self, mb: TrainingInputBatch, layout: TokenLayout, scale: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        """The micro-batch's share of the mini-batch loss, sum(per-token loss * scale), and metrics.

        Metrics are statistics over the micro-batch's loss tokens (`loss_mask`): means,
        or extremes when the name ends in `_max` / `_min`.
        """

    def train_mini_batch(
        self,
        *parts: TrainingInputBatch,
        dp_size: int | None = None,
        balance: bool = False,
        cost_weight: float | None = None,
        keep_gradients: bool = False,
    ) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch; returns mini-batch metrics.

        `parts` hold different fields of the same rows (see `rank_rows`). The loss is
        summed over micro-batches with weights from mini-batch-wide counts
        (all-reduced), and gradients are summed over ranks. Metrics cover every
        micro-batch of every rank: `loss` is the mini-batch loss, means are weighted
        by loss tokens, extremes reduced with max / min, so none depends on the DP or
        micro-batch size. Gradients are freed after the step, or kept until the next
        call with `keep_gradients` (see `gradient_vector`); the CUDA cache stays for the next mini-batch.
        A non-finite loss or gradient norm skips the step: weights, optimizer state, LR schedule and
        `global_step` stay as they were, and `skipped_steps` is 1. A policy mini-batch without `old_logprobs`
        takes its training forward's as them (`train_mini_batches` fills them in first where that is not exact).
        """
        data = self._own_part(TrainingInputBatch.merge(parts), dp_size, balance, cost_weight)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        counts = reduction_counts(data["loss_mask"]).to(self.device)
        dist.all_reduce(counts, group=self.dp_group)  # a sequence-parallel group holds the same rows
        loss_cfg = self.cfg.algorithm
        scale = loss_scale_for_reduction(
            data["loss_mask"], loss_cfg.loss_reduction, loss_cfg.max_seq_len, counts.cpu()
        )
        data["loss_scale"] = scale.float()
        micro_batches = [  # all on the device before the first forward (see `_layout`)
            (self._layout(mb), mb.to(self.device))
            for _, mb in self._micro_batches(data, self.cfg.micro_train_batch_size_per_gpu)
        ]
        totals = MetricTotals(self.device, self.dp_group)
        for i, (layout, mb) in enumerate(micro_batches):
            if self.sharded:
                self.root.set_requires_gradient_sync(i == len(micro_batches) - 1)
            loss, metrics = self._loss(mb, layout, mb["loss_scale"])
            loss.backward()
            totals.add(loss, metrics, mb["loss_mask"].sum())
        max_norm = (
            self.section.optimizer.max_grad_norm if self.section.optimizer.max_grad_norm > 0 else math.inf
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(self._trainable(), max_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        metrics = {**totals.all_reduce(), "grad_norm": grad_norm.item()}
        skip = not (
            math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
        )  # same on every rank
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.global_step += 1
            if not keep_gradients:
                self.optimizer.zero_grad(set_to_none=True)
        return {**metrics, "lr": self.scheduler.get_last_lr()[0], "skipped_steps": float(skip)}

    def train_mini_batches(
        self,
        *parts: Any,
        picks: Sequence[Sequence[tuple[int, int]]] | None = None,
        dp_size: int | None = None,
        balance: bool = False,
        cost_weight: float | None = None,
        keep_gradients: bool = False,
        epochs: int = 1,
    ) -> list[dict[str, float]]:
        """`epochs` passes of `train_mini_batch` over this rank's rows of each mini-batch in `parts` (see
        `rank_rows`), in order: one call for all of a step's optimizer steps. The metrics of each optimizer
        step. Then the CUDA caching allocator's free blocks go back to the colocated engines, once:
        re-allocating them per step costs device time."""
        minis = self.rank_rows(parts, picks, dp_size, balance, cost_weight)
        self._before_training(minis, len(minis) * epochs)
        metrics = [
            self.train_mini_batch(mini, keep_gradients=keep_gradients)
            for _ in range(epochs)
            for mini in minis
        ]
        self._release_cached_memory()
        return metrics

    def _before_training(self, minis: list[TrainingInputBatch], optimizer_steps: int) -> None:
        """Fills in what the loss of this rank's `minis` reads and the driver did not send, before the first
        of their `optimizer_steps`."""

    def gradient_vector(self) -> torch.Tensor | None:
        """The full flattened gradient of the trained parameters (LoRA: the adapters) of the last
        mini-batch trained with `keep_gradients` on rank 0 (collective; None elsewhere)."""
        grads = [
            weight_export.whole(p.grad) if p.grad is not None else torch.zeros(p.shape)
            for p in self._trainable()
        ]
        return torch.cat([g.flatten().cpu() for g in grads]) if self.rank == 0 else None


class PolicyWorker(TrainableWorker):
    """Policy: logprobs, and PPO-style updates with a registered policy loss (+ optional KL and entropy terms).

    Mini-batches sent without `old_logprobs` (`PPOUpdate.old_logprobs_on_worker`: nothing before training
    reads them) get them here, before the step's first optimizer step: a forward in eval mode over all of
    them, as the driver's separate forward would compute them. A step of one optimizer step needs none:
    its weights are those the old logprobs are of, so the training forward's logprobs, detached, are
    taken as them, unless the model has dropout (training mode would then sample other logprobs). The
    mini-batches then have `rollout_logprobs` instead, and the worker reports what the trainer computes
    from old logprobs: `rollout_logprob_gap` (the mean absolute difference from the engine's) and, with
    `ref_logprobs`, `old_kl` (their mean KL penalty).
    """

    role = "policy"

    def _before_training(self, minis: list[TrainingInputBatch], optimizer_steps: int) -> None:
        if all("old_logprobs" in mini for mini in minis) or (
            optimizer_steps == 1 and not self._has_dropout()
        ):
            return
        logprobs = self._forward_rows(TrainingInputBatch.cat(minis))["logprobs"]
        for mini, old in zip(minis, logprobs.split([len(mini) for mini in minis]), strict=True):
            mini["old_logprobs"] = old

    def _has_dropout(self) -> bool:
        """Whether a module of the model drops anything in training mode: a `Dropout` module, or attention
        dropout that an attention module passes to its kernel as a number (`attention_dropout`)."""
        for module in self.model.modules():
            p = getattr(module, "p" if isinstance(module, torch.nn.Dropout) else "attention_dropout", 0.0)
            if isinstance(p, (int, float)) and p > 0:
                return True
        return False

    def _loss(
        self, mb: TrainingInputBatch, layout: TokenLayout, scale: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        cfg = self.cfg.algorithm
        logprobs, entropy = self._logprobs(layout)
        old_logprobs = mb["old_logprobs"] if "old_logprobs" in mb else logprobs.detach()
        per_token, metrics = get_policy_loss(cfg.policy_loss)(
            logprobs,
            old_logprobs,
            mb["advantages"],
            mb["loss_mask"],
            eps_clip_low=cfg.eps_clip_low,
            eps_clip_high=cfg.eps_clip_high,
            clip_ratio_c=cfg.clip_ratio_c,
        )
        if "is_weights" in mb:  # off-policy correction of the policy-gradient term (trainer-computed)
            per_token = per_token * mb["is_weights"]
        metrics["entropy"] = masked_mean(entropy, mb["loss_mask"]).detach()
        if "rollout_logprobs" in mb:  # the driver has no old logprobs: its metrics of them come from here
            metrics["rollout_logprob_gap"] = rollout_logprob_gap(
                mb["rollout_logprobs"], old_logprobs, mb["loss_mask"]
            )
            if "ref_logprobs" in mb:
                old_kl = kl_penalty(old_logprobs, mb["ref_logprobs"], cfg.kl_estimator)
                metrics["old_kl"] = masked_mean(old_kl, mb["loss_mask"])
        if cfg.use_kl_loss:
            kl = kl_penalty(logprobs, mb["ref_logprobs"], cfg.kl_estimator) * mb["loss_mask"]
            per_token = per_token + cfg.kl_loss_coef * kl
            metrics["kl_loss"] = masked_mean(kl, mb["loss_mask"]).detach()
        if cfg.entropy_coeff:
            per_token = per_token - cfg.entropy_coeff * entropy * mb["loss_mask"]
        return (per_token * scale).sum(), metrics


class RefWorker(FSDPWorker):
    """Reference policy: forward-only logprobs."""

    role = "ref"
    trainable = False


class RewardModelWorker(FSDPWorker):
    """A scalar reward model (sequence classification, 1 label), forward-only: `scores` per row.

    A row's text is its prompt part, followed by one placeholder response token: the head runs at the
    position that predicts it, the text's last real token, where a sequence-classification model reads
    its score. So token budgets, balancing and pad rows work as for any forward. `section` holds the
    reward source's model settings (`reward.sources.<name>`, not a `trainer` section)."""

    role = "reward"

    def __init__(self, *args: Any, section: RefConfig, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._section = section

    @property
    def section(self) -> RefConfig:
        return self._section

    def reconfigure(self, cfg: TrainerConfig, section: RefConfig | None = None) -> None:
        """Start over with `cfg` and the reward source's model settings `section` (default: the same)."""
        self._section = section or self._section
        super().reconfigure(cfg)

    def _load_model(self, **kwargs: Any) -> torch.nn.Module:
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification.from_pretrained(
            self.model_path, num_labels=1, dtype=torch.float32, **kwargs
        )

    def _output(self, layout: TokenLayout) -> dict[str, torch.Tensor]:
        scores = self.root(layout, lambda hidden: self.model.score(hidden)[:, 0].float().clone())
        return {"scores": layout.scatter(scores)}


class CriticWorker(TrainableWorker):
    """Critic: the backbone with a scalar value head (token classification, 1 label), clipped value loss."""

    role = "critic"
    full_heads = ("score",)  # a fresh value head trains in full

    def _load_model(self, **kwargs: Any) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForTokenClassification

        # no dropout on the value head: values are regression targets, and layouts stay comparable
        config = AutoConfig.from_pretrained(self.model_path, num_labels=1, classifier_dropout=0.0)
        return AutoModelForTokenClassification.from_pretrained(
            self.model_path, config=config, dtype=torch.float32, **kwargs
        )

    def _values(self, layout: TokenLayout) -> torch.Tensor:
        """V(s_t) for each real response token t in the rows' [n, R] layout: the value head at the
        position that predicts it (only there)."""
        # a copy, not a view: FSDP warns that an in-place op on a returned view would skip its hooks
        values = self.root(layout, lambda hidden: self.model.score(hidden)[:, 0].float().clone())
        return layout.scatter(values)

    def _output(self, layout: TokenLayout) -> dict[str, torch.Tensor]:
        return {"values": self._values(layout)}

    def _loss(
        self, mb: TrainingInputBatch, layout: TokenLayout, scale: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        values = self._values(layout)
        per_token, metrics = value_loss(
            values, mb["old_values"], mb["returns"], mb["loss_mask"], self.cfg.algorithm.value_clip
        )
        return (per_token * scale).sum(), metrics
