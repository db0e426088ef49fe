"""A tiny Qwen2-architecture model and a tokenizer trained in code: no downloads.

`make_tiny_model(dir)` writes a directory that loads with transformers' Auto classes and
with SGLang exactly like a real checkpoint (config.json, model.safetensors, tokenizer files,
ChatML chat template). The model gets a short supervised warm-up on its task's own data
(`Task.warmup`: arith's half-right sums, longtail's noisy scratchpads, or agent episodes such
as examples/add_tool.py's tool calls, rendered exactly as the OpenAI endpoint renders them)
so that it knows the answer format and part of the task, as the paper's runs start from a
distilled model; RL has to do the rest.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.utils import logging as hf_logging

from areal.config import DatasetConfig
from areal.tasks import Batch, ChatCall, load_task
from areal.tasks.arith import make_problems

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
_TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\n</tool_call>'
)
# ChatML; with tools, Qwen2.5's way: the schemas in a system block, the model's calls as
# <tool_call> JSON, results as <tool_response> in a user turn. Literal text after a block tag
# is written as an expression ({{ '\n' }}): transformers renders with trim_blocks, which
# drops a newline that follows a tag. A conversation without tools renders as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '" + _TOOLS_SYSTEM + "' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    '{{ "' + _TOOLS_FORMAT + '<|im_end|>\n" }}{% endif %}'
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"  # in the tools block
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user"
    "{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}<|im_start|>assistant"
    "{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{{ fn['arguments'] | tojson }}{{ '}\n</tool_call>' }}{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS_WORDS = (
    "user assistant system the answer is sum plus equals what of and a to number "
    "compute add result question reason step first then so therefore boxed"
).split()


def build_tokenizer(seed: int = 0, texts: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A byte-level BPE with single-digit tokens, trained on a small synthetic corpus.

    `texts`: a task's rendered agent conversations (tool schemas, tool calls, results). The
    BPE then learns their words, and the tool-call tags become tokens of their own, as in
    Qwen's vocabulary: the tiny model writes a call in ~25 tokens instead of ~65, and reads a
    tools prompt of ~200 instead of ~550 (a 2-layer model samples a long call exactly only
    rarely). Without texts the tokenizer is the one every other tiny model has."""
    rng = random.Random(seed)
    lines = [f"{p['prompt']}{p['answer']}" for p in make_problems(2000, 999, seed)]
    lines += [" ".join(rng.choices(_CORPUS_WORDS, k=12)) for _ in range(400)]
    lines += texts
    tok = Tokenizer(models.BPE())
    # Digits stay single tokens so every number is spelled the same way in every context.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    if texts:
        fast.add_tokens(TOOL_TAGS)  # not special: decoded text keeps them, for the parser
    return fast


def _warmup_batches(task: str, options: dict | None, seed: int) -> Iterator[Batch]:
    """The task's warm-up batches under its dataset.options (None: the task's defaults).
    A warm-up reads no dataset file (the model is cached by task and options, not by data):
    a task that needs one is given os.devnull to satisfy the section's rule."""
    spec = load_task(task)
    path = os.devnull if spec.needs_path else ""
    return spec.warmup(DatasetConfig(type=task, path=path, options=options or {}), seed)


def episode_texts(task: str, options: dict | None, seed: int, n_batches: int = 8) -> list[str]:
    """The whole conversations of the first warm-up batches' agent episodes, rendered by the
    chat template (none for a task of prompt/answer pairs)."""
    batches = _warmup_batches(task, options, seed)
    episodes = [item for _, batch in zip(range(n_batches), batches, strict=False) for item in batch]
    if not episodes or isinstance(episodes[0], tuple):
        return []
    from areal.workflow.openai_api import chat_messages

    render = build_tokenizer(seed)  # only its chat template is used: text, not ids
    return [
        render.apply_chat_template(
            chat_messages({"messages": episode[-1].messages}),
            tools=episode[-1].tools,
            add_generation_prompt=True,
            tokenize=False,
        )
        + episode[-1].response
        for episode in episodes
    ]


def tiny_config(
    tokenizer: PreTrainedTokenizerBase, hidden: int = 64, layers: int = 2, heads: int = 4
) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        # Grouped-query attention (half as many KV heads), but never one KV head: the two-head
        # model of configs/tiny_vllm.yaml with one learnt the sums far worse (10-22% right after
        # warm-up, a slow rise under RL) than with two (20-55%, a steady rise).
        num_key_value_heads=heads // 2 if heads >= 4 and heads % 2 == 0 else heads,
        max_position_embeddings=1024,  # longtail: a ~20-token prompt, answers up to 500
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of a one-turn ChatML conversation ending where the assistant speaks."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def _warmup_sequences(
    tokenizer: PreTrainedTokenizerBase, item: tuple[str, str] | list[ChatCall]
) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of one warm-up example: a prompt and its answer, or an agent
    episode. An episode's calls are rendered by the endpoint's own function (same template,
    tools and messages, so the same ids as in a run); a call whose input extends the previous
    call's input + answer continues its sequence, as rollout.sample_mode=concat trains."""
    eos = tokenizer.eos_token_id
    if isinstance(item, tuple):
        prompt, response = item
        prompt_ids = chat_prompt_ids(tokenizer, prompt)
        response_ids = tokenizer.encode(response, add_special_tokens=False) + [eos]
        return [(prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids))]
    from areal.workflow.openai_api import chat_input_ids

    out: list[tuple[list[int], list[int]]] = []
    for call in item:
        prompt_ids = chat_input_ids(tokenizer, call.messages, call.tools)
        response_ids = tokenizer.encode(call.response, add_special_tokens=False) + [eos]
        if out and prompt_ids[: len(out[-1][0])] == out[-1][0]:
            ids, mask = out.pop()
            mask = mask + [0] * (len(prompt_ids) - len(ids))  # the environment's tokens
        else:
            mask = [0] * len(prompt_ids)
        out.append((prompt_ids + response_ids, mask + [1] * len(response_ids)))
    return out


def _warm_up(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    steps: int,
    task: str,
    options: dict | None,
    seed: int,
    on_step: Callable[[int], None] | None = None,
) -> None:
    """Supervised steps on the task's worked answers, so that RL starts from a model that
    knows the format, as the paper's runs start from a distilled model. on_step(i) runs
    before step i (areal/models/cache.py: progress, threads)."""
    if steps <= 0:
        return
    batches = _warmup_batches(task, options, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    eos = tokenizer.eos_token_id
    model.train()
    for step, batch in zip(range(steps), batches, strict=False):
        if on_step is not None:
            on_step(step)
        pairs = [seq for item in batch for seq in _warmup_sequences(tokenizer, item)]
        width = max(len(ids) for ids, _ in pairs)
        ids = torch.tensor([s + [eos] * (width - len(s)) for s, _ in pairs])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in pairs], dtype=torch.float32)
        # Logits only where the loss is: not over prompts, tool schemas and padding (an
        # agent batch's vocabulary-wide logits everywhere took a fifth of its step).
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]  # [B, T-1, H]
        keep = mask[:, 1:] > 0
        logits = model.lm_head(hidden[keep])  # [N, V]: the N answer tokens'
        loss = torch.nn.functional.cross_entropy(logits, ids[:, 1:][keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build_tiny_model(
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    warmup_steps: int = 200,
    task: str = "arith",
    options: dict | None = None,
    on_step: Callable[[int], None] | None = None,
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """The tiny model and its tokenizer in memory (make_tiny_model writes them), warmed up
    on `task` (a dataset.type whose Task has warm-up data) under its dataset.options;
    on_step(i) runs before warm-up step i (areal/models/cache.py: progress, threads)."""
    if load_task(task).warmup is None:
        raise ValueError(f"task {task!r} has no warm-up data (Task.warmup); use arith")
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(seed, episode_texts(task, options, seed))
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(tiny_config(tokenizer, hidden, layers, heads))
    _warm_up(model, tokenizer, warmup_steps, task, options, seed, on_step)
    return model, tokenizer


def make_tiny_model(
    out_dir: str | os.PathLike,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    warmup_steps: int = 200,
    task: str = "arith",
    options: dict | None = None,
    on_step: Callable[[int], None] | None = None,
) -> Path:
    """Write the tiny model directory (atomically: a half-written one never appears): what
    build_tiny_model makes. A run takes it from the machine's cache instead
    (areal/models/cache.py), which calls this once."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    hf_logging.disable_progress_bar()  # the launcher's console shows training, not file writes
    model, tokenizer = build_tiny_model(
        seed, hidden, layers, heads, warmup_steps, task, options, on_step
    )
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "areal_tiny.json").write_text(
        json.dumps(
            {"seed": seed, "warmup_steps": warmup_steps, "task": task, "options": options or {}}
        )
    )
    try:
        os.rename(tmp, out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
