"""Golden runs: a fixed config in each mode (colocated, server sync, server async, LoRA, two
processes with DDP and with FSDP) must train as it did when tests/golden.json was recorded:
every loss, reward, KL and other statistic of metrics.jsonl, and the final weights' fingerprint.
They guard refactorings of the trainer, which must change no result.

Float results depend on the CPU's kernels (AVX-512 against AVX2 code paths round differently,
and four steps at lr 1e-2 carry that to 2e-5 in a gradient norm), so golden.json holds
recordings per CPU capability (torch.backends.cpu.get_cpu_capability(): AVX512, AVX2), and of a
capability one per kind of machine whose kernels round otherwise still (two AVX-512 machines, one
with AMX, differed by 1e-7 in a gradient norm at step 2): keys AVX512, AVX512/2, ... A run must
equal one of its capability's recordings exactly; a CPU of a capability not recorded is compared
with another's within 1e-5. Record again (`python tests/test_golden.py [KEY]` on each kind of
machine, KEY its recording's key, by default the capability; the others are kept) only for a
change meant to change results, and say so in its commit.

A change of results recorded on one kind of machine leaves the other kinds' recordings of the
modes it changed stale: they are deleted, and until each kind records them again a run of such a
mode, on a machine of a capability where some kind lacks it, is compared with every recording
of it within 1e-3 (kinds differed by up to 1.1e-4, in server_async's is_weight/max; a
refactoring that changes results by more still fails). Deleted so: server_sync and server_async
of AVX2 and AVX512/2, when a decode step with no padded row started folding its query heads
(tandem/engines/engine.py).
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import train
from tandem.demo import addition_rows, write_jsonl
from tandem.rollout.weights import fingerprint

GOLDEN = Path(__file__).with_name("golden.json")
DIGITS = "def digits(prompts, completions, **kw):\n    return [sum(ch.isdigit() for ch in c[-1]['content']) / 4 for c in completions]\n"
# Wall-clock figures and where the run ran: not results. engine/occupancy, added after the
# recordings, follows from the completion lengths the recorded metrics check.
NOT_RESULTS = ("timestamp", "time/", "completion_tokens_per_second", "memory/", "staleness/", "engine/", "weights/")

MODES = {
    # name: (processes, options); 4 steps each, on the tiny model
    "colocate": (1, ["--beta", "0.05", "--num_iterations", "2", "--steps_per_generation", "2", "--per_device_train_batch_size", "8"]),
    "server_sync": (1, ["--rollout_mode", "server"]),
    # with delta weight updates: recorded with whole ones, the same weights arrive
    "server_async": (1, ["--rollout_mode", "server", "--async_generate", "true", "--max_staleness", "1", "--delta_weight_updates", "true"]),
    "lora": (1, ["--use_peft", "true", "--lora_target_modules", "all-linear", "--lora_dropout", "0.0"]),
    "ddp": (2, ["--per_device_train_batch_size", "8"]),
    "fsdp": (2, ["--per_device_train_batch_size", "8", "--fsdp", "full_shard"]),
}


def _args(model, data, out, options, server_url):
    served = ["--rollout_server_urls", server_url] if "server" in options else []
    return [
        "--model_name_or_path", model, "--dataset_name", data, "--output_dir", out, "--reward_funcs", f"{data.parent / 'digits.py'}:digits",
        "--num_generations", "4", "--per_device_train_batch_size", "16", "--max_completion_length", "6", "--learning_rate", "1e-2",
        "--max_steps", "4", "--save_steps", "0", "--disable_tqdm", "true", "--seed", "3", *options, *served,
        "--optim", "adamw_torch",  # the kernel the recordings were made with (adamw_torch_fused rounds otherwise)
        "--gradient_checkpointing", "true",  # as recorded (the default turns it off for a model this small)
    ]  # fmt: skip


def _results(out: Path) -> dict:
    """What a run computed: its metrics without timings, and its final weights' fingerprint."""
    metrics = [
        {k: v for k, v in json.loads(line).items() if not k.startswith(NOT_RESULTS)} for line in (out / "metrics.jsonl").read_text().splitlines()
    ]
    ckpt = out / "checkpoint-4"
    if (ckpt / "sharded").is_dir():
        from tandem.trainer.sharding import load_model

        named = list(load_model(ckpt).named_parameters())
    else:
        named = list(load_file(ckpt / ("adapter_model.safetensors" if (ckpt / "adapter_model.safetensors").is_file() else "model.safetensors")).items())
    return {"metrics": metrics, "weights": fingerprint(named)}


def _run(name: str, model, data, tmp_path, server_url: str) -> dict:
    procs, options = MODES[name]
    out = tmp_path / name
    train(procs, _args(model, data, out, options, server_url), separate=name == "fsdp")
    return _results(out)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("golden")
    (folder / "digits.py").write_text(DIGITS)
    return write_jsonl(addition_rows(0), folder / "data.jsonl")


def _same(got, want, tolerance: float) -> bool:
    if isinstance(want, float) and isinstance(got, float):
        if math.isnan(want) or math.isnan(got):
            return math.isnan(want) and math.isnan(got)
        return abs(got - want) <= tolerance * max(1.0, abs(want))
    return got == want


def _differences(got: dict, want: dict, tolerance: float) -> str | None:
    """How a run differs from a recording (its first step that does, or its weights), or None."""
    if len(got["metrics"]) != len(want["metrics"]):
        return f"{len(got['metrics'])} steps, recorded {len(want['metrics'])}"
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"]), start=1):
        if set(g) != set(w):
            return f"step {step}: metrics {set(g) ^ set(w)} in one of the two only"
        wrong = {k: (g[k], w[k]) for k in w if not _same(g[k], w[k], tolerance)}
        if wrong:
            return f"step {step}: (now, recorded) {wrong}"
    if tolerance == 0 and got["weights"] != want["weights"]:
        return "the final weights differ from the recording"
    return None


def _kinds(recordings: dict, capability: str) -> list[str]:
    """The recordings of this CPU capability's machine kinds: AVX512, AVX512/2, ..."""
    return [key for key in recordings if key.split("/")[0] == capability]


@pytest.mark.parametrize("name", list(MODES))
def test_each_mode_trains_as_recorded(name, tiny_model, data, server, tmp_path):
    recordings = json.loads(GOLDEN.read_text())["recordings"]
    got = _run(name, tiny_model, data, tmp_path, server.url)
    kinds = _kinds(recordings, torch.backends.cpu.get_cpu_capability())
    holding = [key for key in sorted(recordings) if name in recordings[key]]  # the recordings of this mode
    if kinds and all(key in holding for key in kinds):
        against, tolerance = kinds, 0.0
    elif kinds:  # a kind of this capability has not recorded the mode since it changed
        against, tolerance = holding, 1e-3
    else:
        against, tolerance = holding[:1], 1e-5
    differences = {key: _differences(got, recordings[key][name], tolerance) for key in against}
    assert None in differences.values(), f"{name}: " + "; ".join(f"against {key}, {d}" for key, d in differences.items())


if __name__ == "__main__":  # record: python tests/test_golden.py [KEY] (starts its own server)
    import tempfile

    from conftest import Server, run_cli

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "tiny"
        assert run_cli("init-model", model, "--size", "tiny").returncode == 0
        (tmp / "digits.py").write_text(DIGITS)
        dataset = write_jsonl(addition_rows(0), tmp / "data.jsonl")
        server = Server(model)
        try:
            runs = {name: _run(name, model, dataset, tmp, server.url) for name in MODES}
        finally:
            server.stop()
    recordings = json.loads(GOLDEN.read_text())["recordings"] if GOLDEN.exists() else {}
    key = sys.argv[1] if len(sys.argv) > 1 else torch.backends.cpu.get_cpu_capability()
    if key.split("/")[0] != torch.backends.cpu.get_cpu_capability():
        sys.exit(f"{key}: this machine's CPU capability is {torch.backends.cpu.get_cpu_capability()}; record under it, or under it/2, ...")
    recordings[key] = runs
    GOLDEN.write_text(json.dumps({"recordings": recordings}, indent=1) + "\n")
    print(f"recorded {', '.join(runs)} as {key} in {GOLDEN}", file=sys.stderr)
