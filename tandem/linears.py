"""Large linear layers through oneDNN's matmul on a CPU, where F.linear calls the BLAS one (MKL)
in fp32 and an unpacked oneDNN one in bf16. On an AMD EPYC with AVX-512 (docs/benchmarks.md)
MKL ran the few-row matmuls of a decode step far below the memory bandwidth: the 151,936-wide
output layer of the Qwen2.5-0.5B shape took 105 ms for 8 rows, oneDNN 34 ms, and 22 ms with its
weight packed (reordered) for it once. The fp32 results equal the BLAS ones to float rounding.
In bf16 (bf16 weights, or fp32 ones under bf16 autocast) only packed weights go through it,
where the CPU computes bf16 natively: on an AVX-512 machine with AMX a packed bf16 weight read
at 1.6-2x the rate of an unpacked one for 8 rows, with the same results as F.linear's. Without
gradients only: the op has no backward, so this covers generation and the output layer's chunks
(tandem/trainer/head.py).
"""

import contextlib
import functools

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

# Weights of at least this many elements go through oneDNN. Under it the BLAS matmul is as fast
# or faster (a 512x512 weight: 78 against 71 us for 8 rows, 22 against 36 us at 256x256), and
# the test models (at most 256x1024) keep the numerics their recordings hold.
ONEDNN_MIN_WEIGHT = 2**19


class OneDNNLinears(TorchFunctionMode):
    """While active: F.linear on large CPU weights, without gradients, through oneDNN.
    `pack`: reorder each weight once for oneDNN (a copy of it, held while the mode is active),
    which pays where many calls reuse it: a decode loop. Only a packing mode takes bf16 matmuls."""

    def __init__(self, pack: bool = False):
        super().__init__()
        self.pack = pack
        self.bf16 = pack and torch.ops.mkldnn._is_mkldnn_bf16_supported()  # whether it takes bf16 matmuls
        # weight -> (its storage, version and the dtype computed in when packed, the packed copy);
        # an entry goes with its weight, and a weight whose storage or values changed is packed
        # again in its place.
        self.packed = WeakIdKeyDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and len(args) >= 2:
            out = self.linear(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"))
            if out is not None:
                return out
        return func(*args, **kwargs)

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x @ w.T + bias through oneDNN, or None where F.linear should compute it."""
        dtype = None if torch.is_grad_enabled() else self._dtype(x, w)
        if dtype is None:
            return None
        if self.pack:
            state, packed = self.packed.get(w, (None, None))
            if state != (w.data_ptr(), w._version, dtype):
                packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)
                self.packed[w] = ((w.data_ptr(), w._version, dtype), packed)
            w = packed
        bias = None if bias is None else bias.to(dtype)
        return torch.ops.mkldnn._linear_pointwise(x.to(dtype), w, bias, "none", [], "")

    def _dtype(self, x: torch.Tensor, w: torch.Tensor) -> torch.dtype | None:
        """The dtype this computes x @ w.T in (what F.linear would), or None where it leaves the
        call to F.linear: a small weight, one off the CPU, a dtype it does not take."""
        if type(x) is not torch.Tensor or type(w) not in (torch.Tensor, torch.nn.Parameter) or x.device.type != "cpu" or not _large(w, self.bf16):
            return None
        if torch.is_autocast_enabled("cpu"):
            # Under autocast F.linear computes in the autocast dtype: bf16 here when packing.
            bf16 = self.bf16 and torch.get_autocast_dtype("cpu") == torch.bfloat16 and x.dtype in (torch.float32, torch.bfloat16)
            return torch.bfloat16 if bf16 else None
        if x.dtype == w.dtype == torch.float32 or (self.bf16 and x.dtype == w.dtype == torch.bfloat16):
            return x.dtype
        return None


def plain_linear(layer: nn.Module) -> bool:
    """An nn.Linear computing as nn.Linear does (not an fp32 head's patched forward, not an
    adapter), with its weight and bias the only trainable parameters."""
    return type(layer) is nn.Linear and "forward" not in vars(layer)


def _large(w: torch.Tensor, bf16: bool) -> bool:
    """A weight the mode may take: fp32 (or bf16 where it takes bf16 matmuls), on a CPU, at
    least ONEDNN_MIN_WEIGHT elements."""
    return w.dtype in ((torch.float32, torch.bfloat16) if bf16 else (torch.float32,)) and w.device.type == "cpu" and w.numel() >= ONEDNN_MIN_WEIGHT


class LayerLinears:
    """While active (a context, entered again and again): the same matmuls as OneDNNLinears for
    each plain nn.Linear layer of a module, through a forward swapped in on the layer. Every
    other op runs as it is: a torch function mode sees each op of the model, and its Python cost
    was 5-13% of a decode step at the Qwen2.5-0.5B shape (8 rows, bf16 and fp32; the same tokens
    and log-probs either way). Calls with gradients run the layer's own forward."""

    def __init__(self, module: nn.Module, pack: bool):
        self.mode = OneDNNLinears(pack)
        self.layers = [m for m in module.modules() if plain_linear(m) and _large(m.weight, self.mode.bf16)]

    def __enter__(self):
        for layer in self.layers:
            layer.forward = functools.partial(self._forward, layer)
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            vars(layer).pop("forward", None)

    def _forward(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.mode.linear(x, layer.weight, layer.bias)
        return nn.Linear.forward(layer, x) if out is None else out


def fast_linears(module: nn.Module, pack: bool = False, layers: bool = False):
    """OneDNNLinears while `module` runs (LayerLinears with `layers`: where every large matmul is
    a plain nn.Linear layer's, as in a decode step), where it holds a weight the mode takes and
    torch has oneDNN; nothing otherwise: the mode sends every torch call through Python, which
    made the tiny model's decode 1.5x slower where it changed no matmul."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return contextlib.nullcontext()
    if layers:
        swap = LayerLinears(module, pack)
        return swap if swap.layers else contextlib.nullcontext()
    mode = OneDNNLinears(pack)
    return mode if any(_large(p, mode.bf16) for p in module.parameters()) else contextlib.nullcontext()
