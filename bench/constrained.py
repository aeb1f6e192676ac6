"""What constrained decoding costs on tandem's engine, and the two grammar libraries side by side.

    python bench/constrained.py [--threads 2] [--repeats 3]

Shape: a byte-level BPE tokenizer of 151,643 tokens trained here on the Python sources of this
environment (a real vocabulary's size and kind: Qwen2.5's is 151,643 in a model vocabulary of
151,936), the `small` model's layers (3M parameters besides the output layer) with that
vocabulary, 8 rows of up to 64 tokens at temperature 1, a JSON schema of a string and an integer.

Prints: (1) for llguidance, and xgrammar where it is installed (`pip install xgrammar`), the
seconds to read the tokenizer, to compile a tool-call grammar of two tools, and the median
microseconds to fill one row's mask and to apply it, along an answer of 47 tokens; (2) the
engine's milliseconds per decode step of 8 rows, free and constrained, the same prompts and
seeds, and the difference per row and token.
"""

import argparse
import glob
import json
import statistics
import subprocess
import sys
import sysconfig
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tandem.engines.engine import TransformersEngine
from tandem.init_model import build_model
from tandem.rollout.grammar import CallLayout, answer_grammar
from tandem.rollout.types import SamplingParams

VOCAB = 151_936
TOOLS = [{"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}},
         {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}}]  # fmt: skip
ANSWER = '<tool_call>\n{"name": "search", "arguments": {"query": "the population of the largest city in the world, as of the latest census", "limit": 10}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}}, "required": ["title", "year"]}


def tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE of 151,643 tokens, trained on 60 MB of this environment's Python sources (about 16 s)."""
    text, size = [], 0
    for path in sorted(glob.glob(sysconfig.get_paths()["purelib"] + "/**/*.py", recursive=True)):
        try:
            text.append(open(path, encoding="utf-8").read())
        except (UnicodeDecodeError, OSError):
            continue
        size += len(text[-1])
        if size > 60e6:
            break
    core = Tokenizer(models.BPE())
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=151_643, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    core.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def llguidance_figures(tok, ids: list[int]) -> tuple[float, float, float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    info = [None]
    read = _timed(lambda: info.__setitem__(0, llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=[tok.eos_token_id])))
    grammar = answer_grammar(CallLayout(), TOOLS)
    matcher = [None]
    compile_s = _timed(lambda: matcher.__setitem__(0, llguidance.LLMatcher(info[0], grammar, log_level=1)))
    bits, logits, fills, applies = lt.allocate_token_bitmask(1, VOCAB), torch.randn(1, VOCAB), [], []
    for t in ids:
        fills.append(_timed(lambda: lt.fill_next_token_bitmask(matcher[0], bits, 0)))
        applies.append(_timed(lambda: lt.apply_token_bitmask_inplace(logits, bits)))
        assert matcher[0].consume_token(t), matcher[0].get_error()
    return read, compile_s, statistics.median(fills), statistics.median(applies)


def xgrammar_figures(tok, ids: list[int]) -> tuple[float, float, float, float] | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    compiler = [None]
    read = _timed(lambda: compiler.__setitem__(0, xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[tok.eos_token_id]))))

    def compile_():
        calls = [xgr.Grammar.from_json_schema(json.dumps({"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                                                          "required": ["name", "arguments"]})) for t in TOOLS]  # fmt: skip
        grammar = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), xgr.Grammar.union(*calls), xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
        matcher[0] = xgr.GrammarMatcher(compiler[0].compile_grammar(grammar))

    matcher = [None]
    compile_s = _timed(compile_)
    bits, logits, fills, applies = xgr.allocate_token_bitmask(1, VOCAB), torch.randn(1, VOCAB), [], []
    for t in ids:
        fills.append(_timed(lambda: matcher[0].fill_next_token_bitmask(bits, 0)))
        applies.append(_timed(lambda: xgr.apply_token_bitmask_inplace(logits, bits)))
        assert matcher[0].accept_token(t)
    return read, compile_s, statistics.median(fills), statistics.median(applies)


def engine_figures(tok, repeats: int) -> tuple[float, float, int, int]:
    """Median ms per decode step of 8 rows, free and constrained, and the tokens each made."""
    model = build_model("small", VOCAB, 0, tok.eos_token_id, tok.pad_token_id)
    engine = TransformersEngine(model, [tok.eos_token_id], tok.pad_token_id, tokenizer=tok)
    prompts = [tok(f"Name a book and its year ({i}):", add_special_tokens=False)["input_ids"] for i in range(8)]
    seeds = list(range(8))
    grammar = answer_grammar(CallLayout(), answer=SCHEMA)
    out = {}
    for name, params in (("free", SamplingParams(max_tokens=64)), ("constrained", SamplingParams(max_tokens=64, grammar=grammar))):
        engine.generate(prompts, params, seeds)  # warm: packing, the grammar's compile, llguidance's tokenizer
        per_step = []
        for _ in range(repeats):
            start = time.perf_counter()
            outs = engine.generate(prompts, params, seeds)
            per_step.append((time.perf_counter() - start) / max(len(o.token_ids) for o in outs))
        out[name] = (statistics.median(per_step) * 1e3, sum(len(o.token_ids) for o in outs))
    return out["free"][0], out["constrained"][0], out["free"][1], out["constrained"][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    flags = " ".join(f for f in ("avx512f", "avx512_bf16", "amx_tile") if f in cpu) or "avx2 only"
    print(f"cpu: {model_name} ({flags}), {args.threads} threads")
    start = time.perf_counter()
    tok = tokenizer()
    ids = tok(ANSWER, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    print(f"tokenizer: {len(tok)} tokens, trained in {time.perf_counter() - start:.1f} s; the answer is {len(ids)} tokens")
    print(f"{'library':<12} {'read tokenizer s':>17} {'compile s':>10} {'fill us':>8} {'apply us':>9}")
    for name, figures in (("llguidance", llguidance_figures(tok, ids)), ("xgrammar", xgrammar_figures(tok, ids))):
        if figures is None:
            print(f"{name:<12} not installed (pip install {name})")
            continue
        read, compile_s, fill, apply = figures
        print(f"{name:<12} {read:>17.2f} {compile_s:>10.4f} {fill * 1e6:>8.1f} {apply * 1e6:>9.1f}")
    free, constrained, free_tokens, constrained_tokens = engine_figures(tok, args.repeats)
    print(f"engine, 8 rows: free {free:.2f} ms a decode step ({free_tokens} tokens), constrained {constrained:.2f} ms ({constrained_tokens} tokens): "
          f"{constrained / free:.2f}x, {(constrained - free) / 8 * 1e3:.0f} us a row's token")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
