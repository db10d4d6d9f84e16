# GPU image: CUDA, Python 3.11, skyrl with the CUDA vLLM extra, ready to join a Ray cluster.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/skyrl
COPY . .
RUN ln -sf /usr/bin/python3.11 /usr/bin/python3 && SKYRL_EXTRAS=vllm bash scripts/install.sh
ENV PATH=/opt/skyrl/.venv/bin:$PATH

# Head: ray start --head --block; workers: ray start --address=HEAD:6379 --block
CMD ["python", "-m", "skyrl.train", "--help"]
