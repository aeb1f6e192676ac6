"""The `tandem` command: train, rollout, init-model, merge, export, eval, plot, show, demo."""

import argparse
import contextlib
import ctypes
import errno
import gc
import logging
import os
import resource
import sys
import traceback
from pathlib import Path

# Each demo task's training options (inside the package, so a wheel ships them) and folder.
DEMO_CONFIG = Path(__file__).resolve().parent / "demo.yaml"
DEMOS = {"addition": (DEMO_CONFIG, "runs/demo"), "calculator": (DEMO_CONFIG.with_name("demo_calculator.yaml"), "runs/calculator"),
         "agent": (DEMO_CONFIG.with_name("demo_agent.yaml"), "runs/agent")}  # fmt: skip


@contextlib.contextmanager
def _collector_paused():
    """Python's garbage collector held off while modules load: torch, transformers and the rest
    make about 400k objects and almost no garbage, and each of the ~1,000 collections the
    allocations set off would scan them (0.8 s of a `tandem train` process's start)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _train(args: argparse.Namespace) -> int:
    if os.environ.get("NPROC_PER_NODE") and "LOCAL_RANK" not in os.environ:
        _launch(os.environ["NPROC_PER_NODE"], args.argv)
    with _collector_paused():
        from tandem.trainer.config import config_from_args
        from tandem.trainer.loop import NonFiniteStepError, Preempted, train
        from tandem.trainer.stops import SIGTERM_EXIT

    config = config_from_args(args)  # validated here, before any model loads
    try:
        train(config)
    except NonFiniteStepError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 1
    except Preempted as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return SIGTERM_EXIT
    return 0


def _launch(processes: str, argv: list[str]) -> None:
    """`NPROC_PER_NODE=N tandem train ...`: this command in N processes under torchrun, as ms-swift
    starts `swift rlhf` (its NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT too). torchrun takes
    this process's place, so a scheduler's SIGTERM reaches it and its ranks."""
    from tandem.trainer.config import ConfigError

    if not processes.isdigit() or int(processes) < 1:
        raise ConfigError(f"NPROC_PER_NODE={processes!r}: give the number of training processes, e.g. NPROC_PER_NODE=2")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", processes]
    for variable, flag in (("NNODES", "--nnodes"), ("NODE_RANK", "--node_rank"), ("MASTER_ADDR", "--master_addr"), ("MASTER_PORT", "--master_port")):
        if os.environ.get(variable):
            launcher += [flag, os.environ[variable]]
    sys.stdout.flush()
    os.execv(sys.executable, [*launcher, "-m", "tandem.cli", *argv])


def _rollout(args: argparse.Namespace) -> int:
    with _collector_paused():
        from tandem.server.app import serve

    return serve(args)


def _init_model(args: argparse.Namespace) -> int:
    from tandem.init_model import init_model

    model, _ = init_model(args.out, size=args.size, seed=args.seed, head_dim=args.head_dim, reward_model=args.reward_model)
    n = sum(p.numel() for p in model.parameters())
    kind = "reward model (sequence classifier, one score)" if args.reward_model else "model"
    print(f"wrote a {args.size} Qwen2 {kind} ({n / 1e6:.2f}M parameters) with tokenizer and chat template to {args.out}")
    return 0


def _files_command(run):
    """A command that reads what the user names (a run folder, a checkpoint): a missing or wrong
    one is reported in one line with exit code 2, not a traceback."""

    def checked(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except (FileNotFoundError, ValueError) as exc:
            print(f"tandem: {exc}", file=sys.stderr)
            return 2

    return checked


def _merge(args: argparse.Namespace) -> int:
    from tandem.trainer.lora import export_merged

    out = export_merged(Path(args.checkpoint), Path(args.out))
    print(f"wrote base model + adapters of {args.checkpoint} as one model to {out} (loads with AutoModelForCausalLM)")
    return 0


def _export(args: argparse.Namespace) -> int:
    from tandem.trainer.sharding import export

    out = export(Path(args.checkpoint), Path(args.out))
    print(f"wrote the sharded weights of {args.checkpoint} as one model to {out} (loads with AutoModelForCausalLM)")
    return 0


def _show(args: argparse.Namespace) -> int:
    from tandem.show import read_completions, table

    text = table(read_completions(Path(args.run_dir)), args.step, args.width)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `tandem show RUN | head`: the reader stopped reading, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else Python's exit flush fails again
    return 0


def _eval(args: argparse.Namespace) -> int:
    from tandem.trainer.config import ConfigError
    from tandem.trainer.eval import format_table, run_eval, write_json

    if args.num_generations < 1:
        raise ConfigError(f"num_generations={args.num_generations}: must be >= 1")
    results = run_eval(args.model, args.dataset, args.reward_funcs, args.reward_weights, args.num_generations, args.greedy,
                       args.max_completion_length, args.temperature, args.max_prompt_length, args.pass_threshold, args.seed)  # fmt: skip
    print(f"{args.model} on {args.dataset}:\n{format_table(results)}")
    write_json(results, Path(args.out), {"model": args.model, "dataset": args.dataset, "reward_funcs": args.reward_funcs, "greedy": args.greedy})
    print(f"wrote {args.out}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from tandem.plot import plot

    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "plot.png"
    plot([Path(d) for d in args.run_dirs], out, args.smooth)
    print(f"wrote {out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    import time

    with _collector_paused():
        from tandem.demo import prepare, prepare_calculator
        from tandem.trainer.config import TrainConfig, load_yaml
        from tandem.trainer.loop import train

    config_file, folder = DEMOS[args.task]
    out = Path(args.output_dir or folder)
    t0 = time.perf_counter()
    model_dir, data = (prepare if args.task == "addition" else prepare_calculator)(out, seed=args.seed)
    print(f"demo: tiny model after its supervised warm-up in {model_dir}, {data.name} written ({time.perf_counter() - t0:.0f}s)")
    values = load_yaml(args.config or config_file)
    # The demo's run folder is its own: a demo run again starts afresh there.
    values.update(model_name_or_path=str(model_dir), dataset_name=str(data), output_dir=str(out / "run"), seed=args.seed, overwrite_output_dir=True)
    if args.max_steps:
        values["max_steps"] = args.max_steps
    config = TrainConfig(**values)
    config.validate()
    train(config)
    _print_demo_summary(out / "run" / "metrics.jsonl", time.perf_counter() - t0)
    from tandem.plot import plot

    print(f"demo: curves in {plot([out / 'run'], out / 'run' / 'plot.png', window=10)}; `tandem show {out / 'run'}` prints the last completions")
    return 0


def _print_demo_summary(metrics_path: Path, seconds: float) -> None:
    import json

    rewards = [json.loads(line)["reward"] for line in metrics_path.read_text().splitlines()]
    k = max(1, min(10, len(rewards) // 5))
    start, end = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"demo: mean reward {start:.3f} (first {k} steps) -> {end:.3f} (last {k} steps) in {seconds / 60:.1f} min")
    print(f"demo: metrics in {metrics_path}, sample completions in {metrics_path.parent / 'completions.jsonl'}")


def build_parser() -> argparse.ArgumentParser:
    from tandem.trainer.config import add_arguments

    parser = argparse.ArgumentParser(prog="tandem", description="GRPO training with a rollout engine running in tandem.", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser(
        "train",
        help="train a model with GRPO",
        description="Train with GRPO. Options come from --config YAML, then the command line; names follow TRL's GRPOConfig.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(run=_train)

    p = sub.add_parser(
        "rollout",
        help="serve generation and weight updates over HTTP for `tandem train --rollout_mode server`",
        description="The rollout server: generation, versioned weight updates, health. Binds 127.0.0.1 unless told otherwise.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from tandem.server.options import add_arguments as add_server_arguments

    add_server_arguments(p)
    p.set_defaults(run=_rollout)

    p = sub.add_parser("init-model", help="write a small random-init model with tokenizer and chat template (no network)")
    p.add_argument("out", help="folder to write the model to (HF format, loads with AutoModelForCausalLM)")
    p.add_argument("--size", default="tiny", choices=["tiny", "small", "medium"], help="tiny ~0.1M, small ~3M, medium ~25M parameters")
    p.add_argument("--seed", type=int, default=0, help="seed of the random init")
    p.add_argument("--head-dim", type=int, default=0, help="attention head size (0: the size's own: 16, 32, 64); vLLM's CPU attention needs 64 or more")
    p.add_argument("--reward-model", action="store_true", help="a sequence classifier of one score (a reward model for --reward_funcs) instead of a causal LM")
    p.set_defaults(run=_init_model)

    p = sub.add_parser("merge", help="write a LoRA checkpoint's base model with its adapters merged in, as one full model")
    p.add_argument("checkpoint", help="a checkpoint folder of a use_peft run (holds adapter_config.json)")
    p.add_argument("out", help="folder to write the merged model and tokenizer to (HF format)")
    p.set_defaults(run=_files_command(_merge))

    p = sub.add_parser("export", help="write a sharded (fsdp) checkpoint's weights as one HF model, on one process")
    p.add_argument("checkpoint", help="a checkpoint folder of an fsdp run (holds sharded/)")
    p.add_argument("out", help="folder to write the model and tokenizer to (HF format)")
    p.set_defaults(run=_files_command(_export))
    _add_eval(sub)
    _add_runs_readers(sub)
    return parser


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a model or checkpoint on prompts: mean rewards, pass@1 and pass@k; prints a table, writes JSON",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--model", required=True, help="model folder, a run's checkpoint (LoRA and sharded ones too) or hub name")
    p.add_argument("--dataset", required=True, help="prompts, as dataset_name takes them (a 'prompt' column; other columns reach the rewards)")
    p.add_argument("--reward_funcs", nargs="+", required=True, help="as in tandem train: built-in names, 'file.py:fn' or 'module:fn'")
    p.add_argument("--reward_weights", nargs="+", type=float, default=None, help="one weight per reward function (default all 1.0)")
    p.add_argument("--num_generations", type=int, default=4, help="completions per prompt, from fixed seeds (k of pass@k)")
    p.add_argument("--greedy", action="store_true", help="one greedy completion per prompt instead")
    p.add_argument("--max_completion_length", type=int, default=256, help="most tokens per completion")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--max_prompt_length", type=int, default=512, help="longest prompt in tokens (longer ones are an error)")
    p.add_argument("--pass_threshold", type=float, default=1.0, help="a completion passes when its weighted reward is at least this")
    p.add_argument("--seed", type=int, default=42, help="seed of the completions")
    p.add_argument("--out", default="eval.json", help="JSON file to write the results to")
    p.set_defaults(run=_eval)


def _add_runs_readers(sub) -> None:
    """plot, show and demo: commands about runs."""
    p = sub.add_parser("plot", help="draw runs' curves (reward, lengths, KL, clipping, staleness, time per phase, tokens/s) as a PNG")
    p.add_argument("run_dirs", nargs="+", help="output_dir of one or more `tandem train` runs (reads metrics.jsonl); several are overlaid")
    p.add_argument("--out", default=None, help="PNG to write (default: plot.png in the first run's folder)")
    p.add_argument("--smooth", type=int, default=1, help="moving average over this many steps (1: none)")
    p.set_defaults(run=_files_command(_plot))

    p = sub.add_parser("show", help="print a run's logged completions as a table: rewards, advantage, version, prompt, completion")
    p.add_argument("run_dir", help="the output_dir of a `tandem train` run (reads its completions.jsonl)")
    p.add_argument("--step", type=int, default=None, help="the step to show (default: the last one logged)")
    p.add_argument("--width", type=int, default=None, help="line width (default: the terminal's)")
    p.set_defaults(run=_files_command(_show))

    p = sub.add_parser("demo", help="a tiny model learns single-digit addition by RL, with --task calculator to call a tool, or with "
                                    "--task agent the same as an OpenAI Agents SDK agent (2 CPU cores, a few minutes, no network)")  # fmt: skip
    p.add_argument("--task", choices=list(DEMOS), default="addition",
                   help="addition: single-digit sums, learned from the reward alone; calculator: three-digit sums, "
                        "which the model learns to get right by calling the calculator tool; agent: the calculator task as an "
                        "agent written with the OpenAI Agents SDK (examples/agent_calculator.py; pip install 'tandem-rl[agents]')")  # fmt: skip
    p.add_argument("--output_dir", default=None, help="where the model, data and run go (default: runs/<task>, runs/demo for addition)")
    p.add_argument("--config", default=None, help="training options of the demo (default: the task's own, examples/addition.yaml, "
                                                  "examples/calculator.yaml or examples/agent_calculator.yaml)")  # fmt: skip
    p.add_argument("--max_steps", type=int, default=0, help="override the demo config's max_steps (0 keeps it)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, data and training")
    p.set_defaults(run=_demo)


class _Parser(argparse.ArgumentParser):
    """A command's parser: an option is taken by its whole name only (a prefix such as
    --learning_rat is an unknown option, not silently --learning_rate)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)


def _reject_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """One line per unknown option, with the closest option of the command and the --help hint,
    instead of argparse's usage block (exits 2)."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    options = [o for o in sub._option_string_actions if o.startswith("--")]
    lines = []
    for arg in unknown:
        name = arg.split("=", 1)[0]
        if name.startswith("-"):
            close = difflib.get_close_matches(name, options, n=1)
            lines.append(f"unknown option {name}" + (f"; did you mean {close[0]}?" if close else ""))
    lines = lines or [f"unrecognized arguments: {' '.join(unknown)}"]
    print("\n".join(f"tandem {command}: {line} (`tandem {command} --help` lists the options)" for line in lines), file=sys.stderr)
    sys.exit(2)


def _log_to_stderr() -> None:
    """tandem's log lines on the stderr of this call. One handler, replaced on each call, so that
    main() called again in one process (a notebook, a sweep, the tests) neither repeats every line
    nor writes to a stream an earlier caller has closed."""
    log = logging.getLogger("tandem")
    for old in [h for h in log.handlers if getattr(h, "tandem_cli", False)]:
        log.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("tandem: %(message)s"))
    handler.tandem_cli = True
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _return_freed_memory() -> None:
    """Tensors of 4 MiB or more go back to the OS as soon as they are freed: glibc maps each such
    block on its own. Otherwise glibc's heap keeps freed blocks under a threshold that grows to
    32 MB, fragmented, and a training step peaks well above what it holds live. At the
    Qwen2.5-0.5B shape in fp32 (the floor of fp32 AdamW is 7.9 GB), bench/scale.py's colocated
    run at 256 tokens peaked at 11.2 GB without this, 9.8 GB at 16 MiB and 8.9 GB at 4 MiB or
    1 MiB, all within 5% in step time. Below 4 MiB the pages of every mid-sized tensor fault in
    again: at bench/vs_trl.py's toy long shape a training phase took 1.19-1.26 s at 1 MiB against
    0.78-0.82 s at 4 MiB. torch's huge pages for large tensors (THP_MEM_ALLOC_ENABLE=1) stay off,
    torch's default: where the kernel compacts memory for a huge page at the fault
    (transparent_hugepage/defrag "madvise", as here), the 0.5B shape's training phase at 8 x 256
    in bf16 took 44.7 s with them against 40.1 without, at the same peak (docs/benchmarks.md)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: another allocator, left as it is


def _open_files() -> None:
    """As many file descriptors as this process may have: the soft limit raised to the hard one.
    Every session of an agent, every client of a rollout server and every tool worker holds
    sockets or pipes, and the common soft limit of 1,024 was reached by 512 concurrent sessions.
    Where the hard limit is reached anyway, asyncio's traceback for each refused accept (18,406
    of them, 7.4 MB of log, in that run) becomes one line, said once."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # a hard limit the kernel caps lower (macOS): the soft one stays
        pass
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _OutOfFilesOnce) for f in asyncio_log.filters):
        asyncio_log.addFilter(_OutOfFilesOnce())


class _OutOfFilesOnce(logging.Filter):
    """asyncio's records of an accept() that failed for want of file descriptors: the first as one
    line naming the limit, the rest dropped (the listener retries, and connections wait)."""

    said = False

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not (isinstance(exc, OSError) and exc.errno == errno.EMFILE):
            return True
        if self.said:
            return False
        self.said = True
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        record.msg, record.args, record.exc_info = (f"this process has all the {limit} file descriptors it may open (ulimit -n): new connections "
                                                    "wait until others close; raise the limit (ulimit -n, or the hard limit) for more at once"), (), None  # fmt: skip
        return True


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done; 2 a user's mistake (a config value, a dataset, a reward function), one
    message naming it and the fix, the traceback only with TANDEM_DEBUG=1 (a reward function, a
    tool's environment or a rollout_func that fails included); 1 a failure (a server
    gone, a round never came, a checkpoint or log line the disk could not hold, a non-finite step under
    on_nonfinite error); 143 stopped by SIGTERM, with a checkpoint."""
    _return_freed_memory()
    _open_files()
    with _collector_paused():
        from tandem.data import DataError
        from tandem.rewards import RewardError
        from tandem.rollout.client import RolloutServerError
        from tandem.rollout.multiturn import TrajectoryError
        from tandem.trainer.checkpoint import CheckpointError
        from tandem.trainer.config import ConfigError
        from tandem.trainer.metrics import LogWriteError
        from tandem.trainer.producer import RoundTimeout
        from tandem.trainer.stops import AgentsFailing, OtherRankFailed

        parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    args.argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if unknown:
        _reject_unknown(parser, args.command, unknown)
    _log_to_stderr()
    try:
        return args.run(args)
    except (ConfigError, DataError, RewardError, TrajectoryError, FileNotFoundError) as exc:
        _report(f"{'config error: ' if isinstance(exc, ConfigError) else ''}{exc}")
        return 2
    except (RolloutServerError, RoundTimeout, OtherRankFailed, AgentsFailing, CheckpointError, LogWriteError) as exc:
        _report(str(exc))
        return 1


def _report(message: str) -> None:
    if os.environ.get("TANDEM_DEBUG", "") not in ("", "0"):
        traceback.print_exc()
    print(f"tandem: {message}", file=sys.stderr)


def run() -> None:
    """The `tandem` process (its script, `python -m tandem.cli`, each torchrun worker): main(),
    then an exit without the interpreter's last garbage collections. Python's exit tears down
    every module and collects several times over everything torch and transformers made: 1.2 s
    of a short `tandem train` process. What the run left as garbage is collected here once, as
    Python would (finalizers run, files flush); what is still reachable is frozen (gc.freeze), out
    of the collections that follow, and freed with the process. The working directory is on
    sys.path first, as `python -m` has it, for the `module:fn` specs of reward functions and tools."""
    if os.getcwd() not in sys.path and "" not in sys.path:  # `module:fn` specs import from here, as under `python -m`
        sys.path.insert(0, os.getcwd())
    code = main()
    gc.collect()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
