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

    def _dtype(self, x: torch.Tensor, w: torch.Tensor, elements: int | None = None) -> torch.dtype | None:
        """The dtype this computes x @ w.T in (what F.linear would), or None where it leaves the
        call to F.linear: a small weight (of `elements`, where w is one of several stacked), one
        off the CPU, a dtype it does not take."""
        if type(x) is not torch.Tensor or type(w) not in (torch.Tensor, torch.nn.Parameter) or x.device.type != "cpu" or not _large(w, self.bf16, elements):
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


def _large(w: torch.Tensor, bf16: bool, elements: int | None = None) -> bool:
    """A weight the mode may take: fp32 (or bf16 where it takes bf16 matmuls), on a CPU, at
    least ONEDNN_MIN_WEIGHT elements (its own, or `elements`)."""
    dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    return w.dtype in dtypes and w.device.type == "cpu" and (w.numel() if elements is None else elements) >= ONEDNN_MIN_WEIGHT


# Projections of a Llama-family decoder layer (Qwen2, Qwen3, Llama, Mistral) that take the same
# input. A packing LayerLinears runs each set as one matmul over their weights stacked: at the
# Qwen2.5-0.5B shape in bf16, 8 rows, q, k, v, gate and up of 24 layers took 21.1 ms a step
# stacked against 24.9 apart. Each output column's sum is the one it has alone (bitwise: from 1
# to 4,096 rows at that shape, in bf16 and fp32), and in bf16 a small weight's F.linear is
# oneDNN's matmul too, so the tokens stay. In fp32 a small weight's F.linear is MKL's, which
# rounds otherwise: there a set is stacked only where each weight is large on its own.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Siblings:
    """Layers that take the same input, run as one matmul: their weights stacked and packed (kept
    while the weights stay as they were), and the outputs a call made for the layers not yet
    called, with the input they are for."""

    def __init__(self, layers: list[nn.Linear], bf16: bool):
        self.layers = layers
        self.widths = [layer.out_features for layer in layers]
        self.elements = sum(layer.weight.numel() for layer in layers)
        self.each_large = all(_large(layer.weight, bf16) for layer in layers)
        self.packed = (None, None, None)  # (the weights' state, the packed stack, the biases stacked)
        self.ahead: dict[nn.Linear, tuple[torch.Tensor, torch.Tensor]] = {}


def _siblings(module: nn.Module, names: tuple[str, ...], bf16: bool) -> _Siblings | None:
    """`module`'s layers of those names as one set, where they can be stacked: plain nn.Linear
    layers of one input width and weight dtype, all with a bias or none, large together."""
    layers = [getattr(module, name, None) for name in names]
    if not all(plain_linear(layer) for layer in layers):
        return None
    first = layers[0]
    if not all(lin.in_features == first.in_features and lin.weight.dtype == first.weight.dtype and (lin.bias is None) == (first.bias is None) for lin in layers):
        return None
    s = _Siblings(layers, bf16)
    return s if _large(first.weight, bf16, s.elements) else None


class LayerLinears:
    """While active (a context, entered again and again): the same matmuls as OneDNNLinears for
    each plain nn.Linear layer of a module, through a forward swapped in on the layer. Every
    other op runs as it is: a torch function mode sees each op of the model, and its Python cost
    was 5-13% of a decode step at the Qwen2.5-0.5B shape (8 rows, bf16 and fp32; the same tokens
    and log-probs either way). With `pack`, the SIBLINGS of a layer run as one matmul. Calls with
    gradients run the layer's own forward."""

    def __init__(self, module: nn.Module, pack: bool):
        self.mode = OneDNNLinears(pack)
        sets = [_siblings(m, names, self.mode.bf16) for m in module.modules() for names in SIBLINGS] if pack else []
        self.siblings = [s for s in sets if s is not None]
        stacked = {layer for s in self.siblings for layer in s.layers}
        self.layers = [m for m in module.modules() if plain_linear(m) and _large(m.weight, self.mode.bf16) and m not in stacked]

    def __enter__(self):
        for layer in self.layers:
            layer.forward = functools.partial(self._forward, layer)
        for s in self.siblings:
            for layer in s.layers:
                layer.forward = functools.partial(self._sibling_forward, s, layer)
        return self

    def __exit__(self, *exc) -> None:
        for layer in [*self.layers, *(layer for s in self.siblings for layer in s.layers)]:
            vars(layer).pop("forward", None)
        for s in self.siblings:
            s.ahead.clear()

    def _forward(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.mode.linear(x, layer.weight, layer.bias)
        return nn.Linear.forward(layer, x) if out is None else out

    def _sibling_forward(self, s: _Siblings, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """`layer`'s output: made already by a sibling's call on this input, or made now for all."""
        ahead = s.ahead.pop(layer, None)
        if ahead is not None and ahead[0] is x:
            return ahead[1]
        outs = self._stacked(s, x)
        if outs is None:
            return self._forward(layer, x)
        for other, out in zip(s.layers, outs):
            if other is not layer:
                s.ahead[other] = (x, out)
        return outs[s.layers.index(layer)]

    def _stacked(self, s: _Siblings, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Each of s's layers applied to x, (..., its width) views of one matmul's output; None
        where they compute apart (gradients, a dtype the mode leaves to F.linear, fp32 with a
        small weight among them)."""
        weights = [layer.weight for layer in s.layers]
        dtype = None if torch.is_grad_enabled() else self.mode._dtype(x, weights[0], s.elements)
        if dtype is None or (dtype == torch.float32 and not s.each_large):
            return None
        biases = [layer.bias for layer in s.layers if layer.bias is not None]
        state = (tuple((t.data_ptr(), t._version) for t in weights + biases), dtype)
        if s.packed[0] != state:
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([w.to(dtype) for w in weights]), None)
            s.packed = (state, packed, torch.cat([b.to(dtype) for b in biases]) if biases else None)
        out = torch.ops.mkldnn._linear_pointwise(x.to(dtype), s.packed[1], s.packed[2], "none", [], "")
        return out.split(s.widths, dim=-1)


def fast_linears(module: nn.Module, pack: bool = False, layers: bool = False):
    """OneDNNLinears while `module` runs (LayerLinears with `layers`: where every large matmul is
    a plain nn.Linear layer's, as in a decode step), where it holds a weight the mode takes and
    torch has oneDNN; nothing otherwise: the mode sends every torch call through Python, which
    made the tiny model's decode 1.5x slower where it changed no matmul."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return contextlib.nullcontext()
    if layers:
        swap = LayerLinears(module, pack)
        return swap if swap.layers or swap.siblings else contextlib.nullcontext()
    mode = OneDNNLinears(pack)
    return mode if any(_large(p, mode.bf16) for p in module.parameters()) else contextlib.nullcontext()
