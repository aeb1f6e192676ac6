"""The output layer, a chunk of tokens at a time: the log-prob of each chosen token and the
entropy of its distribution, without holding the logits of every token.

At a vocabulary of 151,936 the logits of 2,048 tokens are 1.2 GB in fp32, and a log-softmax,
its gradient and the entropy's softmax each make another copy. Here the forward keeps only the
hidden states (tokens x hidden size) and computes the logits of HEAD_CHUNK_BYTES' worth of
tokens at a time; the backward computes each chunk's logits again and backpropagates through
them, one chunk at a time. The results are today's computation's up to float rounding
(tests/test_trainer_parts.py checks log-probs and every parameter's gradient within 1e-6).
"""

from contextlib import contextmanager

import torch
from torch import nn

from tandem.algo import scaled, selective_log_softmax_into
from tandem.linears import fast_linears, plain_linear

# The fp32 logits of one chunk: 128 MiB, 220 tokens of a 151,936-token vocabulary (a few such
# buffers live at once: logits, softmax, their gradient). Its four matmuls (logits, their
# recomputation, the weight's and the hidden states' gradients) at the Qwen2.5-0.5B shape took
# 6.2 ms a token in chunks of 220 tokens, 6.9 in chunks of 110 and 6.6 in chunks of 440 (2 cores
# with AVX-512, one chunk's matmuls timed alone).
HEAD_CHUNK_BYTES = 128 << 20
# Under bf16 autocast a chunk's weight gradient is a bf16 product added into the fp32 total, made
# this many vocabulary rows at a time: whole it would be half the weight's size (272 MB at the
# Qwen2.5-0.5B shape), a slice 29 MB, in the same time and bitwise the same.
GRAD_SLICE_ROWS = 16384


def chunk_tokens(vocab: int) -> int:
    return max(1, HEAD_CHUNK_BYTES // (4 * vocab))


class _Workspace:
    """The (chunk, vocabulary)-sized tensors of one forward or backward, made once and reused by
    every chunk. The CLI hands each freed block of 4 MiB or more back to the OS (tandem/cli.py:
    _return_freed_memory), so a tensor made per chunk came back as fresh pages, faulted in and
    zeroed by the kernel: at the Qwen2.5-0.5B shape under bf16 autocast, 1,024 tokens' forward
    and backward took 7.0-7.2 s that way and 4.2-5.3 s with the workspace. The values are those
    of the same ops with tensors of their own."""

    def __init__(self, device: torch.device):
        self.device, self.held = device, {}

    def get(self, name: str, rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `rows` rows (contiguous) of the named buffer, made at the shape of its first
        request: the first chunk is the largest."""
        buffer = self.held.get(name)
        if buffer is None:
            buffer = self.held[name] = torch.empty(rows, columns, dtype=dtype, device=self.device)
        assert rows <= len(buffer) and buffer.shape[1] == columns and buffer.dtype == dtype, (name, rows, columns, dtype, buffer.shape)
        return buffer[:rows]


def _scores(logits: torch.Tensor, temperature: float, ws: _Workspace) -> torch.Tensor:
    """scaled(logits.float(), temperature) in the workspace."""
    scores = ws.get("scores", *logits.shape, torch.float32).copy_(logits)
    return scores if temperature == 1.0 else scores.div_(temperature)


def _log_softmax(scores: torch.Tensor, ws: _Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(scores) and its exp, the probabilities, in the workspace."""
    logp = torch._log_softmax(scores, -1, False, out=ws.get("logp", *scores.shape, torch.float32))
    return logp, torch.exp(logp, out=ws.get("p", *scores.shape, torch.float32))


def _computed(head: nn.Linear, autocast: bool, dtype: torch.dtype) -> torch.Tensor:
    """A plain Linear head's weight as its matmuls take it: under autocast a copy in its dtype,
    made once for the whole forward or backward."""
    return head.weight.to(dtype) if autocast else head.weight


def _linear(head: nn.Linear, weight: torch.Tensor, x: torch.Tensor, ws: _Workspace) -> torch.Tensor:
    """A plain Linear head's logits of `x`, `weight` its weight in the dtype computed in (under
    bf16 autocast a bf16 copy): in bf16 in the workspace, through the matmul F.linear calls (in
    fp32 fast_linears may take F.linear to oneDNN)."""
    x, bias = x.to(weight.dtype), None if head.bias is None else head.bias.to(weight.dtype)
    if weight.dtype != torch.bfloat16:
        return torch.nn.functional.linear(x, weight, bias)
    logits = ws.get("logits", len(x), len(weight), weight.dtype)
    return torch.mm(x, weight.T, out=logits) if bias is None else torch.addmm(bias, x, weight.T, out=logits)


def _chunk(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool, ws: _Workspace | None = None):
    """Log-probs (t,) of `tokens` under softmax(logits / temperature), and the entropy (t,) of
    that distribution or None; the logits in fp32, as token_logprobs takes them. With a
    workspace (no gradient through it) the same values in its tensors: torch.logsumexp's ops
    written out, as it makes a tensor of its own."""
    if ws is None:
        scores = scaled(logits.float(), temperature)  # (t, V)
        chosen = scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scores, dim=-1)  # (t,), as token_logprobs
        if not with_entropy:
            return chosen, None
        logp = torch.log_softmax(scores, dim=-1)  # (t, V)
        return chosen, -(logp.exp() * logp).sum(-1)
    scores = _scores(logits, temperature, ws)  # (t, V)
    chosen = selective_log_softmax_into(scores, tokens, ws.get("p", *scores.shape, torch.float32))  # (t,)
    if not with_entropy:
        return chosen, None
    logp, p = _log_softmax(scores, ws)
    return chosen, -p.mul_(logp).sum(-1)


class _ChunkedHead(torch.autograd.Function):
    """Inputs: hidden (T, H) and the head's trainable parameters (for their gradients); the head
    module itself, so an fp32 head or an adapter on it computes as in a plain call. Autocast as it was at the forward is restored for the backward's recompute."""

    @staticmethod
    def forward(ctx, hidden, tokens, head, temperature, with_entropy, entropy_grad, *params):
        ctx.head, ctx.temperature, ctx.entropy_grad = head, temperature, with_entropy and entropy_grad
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        # A head that is not a plain Linear (a LoRA adapter on it) runs again in the backward: the
        # RNG as it was here makes its dropout draw the same masks there (torch's checkpoint does
        # the same), or the gradient would be of other masks than the forward's values.
        plain = plain_linear(head)
        ctx.rng = None if plain else _rng_state(hidden.device)
        ctx.save_for_backward(hidden, tokens, *params)
        step = chunk_tokens(_vocab(head))
        logps, entropies = [], []
        ws = _Workspace(hidden.device)
        weight = _computed(head, *ctx.autocast[1:]) if plain else None
        with fast_linears(head):
            for s in range(0, len(hidden), step):
                h = hidden[s : s + step]
                lp, ent = _chunk(_linear(head, weight, h, ws) if plain else head(h), tokens[s : s + step], temperature, with_entropy, ws)
                logps.append(lp)
                entropies.append(ent)
        logp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)  # (T,)
        entropy = torch.cat(entropies) if with_entropy and entropies else torch.zeros_like(logp)  # (T,)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, tokens, *params = ctx.saved_tensors
        device, enabled, dtype = ctx.autocast
        # A metric's entropy has no gradient, though autograd hands backward zeros for it: the
        # flag, not grad_entropy, says whether the entropy's gradient is computed.
        entropy_grad = ctx.entropy_grad and grad_entropy is not None
        plain = plain_linear(ctx.head)
        grad_hidden = torch.zeros_like(hidden)
        # Where write_weight_grad asked, the weight's gradient (params[0]) is added into weight.grad itself.
        weight = ctx.head.weight
        computed = _computed(ctx.head, enabled, dtype) if plain else weight
        direct = plain and getattr(ctx.head, "weight_grad_in_place", False) and weight.requires_grad
        if direct:
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            grad_params = [weight.grad, *(torch.zeros_like(p) for p in params[1:])]
        else:
            grad_params = [torch.zeros_like(p) for p in params]
        step = chunk_tokens(_vocab(ctx.head))
        ws = _Workspace(hidden.device)
        with _restored_rng(hidden.device, ctx.rng):
            for s in range(0, len(hidden), step):
                h, tok, g_lp = hidden[s : s + step], tokens[s : s + step], grad_logp[s : s + step]
                g_ent = grad_entropy[s : s + step] if entropy_grad else None
                if plain:
                    with fast_linears(ctx.head):
                        grad_hidden[s : s + step] = _linear_backward(ctx.head, computed, h, tok, g_lp, g_ent, ctx.temperature, grad_params, ws)
                    continue
                with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                    h = h.detach().requires_grad_()
                    lp, ent = _chunk(ctx.head(h), tok, ctx.temperature, entropy_grad)
                    objective = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy_grad else 0.0)
                    grads = torch.autograd.grad(objective, [h, *params], allow_unused=True)
                grad_hidden[s : s + step] = grads[0]
                for total, g in zip(grad_params, grads[1:]):
                    if g is not None:
                        total += g
        if direct:
            grad_params[0] = None  # already in weight.grad
        return (grad_hidden, None, None, None, None, None, *grad_params)


def _rng_state(device: torch.device) -> tuple:
    """The CPU generator's state, and the device's where the tensors are on a GPU."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextmanager
def _restored_rng(device: torch.device, state: tuple | None):
    """Inside: the RNG as `state` left it (nothing changed for None); after: as it was before."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def write_weight_grad(head: nn.Linear) -> None:
    """From now on, where the backward is the plain Linear's, add the weight's gradient straight
    into weight.grad and hand autograd none for it. Only for a weight that something else in every
    forward also uses (embedding.py's tied table): its share then reaches the weight's gradient
    accumulator alone, which adds it into weight.grad in place. Hooks on the weight see that share
    only, and DDP's reducer has not been tried with it: one process, unsharded."""
    head.weight_grad_in_place = True


def _linear_backward(head: nn.Linear, weight, h, tokens, g_lp, g_ent, temperature: float, grad_params: list[torch.Tensor], ws: _Workspace) -> torch.Tensor:
    """One chunk's backward through a plain Linear head, written out: the head's weight gradient
    is added into its total in place (autograd would make a whole weight-sized tensor per chunk,
    545 MB at a vocabulary of 151,936). `weight`: the head's weight in the dtype the forward
    computed in (under bf16 autocast a bf16 copy; inputs, logits' gradient and products then in
    bf16, as autograd's are). Returns the chunk's hidden-state gradient."""
    x = h.to(weight.dtype)
    logp, p = _log_softmax(_scores(_linear(head, weight, x, ws), temperature, ws), ws)  # (t, V)
    # d/dz of log p[token]: onehot - p (in p's place where the entropy needs no p)
    g = p * -g_lp.unsqueeze(1) if g_ent is not None else p.mul_(-g_lp.unsqueeze(1))
    g.scatter_add_(1, tokens.unsqueeze(1), g_lp.unsqueeze(1))
    if g_ent is not None:  # d/dz of the entropy H: -p (log p + H)
        entropy = -(p * logp).sum(-1, keepdim=True)
        g -= p * (logp + entropy) * g_ent.unsqueeze(1)
    if temperature != 1.0:
        g.div_(temperature)
    if g.dtype != weight.dtype:  # (t, V): the gradient of the logits
        g = ws.get("g", *g.shape, weight.dtype).copy_(g)
    trainable = [p for p in (head.weight, head.bias) if p is not None and p.requires_grad]
    for total, param in zip(grad_params, trainable):
        if param is not head.weight:
            total += g.sum(0)
        elif total.dtype == g.dtype:
            total.addmm_(g.T, x)
        else:  # a bf16 product added into fp32, as autograd adds each chunk's: a slice of rows at a time
            for r in range(0, len(total), GRAD_SLICE_ROWS):
                rows = g[:, r : r + GRAD_SLICE_ROWS]
                product = torch.mm(rows.T, x, out=ws.get("product", rows.shape[1], x.shape[1], g.dtype))
                # in fp32 first: an add of mixed dtypes makes an fp32 copy of its own
                total[r : r + GRAD_SLICE_ROWS] += ws.get("product32", *product.shape, total.dtype).copy_(product)
    return g @ weight


def _vocab(head: nn.Module) -> int:
    return head.weight.shape[0]


def head_logprobs(head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool = False, entropy_grad: bool = False):
    """Log-probs (T,) of `tokens` (T,) under softmax(head(hidden) / temperature), hidden (T, H),
    and the entropy (T,) of each distribution (zeros unless `with_entropy`; with gradient only if
    `entropy_grad`)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    params = [p for p in head.parameters() if p.requires_grad]
    return _ChunkedHead.apply(hidden, tokens, head, temperature, with_entropy, entropy_grad, *params)
