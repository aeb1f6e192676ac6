"""The rollout server's wire format: pydantic models, JSON only (no pickle crosses the wire)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.rollout.grammar import check
from tandem.rollout.types import REPETITION_PENALTY_RANGE, TEMPERATURE_RANGE


class _Strict(BaseModel):
    # A misspelt field is an error, not a silent default; and no coercion: a token id of true,
    # "3" or 2.0 is a client bug to report, not to guess at. NaN and infinity are refused.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Sampling(_Strict):
    max_tokens: int = Field(256, ge=1, description="Most tokens generated per completion.")
    temperature: float = Field(1.0, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1], description="0.01 is near-greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    min_p: float = Field(0.0, ge=0, lt=1)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1], description="1.0 disables it.")
    grammar: str | None = Field(None, min_length=1, max_length=1 << 20, description="Constrained decoding: llguidance's Lark dialect (tandem/rollout/grammar.py).")

    @field_validator("grammar")
    @classmethod
    def _compiles(cls, grammar):
        if grammar is not None:
            check(grammar, "sampling.grammar")
        return grammar


class GenerateRequest(_Strict):
    prompts: list[list[int]] = Field(..., min_length=1, description="Prompts as token-id lists.")
    n: int = Field(1, ge=1, description="Completions per prompt.")
    sampling: Sampling = Sampling()
    seeds: list[int] = Field(..., description="One seed per completion, len(prompts) * n, prompt-major.")
    min_version: int = Field(0, ge=0, description="Generate only with weights of at least this policy version.")
    version_timeout: float = Field(0.0, ge=0, le=3600, description="Seconds to wait for min_version to go live.")
    instance_id: str | None = Field(
        None, max_length=64, description="The server process the client synced (GET /health): another one refuses the request (409), as it lost that process's weights."
    )


class CompletionOut(BaseModel):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "error"]
    version: int


class GenerateResponse(BaseModel):
    completions: list[CompletionOut]  # len(prompts) * n, prompt-major


class Health(BaseModel):
    status: Literal["loading", "ready"]
    version: int
    instance_id: str  # new at every server start: a client that sees it change knows the server restarted


class Info(BaseModel):
    model: str
    engine: str
    dtype: str
    device: str
    version: int
    vocab_size: int
    max_model_len: int
    max_batch_tokens: int
    max_request_bytes: int
    max_weight_chunk_bytes: int
    host_id: str  # equal for processes on one host: lets a client pick the shared-memory path
    cuda_device: str | None = None  # the UUID of the GPU its engine runs on: a trainer on it pushes through CUDA IPC
    threads: int  # CPU threads the engine keeps busy: a trainer on the same host leaves them free
    stats: dict[str, int]  # requests, engine_calls, sequences, prompt_tokens and cached_prompt_tokens (prefix cache hits) so far


class WeightUpdateBegin(_Strict):
    version: int = Field(..., ge=0, description="The version this update makes live; must be the current one + 1 unless force.")
    force: bool = Field(False, description="Accept any version (a trainer (re)starting makes the server match it).")
    num_tensors: int = Field(..., ge=1)
    adapter: bool = Field(False, description="A LoRA adapter update: factors '<weight>.lora_A' and '<weight>.lora_B' (scale folded into B), and whole weights; served merged into the base weights.")
    run_id: str | None = Field(None, max_length=64, description="The pushing run (POST /run); while a run holds the server, only it may push.")
    delta_from: int | None = Field(None, ge=0, description="A delta update against this version, the one live: its chunks go to /weights/{id}/delta and its commit names "
                                   "the result's fingerprint. Refused (409) unless the server kept that version as a delta base (keep_base).")  # fmt: skip
    keep_base: bool = Field(False, description="Keep this update's weights as the base the next delta update applies to (where the engine does not hold the "
                            "weights as received, a copy: the model's size in memory). Only an update in the engine's dtype can be one.")  # fmt: skip


class RunClaim(_Strict):
    run_id: str = Field(..., min_length=1, max_length=64, description="The training run's id (kept in its checkpoints: a resumed run has the same).")
    name: str = Field(..., max_length=1000, description="Where the run is (output_dir, host, pid), for a refused run's message.")
    threads: int | None = Field(None, ge=1, le=4096, description=(
        "CPU threads the server's engine calls may use while this run holds it: its trainer, on the same host, waits while "
        "they run (sync mode). At most the server's cores; ignored by a server started with --threads. None: the server's own."))  # fmt: skip


class RunHolder(BaseModel):
    run_id: str
    name: str
    since: float  # seconds since the epoch of the run's first claim
    lease_seconds: float  # the hold lapses this long after the last claim: the trainer claims again before


class WeightUpdateHandle(BaseModel):
    update_id: str


class WeightFile(_Strict):
    path: str = Field(..., max_length=64, description="/proc/<pid>/fd/<n>: a sealed memfd holding safetensors, of a process of the server's user on its host.")


class CudaBuffer(_Strict):
    """weights.share_cuda: torch's CUDA IPC handles for a uint8 buffer on the server's GPU."""

    handle: str = Field(..., max_length=256)
    storage_bytes: int = Field(..., ge=0)
    storage_offset: int = Field(..., ge=0)
    offset: int = Field(..., ge=0)
    nbytes: int = Field(..., ge=1)
    ref_counter: str = Field(..., max_length=1024)
    ref_counter_offset: int = Field(..., ge=0)
    event: str | None = Field(None, max_length=256)
    event_sync: bool


class WeightBuffer(_Strict):
    header: dict = Field(..., description="The safetensors header of the buffer's tensors (each tensor's dtype, shape and data_offsets).")
    buffer: CudaBuffer = Field(..., description="The buffer, in a process on the server's GPU (weights.share_cuda).")


class Staged(BaseModel):
    staged: int  # tensors of the update staged so far


class WeightCommit(_Strict):
    fingerprint: str | None = Field(None, max_length=64, description="The fingerprint (GET /weights/fingerprint) the staged weights must have in the engine's dtype; "
                                    "the commit is refused (409) and the update dropped when they differ. Required for a delta update.")  # fmt: skip


class WeightCommitResult(BaseModel):
    version: int
    fingerprint: str


class Fingerprint(BaseModel):
    version: int
    fingerprint: str  # of the weights served (merged, when an adapter is live)
    base_fingerprint: str | None = None  # only while an adapter is live: of the weights it is merged into
    adapter_fingerprint: str | None = None  # only while an adapter is live: of its tensors as received


class ErrorBody(BaseModel):
    error: str
