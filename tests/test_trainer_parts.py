"""Pieces of the trainer that the end-to-end runs cannot isolate."""

import os
import signal
import subprocess
import sys
import textwrap

import torch
from transformers import AutoModelForCausalLM

from tandem.rollout.types import Rollout
from tandem.trainer.checkpoint import latest_checkpoint, save_checkpoint
from tandem.trainer.loop import collate


def test_collate_aligns_completions_and_masks_truncated_ones():
    a = Rollout(0, 0, [7, 8, 9], [4, 2], [-1.0, -1.0], "stop", 0)
    b = Rollout(1, 1, [5], [3, 3, 3], [-1.0] * 3, "length", 0)
    mb = collate([a, b], pad_id=0, device="cpu", mask_truncated=True)
    assert mb.input_ids.tolist() == [[7, 8, 9, 4, 2, 0], [0, 0, 5, 3, 3, 3]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert mb.completion_mask.tolist() == [[1, 1, 0], [0, 0, 0]]  # b hit the length limit
    assert collate([a, b], 0, "cpu", mask_truncated=False).completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]


class _FailingTokenizer:
    def save_pretrained(self, path):
        raise OSError("disk full")


def test_a_failed_save_leaves_latest_on_the_previous_checkpoint(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    save_checkpoint(tmp_path, 1, model, tok, {"seed": 1}, {"global_step": 1})
    try:
        save_checkpoint(tmp_path, 2, model, _FailingTokenizer(), {"seed": 1}, {"global_step": 2})
    except OSError:
        pass
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    assert not (tmp_path / "checkpoint-2").exists()


def test_killing_a_process_mid_save_never_breaks_latest(tiny_model, tmp_path):
    """SIGKILL a process that saves checkpoints in a loop; `latest` must always load."""
    script = textwrap.dedent(
        f"""
        import sys
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from tandem.trainer.checkpoint import save_checkpoint
        model = AutoModelForCausalLM.from_pretrained({str(tiny_model)!r})
        tok = AutoTokenizer.from_pretrained({str(tiny_model)!r})
        for step in range(1, 1000):
            save_checkpoint({str(tmp_path)!r}, step, model, tok, {{}}, {{"global_step": step}})
            print(step, flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    for _ in range(3):  # let a few saves complete, then kill during the next one
        proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    latest = latest_checkpoint(tmp_path)
    assert latest is not None
    AutoModelForCausalLM.from_pretrained(latest)
    assert int(latest.name.split("-")[1]) >= 3
