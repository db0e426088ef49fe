"""Model shapes the benchmarks share, and a random model of one written to a directory.

The 1.5B shape is DeepSeek-R1-Distill-Qwen-1.5B's (the paper's smallest model), with its
151,936-token vocabulary: on a GPU its output layer is a sixth of the weights and of a
decode step's arithmetic. Weights are random (nothing may be downloaded); speed does not
depend on their values.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

QWEN2_1P5B = dict(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=10000.0, tie_word_embeddings=False,
)  # fmt: skip
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the benchmarks run: the GPU if there is one."""


def save_random_qwen2(path: str | Path, shape: dict, dtype: torch.dtype, seed: int = 0) -> Path:
    """A random Qwen2 of `shape` in `path` (initialised on the GPU where there is one: a 1.5B
    model takes a second there, half a minute on CPU), with the tiny models' tokenizer so
    that prompts can be rendered; ids beyond its 512 are ordinary model inputs."""
    from areal.models.tiny import build_tokenizer

    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(Qwen2Config(eos_token_id=0, **shape)).to(dtype)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return Path(path)


if __name__ == "__main__":  # python benchmarks/shapes.py DIR: the 1.5B shape in bf16 in DIR
    import sys

    print(save_random_qwen2(sys.argv[1], QWEN2_1P5B, torch.bfloat16))
