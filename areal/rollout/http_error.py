"""BadRequest: the one exception of our HTTP servers for a request they refuse.

    embedded inference server (server.py)  --BadRequest--> 400 {"error": {"message"}}  (SGLang's)
    OpenAI endpoint (workflow/openai_endpoint.py) --BadRequest--> status {"error": {"message",
                                                                   "type", "param", "code"}}

One concept, the caller's mistake, with its HTTP status and message; each server writes it in
the error shape of the API it imitates, so the body is the server's business, not the error's.
"""

from __future__ import annotations


class BadRequest(ValueError):
    """A request the server refuses: answered with `status` and this message (never a 500)."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.code = code
        """A machine-readable reason, for APIs whose error body has one (OpenAI's)."""
