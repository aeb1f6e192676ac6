"""The Python API in TRL's shape: a TRL script ports by its import line.

    from tandem import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=reward_len, args=GRPOConfig(output_dir="out"), train_dataset=ds)
    trainer.train()

GRPOConfig is tandem's TrainConfig taking TRL's and ms-swift's option names as keywords, resolved
as a YAML file's are (trainer/compat.py): a name tandem cannot honour is refused when the config
is made. GRPOTrainer runs what `tandem train` runs (trainer/build.py and loop.py), with what TRL
takes as objects handed over as such (build.Given): reward functions and reward models, datasets,
the model (trained in place) and its tokenizer, tools, an environment factory and a rollout
function. Every process of `accelerate launch` or `torchrun` runs the script and so holds them.
AsyncGRPOConfig and AsyncGRPOTrainer (TRL 1.18's names) are the same with async generation on.

Callbacks are transformers' TrainerCallbacks, told on every process: on_init_end, on_train_begin,
then each step's on_step_begin, on_step_end and on_log (logs: the step's metrics.jsonl line),
on_evaluate (the main process's eval results, TRL's keys), on_save, on_train_end.
control.should_training_stop ends the run at the end of that round, with its checkpoint. `args` is
the GRPOConfig; `model` and the other keywords HF's Trainer passes are not given.

What a TRL script may pass that tandem does not take is refused at construction, naming the
argument and what to do instead: optimizers, quantization_config, and TRL's rollout_func(prompts,
trainer), which drives vLLM through the trainer.
"""

import json
import math
import os
from pathlib import Path

from tandem.trainer.config import ConfigError, TrainConfig, config_values

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "GRPOConfig", "GRPOTrainer"]


class GRPOConfig(TrainConfig):
    """TrainConfig with TRL's names: GRPOConfig(output_dir, learning_rate=..., use_vllm=True, ...).
    Where it differs from tandem's, the default is TRL's: output_dir 'trainer_output', and 3
    epochs where neither max_steps nor num_train_epochs is given."""

    def __init__(self, output_dir: str | None = None, **options):
        if output_dir is not None:
            options["output_dir"] = output_dir
        options.setdefault("output_dir", "trainer_output")
        # The trainer's, not the run's: train() ends with push_to_hub() (the command line has no push)
        self.push_to_hub, self.hub_model_id = bool(options.pop("push_to_hub", False)), options.pop("hub_model_id", None)
        if "max_steps" not in options and "num_train_epochs" not in options:
            options["num_train_epochs"] = 3.0
        values, resolved = config_values(options, f"in {type(self).__name__}(...)")
        super().__init__(**values)
        self.notes, self.given_as = resolved.notes, resolved.given_as


class AsyncGRPOConfig(GRPOConfig):
    """GRPOConfig with async_generate on: the next round is generated while this one trains."""

    def __init__(self, output_dir: str | None = None, **options):
        options.setdefault("async_generate", True)
        super().__init__(output_dir, **options)


class GRPOTrainer:
    """TRL's GRPOTrainer: train() runs the config's training, with these reward functions and
    datasets. `model` is a hub name or a model folder; `reward_funcs` one or a list of functions
    (plain or async, TRL's keywords: prompts, completions, completion_ids, the dataset's other
    columns), tandem's reward specs ('exact_match', 'file.py:fn') or reward model names;
    `train_dataset` a datasets.Dataset with a 'prompt' column; `peft_config` a peft.LoraConfig."""

    config_class = GRPOConfig

    def __init__(self, model, reward_funcs=None, args: TrainConfig | None = None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, callbacks=None, optimizers=(None, None), quantization_config=None, peft_config=None,
                 tools=None, rollout_func=None, environment_factory=None):  # fmt: skip
        _refuse_objects(optimizers=optimizers, quantization_config=quantization_config)
        name, self._model = (str(model), None) if isinstance(model, (str, os.PathLike)) else (_model_name(model, processing_class), model)
        args = args if args is not None else self.config_class(f"{name.rstrip('/').split('/')[-1]}-GRPO")
        if not isinstance(args, TrainConfig):
            raise TypeError(f"args must be a GRPOConfig (tandem's), got {type(args).__name__}: change the import to `from tandem import GRPOConfig`")
        self.args = args
        args.model_name_or_path = name
        if _is_peft(model):
            if peft_config is not None:
                raise ConfigError("GRPOTrainer(model=PeftModel, peft_config=...): the model has its adapters already; give one of the two")
            _apply_peft(args, model.peft_config[model.active_adapter])
        self._rewards = _rewards(reward_funcs, args, reward_processing_classes)
        args.reward_funcs = [r.name for r in self._rewards]
        self._train, args.dataset_name = _dataset(_taken(train_dataset, args), "train_dataset")
        self._eval, args.eval_dataset = _dataset(eval_dataset, "eval_dataset") if eval_dataset is not None else (None, args.eval_dataset)
        if peft_config is not None:
            _apply_peft(args, peft_config)
        self._objects = _turn_objects(args, tools, environment_factory, rollout_func)
        args.validate()
        self.model, self.processing_class = self._model, processing_class  # the trained model and its tokenizer, after train()
        self._trained, self.accelerator = False, None  # accelerate's Accelerator, once train() has made it
        self.callbacks = _Callbacks(args, list(callbacks or []))
        self.callbacks.init_end()
        self._main = True

    @property
    def state(self):
        """transformers' TrainerState: global_step, max_steps, log_history (metrics.jsonl's lines)."""
        return self.callbacks.state

    def add_callback(self, callback) -> None:
        """A TrainerCallback (an instance, or a class to make one of), told after those given."""
        self.callbacks.add(callback)

    def train(self, resume_from_checkpoint: bool | str | None = None):
        """Train to max_steps (or num_train_epochs); resume_from_checkpoint True takes the newest
        checkpoint in output_dir, a path that one. Returns transformers' TrainOutput."""
        from transformers.trainer_utils import TrainOutput

        from tandem.trainer.build import Given, build
        from tandem.trainer.loop import run_loop

        if resume_from_checkpoint:
            self.args.resume_from_checkpoint = "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
        run = build(self.args, Given(self._rewards, self._train, self._eval, (self.callbacks,), self._model, self.processing_class, self._objects))
        try:
            self.callbacks.begin(run.state.step, run.dist.is_main)
            last = run_loop(run)
            self.model, self._main, self.processing_class, self._trained = run.learner.lm, run.dist.is_main, run.tokenizer, True
            self.accelerator = run.dist.accelerator
        except BaseException:
            run.close(ok=False)
            raise
        run.close()
        self.callbacks.end(Path(self.args.output_dir) / "metrics.jsonl")
        if getattr(self.args, "push_to_hub", False):
            self.push_to_hub()
        losses = [r["loss"] for r in self.state.log_history if isinstance(r.get("loss"), (int, float))]
        loss = sum(losses) / len(losses) if losses else math.nan
        metrics = {k: v for k, v in last.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}  # the last step's
        return TrainOutput(run.state.step, loss, {"train_loss": loss, **metrics})

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """The model as it is now (trained, or the one to train) on eval_dataset (else the one
        given to the trainer), with eval_num_generations completions a prompt by tandem's engine
        in this process: TRL's keys (eval_reward, eval_rewards/NAME/mean, eval_pass@k, ...).
        Callbacks are told on_evaluate, and state.log_history gets the results. ignore_keys, of
        the model's outputs in transformers, has nothing to act on: no outputs are gathered."""
        from transformers import AutoModelForCausalLM

        from tandem.trainer.eval import evaluate_model, prefix
        from tandem.trainer.setup import load_tokenizer, model_load_kwargs

        source = _dataset(eval_dataset, "eval_dataset")[0] if eval_dataset is not None else self._eval or self.args.eval_dataset
        if not source:
            raise ConfigError("GRPOTrainer.evaluate(): give eval_dataset, to it or to GRPOTrainer")
        sources = source if isinstance(source, dict) else {"": source}
        if self.args.fsdp and self.model is not None and self._trained:
            raise ConfigError("GRPOTrainer.evaluate() after a sharded (fsdp) run: evaluate during training (eval_dataset, eval_steps), "
                              "or `tandem eval` on its checkpoint")  # fmt: skip
        a = self.args
        lm = self.model or AutoModelForCausalLM.from_pretrained(a.model_name_or_path, **model_load_kwargs(a.model_init_kwargs, a.trust_remote_code))
        tokenizer = self.processing_class or load_tokenizer(a.model_name_or_path, a.trust_remote_code)[0]
        results = {k: v for name, data in sources.items() for k, v in evaluate_model(lm, tokenizer, data, self._rewards, a, a.eval_num_generations,
                                                                                  a.eval_greedy, a.eval_pass_threshold, prefix(name)).items()}  # fmt: skip
        out = {metric_key_prefix + k.removeprefix("eval"): v for k, v in _trl_keys(results).items()}
        self.state.log_history.append({**out, "step": self.state.global_step})
        self.callbacks.evaluation(self.state.global_step, out)
        return out

    def save_model(self, output_dir: str | None = None) -> None:
        """The trained model (with LoRA, its adapters) and tokenizer as a folder from_pretrained
        loads, from the main process; output_dir defaults to args.output_dir."""
        from tandem.trainer.setup import load_tokenizer

        if self.model is None:
            raise RuntimeError("save_model: nothing is trained yet; call train() first")
        if self._main:
            out = Path(output_dir or self.args.output_dir)
            self.model.save_pretrained(out)
            (self.processing_class or load_tokenizer(self.args.model_name_or_path, self.args.trust_remote_code)[0]).save_pretrained(out)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, token: str | None = None,
                    revision: str | None = None, private: bool | None = None, **kwargs) -> str:  # fmt: skip
        """save_model(), then output_dir (its checkpoints left out) to the hub repository
        args.hub_model_id (default: output_dir's name), made if need be, through huggingface_hub
        as transformers' Trainer does, from the main process. The URL of the commit (a future
        where not `blocking`). Checked here against a stand-in of huggingface_hub's HfApi only:
        this machine reaches no hub."""
        from huggingface_hub import HfApi

        self.save_model()
        if not self._main:
            return ""
        api = HfApi(token=token)
        name = getattr(self.args, "hub_model_id", None) or Path(self.args.output_dir).resolve().name
        repo_id = api.create_repo(name, private=private, exist_ok=True).repo_id
        return api.upload_folder(repo_id=repo_id, folder_path=self.args.output_dir, commit_message=commit_message, revision=revision,
                                 ignore_patterns=["checkpoint-*", "checkpoint-*/**", "_*", "latest"], run_as_future=not blocking)  # fmt: skip


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose default config is AsyncGRPOConfig."""

    config_class = AsyncGRPOConfig


def _refuse_objects(**given) -> None:
    """What tandem does not take from a TRL script: a config error naming it and the way instead."""
    instead = {
        "optimizers": "tandem trains with AdamW (optim, learning_rate, lr_scheduler_type)",
        "quantization_config": "quantized training is not built: train in bf16, or LoRA (peft_config)",
    }
    for name, value in given.items():
        if value is not None and value != (None, None) and value != []:
            raise ConfigError(f"GRPOTrainer({name}=...) is not taken by tandem: {instead[name]}")


def _turn_objects(args: TrainConfig, tools, environment_factory, rollout_func) -> dict:
    """TRL's tools (functions with type hints and a docstring), environment_factory (a class, or a
    callable making one environment) and rollout_func given as objects: into the config as
    loading.GIVEN specs (saved and printed so), the objects by spec for the run."""
    from tandem.aio import is_async
    from tandem.loading import GIVEN, spawn_problem

    objects = {}

    def given(obj, argument: str) -> str:
        if isinstance(obj, str):
            return obj  # tandem's spec
        if not callable(obj):
            raise ConfigError(f"GRPOTrainer({argument}=...) takes functions (or for environment_factory a class), not a {type(obj).__name__}")
        spec = f"{GIVEN}{getattr(obj, '__name__', type(obj).__name__)}"
        if spec in objects:
            raise ConfigError(f"GRPOTrainer({argument}=...): two objects named {spec.removeprefix(GIVEN)!r}; tool calls name them")
        objects[spec] = obj
        return spec

    if tools:
        args.tools = [*args.tools, *(given(t, "tools") for t in tools)]
        for tool in tools:
            if args.tool_workers and not isinstance(tool, str) and (problem := spawn_problem(tool)):
                raise ConfigError(f"GRPOTrainer(tools=...): {tool.__name__} cannot reach tool_workers={args.tool_workers} worker processes: "
                                  f"{problem}; or give tool_workers 0")  # fmt: skip
    if environment_factory is not None:
        args.environment_factory = given(environment_factory, "environment_factory")
    if rollout_func is not None:
        if not isinstance(rollout_func, str) and not is_async(rollout_func):
            raise ConfigError("GRPOTrainer(rollout_func=...): TRL's rollout_func(prompts, trainer) drives vLLM through the trainer, which "
                              "tandem does not expose; give an async def fn(prompt, generate, tokenizer) that awaits generate(token_ids) for "
                              "the engine's tokens (docs/multi-turn.md)")  # fmt: skip
        args.rollout_func = given(rollout_func, "rollout_func")
    return objects


def _is_peft(model) -> bool:
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft") for c in type(model).__mro__)


def _model_name(model, processing_class) -> str:
    """The name a model object goes by (TRL's model id, its config's _name_or_path): its
    tokenizer loads from there unless processing_class is given; checkpoints and messages say it."""
    from transformers import PreTrainedModel

    base = model.get_base_model() if _is_peft(model) else model
    if not isinstance(base, PreTrainedModel):
        raise ConfigError(f"GRPOTrainer(model=...) takes a hub name, a model folder, a transformers PreTrainedModel or a peft PeftModel, "
                          f"not a {type(model).__name__}")  # fmt: skip
    name = base.config._name_or_path
    if not name and processing_class is None:
        raise ConfigError("GRPOTrainer(model=...): the model was not loaded from a folder or the hub, so its tokenizer is not known: "
                          "give processing_class=tokenizer")  # fmt: skip
    return name or type(base).__name__


def _rewards(reward_funcs, args: TrainConfig, processing_classes) -> list:
    """The NamedRewards of TRL's reward_funcs, in order: functions as they are, TRL's strings as
    specs or reward model names (config.load_rewards), reward models given as objects with their
    tokenizers (reward_processing_classes, one per entry, else the model's own);
    args.reward_weights apply in that order."""
    from transformers import PreTrainedModel

    from tandem.rewards.model import RewardModel

    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs] if reward_funcs is not None else []
    if not funcs:
        raise ConfigError("GRPOTrainer(reward_funcs=...): give at least one reward function")
    tokenizers = list(processing_classes) if isinstance(processing_classes, (list, tuple)) else [processing_classes] * len(funcs)
    if len(tokenizers) != len(funcs):
        raise ConfigError(f"GRPOTrainer(reward_processing_classes=...): {len(tokenizers)} for {len(funcs)} reward_funcs; give one each (None for a function)")
    for i, (f, tokenizer) in enumerate(zip(funcs, tokenizers)):
        if isinstance(f, PreTrainedModel):
            name = f.config._name_or_path or type(f).__name__
            if tokenizer is None and not f.config._name_or_path:
                raise ConfigError(f"reward_funcs[{i}] is a {type(f).__name__} not loaded from a folder or the hub: give its tokenizer in "
                                  "reward_processing_classes")  # fmt: skip
            funcs[i] = RewardModel(name, args.reward_model_device, batch_size=args.reward_model_batch_size, model=f, tokenizer=tokenizer)
        elif isinstance(f, (str, os.PathLike)):
            funcs[i] = str(f)
    return args.load_rewards(funcs)


def _taken(ds, args: TrainConfig):
    """A train_dataset that is an IterableDataset (a stream), as TRL takes one: with max_steps (it
    has no length to count epochs by), its first rows, as many as max_steps' rounds use, read once
    into a Dataset. Its other kinds as they are."""
    import datasets

    if not isinstance(ds, datasets.IterableDataset):
        return ds
    if args.max_steps < 1:
        raise ConfigError("GRPOTrainer(train_dataset=IterableDataset): give max_steps (a stream has no length to count num_train_epochs by), "
                          "as TRL needs")  # fmt: skip
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rounds = math.ceil(args.max_steps / args.steps_per_round())
    rows = list(ds.take(max(1, rounds * args.completions_per_round() * world // args.num_generations)))
    if not rows:
        raise ConfigError("GRPOTrainer(train_dataset=IterableDataset): the stream gave no rows")
    return datasets.Dataset.from_list(rows)


def _trl_keys(results: dict) -> dict:
    """eval/* metrics under TRL's names: eval/reward as eval_reward, eval_NAME/reward as eval_NAME_reward."""
    return {k.replace("/", "_", 1) if k.startswith("eval") else k: v for k, v in results.items()}


def _dataset(ds, argument: str):
    """(GivenDataset, its name for messages) of a datasets.Dataset; for eval_dataset, of each of a
    dict of them too ({name: GivenDataset}), as TRL evaluates each under its name."""
    import datasets

    from tandem.data.datasets import GivenDataset

    if ds is None:
        raise ConfigError(f"GRPOTrainer({argument}=...): give a datasets.Dataset with a 'prompt' column")
    if argument == "eval_dataset" and isinstance(ds, dict) and not isinstance(ds, datasets.DatasetDict):
        given = {str(name): _dataset(d, f"eval_dataset[{name!r}]")[0] for name, d in ds.items()}
        return given, f"eval_dataset ({', '.join(f'{name}: {d.rows.num_rows} rows' for name, d in given.items())})"
    if isinstance(ds, (datasets.DatasetDict, dict)):
        raise ConfigError(f"GRPOTrainer({argument}=...) is a DatasetDict of splits {list(ds)}: give one, e.g. {argument}=ds['train']")
    if isinstance(ds, datasets.IterableDataset):
        raise ConfigError(f"GRPOTrainer({argument}=...) is an IterableDataset: tandem encodes every prompt once at start; give a Dataset "
                          "(for a stream, datasets.Dataset.from_list(list(ds.take(n))))")  # fmt: skip
    if not isinstance(ds, datasets.Dataset):
        raise ConfigError(f"GRPOTrainer({argument}=...) must be a datasets.Dataset, got {type(ds).__name__}")
    name = f"{argument} ({ds.num_rows} rows)"
    return GivenDataset(ds, name), name


def _apply_peft(args: TrainConfig, peft_config) -> None:
    """A peft.LoraConfig as tandem's LoRA options."""
    if type(peft_config).__name__ != "LoraConfig":
        raise ConfigError(f"peft_config: only a peft.LoraConfig is taken, got {type(peft_config).__name__}")
    targets = peft_config.target_modules
    args.use_peft, args.lora_r, args.lora_alpha, args.lora_dropout = True, peft_config.r, peft_config.lora_alpha, peft_config.lora_dropout
    args.lora_target_modules = [targets] if isinstance(targets, str) else sorted(targets) if targets else None
    args.lora_modules_to_save = list(peft_config.modules_to_save) if peft_config.modules_to_save else None


class _Callbacks:
    """transformers' TrainerCallbacks as a metrics.Listener of the run, with the TrainerState
    they read (transformers' CallbackHandler would want HF's TrainingArguments and its flow)."""

    def __init__(self, args: TrainConfig, callbacks: list):
        from transformers import TrainerControl, TrainerState

        self.args, self.callbacks, self.state, self.control = args, [], TrainerState(), TrainerControl()
        for callback in callbacks:
            self.add(callback)

    def add(self, callback) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def _tell(self, event: str, **kwargs) -> None:
        for callback in self.callbacks:
            control = getattr(callback, event)(self.args, self.state, self.control, **kwargs)
            self.control = control if control is not None else self.control

    def begin(self, step: int, main: bool) -> None:
        self.state.global_step, self.state.max_steps, self.state.is_world_process_zero = step, self.args.max_steps, main
        self.state.is_local_process_zero = main or int(os.environ.get("LOCAL_RANK", "0")) == 0
        self._tell("on_train_begin")

    def init_end(self) -> None:
        self._tell("on_init_end")

    def step_begin(self) -> None:
        self._tell("on_step_begin")

    def saved(self, step: int) -> None:
        self._tell("on_save")

    def step(self, record: dict) -> bool:
        self.state.global_step = record["step"]
        self.state.log_history.append(record)
        self._tell("on_step_end")
        self._tell("on_log", logs=record)
        return self.control.should_training_stop

    def evaluation(self, step: int, results: dict) -> None:
        """`results` under TRL's names: eval/reward as eval_reward."""
        self._tell("on_evaluate", metrics=_trl_keys(results))

    def end(self, metrics_file: Path) -> None:
        """The run is over: log_history becomes every line of metrics.jsonl (a resumed run's
        earlier steps too) where this process can read it, and on_train_end is told."""
        if metrics_file.is_file():
            self.state.log_history = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
        self._tell("on_train_end")

