"""The Python API in TRL's shape (tandem/api.py): a TRL script with its import line changed runs
under `python` and `accelerate launch`, trains as `tandem train` does, and refuses at
construction what it cannot honour."""

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import ENV, cli_here, free_port
from tandem import AsyncGRPOConfig, GRPOConfig, GRPOTrainer
from tandem.trainer.config import ConfigError

# TRL's quickstart with two reward functions of TRL's convention (keywords; trainer_state; a
# dataset column; an async one; None for no opinion) and epochs instead of steps. Only the import
# line is tandem's.
SCRIPT = """
import json, sys
from datasets import Dataset
from tandem import GRPOConfig, GRPOTrainer

def reward_len(completions, trainer_state, log_metric, log_extra, **kwargs):
    # shaped by training progress: the length aimed at grows from 4 to 8 characters over the run
    assert trainer_state.max_steps == 8 and 0 <= trainer_state.global_step < 8, trainer_state
    aim = 4 + 4 * trainer_state.global_step / trainer_state.max_steps
    log_metric("aim", aim)  # TRL's: a metric of the step, and a column of completions.jsonl
    log_extra("chars", [len(c) for c in completions])
    return [-abs(aim - len(c)) / 8 for c in completions]

async def reward_answer(completions, answer, **kwargs):
    return [float(a in c) if c.strip() else None for c, a in zip(completions, answer)]

out, batch, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
server = sys.argv[4] if len(sys.argv) > 4 else None  # TRL's vLLM server options, a tandem server behind them, async
mode = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=server, async_generate=True, vllm_importance_sampling_correction=False) if server else {}
dataset = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(2)])
args = GRPOConfig(output_dir=out, per_device_train_batch_size=batch, num_generations=4, max_completion_length=8, num_train_epochs=2,
                  learning_rate=1e-3, logging_steps=1, report_to="none", seed=3, disable_tqdm=True, **mode)
trainer = GRPOTrainer(model=model, reward_funcs=[reward_len, reward_answer], args=args, train_dataset=dataset)
result = trainer.train()
trainer.save_model()
if trainer.state.is_world_process_zero:
    print("RESULT", json.dumps({"global_step": result.global_step, "training_loss": result.training_loss, "logged": len(trainer.state.log_history)}))
"""


def _script(path, out, batch, model, procs=1, launcher="accelerate", *extra) -> dict:
    launch = [sys.executable] if procs == 1 else [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(procs),
                                                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                                                  "--main_process_port", str(free_port())]  # fmt: skip
    if procs > 1 and launcher == "torchrun":
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", str(free_port())]
    proc = subprocess.run([*launch, str(path), str(out), str(batch), str(model), *map(str, extra)], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_trl_script_trains_as_tandem_train_does_and_two_processes_as_one(tiny_model, tmp_path):
    script = tmp_path / "grpo.py"
    script.write_text(SCRIPT)
    one = _script(script, tmp_path / "one", 8, tiny_model)
    # 8 prompts, rounds of 2 (8 completions of 4 each), a step a round: 4 steps an epoch, 2 epochs
    assert one["global_step"] == 8 and one["logged"] == 8 and one["training_loss"] == pytest.approx(sum(_losses(tmp_path / "one")) / 8)
    metrics = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert {"rewards/reward_len/mean", "rewards/reward_answer/mean"} <= set(metrics[0])
    assert [m["aim"] for m in metrics] == [4 + 4 * step / 8 for step in range(8)]  # a round a step, scored at its first step
    logged = [json.loads(line) for line in (tmp_path / "one" / "completions.jsonl").read_text().splitlines()]
    assert all(isinstance(c["chars"], int) for c in logged) and len({c["chars"] for c in logged}) > 1
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "one")
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert any(not torch.equal(a, b) for a, b in zip(saved.state_dict().values(), start.state_dict().values()))
    # the same run from the command line, its rewards by spec and its data a file: the same losses
    (tmp_path / "rewards.py").write_text(SCRIPT.split("out, batch")[0])
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a in range(4) for b in range(2)))
    proc = cli_here("train", "--model_name_or_path", tiny_model, "--dataset_name", data, "--output_dir", tmp_path / "cli",
                    "--reward_funcs", f"{tmp_path / 'rewards.py'}:reward_len", f"{tmp_path / 'rewards.py'}:reward_answer",
                    "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "8", "--num_train_epochs", "2",
                    "--learning_rate", "1e-3", "--logging_steps", "1", "--seed", "3", "--disable_tqdm", "true")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "num_train_epochs=2 over 8 prompts: max_steps=8" in proc.stdout
    assert _losses(tmp_path / "cli") == _losses(tmp_path / "one")
    # under accelerate launch, 2 processes of 4 completions train as one of 8
    two = _script(script, tmp_path / "two", 4, tiny_model, procs=2)
    assert two["global_step"] == 8 and _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), abs=1e-6)
    assert [json.loads(line)["aim"] for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()] == [m["aim"] for m in metrics]


def test_a_trl_script_in_async_server_mode_under_torchrun_trains_as_one_process(tiny_model, server, tmp_path):
    script = tmp_path / "grpo.py"
    script.write_text(SCRIPT)
    one = _script(script, tmp_path / "one", 8, tiny_model, 1, "torchrun", server.url)
    two = _script(script, tmp_path / "two", 4, tiny_model, 2, "torchrun", server.url)
    assert one["global_step"] == two["global_step"] == 8
    (a, b) = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in ("one", "two"))
    assert [m["reward"] for m in a] == [m["reward"] for m in b]  # the same completions, gathered
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), abs=1e-6)
    assert a[-1]["staleness/max"] == b[-1]["staleness/max"] == 1  # generated a round ahead


# A TRL callback that stops the run at step 3 (should_training_stop), then the run resumed
# through train(resume_from_checkpoint=True) to max_steps 5.
CALLBACK_SCRIPT = """
import json, sys
from datasets import Dataset
from transformers import TrainerCallback
from tandem import GRPOConfig, GRPOTrainer

class StopAtThree(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_init_end(self, args, state, control, **kwargs):
        self.events.append(["init"])

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(["step", state.global_step])

    def on_save(self, args, state, control, **kwargs):
        self.events.append(["save", state.global_step])

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(["evaluate", sorted(k for k in metrics if k.endswith("reward"))])

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(["begin", state.global_step, state.max_steps])

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(["log", logs["step"], state.global_step])
        if state.global_step == 3:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(["end", state.global_step])

out, model = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)])
options = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=4, save_steps=2, disable_tqdm=True)
first = GRPOTrainer(model, reward_funcs="exact_match", args=GRPOConfig(out, max_steps=8, **options), train_dataset=dataset, callbacks=[StopAtThree])
stopped = first.train()
again = GRPOTrainer(model, reward_funcs="exact_match", args=GRPOConfig(out, max_steps=5, eval_steps=2, **options), train_dataset=dataset,
                    eval_dataset={"all": dataset, "few": dataset.select(range(2))})
again.add_callback(StopAtThree)
resumed = again.train(resume_from_checkpoint=True)
history = [r["step"] for r in again.state.log_history]
evaluated = again.evaluate(eval_dataset=dataset)
print("RESULT", json.dumps({"stopped": stopped.global_step, "first": first.callbacks.callbacks[0].events, "resumed": resumed.global_step,
                            "again": again.callbacks.callbacks[0].events, "history": history, "evaluated": evaluated}))
"""


def test_a_callback_stops_the_run_with_a_checkpoint_and_train_resumes_it(tiny_model, tmp_path):
    script = tmp_path / "callback.py"
    script.write_text(CALLBACK_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), str(tiny_model)], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    got = json.loads(line.removeprefix("RESULT "))
    assert got["stopped"] == 3 and got["first"] == [["init"], ["begin", 0, 8], ["step", 0], ["log", 1, 1], ["step", 1], ["log", 2, 2], ["save", 2],
                                                   ["step", 2], ["log", 3, 3], ["save", 3], ["end", 3]]  # fmt: skip
    assert (tmp_path / "run" / "checkpoint-3").is_dir()  # the stop saved what it trained (save_steps 2 had saved step 2)
    # added after construction: no on_init_end; two eval datasets by name each eval_steps and at the
    # end, then evaluate() after the run on one, TRL's keys
    during = ["evaluate", ["eval_all_reward", "eval_few_reward"]]
    assert got["resumed"] == 5 and got["again"] == [["begin", 3, 5], ["step", 3], ["log", 4, 4], during, ["save", 4], ["step", 4], ["log", 5, 5],
                                                    during, ["save", 5], ["end", 5], ["evaluate", ["eval_reward"]]]  # fmt: skip
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["eval_all/prompts"], e["eval_few/prompts"]) for e in evals] == [(4, 8, 2), (5, 8, 2)]
    assert got["history"] == [1, 2, 3, 4, 5]
    assert got["evaluated"]["eval_prompts"] == 8 and 0 <= got["evaluated"]["eval_reward"] <= 1


# A model given as an object, as TRL scripts load one: trained in place, with its reference a copy
# of its start (beta > 0), to the losses of the run given the model's name; a PeftModel trains its
# own adapters, and a fresh one resumed from its checkpoint trains on as it did.
OBJECT_SCRIPT = """
import json, sys
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from tandem import GRPOConfig, GRPOTrainer

out, name = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)])
options = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=6, max_steps=3, beta=0.04, learning_rate=1e-2,
               disable_tqdm=True)

def losses(folder):
    return [json.loads(line)["loss"] for line in open(f"{folder}/metrics.jsonl")]

def length(completions, **kwargs):
    return [float(len(c)) for c in completions]

GRPOTrainer(name, reward_funcs=length, args=GRPOConfig(f"{out}/named", **options), train_dataset=dataset).train()
model = AutoModelForCausalLM.from_pretrained(name)
start = {k: v.clone() for k, v in model.state_dict().items()}
trainer = GRPOTrainer(model, reward_funcs=length, args=GRPOConfig(f"{out}/object", **options), train_dataset=dataset,
                      processing_class=AutoTokenizer.from_pretrained(name))
trainer.train()
peft = get_peft_model(AutoModelForCausalLM.from_pretrained(name), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
adapters = {k: v.clone() for k, v in peft.state_dict().items()}
lora = GRPOTrainer(peft, reward_funcs=length, args=GRPOConfig(f"{out}/peft", save_steps=2, **options), train_dataset=dataset)
lora.train()
after = peft.state_dict()
again = get_peft_model(AutoModelForCausalLM.from_pretrained(name), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
resumed = GRPOTrainer(again, reward_funcs=length, args=GRPOConfig(f"{out}/peft", **options), train_dataset=dataset)
resumed.train(resume_from_checkpoint=f"{out}/peft/checkpoint-2")
try:  # this script runs training at its top level, as TRL's do: a worker process importing it would run it again
    GRPOTrainer(name, reward_funcs=length, args=GRPOConfig(f"{out}/w", reward_num_workers=1, **options), train_dataset=dataset)
    refused = ""
except ValueError as exc:
    refused = str(exc)
print("RESULT", json.dumps({
    "refused": refused,
    "same_losses": losses(f"{out}/named") == losses(f"{out}/object"), "in_place": trainer.model is model,
    "changed": any(not torch.equal(start[k], v) for k, v in model.state_dict().items()),
    "peft_in_place": lora.model is peft, "lora_r": lora.args.lora_r, "use_peft": lora.args.use_peft,
    "adapters_moved": any(not torch.equal(adapters[k], after[k]) for k in after if "lora_B" in k),
    "base_kept": all(torch.equal(adapters[k], after[k]) for k in after if "lora_" not in k),
    "resumed_same": all(torch.equal(v, after[k]) for k, v in again.state_dict().items()),
    "lrs": [round(json.loads(line)["learning_rate"], 6) for line in open(f"{out}/named/metrics.jsonl")],
}))
"""


def test_a_model_object_trains_in_place_as_its_name_does_and_a_peft_model_trains_its_adapters(tiny_model, tmp_path):
    script = tmp_path / "objects.py"
    script.write_text(OBJECT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(tiny_model)], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    got = json.loads(line.removeprefix("RESULT "))
    assert "whose top level would run again in each worker" in got.pop("refused")
    assert got == {"same_losses": True, "in_place": True, "changed": True, "peft_in_place": True, "lora_r": 4, "use_peft": True,
                   "adapters_moved": True, "base_kept": True, "resumed_same": True,
                   "lrs": [0.01, 0.006667, 0.003333]}  # fmt: skip (each step's own learning rate, TRL's linear decay)


# The script's own functions in reward workers, the script guarded as multiprocessing needs: the
# workers import it (not running it) and score, their log_metric values logged as in this process.
WORKER_SCRIPT = """
import json, sys
from datasets import Dataset
from tandem import GRPOConfig, GRPOTrainer

def length(completions, log_metric, **kwargs):
    log_metric("chars", sum(map(len, completions)) / len(completions))
    return [float(len(c)) for c in completions]

if __name__ == "__main__":
    out, name, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dataset = Dataset.from_list([{"prompt": f"{a}+1="} for a in range(8)])
    args = GRPOConfig(out, per_device_train_batch_size=8, num_generations=4, max_completion_length=6, max_steps=2, reward_num_workers=workers,
                      disable_tqdm=True)
    GRPOTrainer(name, reward_funcs=length, args=args, train_dataset=dataset).train()
"""


def test_a_scripts_reward_function_scores_in_reward_workers_as_in_the_trainer(tiny_model, tmp_path):
    script = tmp_path / "workers.py"
    script.write_text(WORKER_SCRIPT)
    for workers in (0, 2):
        proc = subprocess.run([sys.executable, str(script), str(tmp_path / str(workers)), str(tiny_model), str(workers)], capture_output=True,
                              text=True, env=ENV, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    inline, pooled = ([json.loads(line) for line in (tmp_path / str(w) / "metrics.jsonl").read_text().splitlines()] for w in (0, 2))
    assert [m["reward"] for m in pooled] == [m["reward"] for m in inline] and [m["chars"] for m in pooled] == [m["chars"] for m in inline]


def multiply(a: int, b: int) -> int:
    """Multiplies two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b


class Counter:
    """TRL's environment_factory: reset(**row) per trajectory, its public methods tools, get_reward()."""

    def reset(self, **row):
        self.answer = row["answer"]

    def add(self, a: int, b: int) -> int:
        """Adds two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    def get_reward(self) -> float:
        return float(len(self.answer))


def test_tools_and_an_environment_factory_given_as_objects_run_their_turns(tiny_model, tmp_path):
    rows = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+1="}], "answer": str(a + 1) * (a % 2 + 1)} for a in range(8)])
    args = GRPOConfig(str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4, max_completion_length=8, disable_tqdm=True)
    trainer = GRPOTrainer(str(tiny_model), reward_funcs="environment", args=args, train_dataset=rows, tools=[multiply], environment_factory=Counter)
    trainer.train()
    saved = (tmp_path / "config.yaml").read_text()
    assert "- object:multiply" in saved and "environment_factory: object:Counter" in saved  # said so, never a path that does not load
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"tools/multiply/call_frequency", "tools/add/call_frequency"} <= set(metrics[0])
    # each trajectory's own environment, reset with its row: a reward of its answer's length, 1 or 2
    assert {c["rewards/environment"] for c in map(json.loads, (tmp_path / "completions.jsonl").read_text().splitlines())} <= {1.0, 2.0}
    assert 1.0 < metrics[0]["rewards/environment/mean"] < 2.0
    with pytest.raises(ConfigError, match="TRL's rollout_func\\(prompts, trainer\\) drives vLLM through the trainer"):
        GRPOTrainer(str(tiny_model), reward_funcs=_reward, args=GRPOConfig(str(tmp_path / "f")), train_dataset=_rows(), rollout_func=lambda prompts, trainer: {})


@pytest.mark.quick
def test_a_reward_model_given_as_an_object_scores_as_the_one_given_by_name(tiny_model, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tandem.rewards import score
    from tandem.rewards.model import RewardModel

    rm = tmp_path / "rm"
    assert cli_here("init-model", rm, "--size", "tiny", "--reward-model").returncode == 0
    objects = [AutoModelForSequenceClassification.from_pretrained(rm, num_labels=1), "exact_match"]
    trainer = GRPOTrainer(str(tiny_model), reward_funcs=objects, args=GRPOConfig(str(tmp_path / "run")), train_dataset=_rows(),
                          reward_processing_classes=[AutoTokenizer.from_pretrained(rm), None])  # fmt: skip
    assert [r.name for r in trainer._rewards] == ["rm", "exact_match"]  # TRL's name: the last part of the model's
    prompts, completions = [[{"role": "user", "content": "1+1="}]] * 2, [[{"role": "assistant", "content": c}] for c in ("2", "11")]
    by_name = RewardModel(f"model:{rm}")(prompts, completions)
    assert score(trainer._rewards[:1], prompts, completions)[:, 0].tolist() == pytest.approx(by_name, abs=1e-6) and by_name[0] != by_name[1]


@pytest.mark.quick
def test_push_to_hub_saves_the_model_and_uploads_the_run_folder_through_huggingface_hub(tiny_model, tmp_path, monkeypatch):
    # huggingface_hub's HfApi is the outer boundary (this machine reaches no hub): a stand-in records its calls
    import huggingface_hub

    calls = []

    class Hub:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls.append(("create", repo_id, exist_ok))
            return type("Repo", (), {"repo_id": repo_id})()

        def upload_folder(self, **kwargs):
            calls.append(("upload", kwargs["repo_id"], Path(kwargs["folder_path"]), kwargs["commit_message"], "checkpoint-*" in kwargs["ignore_patterns"]))
            return "https://hub/commit"

    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    args = GRPOConfig(str(tmp_path / "run"), push_to_hub=True, hub_model_id="me/run")  # TRL's options, taken by the trainer
    trainer = GRPOTrainer(model, reward_funcs=_reward, args=args, train_dataset=_rows())
    assert trainer.push_to_hub() == "https://hub/commit"
    assert calls == [("token", None), ("create", "me/run", True), ("upload", "me/run", tmp_path / "run", "End of training", True)]
    assert (tmp_path / "run" / "config.json").is_file() and (tmp_path / "run" / "tokenizer_config.json").is_file()


def _rows(n=4):
    return datasets.Dataset.from_list([{"prompt": "1+1=", "answer": "2"}] * n)


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.quick
def test_trl_names_resolve_and_what_tandem_cannot_honour_is_refused_at_construction(tiny_model, tmp_path):
    args = GRPOConfig(str(tmp_path), use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:9", num_train_epochs=3)
    assert (args.rollout_mode, args.rollout_server_urls, args.max_steps, args.num_train_epochs) == ("server", ["http://127.0.0.1:9"], -1, 3.0)
    assert AsyncGRPOConfig(str(tmp_path)).async_generate
    assert (GRPOConfig().output_dir, GRPOConfig().max_steps, GRPOConfig().num_train_epochs) == ("trainer_output", -1, 3.0)  # TRL's defaults
    with pytest.raises(ConfigError, match="unknown key 'learnig_rate' in GRPOConfig.*did you mean 'learning_rate'"):
        GRPOConfig(learnig_rate=1e-4)
    trainer = GRPOTrainer(str(tiny_model), reward_funcs=[_reward, "exact_match"], args=GRPOConfig(str(tmp_path)), train_dataset=_rows())
    assert trainer.args.reward_funcs == ["_reward", "exact_match"] and trainer.args.dataset_name == "train_dataset (4 rows)"
    # a stream, with max_steps: its first rows, as many as the steps' rounds use (3 rounds of 2 prompts)
    stream = datasets.IterableDataset.from_generator(lambda: ({"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(100)))
    streamed = GRPOTrainer(str(tiny_model), reward_funcs=_reward, args=GRPOConfig(str(tmp_path), max_steps=3, num_generations=4), train_dataset=stream)
    assert streamed._train.rows["prompt"] == ["0+1=", "1+1=", "2+1=", "3+1=", "4+1=", "5+1="]
    refused = [
        (dict(model=torch.nn.Linear(1, 1)), "takes a hub name, a model folder, a transformers PreTrainedModel or a peft PeftModel, not a Linear"),
        (dict(train_dataset=datasets.DatasetDict(train=_rows())), r"is a DatasetDict of splits \['train'\]: give one"),
        (dict(optimizers=(object(), None)), "tandem trains with AdamW"),
        (dict(quantization_config=object()), "quantized training is not built"),
        (dict(reward_funcs=[]), "give at least one reward function"),
        (dict(train_dataset=datasets.IterableDataset.from_generator(lambda: iter([{"prompt": "1+1="}]))), "give max_steps .a stream has no length"),
        (dict(reward_funcs=[_reward, _reward]), "two functions of the same name"),
        (dict(reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=GRPOConfig(str(tmp_path), reward_num_workers=2)),
         "'<lambda>' cannot reach reward_num_workers=2 worker processes: it cannot be pickled.*or give reward_num_workers 0"),
    ]
    for change, message in refused:
        given = dict(model=str(tiny_model), reward_funcs=_reward, args=GRPOConfig(str(tmp_path)), train_dataset=_rows()) | change
        with pytest.raises(ConfigError, match=message):
            GRPOTrainer(**given)
