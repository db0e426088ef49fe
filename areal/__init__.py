"""areal: fully asynchronous RL for LLM reasoning.

`areal.build(model, tokenizer, task, config)` builds a run in this process from objects
(areal/inline.py); `python -m areal.train --config FILE` runs one from a config file. Both
are imported on first use: `import areal` stays as cheap as the config.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Run", "build"]


def __getattr__(name: str) -> Any:
    # Lazily: areal.config's users (every role, the CLI's --help) must not import torch.
    if name in __all__:
        from areal import inline

        return getattr(inline, name)
    raise AttributeError(f"module 'areal' has no attribute {name!r}")
