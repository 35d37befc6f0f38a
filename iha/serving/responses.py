"""What the server answers: generated tokens as text (cut at a stop sequence), and the OpenAI objects around it.

`CompletionText` turns token ids into text as they come (tokenizers' incremental `DecodeStream`, which is what
transformers' server streams with), finds the request's `stop` sequences in it, and holds back the few characters
that may be the start of one, so that a stream never sends text a stop sequence later takes back. The whole answer of
a request that did not stop on a sequence is `tokenizer.decode(tokens, skip_special_tokens=True)`, as
`generate()` users decode.

The objects are OpenAI's: `chat.completion` and `chat.completion.chunk`, `text_completion`; a stream is server-sent
events ending with `data: [DONE]`, as OpenAI's do, with a last chunk of `usage` when the request asks for it
(`stream_options.include_usage`).
"""

import json
import time

from tokenizers.decoders import DecodeStream


class CompletionText:
    """A request's generated tokens and their text, cut at the first stop sequence."""

    def __init__(self, tokenizer, stop: list[str] | None, eos_token_ids: list[int], max_new_tokens: int):
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.eos_token_ids = set(eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped_on_sequence = False
        self._sent = 0
        # A stop sequence may arrive split over tokens: hold back what could be its beginning.
        self._hold_back = max((len(sequence) for sequence in self.stop), default=1) - 1
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._backend = backend
            self._decode_stream = DecodeStream(skip_special_tokens=True)
        else:
            self._decode_stream = None

    @property
    def finished(self) -> bool:
        """Whether nothing more is wanted: a stop sequence or an end-of-sequence token came, or the budget is spent."""
        if self.stopped_on_sequence or len(self.token_ids) >= self.max_new_tokens:
            return True
        return bool(self.token_ids) and self.token_ids[-1] in self.eos_token_ids

    def add(self, token_ids: list[int]) -> str:
        """Take new tokens; the text that can be sent now."""
        for token_id in token_ids:
            if self.finished:
                break
            self.token_ids.append(token_id)
            searched_from = max(len(self.text) - self._hold_back, 0)
            self.text += self._decode_step(token_id)
            self._cut_at_stop(searched_from)
        return self._unsent(final=self.finished)

    def rest(self) -> str:
        """What is left to send once generation has ended."""
        return self._unsent(final=True)

    def finish_reason(self) -> str:
        if self.stopped_on_sequence:
            return "stop"
        if self.token_ids and self.token_ids[-1] in self.eos_token_ids:
            return "stop"
        return "length" if len(self.token_ids) >= self.max_new_tokens else "stop"

    def full_text(self) -> str:
        """The whole answer: decoded at once, or, cut at a stop sequence, the text up to it."""
        if self.stopped_on_sequence:
            return self.text
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _decode_step(self, token_id: int) -> str:
        if self._decode_stream is not None:
            return self._decode_stream.step(self._backend, token_id) or ""
        # A tokenizer without the Rust backend: decode everything again and keep what is new.
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return text[len(self.text) :] if text.startswith(self.text) else ""

    def _cut_at_stop(self, searched_from: int) -> None:
        found = [self.text.find(sequence, searched_from) for sequence in self.stop]
        found = [index for index in found if index >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped_on_sequence = True

    def _unsent(self, final: bool) -> str:
        end = len(self.text) if final else max(len(self.text) - self._hold_back, self._sent)
        piece = self.text[self._sent : end]
        self._sent = end
        return piece


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def now() -> int:
    return int(time.time())


def chat_completion(request_id: str, model: str, text: str, finish_reason: str, token_usage: dict) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": token_usage,
    }


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": now(),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def text_completion(request_id: str, model: str, text: str, finish_reason: str | None, token_usage=None) -> dict:
    """A `text_completion` object, whole or as a stream's chunk (then without usage)."""
    completion = {
        "id": request_id,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if token_usage is not None:
        completion["usage"] = token_usage
    return completion


def usage_chunk(request_id: str, model: str, object_name: str, token_usage: dict) -> dict:
    """The stream's last chunk when `stream_options.include_usage` is set: no choices, the usage."""
    return {
        "id": request_id,
        "object": object_name,
        "created": now(),
        "model": model,
        "choices": [],
        "usage": token_usage,
    }


def server_sent_event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


STREAM_END = "data: [DONE]\n\n"


__all__ = [
    "STREAM_END",
    "CompletionText",
    "chat_chunk",
    "chat_completion",
    "server_sent_event",
    "text_completion",
    "usage",
    "usage_chunk",
]
