# GPU image: CUDA 13 (the torch 2.14 and vLLM 0.33 wheels are built for it; NVIDIA driver >= 580),
# Ubuntu 24.04's Python 3.12 with its headers and a C compiler (Triton compiles a small driver at
# vLLM's first kernel launch), skyrl with the CUDA vLLM extra, ready to join a Ray cluster.
FROM nvidia/cuda:13.0.0-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/skyrl
# .dockerignore keeps a local .venv, .git and run outputs out of the image
COPY . .
RUN SKYRL_EXTRAS=vllm bash scripts/install.sh
ENV PATH=/opt/skyrl/.venv/bin:$PATH

# Head: ray start --head --block; workers: ray start --address=HEAD:6379 --block
CMD ["python", "-m", "skyrl.train", "--help"]
