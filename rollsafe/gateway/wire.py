"""The OpenAI API subset the gateway serves, as strict models (docs/gateway.md, "API").

``POST /v1/chat/completions`` (:class:`ChatRequest`), ``POST /v1/responses``
(:class:`ResponsesRequest`) and ``GET /v1/models``. Every model forbids unknown fields, so a
field the gateway does not implement is a 422 naming it rather than silently ignored; fields
an OpenAI client commonly sends that change nothing here (``user``, ``store``, ``seed``, ...)
are accepted and documented as ignored. Requests may carry NeMo Gym's training fields
(``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``, ``routed_experts``)
on the items and messages an agent sends back: they are accepted and not used (the session's
record already holds every token the gateway made).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

# What a sampling request may ask for; each default defined once, here.
DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
SESSION_METADATA_KEY = "rollsafe_session"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainingFields(_Strict):
    """NeMo Gym's per-item token fields (``nemo_gym.openai_utils.TokenIDLogProbMixin``): all
    three of the token ids and logprobs or none (as NeMo Gym 0.7 checks), ``routed_experts``
    only with them, as nested lists or a trainer's opaque string envelope (NeMo RL's
    ``nrlre1:...``)."""

    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None
    routed_experts: str | list[list[list[int]]] | None = None

    @model_validator(mode="after")
    def _together(self) -> Self:
        given = {name for name in _TOKEN_FIELDS if getattr(self, name) is not None}
        if given and not given >= _REQUIRED_TOKEN_FIELDS:
            missing = ", ".join(sorted(_REQUIRED_TOKEN_FIELDS - given))
            raise ValueError(
                f"the token fields come together: {', '.join(sorted(given))} given, "
                f"{missing} missing"
            )
        return self


_REQUIRED_TOKEN_FIELDS = frozenset(
    {"prompt_token_ids", "generation_token_ids", "generation_log_probs"}
)
_TOKEN_FIELDS = _REQUIRED_TOKEN_FIELDS | {"routed_experts"}


# -- tools ------------------------------------------------------------------------------------


class FunctionSpec(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class ResponsesTool(_Strict):
    """A Responses API function tool: the function's fields inline."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def spec(self) -> FunctionSpec:
        return FunctionSpec(
            name=self.name,
            description=self.description,
            parameters=self.parameters,
            strict=self.strict,
        )


class NamedFunction(_Strict):
    name: str


class ChatToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ResponsesToolChoice(_Strict):
    type: Literal["function"]
    name: str


ToolChoiceMode = Literal["auto", "none", "required"]


# -- chat completions -------------------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["text", "input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="JSON, as a string (OpenAI's convention)")


class ChatToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(TrainingFields):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls on a {self.role} message (only assistant has them)")
        return self


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoiceMode | ChatToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    logprobs: bool = False
    top_logprobs: Literal[0] | None = Field(
        default=None, description="alternatives are not kept: 0 or absent"
    )
    metadata: dict[str, str] | None = None
    # Accepted and ignored (docs/gateway.md): sampling noise is keyed by the session's call,
    # never by a caller's seed; the rest do not change what the model makes here.
    seed: int | None = None
    user: str | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = Field(default=None, ge=0.0, le=0.0, description="only 0")
    frequency_penalty: float | None = Field(default=None, ge=0.0, le=0.0, description="only 0")

    @property
    def budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


# -- responses --------------------------------------------------------------------------------


class MessageItem(TrainingFields):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(TrainingFields):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(TrainingFields):
    """Accepted so an agent can send back what a reasoning model returned; not rendered."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(item: Any) -> str:
    # An "easy input message" ({"role": ..., "content": ...}) has no type field.
    if isinstance(item, dict):
        return str(item.get("type", "message"))
    return str(getattr(item, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponsesTool] = Field(default_factory=list)
    tool_choice: ToolChoiceMode | ResponsesToolChoice = "auto"
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(default=None, ge=1)
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    stream: bool | None = None
    # Accepted and ignored (docs/gateway.md).
    store: bool | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    top_logprobs: Literal[0] | None = None
    include: list[str] | None = None
    background: Literal[False] | None = None
    previous_response_id: None = Field(
        default=None, description="not kept: send the whole conversation as input"
    )

    @property
    def budget(self) -> int:
        return self.max_output_tokens or DEFAULT_MAX_TOKENS


# -- replies ----------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rollsafe"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
