"""The embedded engine's decoding against transformers' `generate`, and its cost in context.

    python benchmarks/engine.py [--shapes 145k,4m] [--batch 64] [--threads 1] [--repeats 3]
    python benchmarks/engine.py --shapes 1.5b --batch 64,256 --context-shapes ""   # a GPU

1) Decode throughput: the same random Qwen2, batch, prompt (20 tokens), sampling at
   temperature 1 and number of torch threads; every sequence generates exactly the shape's
   new tokens (ignore_eos / min_new_tokens). `generate` runs its batch with its own KV cache;
   the engine (areal.rollout.engine.DecodeEngine, in process, no HTTP) gets the same requests
   submitted at once. Tokens/s = batch x new tokens / wall time; medians of the repeats, the
   variants interleaved. Shapes: 145k (hidden 64, 2 layers, 32 new tokens) and 4m (hidden
   256, intermediate 1024, 4 layers, 8/4 heads, 128 new tokens), the issue's geometry; and
   1.5b (DeepSeek-R1-Distill-Qwen-1.5B's, benchmarks/shapes.py, 256 new tokens) for a GPU.
   On a GPU both run there in bf16 (--dtype), else on the CPU in fp32.
2) Prompt length: the cost of generating the shape's new tokens for --context-batch rows after
   a 16-token against a 1,024-token prompt (--prompt-shapes), the engine against `generate`,
   with every row's prompt its own ("distinct") and with the rows one GRPO group of one
   prompt ("group"). The engine computes a prompt shared by rows once (SGLang's radix cache
   does the same; `generate` prefills every row); distinct 1,024-token prompts cost what
   their prefill's arithmetic does (causal attention over 1,024 tokens, torch's CPU flash
   kernel, as `generate`'s forward).
3) Context: the cost of one decode step (KV-cached forward + sampling) with every row at
   context 16 against context 2,048, at --batch rows and at --context-batch rows (8), for
   the shapes above and Qwen2.5-0.5B's (--context-shapes). At 2,048 a step reads the whole
   cache, K and V of every layer: for the 4m shape 4 KB a token (67 MB at 8 rows, 537 MB
   at 64) against 17 MB of weights, so memory traffic, not compute, sets its ratio; a real
   model's step spends far more on its weights' arithmetic.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import Future

import torch
from shapes import DEVICE, QWEN2_1P5B
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal.rollout.engine import DecodeEngine, SamplingParams
from areal.rollout.generation import Request
from areal.rollout.kv_cache import KVCache
from areal.rollout.sampling import sample

SHAPES = {
    "145k": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2), 32),
    # areal.models.tiny's model (configs/tiny.yaml), the vocabulary aside.
    "tiny": (dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2), 32),
    "4m": (dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4), 128),
    # Qwen2.5-0.5B's layers (the vocabulary aside): for the decode-step context cost only.
    "0.5b": (dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2), 0),
    "1.5b": (QWEN2_1P5B, 256),
}  # fmt: skip
PROMPT = list(range(3, 23))


def make_model(shape: str, dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    base = dict(vocab_size=1000, max_position_embeddings=4096, tie_word_embeddings=True)
    config = Qwen2Config(eos_token_id=0, **{**base, **SHAPES[shape][0]})
    with torch.device(DEVICE):
        return Qwen2ForCausalLM(config).to(dtype).eval()


def generate_s(model, prompts: list[list[int]], new: int) -> float:
    """Seconds of transformers' `generate` for exactly `new` tokens after each prompt."""
    ids = torch.tensor(prompts, device=model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
            max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
        )  # fmt: skip
    assert out.shape == (len(prompts), ids.shape[1] + new)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def engine_s(engine: DecodeEngine, prompts: list[list[int]], new: int, tag: str) -> float:
    """Seconds of the engine for exactly `new` tokens after each prompt, all submitted at once."""
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=1.0)
    start = time.perf_counter()
    futures = [engine.submit(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    assert all(len(f.result(timeout=600).output_ids) == new for f in futures)
    return time.perf_counter() - start


def hf_generate(model, batch: int, new: int) -> float:
    return batch * new / generate_s(model, [PROMPT] * batch, new)


def engine_generate(engine: DecodeEngine, batch: int, new: int, tag: str) -> float:
    return batch * new / engine_s(engine, [PROMPT] * batch, new, tag)


def prompt_cost(
    model, engine: DecodeEngine, rows: int, prompt: int, new: int, group: bool, tag: str
) -> tuple[float, float]:
    """Seconds of `generate` and of the engine for rows x new tokens after `prompt`-token
    prompts: one prompt for every row (group) or each row its own."""
    prompts = [[3 + (7 * j + (0 if group else r)) % 900 for j in range(prompt)]
               for r in range(rows)]  # fmt: skip
    return generate_s(model, prompts, new), engine_s(engine, prompts, new, tag)


def decode_step_ms(model, rows: int, context: int, steps: int = 10) -> float:
    """Median ms of one cached decode forward + sampling with every row at `context`. The
    rows are filled by length alone: a step's cost does not depend on the cached values,
    and prefilling 8 x 2,048 tokens of the 0.5B shape would take CPU minutes."""
    cache = KVCache(model, max_cells=rows * (context + steps + 1))
    cache.ensure(rows, context + steps + 1)
    cache.lens = [context] * rows
    params = SamplingParams(max_new_tokens=steps + 1)
    reqs = [
        Request(rid=str(i), prompt_ids=[1], params=params, max_new=1, stop_ids=frozenset([0]),
                 future=Future())
        for i in range(rows)
    ]  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = cache.decode([5] * rows)
        sample(logits.float(), reqs, generator)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="145k,4m")
    parser.add_argument("--prompt-shapes", default="tiny")
    parser.add_argument("--context-shapes", default="145k,4m,0.5b")
    parser.add_argument("--batch", default="64", help="rows; a comma list runs each")
    parser.add_argument("--context-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16" if DEVICE == "cuda" else "float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype, batches = getattr(torch, args.dtype), [int(b) for b in args.batch.split(",")]
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else f"CPU, {args.threads} threads"
    print(f"{where}, {args.dtype}, prompt {len(PROMPT)} tokens, sampling")
    print(f"{'shape':>6} {'batch':>5} {'new':>5} {'generate tok/s':>15} {'engine tok/s':>13} "
          f"{'ratio':>7}")  # fmt: skip
    for shape in filter(None, args.shapes.split(",")):
        model = make_model(shape, dtype)
        new = SHAPES[shape][1]
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            for batch in batches:
                engine = DecodeEngine.from_dir(
                    d, max_batch_size=batch, num_threads=args.threads, device=DEVICE, dtype=dtype
                )
                hf_generate(model, batch, 4)  # warm-up, both
                engine_generate(engine, batch, 4, "warm")
                hf, ours = [], []
                for r in range(args.repeats):
                    hf.append(hf_generate(model, batch, new))
                    ours.append(engine_generate(engine, batch, new, str(r)))
                engine.shutdown()
                h, o = statistics.median(hf), statistics.median(ours)
                print(f"{shape:>6} {batch:>5} {new:>5} {h:>15.0f} {o:>13.0f} {o / h:>6.2f}x")
        del model
    if args.prompt_shapes:
        prompt_table(args)
    if args.context_shapes:
        context_table(args, batches)


def prompt_table(args: argparse.Namespace) -> None:
    rows = args.context_batch
    print()
    print(f"{'shape':>6} {'rows':>5} {'new':>5} {'prompts':>8} {'generate @1024/@16':>19} "
          f"{'engine @1024/@16':>17} {'engine/generate @1024':>22}")  # fmt: skip
    for shape in args.prompt_shapes.split(","):
        model, new = make_model(shape), SHAPES[shape][1]
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            engine = DecodeEngine.from_dir(d, max_batch_size=rows, num_threads=args.threads)
            engine_generate(engine, rows, 4, "warm")
            for group in (False, True):
                times: dict[int, list[tuple[float, float]]] = {16: [], 1024: []}
                for r in range(args.repeats):
                    for prompt in times:  # interleaved
                        times[prompt].append(
                            prompt_cost(model, engine, rows, prompt, new, group, f"{prompt}-{r}")
                        )
                (h16, e16), (h1k, e1k) = (
                    tuple(statistics.median(t[i] for t in times[p]) for i in (0, 1))
                    for p in (16, 1024)
                )
                kind = "group" if group else "distinct"
                print(f"{shape:>6} {rows:>5} {new:>5} {kind:>8} {h1k / h16:>18.2f}x "
                      f"{e1k / e16:>16.2f}x {h1k / e1k:>21.2f}x")  # fmt: skip
            engine.shutdown()


def context_table(args: argparse.Namespace, batches: list[int]) -> None:
    print()
    print(f"{'shape':>6} {'rows':>5} {'step ms @16':>12} {'step ms @2048':>14} {'ratio':>7}")
    for shape in args.context_shapes.split(","):
        model = make_model(shape)
        for rows in sorted({args.context_batch, *batches}):
            steps = 10 if shape != "0.5b" else 3  # 0.5b at 64 rows: seconds a step
            short = decode_step_ms(model, rows, 16, steps)
            long = decode_step_ms(model, rows, 2048, steps)
            print(f"{shape:>6} {rows:>5} {short:>12.2f} {long:>14.2f} {long / short:>6.2f}x")


if __name__ == "__main__":
    main()
