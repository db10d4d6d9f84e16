"""A whole RL step through skyrl against the same work in a bare in-process loop, and skyrl's start-up.

The workload is issue 28's side-by-side with TRL's GRPOTrainer: `examples/custom_env`'s
RepeatWordEnv (one turn), the default tiny model, 16 prompts x 8 samples, at most 4 generated
tokens, 8 optimizer steps per step (mini-batches of 2 prompts, one epoch), GRPO, fp32, the default
optimizer and cosine schedule.

- skyrl: `python -m skyrl.train` in a fresh process (`--engine hf` or `vllm`). Per step: the
  wall-clock time between its metrics records and the phases it times (generate, batch, forward,
  advantages, train, sync; `other` is the rest: the driver's loop, logging). Start-up: from the
  process's start to the start of its first step; the first step's excess over the median step
  (engine warm-up) is printed too.
- bare: one fresh process with no Ray, no FSDP and no engine, with as many torch threads as the
  trainer's workers get (`trainer.placement.cpus_per_worker`). Per step: HF `generate` (sampling,
  temperature 1) on the model being trained, the env's rewards, group-normalised advantages, a
  no-grad forward for the old logprobs, then 8 mini-batches of the PPO-clip loss (token mean) with
  gradient clipping and AdamW. Its weights need no sync.
- trl (`--trl`): TRL's `GRPOTrainer` (the `dev` extra's trl) in a fresh process, on the same work
  as the bare loop, HF `generate` in its process; a step is one generation and its 8 optimizer
  steps. Start-up: from the process's start to its first optimizer step's start.

Each runs alone, one after the other, `--steps` steps each; the first `--warmup` steps are left out
of the medians. Prints each phase's median seconds and share of the step, the start-up figures, with
`--trl` `ratio skyrl/trl`, and last `ratio skyrl/bare` (median seconds per step; the goal is at most
1.2). `--hidden H --layers L` runs them on a larger model of the tiny family (e.g. 512 x 4: 17M
parameters against the default's 0.16M), where the same fixed costs are a smaller share of the step.

Usage: python scripts/bench_step.py [--engine hf|vllm] [--steps 30] [--warmup 3] [--trl]
                                   [--model PATH | --hidden 512 --layers 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "custom_env"
PROMPTS, SAMPLES, MAX_TOKENS, MINI_BATCH_PROMPTS = 16, 8, 4, 2
LR, MIN_LR_RATIO, MAX_GRAD_NORM, CLIP = 2e-3, 0.1, 1.0, 0.2
THREADS = 2  # trainer.placement.cpus_per_worker's default: the policy worker's torch threads
OVERRIDES = [
    "environment.env_class=my_env:RepeatWordEnv",
    f"data.train_path={EXAMPLE / 'prompts.jsonl'}",
    "generator.max_turns=1",
    f"generator.max_generate_length={MAX_TOKENS}",
    f"generator.n_samples_per_prompt={SAMPLES}",
    f"trainer.train_batch_size={PROMPTS}",
    f"trainer.policy_mini_batch_size={MINI_BATCH_PROMPTS}",
    "trainer.update_epochs_per_batch=1",
    # micro-batches as the bare loop's: a whole mini-batch per backward, the whole batch per forward
    f"trainer.micro_train_batch_size_per_gpu={MINI_BATCH_PROMPTS * SAMPLES}",
    f"trainer.micro_forward_batch_size_per_gpu={PROMPTS * SAMPLES}",
    f"trainer.policy.optimizer.lr={LR}",
    "trainer.policy.bf16=false",
    "trainer.ckpt_interval=0",
    "trainer.logger=[jsonl]",
]
SKYRL_PHASES = ["generate", "batch", "forward", "advantages", "train", "sync"]


def run_skyrl(engine: str, steps: int, model: str) -> tuple[float, list[dict[str, float]]]:
    """Seconds from process start to its first step's start, and per step the phases' seconds plus
    `step` (wall-clock, from one metrics record's arrival to the next's)."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            sys.executable,
            "-m",
            "skyrl.train",
            *OVERRIDES,
            f"trainer.total_steps={steps}",
            f"trainer.policy.model.path={model}",
            f"generator.inference_engine.backend={engine}",
            f"hydra.run.dir={run_dir}",
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")])}
        arrivals: list[float] = []
        start = time.time()
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        errors: list[bytes] = []
        reader = threading.Thread(target=lambda: errors.append(process.stderr.read()), daemon=True)
        reader.start()
        metrics = Path(run_dir) / "metrics.jsonl"
        while process.poll() is None:  # when each record arrives: the end of its step
            lines = metrics.read_text().count("\n") if metrics.exists() else 0
            arrivals += [time.time()] * (lines - len(arrivals))
            time.sleep(0.005)
        reader.join()
        if process.returncode:
            sys.exit(f"skyrl run failed ({process.returncode}):\n{errors[0].decode()[-3000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    per_step = []
    for i, record in enumerate(records):
        phases = {p: record[f"timing/{p}_s"] for p in SKYRL_PHASES}
        wall = arrivals[i] - arrivals[i - 1] if i else sum(phases.values())
        per_step.append({**phases, "other": wall - sum(phases.values()), "step": wall})
    return arrivals[0] - per_step[0]["step"] - start, per_step


def run_in_process(side: str, steps: int, model: str) -> tuple[float, list[dict[str, float]]]:
    """The bare loop (`side` bare) or TRL's trainer (trl) in a fresh process: seconds from its start to
    its first step, per-step phases."""
    start = time.time()
    out = subprocess.run(
        [sys.executable, __file__, f"--{side}-worker", "--steps", str(steps), "--model", model],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        sys.exit(f"{side} run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["first_step_at"] - start, result["steps"]


class BareLoop:
    """The bare loop (see the module docstring): one model, generating and training in this process."""

    def __init__(self, model_path: str, steps: int):
        import random

        from transformers import AutoModelForCausalLM, AutoTokenizer

        sys.path.insert(0, str(EXAMPLE))
        from my_env import RepeatWordEnv

        torch.set_num_threads(THREADS)
        torch.manual_seed(0)
        self.env_class = RepeatWordEnv
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        self.schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
            self.optimizer, steps * PROMPTS // MINI_BATCH_PROMPTS, eta_min=LR * MIN_LR_RATIO
        )
        self.rows = [json.loads(line) for line in (EXAMPLE / "prompts.jsonl").read_text().splitlines()]
        for row in self.rows:
            messages = [{"role": "user", "content": row["prompt"]}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            row["ids"] = ids if isinstance(ids, list) else ids["input_ids"]  # transformers 5: BatchEncoding
        self.pad, self.eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        self.order = random.Random(0)

    def step(self) -> dict[str, float]:
        """One step; the seconds of each phase and of the whole step."""
        laps = [("start", time.perf_counter())]
        batch = self.order.sample(self.rows, PROMPTS)
        generated = self.generate(batch)
        laps.append(("generate", time.perf_counter()))
        ids, attention, loss_mask, advantages = self.make_batch(batch, generated)
        laps.append(("batch", time.perf_counter()))
        with torch.no_grad():
            old = self.logprobs(ids, attention)
        laps.append(("forward", time.perf_counter()))
        self.model.train()
        size = MINI_BATCH_PROMPTS * SAMPLES
        for begin in range(0, len(ids), size):
            part = slice(begin, begin + size)
            ratio = (self.logprobs(ids[part], attention[part]) - old[part]).exp()
            surrogate = torch.maximum(
                -advantages[part] * ratio, -advantages[part] * ratio.clamp(1 - CLIP, 1 + CLIP)
            )
            mask = loss_mask[part]
            loss = (surrogate * mask).sum() / mask.sum().clamp(min=1)
            self.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
            self.optimizer.step()
            self.schedule.step()
        laps.append(("train", time.perf_counter()))
        phases = {name: end - laps[i][1] for i, (name, end) in enumerate(laps[1:])}
        return {**phases, "step": laps[-1][1] - laps[0][1]}

    def generate(self, batch: list[dict]) -> list[list[int]]:
        """`SAMPLES` sampled responses per prompt of `batch` (up to and including EOS)."""
        width = max(len(r["ids"]) for r in batch)
        prompts = torch.tensor([[self.pad] * (width - len(r["ids"])) + r["ids"] for r in batch])
        self.model.eval()
        with torch.no_grad():
            generated = self.model.generate(
                input_ids=prompts,
                attention_mask=(prompts != self.pad).long(),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=MAX_TOKENS,
                num_return_sequences=SAMPLES,
                pad_token_id=self.pad,
                eos_token_id=self.eos,
            )[:, width:]
        return [t[: t.index(self.eos) + 1] if self.eos in t else t for t in generated.tolist()]

    def make_batch(self, batch: list[dict], responses: list[list[int]]) -> tuple:
        """Right-padded sequences, attention mask, loss mask (over next-token positions), advantages."""
        sequences, masks, rewards = [], [], []
        for i, response in enumerate(responses):
            row = batch[i // SAMPLES]
            env = self.env_class({}, {"word": row["word"]})
            rewards.append(env.step(self.tokenizer.decode(response, skip_special_tokens=True)).reward)
            sequences.append(row["ids"] + response)
            masks.append([0] * (len(row["ids"]) - 1) + [1] * len(response))
        length = max(map(len, sequences))
        ids = torch.tensor([s + [self.pad] * (length - len(s)) for s in sequences])
        attention = torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in sequences])
        loss_mask = torch.tensor([m + [0] * (length - 1 - len(m)) for m in masks], dtype=torch.float)
        grouped = torch.tensor(rewards).view(PROMPTS, SAMPLES)
        advantages = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
        return ids, attention, loss_mask, advantages.view(-1, 1)

    def logprobs(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def bare_worker(steps: int, model_path: str) -> None:
    """Runs the bare loop; prints a JSON line: when its first step started and its per-step phases."""
    loop = BareLoop(model_path, steps)
    first_step_at = time.time()
    timings = [loop.step() for _ in range(steps)]
    print(json.dumps({"first_step_at": first_step_at, "steps": timings}))


def trl_worker(steps: int, model_path: str) -> None:
    """TRL's `GRPOTrainer` on the same workload (in-process HF `generate`, the env's rewards, `SAMPLES`
    per prompt, `MINI_BATCH_PROMPTS` prompts per optimizer step, one iteration, the same LR schedule,
    clip and gradient clipping, token-mean loss (`dapo`), no KL, fp32); prints a JSON line like
    `bare_worker`'s, a step being one generation and its optimizer steps."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(EXAMPLE))
    from my_env import RepeatWordEnv

    torch.set_num_threads(THREADS)
    rows = [json.loads(line) for line in (EXAMPLE / "prompts.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "word": r["word"]} for r in rows]
    )

    def reward(completions: list, word: list[str], **_: object) -> list[float]:
        texts = [c[0]["content"] for c in completions]
        return [RepeatWordEnv({}, {"word": w}).step(t).reward for t, w in zip(texts, word, strict=True)]

    optimizer_steps = PROMPTS // MINI_BATCH_PROMPTS
    first_step_at: list[float] = []  # the first optimizer step's start (the first generation is in it)
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs) -> None:
            if not first_step_at:
                first_step_at.append(time.time())

        def on_step_end(self, args, state, control, **kwargs) -> None:
            ends.append(time.time())

    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=MINI_BATCH_PROMPTS * SAMPLES,
            steps_per_generation=optimizer_steps,
            num_generations=SAMPLES,
            max_completion_length=MAX_TOKENS,
            num_iterations=1,
            learning_rate=LR,
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATIO},
            weight_decay=0.0,
            epsilon=CLIP,
            beta=0.0,
            loss_type="dapo",
            max_grad_norm=MAX_GRAD_NORM,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            use_cpu=True,
            bf16=False,
            max_steps=optimizer_steps * steps,
            logging_steps=optimizer_steps * steps,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(model_path),
            callbacks=[Clock()],
        )
        trainer.train()
    starts = [first_step_at[0], *ends[optimizer_steps - 1 :: optimizer_steps]]
    timings = [{"step": end - begin} for begin, end in itertools.pairwise(starts)]
    print(json.dumps({"first_step_at": first_step_at[0], "steps": timings}))


def medians(per_step: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(step[key] for step in per_step) for key in per_step[0]}


def report(name: str, startup: float, per_step: list[dict[str, float]], warmup: int) -> float:
    """Prints a side's start-up and its phases' medians and shares; returns its median step."""
    steady = medians(per_step[warmup:])
    shares = ", ".join(f"{k} {v:.3f} s ({v / steady['step']:.0%})" for k, v in steady.items() if k != "step")
    print(f"{name}: start-up {startup:.1f} s to the first step; first step {per_step[0]['step']:.2f} s")
    print(f"{name}: median step {steady['step']:.3f} s" + (f" = {shares}" if shares else ""))
    return steady["step"]


def built_model(directory: str, hidden: int | None, layers: int) -> str:
    """The default tiny model, or (`hidden` set) one of that size written to `directory`."""
    from skyrl.train.utils.tiny_model import (
        DEFAULT_INITIALIZER_RANGE,
        create_tiny_model,
        default_tiny_model_path,
    )

    if hidden is None:
        return str(default_tiny_model_path())
    return str(
        create_tiny_model(
            directory,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=hidden // 64,
            intermediate_size=4 * hidden,
            initializer_range=DEFAULT_INITIALIZER_RANGE,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--model", help="a model directory (default: the default tiny model)")
    sizes.add_argument(
        "--hidden", type=int, help="a tiny model of this hidden size instead (heads of 64, MLP 4x hidden)"
    )
    parser.add_argument("--layers", type=int, default=2, help="with --hidden: its layers")
    parser.add_argument(
        "--trl", action="store_true", help="also run TRL's GRPOTrainer on the same work (the dev extra's trl)"
    )
    parser.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl and importlib.util.find_spec("trl") is None:
        parser.error("--trl needs TRL, which is not installed: pip install -e '.[dev]'")
    if args.hidden is None and args.layers != parser.get_default("layers"):
        parser.error("--layers sizes the model --hidden builds; give --hidden too")
    if args.hidden is not None and (args.hidden < 64 or args.hidden % 64):
        parser.error(
            f"--hidden {args.hidden}: give a multiple of 64 (its attention heads have 64 dimensions)"
        )
    if args.bare_worker or args.trl_worker:
        (bare_worker if args.bare_worker else trl_worker)(args.steps, args.model)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or built_model(tmp, args.hidden, args.layers)
        bare_startup, bare_steps = run_in_process("bare", args.steps, model)
        skyrl_startup, skyrl_steps = run_skyrl(args.engine, args.steps, model)
        trl_run = run_in_process("trl", args.steps, model) if args.trl else None
    bare = report("bare", bare_startup, bare_steps, args.warmup)
    ours = report(f"skyrl ({args.engine} engine)", skyrl_startup, skyrl_steps, args.warmup)
    excess = skyrl_steps[0]["step"] - ours
    print(
        f"skyrl ({args.engine} engine): start-up + first step's excess over the median {skyrl_startup + excess:.1f} s"
    )
    if trl_run is not None:
        trl = report("trl", *trl_run, args.warmup)
        print(f"ratio skyrl/trl {ours / trl:.3f}")
    print(f"ratio skyrl/bare {ours / bare:.3f}")


if __name__ == "__main__":
    main()
