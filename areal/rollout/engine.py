"""Continuous-batching decode engine behind the embedded inference server.

```
 asyncio HTTP layer (any thread)             decode thread (exactly one)
   submit() ──► held ──continue──► waiting ──admit──► running ──step──► Future.set_result
   abort() / pause() / continue_generation()     one lock; act between decode steps
   update_weights() ── load + check on disk ──► copy into the live model between steps
   update_weights_from_distributed() ── receive a bucket from the group's rank 0 + check ──┘
```

Decoding is KV-cached (areal/rollout/kv_cache.py): each running request owns one row of the
cache. A step 1) gives rows to newly admitted requests and compacts the rows of those that
left, 2) prefills the requests without cached keys/values (new, or resumed after a weight
update: nothing computed with old weights is reused, as in SGLang), 3) runs one decode
forward over every row, 4) samples one token per row. Requests join and leave between steps.
Memory is bounded by `max_total_tokens`, cache cells counted as rows x the longest running
request's prompt + max_new_tokens: a request waits until it fits, and one that could never
fit is refused when submitted.

| the decode thread waits for            | unblocked by                                   |
|----------------------------------------|------------------------------------------------|
| a running request (admitted if it fits) | submit(), continue_generation(), a finish     |
| the end of a pause                     | continue_generation()                          |
| a pending weight update (no admission) | update_weights*() applying its tensors         |

| update_weights*() waits for                  | unblocked by                                |
|----------------------------------------------|---------------------------------------------|
| (distributed) its bucket's broadcasts        | rank 0 sending them; the group's timeout    |
| the decode step in flight                    | the step's end                              |
| running requests to finish (when not paused) | their finish or abort (no new admissions)   |

Weight-update groups (areal/weight_group.py, SGLang's /init_weights_update_group): the engine
joins a group by name as one rank, and update_weights_from_distributed() receives one bucket
of tensors from rank 0 (decoding goes on meanwhile: the receive holds no engine lock), checks
it against the model, and applies it as update_weights() applies a directory. A bucket is
received whole even when it will be refused, so that the group stays in step with its
sender; a receive that fails (the peer died, the timeout) changes nothing and leaves the
group broken, for the caller to destroy.

Weight versions (SGLang semantics): a finished request reports the engine's weight_version at
the moment it finishes. Without a pause, an update waits until the running requests finish, so
a request is never generated across a weight change. With pause(mode="in_place"|"retract")
the kept requests resume on the new weights after continue_generation() and report the new
version: their earlier tokens came from the old one. pause(mode="abort") returns partial
outputs with finish_reason abort instead, so nothing crosses a version. A weight version is
the trainer's integer here; the server writes it as SGLang's string (sglang_api.py).

Beside it: generation.py (SamplingParams, the request, GenerationResult), sampling.py (one
token per row), weight_loading.py (checked safetensors), kv_cache.py (the cache),
areal/weight_group.py (the groups).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from areal.cores import Cores
from areal.lora import adapter_layers, check_wire_config, is_adapter_dir, layers_of, merge_layers
from areal.rollout.activity import DecodeMeter
from areal.rollout.generation import PAUSE_MODES, GenerationResult, Request, SamplingParams
from areal.rollout.kv_cache import KVCache
from areal.rollout.sampling import sample
from areal.rollout.sglang_api import DELTA, LORA
from areal.rollout.weight_loading import load_checked
from areal.tokenizer import load_tokenizer
from areal.weight_group import (
    BACKENDS,
    Group,
    Patch,
    apply_bucket,
    decode_delta,
    dtype_of,
    open_group,
    receive,
)

__all__ = ["DecodeEngine", "GenerationResult", "SamplingParams", "length_buckets"]

logger = logging.getLogger(__name__)


class DecodeEngine:
    """A transformers causal LM with one background decode thread and continuous batching.

    Every public method is thread-safe. submit(), abort() and stats() never block;
    pause(), continue_generation(), update_weights*() and shutdown() may wait for the decode
    step in flight (update_weights*() also for running requests), and the weight-update
    group calls for their peers, so call those from a worker thread when on an event loop.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        max_batch_size: int = 64,
        max_total_tokens: int = 0,
        seed: int = 0,
        num_threads: int | Cores = 1,
        weight_version: int = 0,
        device: str = "cpu",
        model_path: str = "",
    ) -> None:
        """Decode with `model` as given (moved to `device`; update_weights copies into its
        parameters). tokenizer: only for sampling_params.stop (None: token ids only).
        model_path: where the weights came from, as /get_model_info reports it. The decode
        thread starts with start(), `with engine:`, or the first submit()."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        # A Cores lends the server's cores while it has nothing to generate (areal/cores.py).
        self.cores = num_threads if isinstance(num_threads, Cores) else Cores(num_threads)
        self.max_batch_size = max_batch_size
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        config = self.model.config
        self.vocab_size: int = self.model.get_input_embeddings().weight.shape[0]
        self.context_len: int = getattr(config, "max_position_embeddings", 1 << 30)
        self.eos_ids = frozenset(
            _as_ids(getattr(self.model.generation_config, "eos_token_id", None))
            | _as_ids(getattr(config, "eos_token_id", None))
        )
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._kv = KVCache(self.model, 1)
        self.max_total_tokens = max_total_tokens or _auto_token_budget(
            self._kv.bytes_per_token(), self.device
        )
        self._kv.max_cells = self.max_total_tokens
        self._rows: list[Request] = []  # the requests in cache rows 0..n-1 (decode thread)
        self._kv_stale = False  # set by a weight update: every row must be recomputed
        # The weights LoRA adapters change, as they were before the first adapter was merged.
        self._lora_base: dict[str, torch.Tensor] | None = None

        self._cv = threading.Condition()
        self._held: list[Request] = []  # submitted during a pause: not admitted yet
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._by_rid: dict[str, Request] = {}
        self._pause_mode: str | None = None
        self._updates_pending = 0
        self._stepping = False
        self._stopping = False
        self._model_path = str(model_path)
        self._weight_version = weight_version
        self._counters = collections.Counter()
        self._meter = DecodeMeter()  # `decode` spans of the timeline (areal/events.py)
        # Weight-update groups by name, with the device their tensors arrive on; apart from
        # _cv, so that joining or receiving never stops decoding.
        self._groups: dict[str, tuple[Group, torch.device]] = {}
        self._joining: set[str] = set()  # names being joined: a second init is refused
        self._groups_lock = threading.Lock()
        self._receiving = threading.Lock()  # one bucket at a time: broadcasts are ordered
        self._thread = threading.Thread(target=self._loop, name="decode", daemon=True)

    @classmethod
    def from_dir(
        cls, model_path: str, *, dtype: torch.dtype = torch.float32, **kwargs: Any
    ) -> DecodeEngine:
        """An engine over the HF model directory model_path (its tokenizer if it has one);
        kwargs as DecodeEngine's. Not started."""
        if not Path(model_path).is_dir():
            raise ValueError(f"model directory {model_path} does not exist")
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        try:
            tokenizer = load_tokenizer(model_path)
        except (OSError, ValueError):  # a weights-only directory: token ids in, token ids out
            tokenizer = None
        return cls(model, tokenizer, model_path=str(model_path), **kwargs)

    def start(self) -> DecodeEngine:
        """Start the decode thread (once; later calls do nothing)."""
        with self._cv:
            if not self._thread.is_alive() and not self._stopping:
                self._thread.start()
        return self

    def __enter__(self) -> DecodeEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- requests -------------------------------------------------------------------------

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> Future:
        """Queue one request; the Future resolves to its GenerationResult."""
        if not prompt_ids:
            raise ValueError("input_ids must not be empty")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"input_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt_ids) >= self.context_len:
            raise ValueError(
                f"the input ({len(prompt_ids)} tokens) is not shorter than the model's context "
                f"length ({self.context_len} tokens)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop needs a tokenizer; the model dir has none")
        stop_ids = frozenset() if params.ignore_eos else self.eos_ids | set(params.stop_token_ids)
        req = Request(
            rid=rid,
            prompt_ids=list(prompt_ids),
            params=params,
            max_new=min(params.max_new_tokens, self.context_len - len(prompt_ids)),
            stop_ids=stop_ids,
            future=Future(),
        )
        if req.max_len > self.max_total_tokens:
            raise ValueError(
                f"the request may need {req.max_len} tokens of KV cache (prompt "
                f"{len(prompt_ids)} + max_new_tokens {req.max_new}), more than this server's "
                f"budget of {self.max_total_tokens} (inference.max_total_tokens): lower "
                "max_new_tokens or raise the budget"
            )
        self.start()
        finished: list[Request] = []
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            if rid in self._by_rid:
                raise ValueError(f"rid {rid!r} is already in flight; request ids must be unique")
            if req.max_new == 0:
                self._finish_locked(req, {"type": "length", "length": 0}, finished)
            else:
                self._by_rid[rid] = req
                (self._held if self._pause_mode else self._waiting).append(req)
                self._cv.notify_all()
        self._resolve(finished)
        return req.future

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "") -> int:
        """Finish requests now with their partial output and finish_reason abort.

        abort_all aborts what the engine has admitted (running and waiting), not the requests
        held back by a pause: SGLang queues those before the scheduler sees them, so an abort
        issued during the pause (e.g. update_weights(abort_all_requests=True)) leaves them be.
        A rid names any request, held ones included. Returns the number aborted.
        """
        finished: list[Request] = []
        with self._cv:
            if abort_all:
                victims = list(self._running) + list(self._waiting)
            else:
                victims = [self._by_rid[rid]] if rid in self._by_rid else []
            for req in victims:
                self._finish_locked(req, _abort(message or "Abort requested."), finished)
            self._cv.notify_all()
        self._resolve(finished)
        return len(finished)

    # ---- control --------------------------------------------------------------------------

    def pause(self, mode: str = "abort") -> int:
        """Stop decoding, SGLang-style; new requests are held until continue_generation().

        abort: abort everything admitted (returns how many). in_place: keep the running and
        waiting requests where they are. retract: move the running ones back to the head of
        the waiting queue (their cache rows are freed unless they are readmitted at once).
        Returns the number of requests aborted or kept. Waits for the step in flight, so that
        no token is added after pause() returns.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        kept = 0
        with self._cv:
            self._pause_mode = mode
            if mode == "retract":
                self._waiting.extendleft(reversed(self._running))
                self._running.clear()
            while self._stepping:
                self._cv.wait()
            kept = len(self._running) + len(self._waiting)
        if mode == "abort":
            return self.abort(abort_all=True, message="Aborted by pause_generation.")
        return kept

    def continue_generation(self) -> None:
        with self._cv:
            self._pause_mode = None
            self._waiting.extend(self._held)
            self._held.clear()
            self._cv.notify_all()

    def update_weights(
        self, model_path: str, weight_version: int | None = None, abort_all_requests: bool = False
    ) -> tuple[bool, str, int]:
        """Load *.safetensors from model_path into the live model between decode steps.

        Returns (success, message, num_paused_requests) like SGLang; a failure changes
        nothing. Without a pause this waits for the running requests to finish (new ones are
        not admitted meanwhile); while paused it applies at once and reports how many
        requests it kept. abort_all_requests aborts what runs first (an interruption in one
        call); requests submitted until the load ends wait for the new weights.

        model_path may be a LoRA adapter directory (areal/lora.py): its update is merged into
        the base weights (kept apart at the first adapter), so that decoding costs what it
        did without LoRA; a whole model's weights replace the base.
        """
        try:
            if is_adapter_dir(model_path):
                tensors = merge_layers(*self._lora_base_for(*adapter_layers(model_path)))
            else:
                tensors = load_checked(self.model, model_path)
                self._lora_base = None
        except (OSError, ValueError) as e:
            return False, f"Failed to update weights from {model_path}: {e}", 0
        kept = self._apply_weights(
            tensors, weight_version, abort_all_requests, "update_weights_from_disk", model_path
        )
        return True, _updated_message(weight_version), kept

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: int | None = None,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        lora_config: dict | None = None,
    ) -> tuple[bool, str]:
        """Receive one bucket of tensors from rank 0 of the group (one broadcast per name, in
        order), then apply it as update_weights() applies a directory (same waits, aborts
        and version); the other tensors of the model stay as they are.

        Returns (success, message). The receive runs outside the engine's lock (decoding
        goes on). Names must be the model's state_dict names (of tied tensors either one),
        shapes its shapes; dtypes may differ (cast on copy). A bucket with a wrong name or
        shape is received whole, then refused; a failed receive (the peer died, the group's
        timeout) is refused too and leaves the group broken. A refusal changes nothing.

        load_format DELTA: deltas against the weights held now (weight_group.encode_delta),
        set entry by entry between decode steps and checked there by the checksum of the
        result; one that differs undoes the bucket's deltas and is refused (requests aborted
        by abort_all_requests stay aborted). load_format LORA: LoRA adapter tensors (PEFT's
        names, every layer's A and B in the bucket), merged into the base kept apart as an
        adapter directory is (update_weights), as lora_config (r, lora_alpha,
        target_modules) says.
        """
        with self._groups_lock:
            entry = self._groups.get(group_name)
            if entry is None:
                return False, f"Failed to update weights: {self._no_group_locked(group_name)}"
        group, device = entry
        try:
            for dtype in dtypes:
                dtype_of(dtype)
        except ValueError as e:  # nothing received: the sender waits for its own timeout
            return False, f"Failed to update weights over group {group_name}: {e}"
        try:
            with self._receiving:
                tensors = receive(group, names, dtypes, shapes, device)
        except Exception as e:  # gloo and NCCL raise RuntimeError subclasses of their own
            logger.warning("receiving weights over group %s failed: %s", group_name, e)
            return False, (
                f"Failed to receive weights over group {group_name} (the group is now broken: "
                f"destroy it and form a new one): {e}"
            )
        try:
            tensors = self._decoded(tensors, load_format, lora_config)
        except ValueError as e:
            return False, f"Failed to update weights over group {group_name}: {e}"
        problems = _bucket_problems(self.model.state_dict(), tensors)
        if problems:
            return False, f"Failed to update weights over group {group_name}: {problems}"
        try:
            self._apply_weights(
                tensors, weight_version, abort_all_requests, "update_weights_from_distributed"
            )
        except ValueError as e:  # a delta's checksum: the weights are as they were
            return False, f"Failed to update weights over group {group_name}: {e}"
        if load_format != LORA:
            self._lora_base = None  # whole tensors replace the base, as a directory's do
        return True, _updated_message(weight_version)

    def _decoded(
        self, received: dict[str, torch.Tensor], load_format: str | None, lora_config: dict | None
    ) -> dict[str, torch.Tensor | Patch]:
        """A received bucket as the weights (or deltas) to apply; ValueError when it does
        not fit the model or its load_format."""
        if load_format == DELTA:  # what changed since the weights held now, checked
            return decode_delta(self.model.state_dict(), received)
        if load_format == LORA:
            return self._adapter_merged(received, lora_config or {})
        return received

    def _adapter_merged(
        self, received: dict[str, torch.Tensor], lora_config: dict
    ) -> dict[str, torch.Tensor]:
        """The weights that received adapter tensors change, merged into the base kept
        apart (areal/lora.py's merge_layers, as for an adapter directory: the same bits)."""
        check_wire_config(lora_config, received)
        return merge_layers(*self._lora_base_for(*layers_of(lora_config, received)))

    def _lora_base_for(self, scale: float, layers: dict) -> tuple[dict, float, dict]:
        """merge_layers' arguments for an adapter's layers: the base weights kept apart
        (merging into merged weights would add the updates up), copied from the model for
        the layers no adapter changed yet (the first adapter, or a bucket's new layers: a
        run's adapters all change the same layers)."""
        state = self.model.state_dict()
        if self._lora_base is None:
            self._lora_base = {}
        for name in layers:
            if name in state and name not in self._lora_base:
                self._lora_base[name] = state[name].detach().clone()
        return self._lora_base, scale, layers

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float = 120.0,
    ) -> tuple[bool, str]:
        """Join the weight-update group group_name as rank rank_offset (this engine is one
        rank); returns (success, message) once all world_size ranks have joined, or fails
        after timeout_s, which also bounds every later receive over the group. backend:
        gloo, or nccl when the engine runs on cuda."""
        if backend not in BACKENDS:
            return False, f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
        if backend == "nccl" and self.device.type != "cuda":
            return False, (
                f"backend nccl needs a cuda device; this server runs on {self.device}: "
                'use backend "gloo"'
            )
        with self._groups_lock:
            if group_name in self._groups or group_name in self._joining:
                return False, (
                    f"a weight-update group named {group_name!r} exists already; destroy it "
                    "first (/destroy_weights_update_group)"
                )
            self._joining.add(group_name)
        try:
            group = open_group(
                backend=backend,
                master_address=master_address,
                master_port=master_port,
                rank=rank_offset,
                world_size=world_size,
                group_name=group_name,
                timeout_s=timeout_s,
            )
        except Exception as e:  # torch's DistStoreError, DistNetworkError, ValueError...
            with self._groups_lock:
                self._joining.discard(group_name)
            return False, f"Failed to init weights update group {group_name}: {e}"
        device = self.device if backend == "nccl" else torch.device("cpu")
        with self._groups_lock:
            self._joining.discard(group_name)
            self._groups[group_name] = (group, device)
        logger.info(
            "joined weight-update group %s as rank %d of %d (%s, %s:%d)",
            group_name, rank_offset, world_size, backend, master_address, master_port,
        )  # fmt: skip
        return True, "Succeeded to initialize custom process group."

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> tuple[bool, str]:
        """Leave and free the group (a broken one too); (False, why) for an unknown name."""
        with self._groups_lock:
            entry = self._groups.pop(group_name, None)
            if entry is None:
                return False, f"Failed to destroy: {self._no_group_locked(group_name)}"
        entry[0].close()
        return True, "Succeeded to destroy custom process group."

    def _no_group_locked(self, name: str) -> str:
        known = ", ".join(sorted(self._groups)) or "none"
        return (
            f"no weight-update group named {name!r} (groups: {known}); join one with "
            "/init_weights_update_group"
        )

    def _apply_weights(
        self,
        tensors: dict[str, torch.Tensor | Patch],
        weight_version: int | None,
        abort_all_requests: bool,
        source: str,
        model_path: str | None = None,
    ) -> int:
        """Copy checked tensors into the live model between decode steps (cast to its dtype;
        deltas set entry by entry: ValueError when one's checksum differs, with nothing
        changed but the aborts); returns the number of requests kept by a pause. source
        names the update in the message of the requests it aborts; model_path: what
        /get_model_info reports from now on (None: unchanged)."""
        with self._cv:
            # Admit nothing from here on: a request resubmitted the moment its abort
            # returns must wait for the new weights, or its tokens would carry the old ones.
            self._updates_pending += 1
        try:
            if abort_all_requests:
                self.abort(abort_all=True, message=f"Aborted by {source}.")
            with self._cv:
                while self._stepping or (self._pause_mode is None and self._running):
                    self._cv.wait()
                with torch.no_grad():
                    apply_bucket(self.model.state_dict(), tensors)
                if model_path is not None:
                    self._model_path = str(model_path)
                self._kv_stale = True
                if weight_version is not None:
                    self._weight_version = weight_version
                return len(self._running) + len(self._waiting) if self._pause_mode else 0
        finally:
            with self._cv:
                self._updates_pending -= 1
                self._cv.notify_all()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request (held ones too) and stop the decode thread."""
        finished: list[Request] = []
        with self._cv:
            self._stopping = True
            for req in list(self._by_rid.values()):
                self._finish_locked(req, _abort("The server is shutting down."), finished)
            self._cv.notify_all()
        self._resolve(finished)
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._groups_lock:
            groups, self._groups = list(self._groups.values()), {}
        for group, _ in groups:
            group.close()

    # ---- introspection --------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def model_path(self) -> str:
        return self._model_path

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {
                "num_running_reqs": len(self._running),
                "num_waiting_reqs": len(self._waiting),
                "num_held_reqs": len(self._held),
                "paused": self._pause_mode,
                "weight_version": self._weight_version,
                "max_batch_size": self.max_batch_size,
                "max_total_tokens": self.max_total_tokens,
                "total_generated_tokens": self._counters["tokens"],
                "total_finished_reqs": self._counters["finished"],
                "total_aborted_reqs": self._counters["aborted"],
                "num_decode_steps": self._counters["steps"],
                # Tokens whose keys/values a prefill computed: prompts, and every prefix again
                # after a weight update (on a CPU one costs about what a decoded token does).
                "total_prefilled_tokens": self._counters["prefilled"],
            }

    # ---- decode thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                batch = self._next_batch_locked()
                if batch is None:
                    self._meter.flush()
                    return
                self._stepping = True
                stale, self._kv_stale = self._kv_stale, False
            self.cores.work()  # may wait briefly for a peer to hand back this server's cores
            t_step = time.time()
            batch = self._place(batch, stale)
            tokens: list[int] = []
            logprobs: list[float] = []
            prefilled = prefill_rows = 0
            error: Exception | None = None
            try:
                tokens, logprobs, prefilled, prefill_rows = self._step(batch)
            except Exception as e:  # a bad step must fail its requests, not kill the server
                logger.exception("decode step failed")
                error = e
            finished: list[Request] = []
            cells = sum(self._kv.lens)  # the context each row attended to (C-level sum)
            self._meter.step(
                t_step,
                time.time(),
                len(batch),
                cells,
                self._kv.read,
                prefilled,
                prefill_rows,
                self.cores.threads,
            )
            with self._cv:
                self._stepping = False
                self._counters["steps"] += 1
                self._counters["prefilled"] += prefilled
                if error is not None:
                    for req in batch:
                        self._finish_locked(req, _abort(f"decode step failed: {error}"), finished)
                else:
                    for req, token, lp in zip(batch, tokens, logprobs, strict=True):
                        if not req.done:  # aborted while the step ran: keep its partial output
                            self._append_locked(req, token, lp, finished)
                self._cv.notify_all()
            self._resolve(finished)

    def _next_batch_locked(self) -> list[Request] | None:
        while not self._stopping:
            if self._pause_mode is None:
                # A pending weight update drains the running batch before it applies. First
                # come, first admitted: a request that does not fit yet blocks later ones.
                longest = max((r.max_len for r in self._running), default=0)
                while self._waiting and not self._updates_pending:
                    if len(self._running) >= self.max_batch_size:
                        break
                    longest = max(longest, self._waiting[0].max_len)
                    if (len(self._running) + 1) * longest > self.max_total_tokens:
                        break
                    self._running.append(self._waiting.popleft())
                if self._running:
                    return list(self._running)
            self.cores.wait()
            self._cv.wait()
        return None

    def _place(self, batch: list[Request], stale: bool) -> list[Request]:
        """Give the batch cache rows 0..n-1: the requests that keep their row stay below
        len(kept), those above it fill the holes the leavers left (one batched copy), new
        ones follow. After a weight update (stale) no cached row is valid any more."""
        members = set(batch)
        kept = [r for r in self._rows if r in members]
        kept_set = set(kept)
        movers = [r for r in kept if r.row >= len(kept)]
        holes = sorted(set(range(len(kept))) - {r.row for r in kept})
        if not stale:  # stale rows are prefilled again: nothing worth copying
            self._kv.move([r.row for r in movers], holes)
        for req, row in zip(movers, holes, strict=True):
            req.row = row
        kept.sort(key=lambda r: r.row)
        for req in kept:
            req.cached = req.cached and not stale
        # New rows are prefilled anyway: longest first, so that a decode step's attention
        # chunks (areal/rollout/chunks.py) hold rows of similar lengths.
        new = sorted(
            (r for r in batch if r not in kept_set),
            key=lambda r: -(len(r.prompt_ids) + len(r.output_ids)),
        )
        for row, req in enumerate(new, start=len(kept)):
            req.row, req.cached = row, False
        self._rows = kept + new
        self._kv.ensure(len(self._rows), max(r.max_len for r in self._rows))
        return self._rows

    def _step(self, batch: list[Request]) -> tuple[list[int], list[float], int, int]:
        """1) prefill the requests not cached 2) one decode forward over all 3) sample.
        Returns the tokens, their log-probs, and the tokens and rows the prefill computed."""
        todo = [r for r in batch if not r.cached]
        cached = [r for r in batch if r.cached]
        for req in todo:  # a one-token prompt has nothing to prefill
            self._kv.reset(req.row)
            req.cached = True
        todo = [r for r in todo if len(r.prompt_ids) + len(r.output_ids) > 1]
        computed, rows = self._prefill(todo, cached)
        last = [(r.output_ids or r.prompt_ids)[-1] for r in batch]
        logits = self._kv.decode(last)  # [B, V]
        return (*sample(logits.float(), batch, self._generator), computed, rows)

    def _prefill(self, todo: list[Request], cached: list[Request]) -> tuple[int, int]:
        """Cache every token but the last of each todo request, computing each distinct
        prefix once: a GRPO group's answers (one prompt, submitted together) and a request
        whose prompt a cached row already holds copy its keys and values instead, as SGLang's
        radix cache shares a prompt. Returns the tokens and rows computed."""
        # Only a cached prompt as long as a new request's could be its source.
        sizes = {len(r.prompt_ids) for r in todo if not r.output_ids}
        held = {tuple(r.prompt_ids[:-1]): r.row for r in cached if len(r.prompt_ids) in sizes}
        first: dict[tuple[int, ...], int] = {}  # prefix -> the row computing it
        compute: list[tuple[int, list[int]]] = []  # (row, prefix)
        shares: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
        for req in todo:
            prefix = (req.prompt_ids + req.output_ids)[:-1]
            key = tuple(prefix)
            src = first.get(key, held.get(key) if not req.output_ids else None)
            if src is None:
                first[key] = req.row
                compute.append((req.row, prefix))
            else:
                shares[src, len(prefix)].append(req.row)
        for bucket in length_buckets([len(p) for _, p in compute]):
            self._kv.prefill([compute[i][0] for i in bucket], [compute[i][1] for i in bucket])
        for (src, length), dsts in shares.items():
            self._kv.share(src, dsts, length)
        return sum(len(p) for _, p in compute), len(compute)

    def _append_locked(self, req: Request, token: int, lp: float, out: list[Request]) -> None:
        req.output_ids.append(token)
        req.logprobs.append(lp)
        self._counters["tokens"] += 1
        # The order of checks is SGLang's: length first, then stop tokens, then stop strings.
        if len(req.output_ids) >= req.max_new:
            self._finish_locked(req, {"type": "length", "length": req.max_new}, out)
        elif token in req.stop_ids:
            self._finish_locked(req, {"type": "stop", "matched": token}, out)
        elif req.params.stop:
            tail = self.tokenizer.decode(req.output_ids[-_STOP_TAIL_TOKENS:])
            matched = next((s for s in req.params.stop if s and s in tail), None)
            if matched is not None:
                self._finish_locked(req, {"type": "stop", "matched": matched}, out)

    def _finish_locked(self, req: Request, reason: dict, out: list[Request]) -> None:
        if req.done:
            return
        req.done = True
        self._by_rid.pop(req.rid, None)
        for queue in (self._running, self._waiting, self._held):
            if req in queue:
                queue.remove(req)
        self._counters["finished"] += 1
        self._counters["aborted"] += reason["type"] == "abort"
        req.result = GenerationResult(
            rid=req.rid,
            prompt_ids=req.prompt_ids,
            output_ids=list(req.output_ids),
            logprobs=list(req.logprobs),
            finish_reason=reason,
            weight_version=self._weight_version,
            e2e_latency=time.monotonic() - req.created,
        )
        out.append(req)

    @staticmethod
    def _resolve(finished: list[Request]) -> None:
        # Outside the lock: Future callbacks may run arbitrary code.
        for req in finished:
            req.future.set_result(req.result)


# A stop string is searched in the decoded tail of this many tokens (SGLang does the same).
_STOP_TAIL_TOKENS = 64


def length_buckets(lengths: list[int], max_padding: float = 0.25) -> list[list[int]]:
    """Indices grouped by similar length, longest first, each group padded by at most
    max_padding of its cells. A padded prefill costs rows x longest: a few short sequences
    beside a long one would pay the long one's length (after a weight update every running
    request is prefilled again, and long-tailed outputs make that the usual case)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    total = 0
    for i in order:
        if buckets:
            longest = lengths[buckets[-1][0]]
            if (len(buckets[-1]) + 1) * longest * (1 - max_padding) <= total + lengths[i]:
                buckets[-1].append(i)
                total += lengths[i]
                continue
        buckets.append([i])
        total = lengths[i]
    return buckets


def _auto_token_budget(bytes_per_token: int, device: torch.device) -> int:
    """A quarter of the memory available now, in cache tokens (max_total_tokens=0)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, free // 4 // bytes_per_token)


def _updated_message(weight_version: int | None) -> str:
    message = "Succeeded to update model weights."
    if weight_version is not None:
        message += f" Weight version updated to {weight_version}."
    return message


def _bucket_problems(
    expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor | Patch]
) -> str:
    """What is wrong with a bucket against the model's state_dict ("" when nothing): unknown
    names and wrong shapes. A bucket is part of a version, so nothing is missing."""
    problems = [
        f"unexpected tensor {name} (not in the model's state_dict)"
        for name in tensors
        if name not in expected
    ]
    problems += [
        f"tensor {name} has shape {tuple(t.shape)}, the model expects {tuple(expected[name].shape)}"
        for name, t in tensors.items()
        if name in expected and t.shape != expected[name].shape
    ]
    return "; ".join(problems)


def _abort(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message}


def _as_ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)
