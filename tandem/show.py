"""`tandem show RUN_DIR`: a run's logged completions (completions.jsonl) as a terminal table."""

import json
import re
import shutil
from pathlib import Path


def read_completions(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "completions.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no completions.jsonl: give the output_dir of a `tandem train` run")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cell(text: str, width: int, keep_end: bool = False) -> str:
    """One line of at most `width` characters: control characters escaped, the rest cut with '…'
    (its start cut instead when keep_end: a prompt's question comes last, after the template)."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if len(text) <= width:
        return text
    return "…" + text[len(text) - width + 1 :] if keep_end else text[: width - 1] + "…"


def _versions(line: dict) -> str:
    """A completion's policy version; of one carried across updates (partial rollouts), each
    version with its tokens: 3:256,4:17."""
    runs = line.get("token_versions")
    return ",".join(f"{v}:{n}" for v, n in runs) if runs and len(runs) > 1 else str(line["policy_version"])


def table(lines: list[dict], step: int | None = None, width: int | None = None) -> str:
    """The completions of `step` (default: the last step logged), one row each: policy version
    (each token's, of a partial rollout), advantage, each reward, finish reason, prompt and
    completion (cut to fit `width`)."""
    if not lines:
        return "no completions logged yet"
    steps = sorted({line["step"] for line in lines})
    step = steps[-1] if step is None else step
    rows = [line for line in lines if line["step"] == step]
    if not rows:
        raise ValueError(f"no completions logged at step {step}; logged steps: {steps[:5]}{' ...' if len(steps) > 5 else ''} {steps[-1]}")
    width = width or shutil.get_terminal_size((160, 24)).columns
    rewards = [k for k in rows[0] if k.startswith("rewards/")]
    head = ["version", "advantage", "reward", *[k.removeprefix("rewards/") for k in rewards], "finish"]
    cells = [[_versions(r), f"{r['advantage']:+.3f}", _num(r["reward"]), *[_num(r[k]) for k in rewards], r["finish_reason"]] for r in rows]
    sizes = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    fixed = sum(sizes) + 2 * len(sizes)
    text_width = max(10, width - fixed - 2)
    prompt_width, completion_width = text_width // 3, text_width - text_width // 3
    out = [f"step {step}, round {rows[0]['round']}: {len(rows)} completions (of steps {steps[0]}..{steps[-1]})"]
    out.append("  ".join(h.rjust(s) for h, s in zip(head, sizes)) + "  " + "prompt".ljust(prompt_width) + "  completion")
    for r, c in zip(rows, cells):
        out.append("  ".join(v.rjust(s) for v, s in zip(c, sizes)) + "  " + _cell(_plain(r["prompt"]), prompt_width, keep_end=True).ljust(prompt_width) + "  " + _cell(r["completion"], completion_width))
        out += _turn_lines(r.get("turns"), width)
    return "\n".join(out)


def _turn_lines(turns: dict | None, width: int) -> list[str]:
    """A multi-turn completion's messages, one line each under its row: the model's turns with
    their policy version, tool calls and results (an error result marked), observations."""
    if not turns:
        return []
    lines, versions = [], iter(turns["versions"])
    for m in turns["messages"]:
        if m["role"] == "assistant":
            calls = ", ".join(f"{c['function']['name']}({json.dumps(c['function']['arguments'])})" for c in m.get("tool_calls", []))
            text = f"model (v{next(versions, '?')})" + (f" calls {calls}" if calls else "") + f": {m['content']}"
        elif m["role"] == "tool":
            text = f"{m.get('name', 'tool')} {'failed' if m['content'].startswith('error: ') else 'returned'}: {m['content']}"
        else:
            text = f"{m['role']}: {m['content']}"
        lines.append("    " + _cell(text, max(20, width - 4)))
    return lines


def _plain(prompt: str) -> str:
    """A templated prompt with its special tokens (<|...|>) left out and whitespace collapsed."""
    return " ".join(re.sub(r"<\|[^|<>]*\|>", " ", prompt).split())


def _num(v) -> str:
    return "none" if v is None else f"{v:.3f}"
