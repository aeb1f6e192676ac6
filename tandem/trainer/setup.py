"""Building what the loop uses: the prompt table, the policy with its optimizer and schedule,
and the reference model. Plain objects out; the loop decides what to do with them."""

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, get_scheduler

from tandem.data import DataError, encode_prompt, load_prompt_dataset, sample_rows
from tandem.rollout.weights import host_id
from tandem.trainer.batch import PrefixSharingLM, checkpoint_layers
from tandem.trainer.embedding import sparse_tied_embedding
from tandem.trainer.mlp import chunk_mlps
from tandem.trainer import lora
from tandem.trainer.config import ConfigError
from tandem.trainer.producer import PromptTable


def load_tokenizer(name: str, trust_remote_code: bool = False, tokenizer=None, model=None):
    """The tokenizer (the given one, or the named model's; with a pad token) and the model's
    max_position_embeddings (the given model's, else the named one's; None if its config has
    none), read before the model loads. A name that loads neither from a folder here nor from the
    hub is a config error that says which."""
    from transformers import AutoConfig, AutoTokenizer

    local = Path(name).expanduser()
    if (tokenizer is None or model is None) and name.startswith(("/", ".", "~")) and not local.is_dir():
        raise ConfigError(f"model_name_or_path={name}: no such folder; give a model folder (e.g. one made by `tandem init-model`) or a hub name")
    try:
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
        model_config = model.config if model is not None else AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
        max_len = getattr(model_config, "max_position_embeddings", None)
    except (OSError, ValueError) as exc:
        where = "the folder holds no model with a tokenizer" if local.is_dir() else "not a folder here, and it did not load from the hub"
        raise ConfigError(f"model_name_or_path={name}: {where} ({exc})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, max_len


@dataclass(frozen=True)
class PromptOptions:
    """How a dataset's prompts are read and encoded (TrainConfig's values)."""

    split: str
    config_name: str | None
    max_prompt_length: int | None
    truncation: str
    max_completion_length: int
    chat_template_kwargs: dict  # extra arguments of the chat template (Qwen3's enable_thinking)


def load_prompts(source: str, tokenizer, options: PromptOptions, max_len: int | None = None, sample: tuple[int, int] = (0, 0)) -> tuple[PromptTable, int]:
    """Encode every prompt of the dataset `source` once (or of `sample`, (rows, seed), drawn from
    it); returns the table and how many prompts were skipped as too long. A prompt that leaves less
    than max_completion_length of the model's `max_len` positions is an error naming its row: the
    engine and the trainer's forward would run past the positions the model knows."""
    ds = load_prompt_dataset(source, options.split, options.config_name)
    if sample[0]:
        ds = sample_rows(ds, *sample)
    others = [c for c in ds.column_names if c != "prompt"]
    table = PromptTable(prompts=[], prompt_ids=[], columns={c: [] for c in others}, conversational=[])
    skipped = 0
    for i, row in enumerate(ds):
        try:
            ids = encode_prompt(tokenizer, row["prompt"], options.max_prompt_length, options.truncation, options.chat_template_kwargs)
        except DataError as exc:
            raise DataError(f"dataset {source}, row {i}: {exc}") from None
        if ids is None:
            skipped += 1
            continue
        if max_len is not None and len(ids) + options.max_completion_length > max_len:
            raise DataError(
                f"dataset {source}, row {i}: its prompt of {len(ids)} tokens and max_completion_length={options.max_completion_length} "
                f"need {len(ids) + options.max_completion_length} positions, more than the model's max_position_embeddings={max_len}; "
                "lower max_completion_length, or max_prompt_length (with prompt_truncation left or skip)"
            )
        table.prompts.append(row["prompt"])
        table.prompt_ids.append(ids)
        table.conversational.append(not isinstance(row["prompt"], str))
        for c in others:
            table.columns[c].append(row[c])
    if not table.prompt_ids:
        raise DataError(f"all {skipped} prompts of {source} are longer than max_prompt_length={options.max_prompt_length}; raise it")
    return table, skipped


@dataclass(frozen=True)
class PolicyOptions:
    """The policy, its reference and its optimizer (TrainConfig's values)."""

    model: str  # model_name_or_path
    load_kwargs: dict  # from_pretrained's (model_load_kwargs)
    disable_dropout: bool
    head_in_fp32: bool  # cast_lm_head_to_fp32, under bf16
    checkpointing: bool  # gradient_checkpointing
    reference: bool  # a frozen reference model (beta > 0 without LoRA)
    lora: lora.LoraOptions | None  # adapters instead of every weight
    fused: bool  # optim adamw_torch_fused
    learning_rate: float
    betas: tuple[float, float]
    weight_decay: float
    lr_scheduler_type: str
    warmup_steps: int
    max_steps: int
    # The tied embedding's sparse backward (embedding.py): one unsharded process only, as DDP and
    # FSDP with it are untried.
    sparse_embedding: bool = False
    given: torch.nn.Module | None = None  # the Python API's model object, trained in place of loading `model`


# fp32 bytes one decoder layer keeps for the backward per token without checkpointing, in units of
# the hidden size and of the intermediate size: the attention's and norms' activations (queries,
# keys, values, attention output, residuals: about 12 x hidden) and the chunked MLP's gate(x) and
# up(x) (mlp.py: 2 x intermediate).
ACTIVATION_BYTES = (4 * 12, 4 * 2)
CHECKPOINT_SHARE = 8  # checkpointing goes on when a micro-batch's activations exceed 1/8 of the memory available


def resolve_checkpointing(model_config, tokens: int, available: int) -> tuple[bool, str]:
    """gradient_checkpointing's default: on where one micro-batch's activations (`tokens` of them)
    would take more than 1/CHECKPOINT_SHARE of the `available` bytes. A 4M model gains nothing
    from it and trained 60% slower with it (issue 51's toy shape); a 0.5B one at 8 x 256 tokens
    would hold about 4 GB more without it. Returns the decision and a line that says why."""
    c = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    need = tokens * (ACTIVATION_BYTES[0] * c.hidden_size + ACTIVATION_BYTES[1] * c.intermediate_size) * c.num_hidden_layers
    on = need * CHECKPOINT_SHARE > available
    return on, (f"gradient_checkpointing {'on' if on else 'off'} (auto: a micro-batch's activations would take about {need / 1e9:.2f} GB "
                f"without it, {'over' if on else 'under'} 1/{CHECKPOINT_SHARE} of the {available / 1e9:.1f} GB this process can have; "
                "gradient_checkpointing true or false forces it)")  # fmt: skip


def available_memory(device: torch.device) -> int:
    """Bytes this process can have: the GPU's free memory, or the host's available memory shared
    by the training processes on it."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as fh:
            fields = dict(line.split(":", 1) for line in fh)
        host = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError):  # no /proc (macOS): the machine's memory
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def model_load_kwargs(init_kwargs: dict | None, trust_remote_code: bool) -> dict:
    """from_pretrained's keyword arguments for the policy and its reference: model_init_kwargs,
    with the weights in float32 unless it names a dtype, as TRL loads them. transformers 5 keeps a
    checkpoint's own dtype by default, and hub checkpoints are stored in bf16, where AdamW's
    updates are rounded away (most of them at a learning rate of 1e-6): mixed precision is bf16's
    job, not the stored weights'. TrainConfig.validate has checked the dtype's name."""
    kwargs = {**(init_kwargs or {}), "trust_remote_code": trust_remote_code}
    key = "torch_dtype" if "torch_dtype" in kwargs and "dtype" not in kwargs else "dtype"  # transformers' older name
    name = kwargs.get(key, "float32")
    kwargs[key] = name if name == "auto" else getattr(torch, name)
    return kwargs


def build_policy(options: PolicyOptions, resume_dir: Path | None, device, shard=None) -> tuple[torch.nn.Module, PrefixSharingLM | None, torch.optim.Optimizer, object]:
    """The policy (from the checkpoint when resuming), the frozen reference model (from the
    starting weights), AdamW over the trainable weights and the learning-rate schedule. `shard`
    (FSDP) shards the policy and the reference before the optimizer is made over the shards; a
    sharded checkpoint's weights are loaded into them later, with the optimizer state."""
    def load(name) -> torch.nn.Module:
        given = options.given if options.given is not None and name == options.model else None
        return _prepared(AutoModelForCausalLM.from_pretrained(name, **options.load_kwargs) if given is None else given, options)

    # A given model is trained in place: its reference is a copy of it as it starts
    reference = copy.deepcopy(options.given) if options.given is not None and options.reference else None
    if options.lora is not None:
        model = lora.adapt(options.lora, load(options.model), resume_dir)
    else:
        if resume_dir is not None and (resume_dir / "adapter_config.json").is_file():
            raise ConfigError(f"checkpoint {resume_dir} holds LoRA adapters: resume it with use_peft true")
        full = resume_dir is not None and shard is None
        model = load(resume_dir if full else options.model)
    if options.disable_dropout:
        disable_dropout(model)
    # Training mode, as a Trainer's: dropout acts in the training forward (from_pretrained returns
    # a model in eval mode). The engine and the passes without gradient switch to eval mode for
    # their own forward (TransformersEngine.generate, Learner._logprobs_no_grad).
    model.train()
    if options.checkpointing:
        checkpoint_layers(model)
    chunk_mlps(model, recompute=options.checkpointing)
    if options.sparse_embedding:
        sparse_tied_embedding(model)
    if shard is not None:
        model = shard(model)
    ref_model = None
    if options.reference:
        ref = load(options.model) if reference is None else _prepared(reference, options)
        ref = ref.to(device) if shard is None else shard(ref)  # sharding moves each unit to the device itself
        ref_model = PrefixSharingLM(ref.eval().requires_grad_(False))
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=options.learning_rate, betas=options.betas, weight_decay=options.weight_decay,
        fused=options.fused,
    )
    # Stepped by hand once per optimizer step: accelerate's prepared scheduler would step once per process.
    scheduler = get_scheduler(options.lr_scheduler_type, optimizer, num_warmup_steps=options.warmup_steps, num_training_steps=options.max_steps)
    return model, ref_model, optimizer, scheduler


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout off: the Dropout modules (after LoRA: its adapters' too), as TRL's
    disable_dropout_in_model, and the probabilities attention layers pass to their kernel
    (Qwen2's and Llama's attention_dropout), which TRL's leaves on."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if name.endswith("dropout") and isinstance(value, float):
                setattr(module, name, 0.0)


def _prepared(model: torch.nn.Module, options: PolicyOptions) -> torch.nn.Module:
    """cast_lm_head_to_fp32: the output layer computes in fp32 under bf16 autocast (TRL's), so the
    log-probs lose no precision to bf16 logits over a large vocabulary."""
    if options.head_in_fp32:
        head = model.get_output_embeddings()

        def fp32_head(hidden: torch.Tensor) -> torch.Tensor:
            with torch.autocast(hidden.device.type, enabled=False):
                return F.linear(hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float())

        head.forward = fp32_head
    return model


def resolve_bf16(requested: bool | None) -> tuple[bool, str | None]:
    """Whether to train in bf16, and a warning for the user or None. By default bf16 where a CUDA
    GPU computes it (TRL's default), fp32 on CPU. A CPU without AVX512-BF16 or AMX emulates bf16
    matmuls: asked for there, the run goes on in bf16 with a warning."""
    if torch.cuda.is_available():
        return (torch.cuda.is_bf16_supported() if requested is None else requested), None
    if not requested:
        return False, None
    native = any(getattr(torch.cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    if native:
        return True, None
    return True, (
        "bf16 on a CPU without native bf16 (no AVX512-BF16 or AMX): torch emulates it, and bf16 matmuls run 10x to "
        "500x slower than fp32 on such a CPU (bench/vs_trl.py measures this machine); drop --bf16 true to train in fp32"
    )


def _on_this_cpu(info: dict) -> bool:
    """Whether a rollout server (its /info) computes on this host's CPU, beside the trainer."""
    return info["host_id"] == host_id() and info["device"] == "cpu"


def lent_threads(urls: list[str], server_infos: list[dict]) -> tuple[dict[str, int], str] | None:
    """Sync mode: training waits while rollout servers generate, so the servers on this host's
    CPU may generate on all of its cores, split between them (each keeps half by default, for
    async mode). Threads by URL and a line saying so; None where no server computes on this
    host's CPU, or where OMP_NUM_THREADS says what the user wants."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    here = [url for url, info in zip(urls, server_infos) if _on_this_cpu(info)]
    if not here:
        return None
    threads = max(1, len(os.sched_getaffinity(0)) // len(here))
    return {url: threads for url in here}, (f"rollout servers on this host generate on {threads} thread(s) each while training waits "
                                            "(sync mode; a server started with --threads keeps its own)")  # fmt: skip


def trainer_threads(server_infos: list[dict], local_processes: int) -> tuple[int, str] | None:
    """Torch threads for each training process when rollout servers compute on this host's CPU:
    the cores they leave (each reports its threads in /info), split between this host's
    training processes; and a line saying so. None when no server computes on this host's CPU,
    on a GPU, or when OMP_NUM_THREADS already says what the user wants."""
    if "OMP_NUM_THREADS" in os.environ or torch.cuda.is_available():
        return None
    here = [info for info in server_infos if _on_this_cpu(info)]
    if not here:
        return None
    cores = len(os.sched_getaffinity(0))
    taken = sum(info["threads"] for info in here)
    threads = max(1, (cores - taken) // max(1, local_processes))
    return threads, f"rollout servers on this host use {taken} of its {cores} cores; training uses {threads} thread(s) per process (OMP_NUM_THREADS overrides)"
