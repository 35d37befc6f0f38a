"""How many tokens one request may take, prompt and completion together, and the check of each request against it.

The limit is the smallest of the model's context (`max_position_embeddings`), `--max_model_len`, and under continuous
batching the paged cache: one request must fit the whole cache alone, or the engine's worker stops with "No requests
can be scheduled and no requests can be offloaded" and takes every other request with it. A request over the limit
is refused at once with a 400 that states the numbers (OpenAI's `context_length_exceeded`), before any work; a request
without `max_tokens` gets what is left of the limit after its prompt, as OpenAI-compatible servers do. An empty prompt
is refused too: the model is never given zero tokens.
"""

from dataclasses import dataclass

from .errors import bad_request


@dataclass(frozen=True)
class TokenLimit:
    """At most `tokens` per request (prompt + completion), and what sets that number, for messages."""

    tokens: int
    reason: str


def token_limit(context: int | None, max_model_len: int | None, cache_tokens: int | None) -> TokenLimit:
    """The per-request limit from the model's context, the `--max_model_len` flag and the paged cache (None: absent).

    `--max_model_len` may lower the model's context, never raise it (the positions beyond it were never trained);
    ValueError if it would, or if nothing bounds a request at all.
    """
    if max_model_len is not None and context is not None and max_model_len > context:
        raise ValueError(
            f"--max_model_len {max_model_len} is more than the model's context of {context} tokens "
            "(max_position_embeddings in its config.json); give at most that"
        )
    bounds = []
    if context is not None:
        bounds.append((context, "the model's context, max_position_embeddings"))
    if max_model_len is not None:
        bounds.append((max_model_len, "--max_model_len"))
    if cache_tokens is not None:
        bounds.append((cache_tokens, "the paged cache of continuous batching, --cb_num_blocks"))
    if not bounds:
        raise ValueError(
            "the model's config.json has no max_position_embeddings: give the context with --max_model_len"
        )
    tokens, reason = min(bounds, key=lambda bound: bound[0])
    return TokenLimit(tokens, reason)


def completion_budget(
    limit: TokenLimit, prompt_tokens: int, max_tokens: int | None, max_tokens_param: str, prompt_param: str
) -> int:
    """The number of new tokens a request gets: its `max_tokens`, or what the limit leaves after its prompt; a 400
    stating the numbers when the request does not fit."""
    if prompt_tokens == 0:
        raise bad_request(
            f"The prompt is empty (0 tokens): there is nothing to continue. Give '{prompt_param}' some text.",
            param=prompt_param,
            code="empty_prompt",
        )
    if max_tokens is None:
        if prompt_tokens >= limit.tokens:
            raise bad_request(
                f"This server takes at most {limit.tokens} tokens per request, prompt and completion together "
                f"({limit.reason}), but the prompt alone has {prompt_tokens} tokens, leaving none for the completion. "
                "Shorten the prompt.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return limit.tokens - prompt_tokens
    if prompt_tokens + max_tokens > limit.tokens:
        if prompt_tokens >= limit.tokens:
            fix, param = f"Shorten the prompt to fewer than {limit.tokens} tokens.", prompt_param
        else:
            left = limit.tokens - prompt_tokens
            fix, param = f"Shorten the prompt or lower '{max_tokens_param}' to at most {left}.", max_tokens_param
        raise bad_request(
            f"This server takes at most {limit.tokens} tokens per request, prompt and completion together "
            f"({limit.reason}), but this request asks for {prompt_tokens + max_tokens}: {prompt_tokens} in the prompt "
            f"and {max_tokens} for the completion ('{max_tokens_param}'). {fix}",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens


__all__ = ["TokenLimit", "completion_budget", "token_limit"]
