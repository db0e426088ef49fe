"""Each role's log lines: timestamp, role, and the step/version it is at.

    2025-01-01 12:00:03,123 trainer0 [step 12 version 11] areal.trainer INFO: ...

A role calls `setup(name)` once, then `set_context(step=..., version=...)` whenever they
change; a value may be a callable, read at each line (the server's current weights). The
context sits on the handler, so every library's log lines carry it too.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

_context: dict[str, Any] = {}


def set_context(**fields: Any) -> None:
    """Fields shown in every following log line of this process (None removes one)."""
    for key, value in fields.items():
        if value is None:
            _context.pop(key, None)
        else:
            _context[key] = value


def context_text() -> str:
    parts = [f"{k} {v() if callable(v) else v}" for k, v in _context.items()]
    return " ".join(parts) or "-"


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.context = context_text()
        return True


def make_handler(name: str, stream: TextIO | None = None) -> logging.Handler:
    """A handler writing `time name [context] logger LEVEL: message` lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {name} [%(context)s] %(name)s %(levelname)s: %(message)s")
    )
    return handler


def setup(name: str, level: int = logging.INFO) -> None:
    """Log to stderr (the role's logs/{name}.log under a launcher) with time and context."""
    logging.basicConfig(level=level, handlers=[make_handler(name)], force=True)
