"""The gated MLP of Llama-family decoder layers (Qwen2, Qwen3, Llama, Mistral):
down(silu(gate(x)) * up(x)), with a backward that holds less.

Autograd keeps four activations of tokens x intermediate size for this MLP's backward (gate(x),
its silu, up(x) and their product) and makes three more there. At the Qwen2.5-0.5B shape and
8 x 1,024 tokens each is 160 MB: the backward of one layer peaked 0.95 GB above what it
started with, the largest transient of a training step, so the step's peak. Here the forward
keeps gate(x) and up(x) only, and the backward runs a chunk of MLP_CHUNK_BYTES' worth of tokens
at a time, computing each chunk's silu and product again (elementwise, no matmul) and adding its
weight gradients into their totals. The same computation up to float rounding
(tests/test_trainer_parts.py compares the gradients within 1e-6).

Where the decoder layers are checkpointed (gradient_checkpointing, on by default at real shapes), it keeps x
alone and the backward computes each chunk's gate(x) and up(x) again as well. x is held on the
autograd context, past the saved-tensor hooks through which torch's checkpoint drops what a layer
keeps, and the MLP saves nothing through them, so the layer's recomputation in the backward stops
at the MLP's input (torch's checkpoint stops once it has made again everything it dropped). The
backward then runs two of the MLP's three matmuls again where the recomputation ran all three,
and the MLP's backward and the attention's recomputation no longer overlap: on a 4-layer model
of the Qwen2.5-0.5B shape at 8 x 1,024 tokens the step's peak fell from 4.55 to 4.18 GB, at the
same speed (docs/benchmarks.md). Each layer keeps x (tokens x hidden) besides its input until
its backward. (With the checkpoint's early stop turned off the recomputation would run this
forward again: the same result, done twice.)

Only where an activation is larger than one chunk, with gradients and without autocast; every
other call is the module's own (the test models keep the numerics their recordings hold).
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import activations

from tandem.linears import plain_linear

# What transformers' "silu" is (its own class in recent releases, torch's before).
SILU = (nn.SiLU, *[c for c in (getattr(activations, "SiLUActivation", None),) if c is not None])

# One intermediate activation's chunk in the backward: 16 MiB, 862 tokens at an intermediate size
# of 4,864 (five such buffers live at once).
MLP_CHUNK_BYTES = 16 << 20


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, chunk: int, recompute: bool = False) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x (..., H), weights as nn.Linear holds them (no bias), the
    backward `chunk` tokens at a time; with `recompute` keeping x only (above)."""
    return _GatedMLP.apply(x, gate, up, down, chunk, recompute)


class _GatedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, up, down, chunk, recompute):
        flat = x.reshape(-1, x.shape[-1])  # (T, H)
        out = torch.empty((len(flat), down.shape[0]), dtype=x.dtype, device=x.device)  # (T, H)
        g = u = None
        if not recompute:
            g, u = F.linear(flat, gate), F.linear(flat, up)  # (T, I) each, kept for the backward
        for s in range(0, len(flat), chunk):
            gc, uc = _gate_up(flat, g, u, gate, up, s, chunk)
            torch.mm(F.silu(gc) * uc, down.T, out=out[s : s + chunk])
        ctx.chunk, ctx.recompute = chunk, recompute
        if recompute:  # past autograd's saved-tensor hooks: a checkpoint keeps it (above)
            ctx.inputs = (x, gate, up, down)
        else:
            ctx.save_for_backward(x, g, u, gate, up, down)
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.recompute:
            x, g, u, gate, up, down = ctx.saved_tensors
        elif ctx.inputs is None:
            raise RuntimeError("a second backward through the gated MLP: its input went after the first (retain_graph keeps nothing here)")
        else:
            (x, gate, up, down), g, u = ctx.inputs, None, None
            ctx.inputs = None  # the graph outlives this call: let x go now
        flat, grad_out = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])  # (T, H)
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad[:4]
        grad_x = torch.empty_like(flat) if need_x else None
        grad_gate, grad_up, grad_down = (torch.zeros_like(w) if need else None for w, need in ((gate, need_gate), (up, need_up), (down, need_down)))
        for s in range(0, len(flat), ctx.chunk):
            xc, go = flat[s : s + ctx.chunk], grad_out[s : s + ctx.chunk]
            gc, uc = _gate_up(flat, g, u, gate, up, s, ctx.chunk)
            act = F.silu(gc)  # (t, I)
            if need_down:
                grad_down.addmm_(go.T, act * uc)
            grad_prod = go @ down  # (t, I): the gradient of silu(g) * u
            grad_u = grad_prod * act
            grad_g = torch.ops.aten.silu_backward(grad_prod.mul_(uc), gc)
            if need_up:
                grad_up.addmm_(grad_u.T, xc)
            if need_gate:
                grad_gate.addmm_(grad_g.T, xc)
            if need_x:
                torch.addmm(grad_u @ up, grad_g, gate, out=grad_x[s : s + ctx.chunk])
        return (grad_x.view_as(x) if need_x else None), grad_gate, grad_up, grad_down, None, None


def _gate_up(flat, g, u, gate, up, s, chunk):
    """gate(x) and up(x) for tokens s..s+chunk: kept ones, or computed again where none are kept."""
    if g is None:
        xc = flat[s : s + chunk]
        return F.linear(xc, gate), F.linear(xc, up)
    return g[s : s + chunk], u[s : s + chunk]


def chunk_mlps(model: nn.Module, recompute: bool = False) -> int:
    """Give every gated MLP of `model` whose projections are plain bias-free nn.Linear layers (none
    with a forward of its own) and whose activation is SiLU (not LoRA's adapted layers) the
    backward above; `recompute` where its decoder layers are checkpointed. Returns how many."""
    mlps = [m for m in model.modules() if _gated(m)]
    for mlp in mlps:
        mlp.forward = functools.partial(_forward, mlp, mlp.forward, recompute)
    return len(mlps)


def _gated(m: nn.Module) -> bool:
    linears = [getattr(m, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(m, "act_fn", None)
    return all(plain_linear(lin) and lin.bias is None for lin in linears) and type(act) in SILU and "forward" not in vars(act)


def _forward(mlp: nn.Module, own, recompute: bool, x: torch.Tensor) -> torch.Tensor:
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    chunk = max(1, MLP_CHUNK_BYTES // (weights[0].shape[0] * x.element_size()))
    large = x.numel() // x.shape[-1] > chunk
    trained = torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))
    if not (large and trained) or torch.is_autocast_enabled(x.device.type):
        return own(x)
    return gated_mlp(x, *weights, chunk, recompute)
