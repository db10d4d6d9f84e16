import pytest
from transformers import AutoTokenizer

from skyrl.train.inference import InferenceEngineClient, InferenceEngineConfig


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="package")
def hf_client(ray_cluster, tiny_model_path):
    """One hf engine actor for this folder's rollout and agent tests."""
    cfg = InferenceEngineConfig(backend="hf", device="cpu", kv_cache_memory_bytes=64 << 20)
    client = InferenceEngineClient.from_config(cfg, str(tiny_model_path))
    yield client
    client.shutdown()
