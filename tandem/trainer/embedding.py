"""The input embedding's backward where its weight is the output layer's too (tie_word_embeddings:
Qwen2.5 up to 3B, Qwen3 up to 4B, Llama 3.2's 1B and 3B).

nn.Embedding's backward makes a dense gradient the size of its whole table (vocabulary x hidden:
545 MB at the Qwen2.5-0.5B shape) to hold the few rows a batch looked up, and autograd adds it to
the output layer's gradient of the same weight, another table-sized tensor. The lookup's backward
runs last, when every other gradient already exists, so these two were a training step's peak.
Here the output layer adds its gradient straight into weight.grad (head.write_weight_grad) and the
lookup's gradient is sparse, one row per token looked up, which the weight's gradient accumulator
adds into weight.grad in place: one table-sized tensor, the gradient itself. (Left to autograd, a
sparse share and a dense one meeting in its input buffer are summed into a new dense tensor.)

Only in one unsharded process, where the table is tied, trained and at least
EMBEDDING_SPARSE_BYTES; every other call is the module's own. The sums run in another order, so
the gradient differs by float rounding (tests/test_trainer_parts.py: within 1e-6), and the test
models, whose tables are far smaller, keep the numerics their recordings hold.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.linears import plain_linear
from tandem.trainer.head import write_weight_grad

# Tables from 64 MiB up (the Qwen2.5-0.5B shape's is 520 MiB): far more rows than a batch looks up.
EMBEDDING_SPARSE_BYTES = 64 << 20


def sparse_tied_embedding(model: nn.Module) -> bool:
    """Give `model`'s input embedding and output layer the backward above where the two share a
    plain nn.Embedding's and nn.Linear's weight that is large enough. Returns whether it did."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    weight = embed.weight
    tied = plain_linear(head) and head.weight is weight and type(embed) is nn.Embedding and "forward" not in vars(embed)
    if not (tied and weight.numel() * weight.element_size() >= EMBEDDING_SPARSE_BYTES):
        return False
    write_weight_grad(head)
    embed.forward = functools.partial(_forward, embed, embed.forward)
    return True


def _forward(embed: nn.Embedding, own, ids: torch.Tensor) -> torch.Tensor:
    if not (torch.is_grad_enabled() and embed.weight.requires_grad):
        return own(ids)
    return F.embedding(ids, embed.weight, embed.padding_idx, embed.max_norm, embed.norm_type, embed.scale_grad_by_freq, sparse=True)
