"""How the OpenAI-compatible API refuses or fails a request: `ApiError`, its HTTP status, OpenAI's error shape."""

from __future__ import annotations

from router.api import ErrorKind, GenerationError

# What a refused or failed request's kind is over HTTP: its status, and its error's `code`.
HTTP_STATUS = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.SHUTTING_DOWN: 503,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.DEADLINE_EXCEEDED: 504,
}
HTTP_CODE = {ErrorKind.INVALID_ARGUMENT: None, ErrorKind.OVERLOADED: "queue_full"}

# A GenerationParams field in the OpenAI request's words (an error's `param`).
PARAMS = {"prompt_token_ids": "prompt", "speculation.max_draft_tokens": "speculation"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def of(cls, err: GenerationError) -> ApiError:
        """A GenerationError in HTTP's words."""
        code = HTTP_CODE.get(err.kind, err.kind.value)
        return cls(HTTP_STATUS.get(err.kind, 500), err.message, param=PARAMS.get(err.field, err.field), code=code)

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(self.status)
        kind = kind or ("server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def unsupported(field: str, why: str = "not supported by specfleet") -> ApiError:
    return ApiError(400, f"{field}: {why}", param=field, code="unsupported_field")
