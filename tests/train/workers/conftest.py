"""Helpers for worker tests."""

import torch


@torch.no_grad()
def row_logprobs(model: torch.nn.Module, batch, row: int) -> torch.Tensor:
    """Logprobs of row `row`'s response tokens under a plain HF forward of the row without its padding."""
    tokens = batch["sequences"][row][batch["attention_mask"][row].bool()]
    response = int(batch["response_mask"][row].sum())
    logits = model(tokens[None]).logits[0, -response - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, tokens[-response:, None])[:, 0]
