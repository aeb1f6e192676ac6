"""The OpenAI-compatible endpoint's wire format (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`), in the shape of OpenAI's API and vLLM's `entrypoints/openai/protocol.py`.

A request field tandem cannot honour is refused (400, naming it), never ignored: a client that
asks for `top_logprobs` or a forced tool call must not get something else without knowing. Fields
OpenAI's own client sends back unchanged inside earlier messages (an assistant message's
`refusal`, `annotations`, `audio`, `function_call`, all null) are accepted when null, and so are
vLLM's and SGLang's switches that a router writes into what it forwards, at the values that ask
for what tandem does (NEUTRAL; the reasoning switches at any value: there is no reasoning to
separate). Every response also carries the token ids of the prompt and of each completion (as
vLLM's `return_token_ids` does), so a client can train on exactly the engine's tokens.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.rollout.types import REPETITION_PENALTY_RANGE, TEMPERATURE_RANGE

ROLES = ("system", "developer", "user", "assistant", "tool")
# What OpenAI's client writes into an assistant message it hands back (ChatCompletionMessage
# dumped), null where tandem's responses leave them.
_ECHOED = ("refusal", "annotations", "audio", "function_call")


# The value of each vLLM or SGLang switch that asks for what tandem does: stop strings cut from
# the text, generation ended at EOS, special tokens left out of the text, no hidden states, a
# new assistant turn.
NEUTRAL = {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False, "continue_final_message": False}


class _Request(BaseModel):
    # A field tandem does not know is an error naming it (OpenAI answers the same: 400).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI writes it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Request):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image_url", "input_image", "image"):
            raise ValueError("images are not supported: the served model takes text; send text parts")
        if kind not in (None, "text"):
            raise ValueError(f"content parts of type {kind!r} are not supported; send text parts")
        return part


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _known(self):
        extra = {k: v for k, v in (self.model_extra or {}).items() if not (k in _ECHOED and v in (None, []))}
        if extra:
            raise ValueError(f"message fields {sorted(extra)} are not supported")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionSpec(_Request):
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(_Request):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None  # {"name", "schema", "strict", "description"}

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and not isinstance((self.json_schema or {}).get("schema", {}), dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema (an object)")
        return self

    def answer(self) -> dict | None:
        """The schema an answer must be a value of ({} for any object), None for free text."""
        if self.type == "json_schema":
            return (self.json_schema or {}).get("schema") or {}
        return {} if self.type == "json_object" else None


class _Bookkeeping(_Request):
    """What clients send for their own bookkeeping (OpenAI's stored completions, tracing, routing
    tiers), in chat and in the Responses API: it changes nothing in what is generated, so it is
    accepted and ignored."""

    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


def _forced_name(tool_choice) -> str | None:
    """The function a tool_choice names ({"type": "function", "function": {"name": ...}}), else None."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(tool_choice.get("function"), dict):
        return tool_choice["function"].get("name")
    return None


def _check_tool_choice(tool_choice, tools: list[str]) -> None:
    """tool_choice auto, none, required or a named function, of the declared `tools`' names."""
    if tool_choice in (None, "auto", "none"):
        return
    if tool_choice == "required" or _forced_name(tool_choice) is not None:
        if not tools:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools: declare the functions the answer must call")
        name = _forced_name(tool_choice)
        if name is not None and name not in tools:
            raise ValueError(f"tool_choice names the function {name!r}, which tools does not declare (declared: {', '.join(tools)})")
        return
    raise ValueError(f"tool_choice {tool_choice!r} is not supported: send 'auto', 'none', 'required' or "
                     "{'type': 'function', 'function': {'name': ...}}")  # fmt: skip


class _Sampling(_Bookkeeping):
    model: str
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0, le=TEMPERATURE_RANGE[1], description="0 is greedy (sampled at 0.01).")
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Bookkeeping too, ignored. reasoning_effort: the chat templates tandem serves take no
    # reasoning switch (a template that does takes it through chat_template_kwargs).
    reasoning_effort: str | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: dict | None = None
    # vLLM's extensions, named as there
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    # What tandem cannot honour, refused when set to anything but the value that asks for nothing.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's and SGLang's switches, which a router in front of several servers (vllm-router)
    # writes into every request it forwards, at the values that ask for what tandem does anyway
    # (NEUTRAL); any other value is refused, naming it.
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_hidden_states: bool = False

    @model_validator(mode="after")
    def _honoured(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported (use repetition_penalty, vLLM's)")
        for name, neutral in NEUTRAL.items():
            if getattr(self, name, neutral) != neutral:
                raise ValueError(f"{name} {getattr(self, name)} is not supported: tandem answers as with {name} {neutral}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        if self.prediction and (self.prediction.get("content") or "") not in ("", []):
            raise ValueError("prediction is not supported (predicted outputs): leave it out or empty")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(..., min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict | None = None  # "auto", "none", "required" or a named function (constrained)
    parallel_tool_calls: bool | None = None  # false: at most one call, the text ends after the first
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict | None = None  # vLLM's: accepted where it equals the run's (checked by the serving)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    continue_final_message: bool = False  # NEUTRAL
    # With no reasoning parser there is no reasoning to separate: any value answers the same.
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None

    @model_validator(mode="after")
    def _chat(self):
        _check_tool_choice(self.tool_choice, [t.function.name for t in self.tools or ()])
        if self.top_logprobs:
            raise ValueError("top_logprobs is not supported: the engines report the sampled token's log-prob only (logprobs: true)")
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; give one")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def one_call(self) -> bool:
        """At most one call in the answer: parallel_tool_calls false, or a named tool_choice."""
        return self.parallel_tool_calls is False or _forced_name(self.tool_choice) is not None

    def forced(self) -> list[dict] | None:
        """The function specs an answer must call (tool_choice required: any declared one; named:
        that one), None where the model may answer in text."""
        name = _forced_name(self.tool_choice)
        if self.tool_choice != "required" and name is None:
            return None
        return [t.function.model_dump(exclude_none=True) for t in self.tools if name is None or t.function.name == name]


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(..., description="Text, or token ids")
    logprobs: int | None = Field(None, ge=0, le=0, description="0: the sampled tokens' log-probs (more is not supported)")
    echo: bool = False

    @model_validator(mode="after")
    def _plain(self):
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    def limit(self) -> int | None:
        return self.max_tokens


# ---------------------------------------------------------------- responses


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int]  # the completion's tokens, exactly as the engine produced them


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int]  # the prompt as the server rendered and tokenized it
    version: int  # the policy version of the weights that generated every choice (tandem's)


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class TextChoiceLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list | None = None
    text_offset: list[int]


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: TextChoiceLogprobs | None = None
    token_ids: list[int]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    prompt_token_ids: list[int]
    version: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- the Responses API
# POST /v1/responses, as OpenAI's client and the frameworks over it (the Agents SDK's default
# model) send it. A request becomes a chat request (ResponsesRequest.chat), answered by the same
# serving logic, so a session records it as it records chat: the same rows, the same tokens.


class ResponsesTool(_Request):
    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponsesRequest(_Bookkeeping):
    model: str
    input: str | list[dict]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=TEMPERATURE_RANGE[1])
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    previous_response_id: str | None = None
    text: dict | None = None  # {"format": {"type": "text"}}; other formats as response_format
    # What the Agents SDK sends at its defaults, ignored
    reasoning: dict | None = None  # as reasoning_effort: no reasoning switch in these templates
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=0)
    stream_options: dict | None = None

    def messages(self, earlier: list[dict]) -> list[dict]:
        """The conversation as chat messages: `earlier` (previous_response_id's), the
        instructions as a system message first, then the input's items."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        out += [m for m in earlier if m["role"] != "system" or not self.instructions]
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for k, item in enumerate(items):
            kind = item.get("type", "message")
            if kind == "message":
                content = item.get("content")
                if isinstance(content, list):
                    content = [_text_part(part, k) for part in content]
                out.append({"role": item.get("role", "user"), "content": content})
            elif kind == "function_call":
                call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
                if out and out[-1]["role"] == "assistant":  # the calls of one answer join its message
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item["output"] if isinstance(item["output"], str) else "".join(_text_part(p, k)["text"] for p in item["output"])
                out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            elif kind == "reasoning":
                continue  # an earlier answer's reasoning: none is made here, none rendered
            else:
                raise ValueError(f"input[{k}]: items of type {kind!r} are not supported (messages, function_call, function_call_output)")
        return out

    def chat(self, earlier: list[dict]) -> ChatCompletionRequest:
        fmt = (self.text or {}).get("format")
        if fmt is not None and fmt.get("type") == "json_schema":  # the Responses API's shape of it, as chat's
            fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:  # the Responses API's shape of it, as chat's
            choice = {"type": "function", "function": {"name": choice["name"]}}
        tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools] if self.tools else None
        return ChatCompletionRequest(model=self.model, messages=self.messages(earlier), tools=tools, tool_choice=choice,
                                     parallel_tool_calls=self.parallel_tool_calls, max_completion_tokens=self.max_output_tokens,
                                     temperature=self.temperature, top_p=self.top_p, response_format=fmt)  # fmt: skip


def _text_part(part: dict, k: int) -> dict:
    if part.get("type") in ("input_text", "output_text", "text"):
        return {"type": "text", "text": part["text"]}
    if part.get("type") in ("input_image", "image_url"):
        raise ValueError(f"input[{k}]: images are not supported: the served model takes text; send input_text parts")
    raise ValueError(f"input[{k}]: content parts of type {part.get('type')!r} are not supported; send input_text parts")


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict = {"cached_tokens": 0}
    output_tokens_details: dict = {"reasoning_tokens": 0}


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete"]
    incomplete_details: dict | None = None
    model: str
    output: list[dict]  # message and function_call items, as OpenAI writes them
    instructions: str | None = None
    tools: list[dict] = []
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict = {"format": {"type": "text"}}
    error: None = None
    metadata: dict = {}
    usage: ResponseUsage
    prompt_token_ids: list[int]  # tandem's, as in a chat answer
    output_token_ids: list[int]
    version: int
