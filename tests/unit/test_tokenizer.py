"""load_tokenizer: the tokenizer AutoTokenizer gives, without importing torch where it can."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from areal.models.tiny import TOOL_TAGS, build_tokenizer
from areal.tokenizer import load_tokenizer

TEXTS = [
    "What is 3 + 4? Put the answer in \\boxed{}.",
    "so therefore \\boxed{7}<|im_end|><|endoftext|>",
    f'{TOOL_TAGS[0]}{{"name": "add", "arguments": {{"a": 2, "b": 5}}}}{TOOL_TAGS[1]}',
    "unicode: é ü 漢字 🙂",
]
CHAT = [
    {"role": "system", "content": "You add."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "\\boxed{4}"},
    {"role": "user", "content": "And 1 + 1?"},
]


def assert_same(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.apply_chat_template(CHAT, add_generation_prompt=True) == (
        theirs.apply_chat_template(CHAT, add_generation_prompt=True)
    )
    assert (ours.eos_token_id, ours.pad_token_id, len(ours)) == (
        theirs.eos_token_id,
        theirs.pad_token_id,
        len(theirs),
    )


@pytest.mark.parametrize("texts", [(), tuple(TEXTS)], ids=["arith", "agent_task"])
def test_the_tiny_tokenizer_is_autotokenizers_and_imports_no_torch(tmp_path, texts):
    build_tokenizer(1, list(texts)).save_pretrained(tmp_path)
    assert_same(load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(tmp_path))
    probe = (
        "import sys; from areal.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(tmp_path)!r}); t.apply_chat_template([{{'role': 'user', "
        "'content': 'hi'}]); print(sorted(m for m in ('torch', 'transformers.modeling_utils') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_another_class_goes_through_autotokenizer(tmp_path):
    build_tokenizer(1).save_pretrained(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    config.write_text(json.dumps({**settings, "tokenizer_class": "Qwen2Tokenizer"}))
    assert_same(load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(tmp_path))


def test_a_directory_without_a_tokenizer_fails_as_autotokenizer_does(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(Exception) as ours:
        load_tokenizer(str(tmp_path))
    with pytest.raises(Exception) as theirs:
        AutoTokenizer.from_pretrained(tmp_path)
    assert type(ours.value) is type(theirs.value)
