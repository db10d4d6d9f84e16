"""A PNG of reward and key metrics over steps, from a run directory's metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from skyrl.train.utils.tracking import read_metrics

PANELS = (
    ("reward/mean", "mean reward"),
    ("episode/turns", "turns per episode"),
    ("policy/grad_norm", "grad norm"),
    ("policy/entropy", "entropy"),
    ("timing/generate_s", "generate (s)"),
    ("timing/train_s", "train (s)"),
)


def plot_metrics(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write `run_dir/metrics.png` (or `out`) with one panel per key metric; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "metrics.png"
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points, strict=True))
        ax.set_title(title)
        ax.set_xlabel("step")
    eval_points = [
        (r["step"], r["eval/greedy/reward_mean"]) for r in records if "eval/greedy/reward_mean" in r
    ]
    if eval_points:
        axes.flat[0].plot(*zip(*eval_points, strict=True), "o-", label="eval (greedy)")
        axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
