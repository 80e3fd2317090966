"""``ApiError``: what a client did wrong (or a server error worded for a client), with the
HTTP status and the offending field; HTTP answers it as OpenAI's error JSON, gRPC as a
status code (``router.grpc_api``)."""

from __future__ import annotations


class ApiError(Exception):
    """An error the client caused (or a server error worded for the client)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        """The OpenAI error shape."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
