"""The attention tandem runs a CPU model on: transformers' sdpa, except for two shapes where it
takes a route that is faster on a CPU and gives the same attention.

- One query token of a grouped-query model with no mask (a decode step where no row is padded:
  a group's completions of one prompt). There transformers calls sdpa with `enable_gqa`, which on
  a CPU took 2x as long in fp32 and 5-13x in bf16 as the same attention with each key/value
  head's query heads folded into its query rows, the route transformers itself takes where a mask
  is given. At the Qwen2.5-0.5B shape in bf16, 8 rows: 0.87 ms a layer with up to 256 tokens
  cached, 2.45 ms at 256-512, against 0.16 and 0.31 ms folded; a decode step of 8 x 512 tokens
  took 113 ms, now 78.
- Many query tokens after a prefix of cached ones (the trainer's completions, run against their
  prompt's cache: tandem/trainer/batch.py). transformers gives sdpa an explicit mask there, so
  its CPU kernel computes every query against every key, the half that the mask hides included.
  The same attention is causal from the top left in a query tensor as long as the keys, with the
  prefix's queries as zeros (which nothing reads), so sdpa runs with `is_causal` and skips that
  half. A row's left padding (prompts of several lengths) is rotated to its end first, where no
  query of the row's tokens reaches it. Alone (bench/attention.py: 8 rows x 1,024 queries after
  32 cached tokens, 14 heads of 64 over 2 key/value heads, bf16), a layer's forward and backward
  took 480 ms against 654 with the mask; 1.16x as fast at 512 queries and slower below (the
  prefix's zero queries and the copies), so it is taken from CAUSAL_MIN_QUERIES on. The outputs were bitwise the same as with
  the mask; the keys' and values' gradients round otherwise (the kernel's blocks of queries start
  elsewhere).

- Short sequences in bf16 or fp16 (bf16 weights, or fp32 ones under autocast): a training
  micro-batch of short completions, a prompt's prefill. The CPU flash kernel's low-precision
  backward is slow at these sizes: on an AMD EPYC with AVX512-BF16 and no AMX, a micro-batch of
  the toy shape of bench/vs_trl.py (54 rows of 63 completion tokens after 23 prompt tokens, 8
  heads of 32 over 4 key/value heads, fp32 under bf16 autocast) took 48 ms a layer forward and
  backward on 2 cores, 79 on one, against 17 and 26 with the attention written out (a matmul, a
  softmax in fp32, a matmul, as transformers' eager attention; each key/value head's query heads
  folded into its rows). The written-out form keeps every score for the backward and gets slower
  than the kernel as they grow (2x slower at 64 rows of 200 tokens), so it is taken up to
  MATH_MAX_SCORES scores a call. It is taken without gradients too, where it is up to 1.4x slower
  than the kernel, so that a forward without gradients (the old policy's log-probs) computes what
  the training forward does. In fp32 the kernel is as fast or faster. The same attention up to
  bf16's rounding (the probabilities are rounded to bf16 before they weigh the values).

A query at a padded position (whose own key the mask hides) gets another value than sdpa would
give it: callers never read those (transformers' own convention).
"""

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

TANDEM_SDPA = "tandem_sdpa"
CAUSAL_MIN_QUERIES = 512
MATH_MAX_SCORES = 2**22  # batch x heads x queries x keys: 4M scores kept for the backward, 24 MB a layer


def tandem_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' sdpa attention (query (B, H, L, D), key and value (B, KVH, S, D) -> (B, L, H,
    D)), by the routes of the module docstring where they apply."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = not dropout and all(kwargs.get(k) is None for k in ("position_bias", "softcap", "cache"))
    length, keys = query.shape[2], key.shape[2]
    if plain and length == 1 and attention_mask is None and groups > 1:
        return _folded_one_query(query, key, value, scaling, groups), None
    if plain and CAUSAL_MIN_QUERIES <= length < keys and _causal_after_prefix(attention_mask, length, keys):
        return _causal_from_top_left(query, key, value, attention_mask, scaling, groups), None
    if plain and length > 1 and _written_out_pays(module, query, keys, attention_mask, kwargs.get("is_causal")):
        return _written_out(query, key, value, attention_mask, scaling, groups), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _folded_one_query(query, key, value, scaling, groups):
    b, heads, _, dim = query.shape  # (B, H, 1, D)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, heads // groups, groups, dim), key, value, scale=scaling)  # (B, KVH, H/KVH, D)
    return out.reshape(b, heads, 1, value.shape[-1]).transpose(1, 2).contiguous()  # (B, 1, H, D)


def _causal_after_prefix(mask, length: int, keys: int) -> bool:
    """Whether `mask` (B, 1, L, S) lets each query i see keys up to S - L + i, except each row's
    padded keys: one run of them at its start (within the prefix) and one at its end."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2:] != (length, keys):
        return False
    valid = mask[:, 0, -1]  # (B, S): the last query sees every key but the padded ones
    pads = valid.int().argmax(-1)  # (B,)
    one_run = (valid[:, 1:] & ~valid[:, :-1]).sum(-1) + valid[:, 0] == 1  # (B,): a row's keys start once, end once
    causal = torch.arange(keys, device=mask.device) <= torch.arange(keys - length, keys, device=mask.device)[:, None]  # (L, S)
    return bool(one_run.all()) and int(pads.max()) <= keys - length and torch.equal(mask, causal & valid[:, None, None, :])


def _causal_from_top_left(query, key, value, mask, scaling, groups):
    b, heads, length, dim = query.shape
    keys = key.shape[2]
    pads = mask[:, 0, -1].int().argmax(-1)  # (B,) each row's left-padded keys
    query = torch.cat([query.new_zeros(b, heads, keys - length, dim), query], dim=2)  # (B, H, S, D): the prefix's queries are zeros
    rotate = bool(pads.any())
    if rotate:  # position j of row r holds what was at (j + pads[r]) mod S: its padded keys at the end
        index = (torch.arange(keys, device=query.device) + pads[:, None]) % keys  # (B, S)
        query, key, value = (t.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])) for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=groups > 1)  # (B, H, S, D)
    if rotate:
        back = (torch.arange(keys, device=out.device) - pads[:, None]) % keys  # (B, S)
        out = out.gather(2, back[:, None, :, None].expand(-1, heads, -1, out.shape[3]))
    return out[:, :, keys - length :].transpose(1, 2).contiguous()  # (B, L, H, D)


def _written_out_pays(module, query, keys: int, mask, is_causal: bool | None) -> bool:
    """Whether the attention written out is the faster route (the module docstring): short, on a
    CPU, computed in bf16 or fp16 (the query's dtype, or autocast's, which sdpa takes), with a
    boolean mask or none where sdpa would be causal (its is_causal, else the module's)."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    if query.device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or query.shape[0] * query.shape[1] * query.shape[2] * keys > MATH_MAX_SCORES:
        return False
    if mask is not None:
        return mask.dtype == torch.bool
    return is_causal if is_causal is not None else getattr(module, "is_causal", True)


def _written_out(query, key, value, mask, scaling, groups):
    """softmax(q k^T * scaling, masked) v, the softmax in fp32; `mask` (B, 1, L, S) says what each
    query sees (None: causal from the top left, as sdpa's is_causal)."""
    b, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if scaling is None:
        scaling = dim**-0.5
    if mask is None:
        mask = torch.ones(length, keys, dtype=torch.bool, device=query.device).tril()[None, None]
    scores = torch.matmul(query.reshape(b, kv_heads, groups * length, dim), key.transpose(2, 3)) * scaling  # (B, KVH, G*L, S)
    # A fully masked row (a padded query) gets the same score everywhere, not -inf: no NaN to spread.
    scores = scores.view(b, kv_heads, groups, length, keys).masked_fill(~mask[:, :, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype).view(b, kv_heads, groups * length, keys)
    return torch.matmul(probs, value).view(b, heads, length, value.shape[-1]).transpose(1, 2).contiguous()  # (B, L, H, D)


def use_tandem_attention(model: torch.nn.Module) -> bool:
    """Runs `model` on tandem_sdpa from now on where it runs on transformers' sdpa on a CPU;
    whether it does."""
    config = getattr(model, "config", None)
    if config is None or config._attn_implementation not in ("sdpa", TANDEM_SDPA) or next(model.parameters()).device.type != "cpu":
        return False
    config._attn_implementation = TANDEM_SDPA
    return True


AttentionInterface.register(TANDEM_SDPA, tandem_sdpa)
AttentionMaskInterface.register(TANDEM_SDPA, sdpa_mask)
