"""A LoRA adapter over a weight-update group (model.lora, weights.transport=distributed):
the embedded engine merges the adapter tensors it receives exactly as it merges the same
adapter from disk (the same bits), version after version, and refuses what does not fit.

    sender process (rank 0: the trainer's part)      this process (rank 1: the engine)
    read each version's adapter, buckets of          engine.update_weights_from_distributed
    whole layers (A and B together), send            (load_format "lora", lora_config)

The sender is a spawned process (two ranks of one gloo group cannot live in one process);
it reads the adapter directories the trainer saved, after the test checked that they hold
the trainer's tensors bit for bit (hf_tensors, what the broadcaster sends).
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from areal import weight_group as wg
from areal.comm.net import free_port
from areal.lora import adapter_leaves, layer_of, merged_cost, read_adapter
from areal.rollout.engine import DecodeEngine
from areal.rollout.sglang_api import LORA
from tests.unit.test_lora import SEQS, SPEC, _step, make_backend

pytestmark = pytest.mark.timeout(120)

BUCKET_BYTES = 6_000  # a few layers a bucket: a version takes several
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from areal.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", warmup_steps=0)


def _named(adapter_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """A version's tensors in the order both sides bucket them (a layer's A, then its B)."""
    return sorted(read_adapter(adapter_dir)[1].items())


def _buckets(adapter_dir: Path) -> list[list[tuple[str, torch.Tensor]]]:
    return list(wg.buckets(_named(adapter_dir), BUCKET_BYTES, layer_of))


def _sender(port: int, versions: list[str], extra: list, out: mp.Queue) -> None:
    """Rank 0: every version's buckets, then the `extra` buckets (name, dtype, shape)
    (zeros: what a refused bucket sends)."""
    try:
        group = wg.open_group(
            backend="gloo", master_address="127.0.0.1", master_port=port, rank=0,
            world_size=2, group_name="lora", timeout_s=TIMEOUT_S,
        )  # fmt: skip
        for path in versions:
            for bucket in _buckets(Path(path)):
                wg.send(group, [t.contiguous() for _, t in bucket])
        for bucket in extra:
            wg.send(group, [torch.zeros(shape, dtype=wg.dtype_of(dt)) for _, dt, shape in bucket])
        out.put("sent")
        group.close()
    except Exception as e:  # the test reports it
        out.put(f"{type(e).__name__}: {e}")


def _receive(engine: DecodeEngine, adapter_dir: Path, version: int) -> None:
    config = read_adapter(adapter_dir)[0]
    lora_config = {
        "r": config["r"],
        "lora_alpha": config["lora_alpha"],
        "target_modules": config["target_modules"],
    }
    buckets = _buckets(adapter_dir)
    assert len(buckets) > 2  # the merge works bucket by bucket
    for bucket in buckets:
        ok, message = engine.update_weights_from_distributed(
            **wg.spec(bucket), group_name="lora", weight_version=version,
            load_format=LORA, lora_config=lora_config,
        )  # fmt: skip
        assert ok, message


def _logprobs(engine: DecodeEngine, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = engine.model(torch.tensor([seq])).logits[0]
    return torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[
        :, 0
    ]


def test_an_adapter_over_the_group_is_served_as_the_same_adapter_from_disk(model_dir, tmp_path):
    backend = make_backend(model_dir)
    dirs = []
    for v in (1, 2):
        _step(backend, v)
        backend.save_hf(tmp_path / f"v{v}")
        dirs.append(tmp_path / f"v{v}")
        # What the broadcaster sends is what the version's directory holds, bit for bit.
        sent = dict(backend.hf_tensors())
        on_disk = read_adapter(tmp_path / f"v{v}")[1]
        assert sent.keys() == on_disk.keys()
        assert all(torch.equal(sent[n], on_disk[n]) for n in sent)
    assert read_adapter(dirs[0])[0]["target_modules"] == adapter_leaves(sent)
    name, a = _named(dirs[0])[0]
    wrong_rank = [(name, "float32", [SPEC.rank + 1, a.shape[1]])]  # refused, then received
    lone_a = [(name, "float32", list(a.shape))]  # a layer's A without its B
    port, out = free_port("127.0.0.1"), mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(
        target=_sender, args=(port, [str(d) for d in dirs], [wrong_rank, lone_a], out),
        daemon=True,
    )  # fmt: skip
    proc.start()
    by_group = DecodeEngine.from_dir(str(model_dir))
    from_disk = DecodeEngine.from_dir(str(model_dir))
    try:
        ok, message = by_group.init_weights_update_group(
            "127.0.0.1", port, 1, 2, "lora", "gloo", TIMEOUT_S
        )
        assert ok, message
        for v, adapter_dir in enumerate(dirs, 1):
            _receive(by_group, adapter_dir, v)
            ok, message, _ = from_disk.update_weights(str(adapter_dir), weight_version=v)
            assert ok, message
            assert by_group.weight_version == v
            # The same merge of the same tensors: the same bits (versions do not add up).
            disk_state = from_disk.model.state_dict()
            for n, t in by_group.model.state_dict().items():
                assert torch.equal(t, disk_state[n]), n
        lp = _logprobs(by_group, SEQS[0])
        assert (lp - backend.forward([[SEQS[0]]])[0]).abs().max() < 1e-5  # the trainer's
        # A bucket that does not fit is received whole, refused, and changes nothing.
        before = {n: t.clone() for n, t in by_group.model.state_dict().items()}
        config = {
            "r": SPEC.rank,
            "lora_alpha": SPEC.alpha,
            "target_modules": adapter_leaves([name]),
        }
        for bucket, why in ((wrong_rank, "rank r=4"), (lone_a, "without")):
            names, dtypes, shapes = (list(x) for x in zip(*bucket, strict=True))
            ok, message = by_group.update_weights_from_distributed(
                names, dtypes, shapes, "lora", 3, load_format=LORA, lora_config=config
            )
            assert not ok and why in message, message
        assert by_group.weight_version == 2
        assert all(torch.equal(t, before[n]) for n, t in by_group.model.state_dict().items())
        assert out.get(timeout=TIMEOUT_S) == "sent"
    finally:
        by_group.shutdown()
        from_disk.shutdown()
        proc.join(10)


def test_a_lora_bucket_counts_the_weights_its_merge_makes():
    """bucket_mb bounds what a server holds while it applies a bucket: the merged weights
    (out x in, the server's dtype), not the adapter's few bytes; A and B never split."""
    named = []
    for i in range(6):
        layer = f"base_model.model.model.layers.{i}.mlp.up_proj"
        named += [(f"{layer}.lora_A.weight", torch.zeros(4, 64)),
                  (f"{layer}.lora_B.weight", torch.zeros(128, 4))]  # fmt: skip
    merged = 128 * 64 * 2  # one layer's bf16 weight
    for budget, per_bucket in ((merged, 1), (2 * merged, 2), (3 * merged + 1, 3)):
        got = list(wg.buckets(named, budget, layer_of, merged_cost(named, 2)))
        assert [len(b) for b in got] == [2 * per_bucket] * (6 // per_bucket), (budget, got)
        assert all(layer_of(b[0][0]) == layer_of(b[1][0]) for b in got)
