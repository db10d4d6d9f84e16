"""Shared-memory weight groups on CPU (/dev/shm): packing, mapping, clear errors, nothing left behind."""

import dataclasses
import os

import pytest
import torch

from skyrl.train.inference.shared_weights import (
    ALIGN_BYTES,
    SHM_DIR,
    SharedBuffer,
    SharedWeightsError,
    open_shared,
    packed_nbytes,
)

CPU = torch.device("cpu")


def torch_shm_files() -> set[str]:
    return {f for f in os.listdir(SHM_DIR) if f.startswith("torch_")}


def mixed_group() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 3, generator=gen),  # 84 bytes: the next tensor starts past a padding
        "b.weight": torch.randn(5, generator=gen).to(torch.bfloat16),
        "c.bias": torch.randn(2, 3, generator=gen).t(),  # not contiguous
        "d.weight": torch.randn(3, 2, generator=gen).to(torch.float16),
    }


def test_a_group_round_trips_through_shared_memory_with_every_dtype_and_layout():
    group = mixed_group()
    buffer = SharedBuffer(packed_nbytes(group.values()), CPU)
    try:
        shared = buffer.share(group)
        assert all(offset % ALIGN_BYTES == 0 for *_, offset in shared.layout)
        assert shared.spec() == [
            (n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in group.items()
        ]
        opened = open_shared(shared)
        assert [name for name, _ in opened] == list(group)
        for name, tensor in opened:
            assert tensor.dtype == group[name].dtype
            torch.testing.assert_close(tensor, group[name], rtol=0, atol=0)
        # the next group reuses the buffer: what was opened now shows the new bytes
        doubled = {name: t * 2 for name, t in group.items()}
        buffer.share(doubled)
        torch.testing.assert_close(opened[0][1], doubled["a.weight"], rtol=0, atol=0)
    finally:
        buffer.close()


def test_closing_the_buffer_and_dropping_the_mapping_leaves_no_file_in_dev_shm():
    group = mixed_group()
    buffer = SharedBuffer(packed_nbytes(group.values()), CPU)
    shared = buffer.share(group)
    file = shared.handle[1].decode().lstrip("/")  # (manager socket, file name, size)
    opened = open_shared(shared)
    assert file in torch_shm_files(), "the buffer should live in /dev/shm while it is shared"
    buffer.close()
    del opened
    assert file not in torch_shm_files()


def test_a_group_larger_than_the_buffer_is_refused():
    group = mixed_group()
    buffer = SharedBuffer(packed_nbytes(group.values()) - ALIGN_BYTES, CPU)
    try:
        with pytest.raises(ValueError, match=r"does not fit a shared buffer of \d+ bytes \(at d.weight\)"):
            buffer.share(group)
    finally:
        buffer.close()


def test_a_buffer_larger_than_dev_shm_names_the_sizes_and_the_fallback():
    with pytest.raises(
        SharedWeightsError, match=r"MiB free in /dev/shm .*inference_engine.weight_sync=object_store"
    ):
        SharedBuffer(1 << 60, CPU)


def test_a_group_from_another_host_is_refused_with_the_placement_to_use():
    group = mixed_group()
    buffer = SharedBuffer(packed_nbytes(group.values()), CPU)
    try:
        elsewhere = dataclasses.replace(buffer.share(group), host="another-node")
        with pytest.raises(SharedWeightsError, match=r"'another-node'.*colocate_all=true"):
            open_shared(elsewhere)
    finally:
        buffer.close()
