"""One GPU: the embedded engine on CUDA, and a whole tiny run with the server and a megatron
trainer (bf16 parameters, fp32 gradients and Adam) sharing the GPU (launcher.gpus_per_node=1).

Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from areal.models.tiny import make_tiny_model
from areal.rollout.engine import DecodeEngine, SamplingParams
from tests.system.test_run import processes_mentioning, read_metrics, run_train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_engine_on_cuda_returns_the_models_logprobs(tmp_path):
    """Batched, KV-cached decoding on the GPU: each token's log-prob is the full forward's."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path / "model", warmup_steps=0)
    engine = DecodeEngine.from_dir(
        str(model_dir), max_batch_size=8, device="cuda", max_total_tokens=4096
    )
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (1, 5, 17, 40)]
        params = SamplingParams(max_new_tokens=48, temperature=0.7, ignore_eos=True)
        futs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(prompts)]
        results = [f.result(timeout=120) for f in futs]
    finally:
        engine.shutdown()
    ref = AutoModelForCausalLM.from_pretrained(model_dir).cuda().eval()
    for prompt, res in zip(prompts, results, strict=True):
        assert len(res.output_ids) == 48
        ids = torch.tensor([prompt + res.output_ids], device="cuda")
        with torch.no_grad():
            logits = ref(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / 0.7
        want = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
        got = torch.tensor(res.logprobs, device="cuda")
        assert torch.allclose(got, want, atol=2e-3), (got - want).abs().max()


def test_tiny_run_on_one_shared_gpu_with_megatron_in_bf16_learns(tmp_path):
    steps = 60
    proc = run_train(
        tmp_path,
        f"total_train_steps={steps}",
        "trial_name=gpu",
        "launcher.gpus_per_node=1",
        "trainer.backend=megatron",
        "model.dtype=bfloat16",
        "trainer.save_dtype=bfloat16",
        timeout=480,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    exp = tmp_path / "tiny/gpu"
    log = (exp / "logs/server0.log").read_text()
    assert "CUDA_VISIBLE_DEVICES=0" in log and " on cuda" in log
    metrics = read_metrics(exp)
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    # bf16 inference against the bf16 trainer on the same weights: close, not equal (about
    # 1e-2 in bfloat16, 0.033 in the H200 run of docs/benchmarks/gpu.md; float32 would be
    # about 1e-6 here).
    diffs = [m["train/fresh_logprob_diff_max"] for m in metrics if m["train/fresh_tokens"]]
    assert diffs and max(diffs) < 0.5, diffs
    print(f"fresh_logprob_diff_max: median {sorted(diffs)[len(diffs) // 2]:.4f}, max {max(diffs)}")
    rewards = [m["reward/mean"] for m in metrics]
    means = [sum(rewards[i : i + 20]) / 20 for i in range(0, steps - 19, 10)]
    assert max(means) > means[0] + 1.0, means
    assert processes_mentioning(str(tmp_path)) == []
