"""Who gets in: the API key (`--api_key` / `IHA_API_KEY`) and the bound on requests in flight
(`--max_concurrent_requests`).

With a key, every /v1 request must carry `Authorization: Bearer KEY` (what the `openai` client sends as its
`api_key`), else 401; /health stays open for load balancers and supervisors. Without a key the server is open to
whoever reaches its port, which is why listening beyond this machine without one prints a warning.

A generation request holds a slot from the moment it passes its checks until its generation has stopped (finished,
cancelled because the client left, timed out): running or waiting for the engine. When every slot is taken the
request is refused at once with 429 and `Retry-After`, which the `openai` client honours by retrying later, instead of
queueing without bound.
"""

import hmac
import ipaddress

from fastapi import Request

from .errors import APIError


API_KEY_VARIABLE = "IHA_API_KEY"
# Seconds a client refused for lack of a slot is told to wait before trying again.
RETRY_AFTER_SECONDS = 1


class APIKeyCheck:
    """A FastAPI dependency: 401 for a request without the server's bearer key (no key: every request passes)."""

    def __init__(self, key: str | None):
        self.key = key or None

    def __call__(self, request: Request) -> None:
        if self.key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.key.encode()):
            return
        raise APIError(
            401,
            "Missing or incorrect API key: send the header 'Authorization: Bearer KEY' with the key the server was "
            f"started with (--api_key or {API_KEY_VARIABLE}); the openai client sends its api_key that way.",
            param=None,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def is_local_address(host: str) -> bool:
    """Whether listening on `host` keeps the server to this machine (a loopback name or address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, key: str | None, prog: str) -> str | None:
    """The one-line warning of a server listening beyond this machine without a key, or None."""
    if key or is_local_address(host):
        return None
    return (
        f"{prog}: warning: listening on {host} without an API key: anyone who can reach this port can use the model; "
        f"set --api_key or the {API_KEY_VARIABLE} environment variable."
    )


class Slot:
    """One request's place among the requests in flight; `release` gives it back (once, however often called)."""

    def __init__(self, slots: "RequestSlots"):
        self._slots = slots
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots.in_use -= 1


class RequestSlots:
    """At most `limit` generation requests in flight; beyond it, 429 with Retry-After. Used on the event loop only."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"--max_concurrent_requests must be at least 1, not {limit}")
        self.limit = limit
        self.in_use = 0

    def take(self) -> Slot:
        if self.in_use >= self.limit:
            raise APIError(
                429,
                f"The server is busy: it is already serving {self.limit} requests, its limit "
                f"(--max_concurrent_requests). Retry in {RETRY_AFTER_SECONDS} s.",
                type="rate_limit_error",
                code="too_many_requests",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        self.in_use += 1
        return Slot(self)


__all__ = ["API_KEY_VARIABLE", "APIKeyCheck", "RequestSlots", "Slot", "exposure_warning", "is_local_address"]
