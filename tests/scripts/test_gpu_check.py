"""scripts/gpu_check.py runs where only torch and transformers are: here on CPU, with Ray unimportable."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_trains_and_hands_weights_over_without_ray(tmp_path):
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('ray is not available here')\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(
        [
            sys.executable,
            "scripts/gpu_check.py",
            "--tiny",
            "--steps",
            "1",
            "--trajectories",
            "2",
            "--turns",
            "3",
            "--profile",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "world size 1 (cpu)" in out and "MFU n/a" in out
    assert "tokens forwarded (prefix-shared)" in out and "tokens/s" in out
    assert "bf16 vs fp32 logprobs: mean |diff| 0.00e+00" in out  # CPU trains fp32 either way
    assert "IPC hand-off of a weight group to another process: exact" in out
    # the default packed varlen layout against padded sdpa: the same logprobs in fp32
    gap = re.search(r"varlen vs sdpa .* in bf16: logprobs mean \|diff\| \S+, max (\S+);", out)
    assert gap and float(gap.group(1)) < 1e-5, out
    assert "LoRA rank 16: 47,104 trainable parameters" in out  # the tiny model's 2 layers x 7 projections
    assert "cpu_offload step: grad_norm" in out and "a weight group in bf16" in out
    assert "forward (no grad): " in out and "Self CPU time total" in out  # --profile's table
