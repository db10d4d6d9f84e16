"""Ulysses sequence parallelism's parts: the slices of a layout, and attention over two gloo ranks. The
workers at SP=2 and DP=2 x SP=2 train like the plain path: `test_layout_equivalence.py`."""

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from scripts.check_dp_equivalence import stepwise_batch
from skyrl.train.workers.layout import build_layout
from skyrl.train.workers.sequence_parallel import shard_layout

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("packed", [False, True], ids=["trimmed", "packed"])
@pytest.mark.parametrize("size", [2, 3])
def test_the_slices_of_a_layout_hold_each_needed_token_once_at_its_global_position(packed, size):
    batch, _ = stepwise_batch(64, share_prefixes=True)
    for count in range(4, len(batch)):  # the first rows whose layout has a length sp does not divide
        rows = batch.select_rows(list(range(count)))
        layout = build_layout(
            rows["sequences"], rows["attention_mask"], rows["response_mask"], rows["prefix_group"], packed
        )
        width = layout.input_ids.shape[1]
        if width % size:
            break
    assert width % size, "the slices are padded"
    slices = [shard_layout(layout, rank, size, None) for rank in range(size)]
    # the slices side by side are the padded layout: the same tokens at the same (global) positions
    ids = torch.cat([s.input_ids for s in slices], 1)
    positions = torch.cat([s.position_ids for s in slices], 1)
    assert ids.shape[1] % size == 0 and torch.equal(ids[:, :width], layout.input_ids)
    assert torch.equal(positions[:, :width], layout.position_ids) and not ids[:, width:].any()
    if packed:  # the pad tokens are a sequence of their own
        assert slices[0].cu_seqlens.tolist() == [*layout.cu_seqlens.tolist(), ids.shape[1]]
    # each needed token is in exactly one slice, which holds the hidden state that predicts it
    needed = {
        (r, c): t
        for r, c, t in zip(layout.rows.tolist(), layout.cols.tolist(), layout.targets.tolist(), strict=True)
    }
    found = {}
    for rank, s in enumerate(slices):
        chunk = s.input_ids.shape[1]
        for i, r, c, t in zip(
            s.index.tolist(), s.rows.tolist(), s.cols.tolist(), s.targets.tolist(), strict=True
        ):
            assert (r, c) not in found
            found[r, c] = t
            global_index = layout.index[(layout.rows == r) & (layout.cols == c)].item()
            row, column = divmod(global_index, width)
            assert (i // chunk, i % chunk) == (row, column - rank * chunk)
    assert found == needed


ATTENTION_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist, torch.nn.functional as F
    from skyrl.train.workers import sequence_parallel

    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sequence_parallel.use_group(dist.new_group([0, 1]))
    module = torch.nn.Module()

    def reference(q, k, v, bounds):
        outs = [
            F.scaled_dot_product_attention(
                *(t[:, :, a:b] for t in (q, k, v)), is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
            )
            for a, b in zip(bounds, bounds[1:])
        ]
        return torch.cat(outs, 2).transpose(1, 2)  # [B, L, H, D]

    for inner, batch, bounds in [("sdpa", 2, [0, 10]), ("varlen", 1, [0, 3, 8, 10])]:
        for kv_heads in (4, 2, 1):  # split over the ranks; repeated to one per query head when 2 does not divide
            torch.manual_seed(kv_heads)
            q = torch.randn(batch, 4, 10, 8, dtype=torch.float64, requires_grad=True)
            k, v = (torch.randn(batch, kv_heads, 10, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
            weights = torch.randn(batch, 10, 4, 8, dtype=torch.float64)
            full = reference(q, k, v, bounds)
            (full * weights).sum().backward()
            mine = slice(5 * rank, 5 * rank + 5)
            parts = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            kwargs = {"cu_seq_lens_q": torch.tensor(bounds), "max_length_q": 5} if inner == "varlen" else {}
            out, _ = sequence_parallel.ulysses_attention(inner, module, *parts, None, **kwargs)
            (out * weights[:, mine]).sum().backward()  # the ranks' losses add up to the whole one
            torch.testing.assert_close(out, full[:, mine], rtol=1e-12, atol=1e-12)
            for part, whole in zip(parts, (q, k, v)):
                torch.testing.assert_close(part.grad, whole.grad[:, :, mine], rtol=1e-12, atol=1e-12)
    dist.destroy_process_group()  # gloo's threads stopped before exit (else an abort at exit, seen once in CI)
    print("attention ok")
    """
)


def test_ulysses_attention_over_two_ranks_gives_the_whole_sequences_attention_and_gradients():
    """sdpa over right-padded rows and varlen over packed sequences, with 4, 2 and 1 key/value heads for 4
    query heads: each rank's output and its slice's gradients (every rank's loss flowing back through the
    all-to-all) equal those of attention over the whole sequence on one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", ATTENTION_SCRIPT, str(rank), port],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for process in ranks:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-3000:]
        assert "attention ok" in out
