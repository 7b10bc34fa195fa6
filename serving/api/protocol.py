"""OpenAI-compatible request schemas (pydantic) and the OpenAI error body.

Unknown fields are ignored, as OpenAI-compatible servers do; vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...) are accepted too.

Every integer is bounded here, before it can reach a tensor: a JSON integer has no size limit, and one
that does not fit in 64 bits used to stop the engine thread for every client (``top_k: 1e20``). NaN and
infinity (which Python's JSON parser accepts) are refused for the same reason. Bounds that depend on
the model (``top_k`` against the vocabulary, ``max_tokens`` against the context) are the engine's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
# Far above any context length, far below anything a tensor cannot hold.
MAX_TOKEN_COUNT = 2 ** 31 - 1
MAX_CHOICES = 16
MAX_LOGPROBS = 20

TokenCount = Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: a named schema. ``strict`` is accepted either way: the engine
    always holds a reply to its schema (OpenAI's strict mode), so there is no looser mode to fall back to."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _a_json_schema(self) -> JsonSchemaFormat:
        """A schema that is not JSON Schema at all is refused here, naming its part (the engine's grammar
        compiler names what it cannot use of a valid one)."""
        check_json_schema(self.schema_, "schema")
        return self


MAX_SCHEMA_NESTING = 24


def check_json_schema(schema: dict, field: str) -> None:
    """ValueError ``"<field>.<path>: why"`` unless ``schema`` is JSON Schema (draft 2020-12) of sane depth."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if _nesting(schema) > MAX_SCHEMA_NESTING:  # the checks below recurse a few frames per level
        raise ValueError(f"{field}: nests deeper than {MAX_SCHEMA_NESTING} levels")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "".join(f".{p}" for p in e.path)
        raise ValueError(f"{field}{where}: {e.message}") from None
    except RecursionError:  # a $ref cycle, say
        raise ValueError(f"{field}: too deeply recursive to check") from None


def _nesting(value: Any) -> int:
    """How deep ``value``'s dicts and lists nest, without recursion (a hostile body may nest thousands deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_NESTING:
                stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (free), ``json_object`` (any JSON object) or ``json_schema``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required when type is json_schema")
        return self


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKEN_COUNT)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    # vLLM's range: a signed 64-bit integer; choice i of n samples with seed + i, which must fit too
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    min_tokens: TokenCount = 0
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # vLLM's extension: the stream's first chunk carries `prompt_token_ids`, every chunk's choice the `token_ids`
    # it adds, so a gateway can finish a broken stream on another replica from exactly those tokens
    return_token_ids: StrictBool = False
    user: str | None = None
    # the reply as JSON (any object, or one schema): held to it by a grammar in the engine's sampler
    response_format: ResponseFormat | None = None
    # ours (vLLM has none): the prompt's last N tokens are the reply so far, which the grammar reads first; the
    # gateway sends it when it finishes a constrained stream on another replica
    response_prefix_tokens: TokenCount = 0

    @model_validator(mode="after")
    def _prefix_needs_a_format(self) -> _Sampling:
        fmt = self.response_format
        if self.response_prefix_tokens and (fmt is None or fmt.type == "text"):
            raise ValueError("response_prefix_tokens: needs a json response_format")
        return self

    @model_validator(mode="after")
    def _seed_covers_every_choice(self) -> _Sampling:
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            raise ValueError(f"seed: seed + n - 1 must be <= {INT64_MAX} (choice i samples with seed + i)")
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: TokenCount | None = 16
    echo: StrictBool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)


class TextContentPart(BaseModel):
    """An OpenAI content part, well-formed whatever its type; the models served read text only, so the chat
    handler answers any other type (an image) with a 400 naming the part."""

    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[TextContentPart] | None = None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _parameters_are_a_schema(self) -> FunctionSpec:
        if self.parameters is not None:
            check_json_schema(self.parameters, "parameters")
        return self


class ToolSpec(BaseModel):
    """OpenAI's ``tools[i]``: a function the model may call, its arguments described by a JSON schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    # vLLM's: render the last (assistant) message open-ended so the model continues it; the gateway uses
    # this to finish on another replica a stream whose replica died mid-answer
    continue_final_message: StrictBool = False

    @model_validator(mode="after")
    def _continue_needs_no_generation_prompt(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt=false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's")
        return self


# ----------------------------------------------------------------------------- responses
# What the handlers answer, as models: they are published in the OpenAPI document (client generators and
# the fuzz test read them); the handlers build plain dicts on the hot path.
FinishReason = Literal["stop", "length", "abort", "error"]
ErrorType = Literal["invalid_request_error", "not_found_error", "rate_limit_error", "server_error",
                    "service_unavailable"]


class ErrorInfo(BaseModel):
    message: str
    type: ErrorType
    param: str | None = Field(None, description="the request field at fault, dotted (`messages.0.content`)")
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object: every 4xx and 5xx answer has this body."""

    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string holding a lone UTF-16 surrogate, else None.

    JSON may escape one (``"\\ud800"``) and Python's parser keeps it, but it is not Unicode text: the
    tokenizer and the UTF-8 encoder fail on it deep inside the request, so it is refused at the door.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = find_lone_surrogate(key, path) or find_lone_surrogate(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = find_lone_surrogate(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None

