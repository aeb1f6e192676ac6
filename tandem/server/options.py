"""`tandem rollout`'s options, apart from the server: every other command's parser is built
without loading FastAPI (0.3 s of each `tandem train` process's start)."""

import argparse
import os
from pathlib import Path

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
DEFAULT_MAX_CHUNK_BYTES = 2 * 2**30
DEFAULT_BODY_TIMEOUT = 30.0
ENGINE_NAMES = ("transformers", "vllm")  # tandem.server.app.ENGINES loads each
API_KEY_ENV = "TANDEM_API_KEY"  # the rollout servers' key, read by `tandem rollout` and `tandem train` alike


def read_api_key(given: str | None, file: str | None, file_option: str) -> str | None:
    """The servers' key: `given`, else the first line of `file`, else the environment's
    TANDEM_API_KEY, else None. A file without a key is a ValueError naming `file_option`."""
    if given is not None:
        return given
    if file is not None:
        try:
            return Path(file).read_text().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            raise ValueError(f"{file_option} {file}: no key read from it ({exc or 'the file is empty'})") from None
    return os.environ.get(API_KEY_ENV) or None


def api_key(args: argparse.Namespace) -> str | None:
    """`tandem rollout`'s key: --api-key, else --api-key-file, else TANDEM_API_KEY."""
    return read_api_key(args.api_key or None, args.api_key_file or None, "--api-key-file")


def _one_engine(text: str) -> int:
    if text != "1":
        raise argparse.ArgumentTypeError(f"{text!r}: a tandem rollout server runs one engine; for {text}, start {text} servers on ports "
                                         "of their own and give the trainer every one (--vllm_server_port P1 P2 ...)")  # fmt: skip
    return 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder in HF format or hub name (the trainer's starting weights)")
    p.add_argument("--served-model-name", "--served_model_name", dest="served_model_name", default=None,
                   help="the model's id in the OpenAI-compatible API (/v1/models); default: the model folder's name, or a hub name's last part "
                   "(a path as an id reads as a provider prefix to some clients). Requests that name --model are answered too")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; anything but loopback needs --api-key (or --insecure)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="dtype the engine holds the weights in")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health. Rather than here, "
                   "where other users of the host see it: in the environment variable TANDEM_API_KEY, or --api-key-file")
    p.add_argument("--api-key-file", default=None, help="a file holding the key (its first line), instead of --api-key")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without --api-key (anyone who reaches the port can replace the weights)")
    p.add_argument("--max-batch-tokens", type=int, default=65536, help="most prompt + max_tokens tokens in one engine call")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, help="largest JSON request body")
    p.add_argument("--max-weight-chunk-bytes", type=int, default=DEFAULT_MAX_CHUNK_BYTES, help="largest weight chunk body")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT, help="seconds a request body may pause between pieces before the request is dropped (408)")
    p.add_argument("--run-lease", type=float, default=60.0, help="seconds a training run's hold on the server lasts without renewal: "
                   "its trainer renews it every quarter of this, so a trainer that died frees the server after it")
    p.add_argument("--max-version-waiters", type=int, default=256, help="most /generate requests that may wait for a min_version at once; more get 503")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads. 0: on --device cpu, half of this host's cores (a trainer on the same host takes the rest in async mode, and lends the server every core while it generates for a sync run); on a GPU, torch's default. Given, the server keeps it")
    p.add_argument("--engine", default="transformers", choices=ENGINE_NAMES, help="transformers: tandem's own decode loop (any causal LM, CPU or GPU). vllm: vLLM (pip install 'tandem-rl[vllm]'); the options below are vLLM's own")
    v = p.add_argument_group("vLLM engine options (--engine vllm; unset: vLLM's defaults, but see --kv-cache-memory-bytes on CPU)")
    v.add_argument("--gpu-memory-utilization", "--vllm_gpu_memory_utilization", dest="gpu_memory_utilization", type=float, default=None,
                   help="fraction of GPU memory vLLM may use for weights and KV cache")  # fmt: skip
    v.add_argument("--tensor-parallel-size", "--vllm_tensor_parallel_size", "--tensor_parallel_size", dest="tensor_parallel_size", type=int,
                   default=None, help="GPUs to shard the model over")  # fmt: skip
    v.add_argument("--data_parallel_size", "--vllm_data_parallel_size", dest="data_parallel_size", type=_one_engine, default=1,
                   help="ms-swift's engines per server: 1 (for more, start a server per engine and give the trainer each URL)")  # fmt: skip
    v.add_argument("--max-model-len", "--vllm_max_model_len", dest="max_model_len", type=int, default=None,
                   help="longest prompt + completion; default: the model's")  # fmt: skip
    v.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None, help="reuse the KV cache of shared prompt prefixes (cleared at every weight update)")
    v.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs or torch.compile: starts faster, generates slower")
    v.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="bytes of KV cache. On --device cpu, where it lives in host memory, the default is what --max-batch-tokens tokens need")
