"""`tandem init-model`: a small causal LM with a real tokenizer and chat template, made offline.

The tokenizer is character level (printable ASCII plus newline) with ChatML special tokens, so
any text round-trips and the chat template is a real Jinja template applied by transformers.
The model is a Qwen2 architecture at random init; `warmup_sft` can then teach it an output format
by plain supervised learning, which the demo uses before RL (see README).
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from tandem.data import encode_prompt

PAD, BOS_CHAT, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# ChatML, with tools in Qwen2.5's way: listed in a system turn, called as
# <tool_call>{json}</tool_call> in the assistant's text, answered in <tool_response> blocks of a
# user turn. The tool list is short (names and arguments, not the JSON schemas) to suit a small
# context; a function without parameters (OpenAI's API leaves them optional) is listed as name().
# Without tools it renders plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{% endif %}"
    "{{ 'Tools:' }}{% for tool in tools %}{{ ' ' + tool['function']['name'] + '(' + (((tool['function']['parameters'] or {})['properties'] or {}) | list | join(', ')) + ')' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '\\n<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' + (call['function']['arguments'] | tojson) + '}</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# name -> (hidden_size, intermediate_size, layers, heads, kv_heads)
SIZES = {
    "tiny": (64, 256, 2, 4, 2),  # ~0.1M parameters: tests
    "small": (256, 1024, 4, 8, 4),  # ~3M parameters: benchmarks, about a second a step on 2 cores
    "medium": (512, 2048, 8, 8, 4),  # ~25M parameters
}


def build_tokenizer(for_tools: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: one token per byte, as in GPT-2/Qwen2 tokenizers before any
    merge is learned. Being the same kind of tokenizer as Qwen2's, it loads the same way through
    AutoTokenizer (which picks Qwen2's tokenizer class from the model config).

    `for_tools` (the tool demo's): the numbers 10 to 999 are one token each, as GPT-4's tokenizer
    groups digits in threes, and the tool tags are tokens of their own, as in Qwen2.5's and Qwen3's
    vocabularies. Copying a number is then copying one token, which a model this small learns in
    a warm-up of minutes; copying digit by digit it did not. They are added tokens, not merges:
    transformers loads a Qwen2 model's tokenizer with Qwen2's pre-tokenizer, which splits digits."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_order = sorted(alphabet, key=lambda ch: _BYTE_OF[ch])
    vocab = {tok: i for i, tok in enumerate([PAD, BOS_CHAT, EOS] + byte_order)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        additional_special_tokens=[BOS_CHAT],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    if for_tools:
        # Plain added tokens (not special): decoded text keeps them, for the tool parser to read.
        tok.add_tokens([str(n) for n in range(10, 1000)] + TOOL_TAGS)
    return tok


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_OF = {ch: b for b, ch in _byte_to_unicode().items()}


def build_model(size: str, vocab_size: int, seed: int, eos_token_id: int, pad_token_id: int, head_dim: int = 0, reward_model: bool = False):
    """A random-init Qwen2 causal LM, or with `reward_model` a sequence classifier of one score."""
    if size not in SIZES:
        raise ValueError(f"unknown --size {size!r}; choose one of {', '.join(SIZES)}")
    hidden, inter, layers, heads, kv = SIZES[size]
    if head_dim:  # fewer, wider heads at the same width (vLLM's CPU attention needs head_dim >= 64)
        if hidden % head_dim:
            raise ValueError(f"--head-dim {head_dim} must divide the {size} model's hidden size {hidden}")
        heads = hidden // head_dim
        kv = max(1, heads // 2)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        num_labels=1,
    )
    torch.manual_seed(seed)
    return (Qwen2ForSequenceClassification if reward_model else Qwen2ForCausalLM)(config)


def warmup_sft(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    pairs: list[tuple[str, str]] | None = None,
    steps: int = 300,
    lr: float = 3e-3,
    batch_size: int = 32,
    seed: int = 0,
    rows: list[tuple[list[int], list[int]]] | None = None,
) -> list[float]:
    """Supervised steps on (user message, assistant reply) pairs, or on encoded `rows` of
    (token ids, labels with -100 where the loss does not look); the loss covers the replies only."""
    gen = torch.Generator().manual_seed(seed)
    rows = list(rows or [])
    for prompt, reply in pairs or []:
        p = encode_prompt(tokenizer, [{"role": "user", "content": prompt}], None, "error")
        r = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((list(p) + r, [-100] * len(p) + r))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        batch = [rows[i] for i in torch.randint(len(rows), (batch_size,), generator=gen).tolist()]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)  # (N, T), right-padded
        labels = torch.full((len(batch), width), -100)  # (N, T)
        for i, (x, y) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            labels[i, : len(y)] = torch.tensor(y)
        # No attention mask: the rows are right-padded, so under causal attention no real token
        # sees a pad. The output layer runs on the positions the loss looks at only (a third of
        # them in the tool demo's conversations): the same loss as HF's `labels=`, and the tool
        # demo's 1,200 steps in 76 s instead of 102 on one thread.
        hidden = model.model(input_ids=ids).last_hidden_state  # (N, T, H)
        targets = labels[:, 1:]  # (N, T-1): position t predicts token t+1
        looked_at = targets != -100
        logits = model.lm_head(hidden[:, :-1][looked_at])  # (L, V), L positions in the loss
        loss = torch.nn.functional.cross_entropy(logits.float(), targets[looked_at])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def init_model(out: str | Path, size: str = "tiny", seed: int = 0, head_dim: int = 0, reward_model: bool = False, for_tools: bool = False):
    tokenizer = build_tokenizer(for_tools)
    model = build_model(size, len(tokenizer), seed, tokenizer.eos_token_id, tokenizer.pad_token_id, head_dim, reward_model)
    if not reward_model:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    save(model, tokenizer, out)
    return model, tokenizer


def save(model, tokenizer, out: str | Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
