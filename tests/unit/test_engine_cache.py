"""The KV-cached engine against a full transformers forward, token by token.

Every returned log-prob must equal log_softmax(logits / T) of a plain forward over
prompt + output with the weights that generated that token, across joins, leaves, pauses in
every mode, aborts, resumes and weight updates (a resumed request recomputes its cache).
"""

from __future__ import annotations

import copy
import functools
import time
from concurrent.futures import Future

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal.rollout.chunks import attention_chunks, cells_read
from areal.rollout.engine import DecodeEngine, SamplingParams
from areal.rollout.kv_cache import KVCache
from areal.rollout.sampling import categorical

TEMP = 0.7
ATOL = 1e-4


def _config(**kw) -> Qwen2Config:
    base = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=0,
    )
    return Qwen2Config(**{**base, **kw})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two weight sets of one architecture: A in model/, B in weights_b/ (safetensors only)."""
    root = tmp_path_factory.mktemp("engine")
    torch.manual_seed(0)
    a = Qwen2ForCausalLM(_config()).eval()
    a.save_pretrained(root / "model")
    torch.manual_seed(1)
    b = Qwen2ForCausalLM(_config()).eval()
    (root / "weights_b").mkdir()
    save_file(
        {k: v.contiguous() for k, v in b.state_dict().items() if k != "lm_head.weight"},
        root / "weights_b" / "model.safetensors",
    )
    return {"dir": root, "a": a, "b": b}


@pytest.fixture
def engine(models):
    eng = DecodeEngine(
        copy.deepcopy(models["a"]), max_batch_size=8, seed=3, max_total_tokens=8 * 200
    )
    yield eng
    eng.shutdown()


def _params(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=TEMP, ignore_eos=True, **kw)


def _reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0] / TEMP
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return lp.gather(1, torch.tensor(output)[:, None])[:, 0]


def _check(model, prompt, output, logprobs, start: int = 0, end: int | None = None):
    """Log-probs of output[start:end] equal model's, given everything before them."""
    end = len(output) if end is None else end
    ref = _reference(model, prompt, output[:end])[start:]
    got = torch.tensor(logprobs[start:end])
    assert len(got) == end - start
    assert torch.allclose(got, ref, atol=ATOL), (got - ref).abs().max()


def _wait_tokens(engine, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats()["total_generated_tokens"] < n:
        assert time.monotonic() < deadline, "the engine generated nothing"
        time.sleep(0.005)


def _prompts(k: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 17, 40, 5, 64, 2, 9][:k]
    return [torch.randint(1, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("chunk_rows", [16, 2])  # one attention chunk; chunks of 2 rows
def test_cached_forward_equals_full_forward_across_row_moves(models, chunk_rows):
    model = models["a"]
    cache = KVCache(model, max_cells=6 * 64)
    cache.chunk_rows = chunk_rows
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 9, 1, 30, 7, 12)]
    cache.ensure(6, 64)
    cache.prefill([0, 1, 3, 4, 5], [seqs[i][:-1] for i in (0, 1, 3, 4, 5)])
    for step in range(12):
        if chunk_rows == 2:  # the lengths differ enough for chunks to pay
            assert len(attention_chunks(cache.lens, chunk_rows)) == len(seqs) // 2
        layout = attention_chunks(cache.lens, chunk_rows)
        logits = cache.decode([s[-1] for s in seqs])
        assert cache.read == cells_read(layout)  # what the planner costs a step by
        for row, s in enumerate(seqs):
            with torch.no_grad():
                ref = model(input_ids=torch.tensor([s])).logits[0, -1]
            assert torch.allclose(logits[row], ref, atol=ATOL)
        for s in seqs:
            s.append(int(torch.randint(0, 300, (1,), generator=g)))
        if step == 4:  # rows 0 and 2 leave; the last two rows fill their places at once
            cache.move([4, 5], [0, 2])
            seqs = [seqs[4], seqs[1], seqs[5], seqs[3]]
            cache.ensure(4, 64)


def test_joins_and_leaves_keep_every_logprob_exact(engine, models):
    prompts = _prompts(8)
    first = [engine.submit(f"a{i}", p, _params(10 + 7 * i)) for i, p in enumerate(prompts[:4])]
    _wait_tokens(engine, 12)  # the later ones join a running batch
    later = [engine.submit(f"b{i}", p, _params(25)) for i, p in enumerate(prompts[4:])]
    for prompt, fut in zip(prompts, first + later, strict=True):
        res = fut.result(timeout=60)
        assert res.finish_reason["type"] == "length"
        _check(models["a"], prompt, res.output_ids, res.logprobs)


def test_one_prompt_is_prefilled_once_for_its_group_and_for_later_requests(engine, models):
    """A GRPO group (one prompt, its answers submitted together) computes the prompt's keys
    and values once; a request that joins later with a prompt a running row holds copies
    them too; a prompt that differs is computed. Every log-prob stays exact."""
    prompt, other = _prompts(8, seed=5)[5], _prompts(8, seed=6)[3]  # 64 and 40 tokens
    prefilled = engine.stats()["total_prefilled_tokens"]
    group = [engine.submit(f"g{i}", prompt, _params(40)) for i in range(4)]
    _wait_tokens(engine, 12)
    late = engine.submit("late", prompt, _params(20))
    diff = engine.submit("other", other, _params(20))
    for fut in [*group, late]:
        _check(models["a"], prompt, fut.result(timeout=60).output_ids, fut.result().logprobs)
    _check(models["a"], other, diff.result(timeout=60).output_ids, diff.result().logprobs)
    assert engine.stats()["total_prefilled_tokens"] - prefilled == len(prompt) - 1 + len(other) - 1


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_weight_update_while_paused_recomputes_the_cache(engine, models, mode):
    prompts = _prompts(5, seed=1)
    prefilled = engine.stats()["total_prefilled_tokens"]
    futs = [engine.submit(f"r{i}", p, _params(60)) for i, p in enumerate(prompts)]
    _wait_tokens(engine, 30)
    assert engine.pause(mode) == 5
    split = {f"r{i}": len(engine._by_rid[f"r{i}"].output_ids) for i in range(5)}
    ok, _, kept = engine.update_weights(str(models["dir"] / "weights_b"), 1)
    assert ok and kept == 5
    engine.continue_generation()
    for i, (prompt, fut) in enumerate(zip(prompts, futs, strict=True)):
        res = fut.result(timeout=60)
        k = split[f"r{i}"]
        assert 0 < k < 60 and len(res.output_ids) == 60 and res.weight_version == 1
        _check(models["a"], prompt, res.output_ids, res.logprobs, end=k)
        _check(models["b"], prompt, res.output_ids, res.logprobs, start=k)
    # Every prompt once, then every prompt and its partial output again on the new weights.
    again = sum(len(p) + split[f"r{i}"] - 1 for i, p in enumerate(prompts))
    expected = sum(len(p) - 1 for p in prompts) + again
    assert engine.stats()["total_prefilled_tokens"] - prefilled == expected


def test_pause_abort_then_resume_on_new_weights(engine, models):
    prompts = _prompts(4, seed=2)
    futs = [engine.submit(f"p{i}", p, _params(80)) for i, p in enumerate(prompts)]
    _wait_tokens(engine, 20)
    assert engine.pause("abort") == 4
    partial = [f.result(timeout=10) for f in futs]
    assert all(r.finish_reason["type"] == "abort" for r in partial)
    assert engine.update_weights(str(models["dir"] / "weights_b"), 1)[0]
    engine.continue_generation()
    # The rollout worker's resume: prompt + partial output as the new prompt.
    resumed = [
        engine.submit(f"q{i}", p + r.output_ids, _params(80 - len(r.output_ids)))
        for i, (p, r) in enumerate(zip(prompts, partial, strict=True))
    ]
    for prompt, part, fut in zip(prompts, partial, resumed, strict=True):
        _check(models["a"], prompt, part.output_ids, part.logprobs)
        res = fut.result(timeout=60)
        _check(models["b"], prompt + part.output_ids, res.output_ids, res.logprobs)
        assert len(part.output_ids) + len(res.output_ids) == 80


def test_update_with_abort_all_holds_resubmissions_until_the_new_weights(engine, models):
    """SGLang's one-call interruption: abort, load, go on. The worker resubmits the moment
    an abort returns (here: from the Future's callback, in the aborting thread itself);
    those requests must wait for the load, so every resumed token is the new weights'."""
    prompts = _prompts(4, seed=4)
    resumed: dict[int, Future] = {}

    def resubmit(i: int, fut: Future) -> None:
        part = fut.result()
        assert part.finish_reason["type"] == "abort"
        ids = prompts[i] + part.output_ids
        resumed[i] = engine.submit(f"u{i}", ids, _params(70 - len(part.output_ids)))
        time.sleep(0.05)  # time for the decode thread to admit it, were it allowed to

    futs = [engine.submit(f"t{i}", p, _params(70)) for i, p in enumerate(prompts)]
    for i, fut in enumerate(futs):
        fut.add_done_callback(functools.partial(resubmit, i))
    _wait_tokens(engine, 20)
    ok, _, _ = engine.update_weights(str(models["dir"] / "weights_b"), 1, True)
    assert ok and sorted(resumed) == [0, 1, 2, 3]
    for i, (prompt, fut) in enumerate(zip(prompts, futs, strict=True)):
        part, res = fut.result(), resumed[i].result(timeout=60)
        assert 0 < len(part.output_ids) < 70 and res.weight_version == 1
        _check(models["a"], prompt, part.output_ids, part.logprobs)
        _check(models["b"], prompt + part.output_ids, res.output_ids, res.logprobs)


def test_abort_one_request_leaves_the_others_exact(engine, models):
    prompts = _prompts(6, seed=3)
    futs = [engine.submit(f"x{i}", p, _params(50)) for i, p in enumerate(prompts)]
    _wait_tokens(engine, 40)
    assert engine.abort("x1") == 1 and engine.abort("x3") == 1
    for i, (prompt, fut) in enumerate(zip(prompts, futs, strict=True)):
        res = fut.result(timeout=60)
        assert (res.finish_reason["type"] == "abort") == (i in (1, 3))
        _check(models["a"], prompt, res.output_ids, res.logprobs)


def test_token_budget_queues_what_does_not_fit_and_refuses_what_never_fits(models):
    engine = DecodeEngine(copy.deepcopy(models["a"]), max_batch_size=8, max_total_tokens=100)
    try:
        with pytest.raises(ValueError, match="max_total_tokens"):
            engine.submit("big", [1] * 20, _params(81))  # 101 cells > 100
        # Each needs 40 cells: two run at once (80 <= 100), the third waits for a place.
        futs = [engine.submit(f"s{i}", [1 + i] * 10, _params(30)) for i in range(3)]
        peak = 0
        deadline = time.monotonic() + 60
        while not all(f.done() for f in futs):
            assert time.monotonic() < deadline
            peak = max(peak, engine.stats()["num_running_reqs"])
            time.sleep(0.001)
        assert peak <= 2
        for i, fut in enumerate(futs):
            res = fut.result()
            assert len(res.output_ids) == 30
            _check(models["a"], [1 + i] * 10, res.output_ids, res.logprobs)
    finally:
        engine.shutdown()


def test_a_bfloat16_engine_generates_and_loads_float32_weights_cast(models):
    """--dtype bfloat16: the model and its cache are bfloat16, float32 weights loaded later
    are cast to it, and log-probs are the bfloat16 model's (float32 ones within its noise)."""
    eng = DecodeEngine.from_dir(str(models["dir"] / "model"), max_batch_size=4, seed=3,
                                max_total_tokens=4 * 200, dtype=torch.bfloat16)  # fmt: skip
    try:
        assert {p.dtype for p in eng.model.parameters()} == {torch.bfloat16}
        ok, message, _ = eng.update_weights(str(models["dir"] / "weights_b"), weight_version=1)
        assert ok, message
        for name, p in models["b"].state_dict().items():
            assert torch.equal(eng.model.state_dict()[name], p.bfloat16()), name
        prompt = _prompts(3)[2]
        r = eng.submit("r", prompt, _params(12)).result(timeout=60)
        ref = _reference(eng.model, prompt, r.output_ids)
        assert torch.allclose(torch.tensor(r.logprobs), ref.float(), atol=0.05)
        assert (
            torch.tensor(r.logprobs) - _reference(models["b"], prompt, r.output_ids)
        ).abs().max() < 0.2
    finally:
        eng.shutdown()


def test_other_architectures_are_refused_with_a_clear_message():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="inference.backend=sglang"):
        KVCache(model, max_cells=64)


def test_categorical_draws_each_index_with_its_probability():
    """The sampler behind every sampled token: frequencies match the weights (unnormalised,
    zeros included), and an index of weight 0 is never drawn, even at a row's last entry."""
    weights = torch.tensor(
        [[0.5, 0.0, 1.5, 2.0, 0.0], [0.0, 0.0, 0.0, 1e-3, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]]
    )
    generator = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.zeros_like(weights)
    for _ in range(n // 100):
        draws = torch.stack([categorical(weights, generator) for _ in range(100)], 1)  # [3, 100]
        counts.scatter_add_(1, draws, torch.ones_like(draws, dtype=counts.dtype))
    expected = weights / weights.sum(-1, keepdim=True)
    assert (counts[weights == 0] == 0).all()
    # 4.5 standard deviations of a binomial count: a wrong sampler fails, chance does not.
    sd = (n * expected * (1 - expected)).sqrt()
    assert ((counts - n * expected).abs() <= 4.5 * sd + 1e-6).all(), counts / n
