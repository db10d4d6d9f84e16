"""CPU tensors through Ray as bytes (`register_tensor_serializer`): the same values, dtype and shape on
arrival, only a view's own elements, a writable tensor of the receiver's own; others as before."""

import pickle

import pytest
import torch

from skyrl.train.utils.ray_tensors import register_tensor_serializer

big = torch.arange(10_000, dtype=torch.float32).view(100, 100)
TENSORS = {
    "float32 view": big[3:5, 10:20],  # neither contiguous nor owning its storage
    "bfloat16": torch.randn(4, 3).to(torch.bfloat16),  # no numpy dtype
    "bool": torch.tensor([True, False, True]),
    "int64 0-dim": torch.tensor(7),
    "empty": torch.empty(0, 5, dtype=torch.int32),
    "large": torch.randn(300_000),  # past Ray's inline limit: through the shared-memory store
}


def _round_trip(ray, value):
    return ray.get(ray.put(value))


@pytest.fixture(scope="module")
def registered(ray_cluster):
    register_tensor_serializer()
    return ray_cluster


@pytest.mark.parametrize("name", TENSORS)
def test_a_cpu_tensor_arrives_equal_as_a_tensor_of_its_own(registered, name):
    sent = TENSORS[name]
    before = sent.clone()
    got = _round_trip(registered, sent)
    assert type(got) is torch.Tensor
    assert got.dtype == sent.dtype and got.shape == sent.shape
    assert torch.equal(got, sent)
    assert got.untyped_storage().nbytes() == sent.nbytes  # a view's elements only, not its storage
    got.add_(1) if got.dtype != torch.bool else got.logical_not_()  # writable, and not the sender's
    assert torch.equal(sent, before) and (got.numel() == 0 or not torch.equal(got, sent))


def test_it_travels_as_bytes_not_through_torch_load(registered):
    """A pickled batch of many small tensors carries no `torch.load` per tensor (the cost it removes)."""
    from ray._private.worker import global_worker

    rows = [torch.randn(40) for _ in range(64)]
    data = global_worker.get_serialization_context().serialize(rows).to_bytes()
    assert b"_load_from_bytes" not in data and b"ray_tensors" in data
    assert all(torch.equal(a, b) for a, b in zip(_round_trip(registered, rows), rows, strict=True))


def test_tensors_needing_grad_and_parameters_travel_as_torch_pickles_them(registered):
    leaf = torch.randn(3, requires_grad=True)
    got = _round_trip(registered, leaf)
    assert got.requires_grad and torch.equal(got.detach(), leaf.detach())
    parameter = torch.nn.Parameter(torch.randn(2, 2))
    assert isinstance(_round_trip(registered, parameter), torch.nn.Parameter)
    derived = _round_trip(registered, leaf * 2)  # as torch pickles it: a leaf that needs grad
    assert derived.requires_grad and derived.grad_fn is None
    assert pickle.loads(pickle.dumps(big)).shape == big.shape  # plain pickle is untouched


def test_a_process_that_did_not_register_reads_them_and_one_that_did_sends_them(registered):
    """A Ray worker process reads the bytes this process sent; it sends them itself once registered."""

    @registered.remote
    def double(t: torch.Tensor, register: bool) -> tuple[torch.Tensor, bool]:
        from ray._private.worker import global_worker

        if register:
            register_tensor_serializer()
        data = global_worker.get_serialization_context().serialize(t * 2).to_bytes()
        return t * 2, b"ray_tensors" in data

    sent = TENSORS["bfloat16"]
    for register in (False, True):
        doubled, as_bytes = registered.get(double.remote(sent, register))
        assert torch.equal(doubled, sent * 2) and as_bytes == register
