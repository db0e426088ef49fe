"""The whole system against TRL's synchronous GRPOTrainer, same model, data and geometry.

    pip install -c constraints.txt trl     # constraints.txt: torch==2.13.0+cpu (keeps torch)
    python benchmarks/vs_trl.py [--shapes 145k,4m] [--steps 30] [--repeats 1]

Both train the same random-initialised Qwen2 (the tiny tokenizer; shapes as in
benchmarks/engine.py: 145k with 32 new tokens, 4m with 128) on the tiny task's sums (same
prompts, same grader), 8 prompts x 8 samples per step, one optimizer step per step
(areal: ppo.n_minibatches=1), temperature 1, no KL term, learning rate 1e-3.

Effective training throughput, counted the same way for all: completion tokens that enter
the update per second of wall time, over the steps after warm-up (the first fifth left
out; tiny_run.effective_throughput). TRL: its own per-step log (completions/mean_length
x 64) and wall clock at each step's end; areal: metrics.jsonl (train/n_tokens, time).
Each variant is its own process on the same 2 cores (TRL with torch's default threads;
areal's roles split the cores, inference.num_threads / trainer.num_threads = 0). Prints
the table and the ratios areal/TRL at eta=0 and eta=4; with --repeats > 1, medians.

TRL is a benchmark dependency only: nothing in areal imports it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine import SHAPES  # the same model shapes and new-token counts
from tiny_run import effective_throughput, train_tiny

PROMPTS, GROUP, LR, MAX_OPERAND = 8, 8, 1e-3, 5


def make_model(shape: str, out: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal.models.tiny import build_tokenizer

    tok = build_tokenizer(0)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok), max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        **SHAPES[shape][0],
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_areal(model: Path, new: int, eta: int, steps: int, root: str, name: str) -> float:
    overrides = [
        f"model.path={model}", f"max_staleness={eta}", f"rollout.max_new_tokens={new}",
        f"rollout.group_size={GROUP}", f"trainer.batch_size={PROMPTS}",
        f"dataset.max_operand={MAX_OPERAND}", "ppo.n_minibatches=1", f"trainer.lr={LR}",
        "trainer.warmup_steps_ratio=0", "trainer.mb_spec.max_tokens_per_mb=8192",
    ]  # fmt: skip
    return effective_throughput(train_tiny(root, name, steps, overrides))


def run_trl(model: Path, new: int, steps: int, out: str) -> float:
    """In its own process: `python vs_trl.py --trl-worker ...` prints the throughput."""
    cmd = [sys.executable, __file__, "--trl-worker", str(model), str(new), str(steps), out]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return float(proc.stdout.strip().splitlines()[-1])


def trl_worker(model: str, new: int, steps: int, out: str) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal.tasks.arith import is_correct, make_problems

    rows = make_problems(PROMPTS * (steps + 2), MAX_OPERAND, seed=1)
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
         for r in rows]
    )  # fmt: skip

    def reward(completions, answer, **_):
        pairs = zip(completions, answer, strict=True)
        return [5.0 if is_correct(c[0]["content"], a) else -5.0 for c, a in pairs]

    marks: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                marks.append((time.perf_counter(), logs["completions/mean_length"]))

    config = GRPOConfig(
        output_dir=out, per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
        max_completion_length=new, learning_rate=LR, beta=0.0, temperature=1.0,
        logging_steps=1, max_steps=steps, report_to="none", save_strategy="no", use_cpu=True,
        lr_scheduler_type="constant", warmup_steps=0, disable_tqdm=True, seed=1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model),
        processing_class=AutoTokenizer.from_pretrained(model),
        reward_funcs=reward, args=config, train_dataset=data, callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()
    steps = [{"time": t, "train/n_tokens": length * PROMPTS * GROUP} for t, length in marks]
    print(effective_throughput(steps))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        model, new, steps, out = sys.argv[2:6]
        trl_worker(model, int(new), int(steps), out)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="145k,4m")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for shape in args.shapes.split(","):
            new = SHAPES[shape][1]
            model = make_model(shape, Path(root) / f"model-{shape}")
            res: dict[str, list[float]] = {"trl": [], "eta=0": [], "eta=4": []}
            for r in range(args.repeats):  # interleaved: all see the same machine
                tag = f"{shape}-{r}"
                res["trl"].append(run_trl(model, new, args.steps, f"{root}/trl-{tag}"))
                for eta in (0, 4):
                    res[f"eta={eta}"].append(
                        run_areal(model, new, eta, args.steps, root, f"{tag}-eta{eta}")
                    )
                print(f"  {shape} repeat {r}: " + ", ".join(
                    f"{k} {v[-1]:.0f} tok/s" for k, v in res.items()), flush=True)  # fmt: skip
            rows.append((shape, new, {k: statistics.median(v) for k, v in res.items()}))
    print(f"{'shape':>6} {'new':>4} {'TRL tok/s':>10} {'areal eta=0':>12} {'areal eta=4':>12} "
          f"{'eta=0/TRL':>10} {'eta=4/TRL':>10}")  # fmt: skip
    for shape, new, m in rows:
        print(
            f"{shape:>6} {new:>4} {m['trl']:>10.0f} {m['eta=0']:>12.0f} {m['eta=4']:>12.0f} "
            f"{m['eta=0'] / m['trl']:>9.2f}x {m['eta=4'] / m['trl']:>9.2f}x"
        )


if __name__ == "__main__":
    main()
