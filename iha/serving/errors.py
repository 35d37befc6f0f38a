"""Errors of `iha serve` in the OpenAI API's shape: `{"error": {"message", "type", "param", "code"}}`.

The `openai` client, and every tool built on it, reads a failed request's message from that body (`error.message`)
and picks its exception class from the status (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 429
RateLimitError, 5xx InternalServerError). Every answer of the server that is not a success has this shape: the
requests the server refuses (`APIError`), routes that do not exist, and failures of the server itself (a 500 with a
message; the traceback goes to the log, the server keeps serving).
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


logger = logging.getLogger("iha.serving")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """A request the server answers with an error: the HTTP status and the OpenAI error object's fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, *, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def server_failure(what: str) -> APIError:
    """The 500 of a request the server failed on (its traceback logged where it happened)."""
    return APIError(
        500,
        f"The server failed while {what} (the traceback is in the server's log); the server keeps serving.",
        type=SERVER_ERROR,
        code="internal_error",
    )


# Statuses of routing errors (Starlette's, e.g. a path that does not exist) -> the OpenAI error code.
HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = str(error.detail)
        if error.status_code == 404:
            message = f"There is no route {request.method} {request.url.path} (this server has /v1/chat/completions, "
            message += "/v1/completions, /v1/models and /health)."
        elif error.status_code == 405:
            message = f"{request.url.path} does not take {request.method}."
        body = error_body(message, code=HTTP_CODES.get(error.status_code))
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, error: RequestValidationError) -> JSONResponse:
        # The routes read their bodies themselves (`iha.serving.validation`); this covers path parameters.
        return JSONResponse(error_body(f"Invalid request: {error.errors()}"), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return server_failure(f"answering {request.method} {request.url.path}").response()


__all__ = ["APIError", "INVALID_REQUEST", "SERVER_ERROR", "bad_request", "error_body", "install_error_handlers"]
