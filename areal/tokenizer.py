"""A model's tokenizer, loaded without importing torch where the model allows it.

The controller and the rollout workers only tokenize, yet transformers' `AutoTokenizer`
imports the config classes and with them torch: 3.8-5.2 s of each role's start while the
server and the trainer import torch too (a tiny run on a 2-core machine, measured with
PYTHONPROFILEIMPORTTIME). A tokenizer saved as `TokenizersBackend` (transformers 5's
tokenizer.json class, the tiny model's) is exactly the class `AutoTokenizer` picks for it,
and its module needs no torch, so it is loaded directly; any other class goes through
`AutoTokenizer`, whose per-model rules stay the authority.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The names transformers 5 gives its tokenizer.json class (PreTrainedTokenizerFast is an alias).
_DIRECT = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    config = Path(path) / "tokenizer_config.json"
    try:
        name = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None  # no or an odd tokenizer_config.json: AutoTokenizer says what is wrong
    if name in _DIRECT and (Path(path) / "tokenizer.json").is_file():
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
