"""Large fp32 linear layers through oneDNN's matmul on a CPU, where F.linear calls the BLAS one
(MKL). On an AMD EPYC with AVX-512 (docs/benchmarks.md) MKL ran the few-row matmuls of a
decode step far below the memory bandwidth: the 151,936-wide output layer of the Qwen2.5-0.5B
shape took 105 ms for 8 rows, oneDNN 34 ms, and 22 ms with its weight packed (reordered) for
it once. The results equal the BLAS ones to float rounding. Without gradients only: the op has
no backward, so this covers generation and the output layer's chunks (tandem/trainer/head.py).
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

# Weights of at least this many elements go through oneDNN. Under it the BLAS matmul is as fast
# or faster (a 512x512 weight: 78 against 71 us for 8 rows, 22 against 36 us at 256x256), and
# the test models (at most 256x1024) keep the numerics their recordings hold.
ONEDNN_MIN_WEIGHT = 2**19


class OneDNNLinears(TorchFunctionMode):
    """While active: F.linear on large fp32 CPU weights, without gradients or autocast, through oneDNN.
    `pack`: reorder each weight once for oneDNN (a copy of it, held while the mode is active),
    which pays where many calls reuse it: a decode loop."""

    def __init__(self, pack: bool = False):
        super().__init__()
        self.pack = pack
        # weight -> (its storage and version when packed, the packed copy); an entry goes with its
        # weight, and a weight whose storage or values changed is packed again in its place.
        self.packed = WeakIdKeyDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Under autocast F.linear computes in bf16, which this would bypass.
        if func is torch.nn.functional.linear and len(args) >= 2 and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu"):
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if type(x) is torch.Tensor and type(w) in (torch.Tensor, torch.nn.Parameter) and x.dtype == torch.float32 and x.device.type == "cpu" and _large(w):
                if self.pack:
                    state, packed = self.packed.get(w, (None, None))
                    if state != (w.data_ptr(), w._version):
                        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                        self.packed[w] = ((w.data_ptr(), w._version), packed)
                    w = packed
                return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        return func(*args, **kwargs)


def _large(w: torch.Tensor) -> bool:
    """A weight this takes: fp32, on a CPU, at least ONEDNN_MIN_WEIGHT elements."""
    return w.dtype == torch.float32 and w.device.type == "cpu" and w.numel() >= ONEDNN_MIN_WEIGHT


def fast_linears(module: torch.nn.Module, pack: bool = False):
    """OneDNNLinears while `module` runs, where it holds a weight the mode takes and torch has
    oneDNN; nothing otherwise: the mode sends every torch call through Python, which made the
    tiny model's decode 1.5x slower where it changed no matmul."""
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    return OneDNNLinears(pack) if onednn and any(_large(p) for p in module.parameters()) else contextlib.nullcontext()
