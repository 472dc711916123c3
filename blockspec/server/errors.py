"""Errors in the OpenAI JSON shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can see goes through `APIError`, so the status code, the `type` and the
`code` are chosen in one place and clients written for the OpenAI API handle them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.errors import BlockspecError, ContextLengthError

INVALID = "invalid_request_error"


@dataclass
class APIError(Exception):
    """An error answered to the client; `status` is the HTTP status code."""

    status: int
    message: str
    type: str = INVALID
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        # Messages may quote the client's input, which can hold lone surrogates: escape what
        # UTF-8 cannot carry so the error itself can always be sent.
        return {"error": {"message": _sendable(self.message), "type": self.type, "param": _sendable(self.param),
                          "code": self.code}}


def _sendable(text: str | None) -> str | None:
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID, param, code)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds this server's limit of {limit} bytes "
                    "(--max-request-bytes); send a shorter prompt", INVALID, None, "request_too_large")


def unknown_field(name: str) -> APIError:
    """What OpenAI answers for a field it does not know."""
    return APIError(400, f"Unrecognized request argument supplied: {name}", INVALID, name, "unknown_parameter")


def unauthorized() -> APIError:
    return APIError(
        401, "invalid or missing API key; send 'Authorization: Bearer <key>' with the key the server "
        "was started with (--api-key)", INVALID, None, "invalid_api_key",
    )


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404, f"the model {model!r} does not exist on this server; use {served!r} (see GET /v1/models)",
        INVALID, "model", "model_not_found",
    )


def queue_full(message: str) -> APIError:
    return APIError(429, f"the server is busy: {message}; retry later", "rate_limit_error", None, "queue_full")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another server", "server_error", None, "shutting_down")


def internal(reference: str) -> APIError:
    """A failure of the server itself; the details go to its log under `reference`, not to the client."""
    return APIError(500, f"internal server error (reference {reference} in the server log); retry, or report it",
                    "server_error", None, "internal_error")


def from_blockspec(e: BlockspecError, param: str | None = None) -> APIError:
    """A library error raised while admitting a request: the client's fault, so 400."""
    if isinstance(e, ContextLengthError):
        return bad_request(str(e), param or "messages", "context_length_exceeded")
    return bad_request(str(e), param)


def http_status_error(status: int, detail: str) -> APIError:
    """Routing failures (unknown path, wrong method) in the same shape."""
    kind = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return APIError(status, detail, INVALID if status < 500 else "server_error", None, kind)
