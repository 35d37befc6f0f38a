"""The checks of a request body before any work: the JSON, then every field, as the OpenAI API checks them.

A body is JSON (else 400 `invalid_json`), an object, and its fields have the types and ranges of the OpenAI API
(`max_tokens` >= 1, `temperature` in [0, 2], `top_p` in (0, 1], `n` in [1, 128], up to 4 non-empty `stop` strings,
`messages` a non-empty array of messages with a known `role`, ...): each broken rule is a 400 naming the field
(`param`, as `messages[1].role`) and the rule. A field the OpenAI API does not have is refused as it refuses it
("Unrecognized request argument supplied"). A field it has that this server cannot honour (`n` > 1, `logprobs`, tools,
penalties, ...) is accepted at its no-op value and otherwise refused with a 400 saying so: never silently ignored.

The types are strict, as the API's are: `"0.5"` is not a number, `true` not an integer, `1.0` not an integer.
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from .errors import APIError, bad_request


# The OpenAI API's bounds.
MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 128
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Roles a message may have here: "tool" and "function" messages answer tool calls, which this server does not make.
SERVED_ROLES = ("system", "developer", "user", "assistant")


# The integer fields (the others with bounds are numbers): OpenAI's codes say which (`integer_below_min_value`).
INTEGER_FIELDS = {"max_tokens", "max_completion_tokens", "n", "seed", "top_logprobs", "best_of", "logprobs"}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class ChatMessage(StrictModel):
    role: Literal[ROLES]
    # A string, or an array of content parts ({"type": "text", "text": ...}); null only for an assistant message
    # (whose tool calls this server never makes).
    content: Any = None
    name: str | None = None
    # Fields of assistant and tool messages in the OpenAI API: accepted when empty (`check_supported`).
    tool_calls: list | None = None
    tool_call_id: str | None = None
    function_call: dict | None = None
    refusal: str | None = None
    audio: dict | None = None

    @field_validator("content", mode="before")
    @classmethod
    def text_content(cls, content):
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise PydanticCustomError(
                "invalid_type",
                "expected a string or an array of content parts, but got {kind}",
                {"kind": kind(content)},
            )
        for index, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise PydanticCustomError(
                    "invalid_type", "part {index} is not a content part object with a 'type'", {"index": index}
                )
            if part["type"] != "text":
                raise PydanticCustomError(
                    "unsupported_value",
                    "part {index} is of type '{type}': this server serves a text model and reads only 'text' parts",
                    {"index": index, "type": part["type"]},
                )
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise PydanticCustomError(
                    "invalid_type",
                    "part {index} must have 'type': 'text' and 'text': a string, nothing else",
                    {"index": index},
                )
        return content

    def text(self) -> str:
        """The message's text (an array's text parts joined by newlines)."""
        if isinstance(self.content, list):
            return "\n".join(part["text"] for part in self.content)
        return self.content or ""


def stop_sequences(stop):
    if stop is None:
        return None
    sequences = [stop] if isinstance(stop, str) else stop
    if not isinstance(sequences, list) or not all(isinstance(sequence, str) for sequence in sequences):
        raise PydanticCustomError(
            "invalid_type", "expected a string or an array of strings, but got {kind}", {"kind": kind(stop)}
        )
    if len(sequences) > MAX_STOP_SEQUENCES:
        raise PydanticCustomError(
            "array_above_max_length",
            "expected at most {most} stop sequences, but got {count}",
            {"most": MAX_STOP_SEQUENCES, "count": len(sequences)},
        )
    if any(sequence == "" for sequence in sequences):
        raise PydanticCustomError("empty_string", "a stop sequence is an empty string")
    return sequences


class SamplingFields(StrictModel):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: Any = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, int | float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def stop_as_list(cls, stop):
        return stop_sequences(stop)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    web_search_options: dict | None = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The completion's token budget the request asks for, and the field that asked."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt` is one prompt: a string, or an array of token ids (each also as a one-element
    array, as the API allows)."""

    prompt: Any
    suffix: str | None = None
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1, le=20)
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt", mode="before")
    @classmethod
    def one_prompt(cls, prompt):
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(token, int) and not isinstance(token, bool) for token in prompt):
            return prompt
        if isinstance(prompt, list) and all(isinstance(item, str | list) for item in prompt):
            raise PydanticCustomError(
                "unsupported_value",
                "{count} prompts in one request: this server answers one prompt per request; send them one by one",
                {"count": len(prompt)},
            )
        raise PydanticCustomError(
            "invalid_type", "expected a string or an array of token ids, but got {kind}", {"kind": kind(prompt)}
        )

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"


def kind(value) -> str:
    """The JSON name of a value's type, for messages ("a string", "an object", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def read_json_object(raw: bytes) -> dict:
    """The request body as a JSON object; 400 `invalid_json` otherwise."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad_request(
            f"The request body is not valid JSON ({error}). Send a JSON object, with the header "
            "'Content-Type: application/json'.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, but it is {kind(body)}.", code="invalid_json")
    return body


def parse_request(raw: bytes, model_class: type[SamplingFields]) -> SamplingFields:
    """The body checked field by field into `model_class`; the first broken rule is a 400 naming its field."""
    body = read_json_object(raw)
    try:
        request = model_class.model_validate(body)
    except ValidationError as error:
        raise validation_error(error.errors(include_url=False)) from None
    check_supported(request)
    return request


def parameter_name(location: tuple) -> str:
    """("messages", 0, "role") -> "messages[0].role", the API's spelling of a nested field."""
    name = ""
    for part in location:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def validation_error(errors: list[dict]) -> APIError:
    """The first of pydantic's errors as the OpenAI API words it."""
    error = errors[0]
    param = parameter_name(error["loc"])
    kind_of_error, value, context = error["type"], error.get("input"), error.get("ctx") or {}
    shown = json.dumps(value)[:80] if value is not None else "null"
    if kind_of_error == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if kind_of_error == "extra_forbidden":
        where, _, field = param.rpartition(".")
        message = f"Unrecognized request argument supplied: '{field or param}'"
        message += f" (in '{where}')." if where else "."
        return bad_request(message, param=param, code="unknown_parameter")
    bounds = {
        "greater_than_equal": (">=", "ge", "below_min_value"),
        "greater_than": (">", "gt", "below_min_value"),
        "less_than_equal": ("<=", "le", "above_max_value"),
        "less_than": ("<", "lt", "above_max_value"),
    }
    if kind_of_error in bounds:
        sign, key, rule = bounds[kind_of_error]
        number = "integer" if param.rpartition(".")[2] in INTEGER_FIELDS else "decimal"
        bound = context[key]
        bound = int(bound) if float(bound).is_integer() else bound
        return bad_request(
            f"Invalid '{param}': expected a value {sign} {bound}, but got {shown} instead.",
            param=param,
            code=f"{number}_{rule}",
        )
    if kind_of_error == "too_short" and isinstance(value, list) and not value:
        return bad_request(
            f"Invalid '{param}': empty array. Expected an array with at least one element.",
            param=param,
            code="empty_array",
        )
    if kind_of_error == "literal_error":
        return bad_request(
            f"Invalid value for '{param}': {shown}; expected one of {context.get('expected')}.", param=param
        )
    if kind_of_error in ("invalid_type", "unsupported_value", "array_above_max_length", "empty_string"):
        return bad_request(f"Invalid '{param}': {error['msg']}.", param=param, code=kind_of_error)
    if kind_of_error == "finite_number":
        return bad_request(f"Invalid '{param}': expected a finite number, but got {shown}.", param=param)
    if kind_of_error.endswith("_type") or kind_of_error.endswith("_parsing") or kind_of_error == "model_type":
        expected = error["msg"].removeprefix("Input should be ").removeprefix("a valid ")
        return bad_request(
            f"Invalid type for '{param}': expected {article(expected)}, but got {kind(value)} ({shown}) instead.",
            param=param,
            code="invalid_type",
        )
    return bad_request(f"Invalid '{param}': {error['msg']} (got {shown}).", param=param)


def article(noun: str) -> str:
    noun = {"dictionary": "object", "list": "array", "number": "number"}.get(noun, noun)
    if noun.startswith(("a ", "an ")):
        return noun
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def unsupported(param: str, what: str) -> APIError:
    return bad_request(f"Unsupported '{param}': {what}.", param=param, code="unsupported_parameter")


def check_supported(request: SamplingFields) -> None:
    """Fields of the OpenAI API that this server cannot honour: accepted at their no-op value, refused otherwise."""
    if request.n not in (None, 1):
        raise unsupported("n", f"this server returns one choice per request (n=1), not {request.n}")
    if request.stream_options is not None and not request.stream:
        raise bad_request("Invalid 'stream_options': only allowed when 'stream' is true.", param="stream_options")
    for penalty in ("frequency_penalty", "presence_penalty"):
        if getattr(request, penalty) not in (None, 0):
            raise unsupported(penalty, "this server does not apply penalties; leave it out (or 0)")
    if request.logit_bias:
        raise unsupported("logit_bias", "this server does not bias logits; leave it out (or {})")
    if isinstance(request, ChatCompletionRequest):
        check_chat_supported(request)
    else:
        check_completion_supported(request)


def check_chat_supported(request: ChatCompletionRequest) -> None:
    if request.logprobs or request.top_logprobs is not None:
        raise unsupported("logprobs", "this server does not return log probabilities")
    if request.tools or request.functions or request.tool_choice not in (None, "none", "auto"):
        param = "tools" if request.tools else ("functions" if request.functions else "tool_choice")
        raise unsupported(param, "this server does not call tools (function calling)")
    if request.function_call not in (None, "none", "auto"):
        raise unsupported("function_call", "this server does not call functions")
    if request.response_format not in (None, {"type": "text"}):
        raise unsupported("response_format", "this server answers in plain text only ({'type': 'text'})")
    if request.modalities not in (None, ["text"]):
        raise unsupported("modalities", "this server answers with text only (['text'])")
    if request.store:
        raise unsupported("store", "this server keeps no completions")
    for field in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        if getattr(request, field) is not None:
            raise unsupported(field, "not available on this server")
    for index, message in enumerate(request.messages):
        where = f"messages[{index}]"
        if message.role not in SERVED_ROLES:
            raise unsupported(
                f"{where}.role",
                f"'{message.role}' messages answer tool calls, which this server does not make; send "
                f"{', '.join(repr(role) for role in SERVED_ROLES)} messages",
            )
        if message.tool_calls or message.function_call is not None or message.audio is not None:
            field = "tool_calls" if message.tool_calls else ("function_call" if message.function_call else "audio")
            raise unsupported(f"{where}.{field}", "this server does not call tools or take audio")
        if message.tool_call_id is not None:
            raise unsupported(f"{where}.tool_call_id", "only 'tool' messages have one")
        if message.content is None and message.role != "assistant":
            raise bad_request(
                f"Invalid '{where}.content': a {message.role} message needs content (a string or text parts).",
                param=f"{where}.content",
                code="missing_required_parameter",
            )


def check_completion_supported(request: CompletionRequest) -> None:
    if request.suffix:
        raise unsupported("suffix", "this server does not fill in the middle")
    if request.echo:
        raise unsupported("echo", "this server does not echo the prompt")
    if request.best_of not in (None, 1):
        raise unsupported("best_of", "this server generates one completion per request")
    if request.logprobs:
        raise unsupported("logprobs", "this server does not return log probabilities")


__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "parse_request",
    "read_json_object",
    "validation_error",
]
