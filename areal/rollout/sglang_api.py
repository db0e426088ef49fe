"""SGLang's HTTP API (0.5.x shapes), both halves side by side: plain functions, no I/O.

```
 client side (client.py: SGLangClient)              server side (server.py: embedded server)
 build_generate_request ─────POST /generate──────►  parse_generate_body -> [GenerateSpec]
 parse_generate_response ◄────── JSON ───────────  format_generate_output(GenerationResult)
 build_update_weights_request ─POST /update_weights_from_disk─► parse_update_weights_body
 update_weights_problem ◄──────── JSON ──────────  format_update_weights_response
 build_pause_request / build_abort_request ──────► parse_pause_body / parse_abort_body
 build_init_weights_group_request ─POST /init_weights_update_group─► parse_init_weights_group_body
 build_update_weights_from_distributed_request ─POST /update_weights_from_distributed─►
                                                   parse_update_weights_from_distributed_body
 build_destroy_weights_group_request ─POST /destroy_weights_update_group─►
                                                   parse_destroy_weights_group_body
 success_problem ◄─────────── JSON ──────────────  format_success_response
                                                   format_model_info, format_server_info
 parse_weight_version: the one reader of a weight version on the wire (both sides)
```

Weight versions are integers everywhere inside areal (the trainer's count of updates) and
strings on the wire, as SGLang sends them: `format_weight_version` writes one,
`parse_weight_version` reads one. SGLang's initial version string "default" (a server started
without --weight-version) reads as 0: SGLang starts from the base model, which is version 0
of a run.

A weight-update group (areal/weight_group.py) carries new weights without the disk: the trainer
(rank 0) and the server join a group (/init_weights_update_group), then each
/update_weights_from_distributed names one bucket of tensors (names, dtypes, shapes) that rank 0
broadcasts, one tensor at a time, while the request waits; /destroy_weights_update_group leaves
the group. All three answer SGLang's {"success", "message"}, 400 when refused.

A server-side parser raises BadRequest (areal/rollout/http_error.py) with what to fix; the
server answers it with 400 and SGLang's error body (`format_error`). A client-side parser
raises ValueError naming the missing or malformed field.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from areal.rollout.generation import PAUSE_MODES, GenerationResult, SamplingParams
from areal.rollout.http_error import BadRequest
from areal.rollout.inference import FINISH_REASONS, GenerateOutput

DELTA = "delta"
"""The load_format of a bucket of deltas (areal/weight_group.py's encode_delta): the
embedded server's own; SGLang's servers take none."""

LORA = "lora"
"""The load_format of a bucket of LoRA adapter tensors (model.lora with
weights.transport=distributed): PEFT's names (base_model.model.<layer>.lora_A.weight and
.lora_B.weight, both of a layer in one bucket), and the request's lora_config says how to
apply them (r, lora_alpha, target_modules: PEFT's adapter_config fields). The embedded
server merges them into its base as it merges an adapter directory; SGLang's servers take
none over a group (their /load_lora_adapter_from_tensors takes pickled tensors, not a
broadcast)."""

FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)
"""SGLang's plain-text answer to /flush_cache, as clients may log it."""

# SGLang sampling parameters the embedded server accepts only at their neutral value.
_NEUTRAL_PARAMS: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "custom_params": None,
    "logit_bias": None,
    "sampling_seed": None,
}
# Presentation-only SGLang parameters: they shape the returned text, not the tokens.
_TEXT_PARAMS = {"skip_special_tokens": True, "spaces_between_special_tokens": True}
_IGNORED_PARAMS = {"stream_interval", "no_stop_trim"}


# ---- weight versions (both sides) ---------------------------------------------------------


def parse_weight_version(value: Any) -> int:
    """Our integer version from SGLang's weight_version string ("default" is 0, "v7" is 7);
    an int passes through. ValueError for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text == "default":
            return 0
        text = text[1:] if text[:1] in ("v", "V") else text
        if text.isdigit():
            return int(text)
    raise ValueError(f"meta_info.weight_version {value!r} is not an integer version")


def format_weight_version(version: int) -> str:
    """The wire form of a weight version: SGLang's weight_version is a string."""
    return str(version)


# ---- client side: request builders --------------------------------------------------------


def build_generate_request(
    input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
) -> dict[str, Any]:
    """The /generate body for one prompt: token ids in, token ids and log-probs out."""
    if not input_ids:
        raise ValueError("input_ids must not be empty")
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": dict(sampling_params),
        "return_logprob": True,
        "stream": False,
    }
    if rid is not None:
        body["rid"] = rid
    return body


def build_batch_generate_request(
    input_ids: list[list[int]], sampling_params: list[dict[str, Any]], rids: list[str]
) -> dict[str, Any]:
    """SGLang's batch form of /generate: one list entry per prompt, answered by a list."""
    if not input_ids or any(not ids for ids in input_ids):
        raise ValueError("input_ids must not be empty")
    body = build_generate_request(input_ids[0], sampling_params[0], rids[0])
    body.update(
        input_ids=[[int(t) for t in ids] for ids in input_ids],
        sampling_params=[dict(p) for p in sampling_params],
        rid=list(rids),
    )
    return body


def build_update_weights_request(
    model_path: str, weight_version: int, abort_all_requests: bool = False
) -> dict[str, Any]:
    """The /update_weights_from_disk body: load model_path, report weight_version from now on."""
    return {
        "model_path": str(model_path),
        "weight_version": format_weight_version(weight_version),
        "abort_all_requests": abort_all_requests,
        "flush_cache": True,
    }


DEFAULT_GROUP_NAME = "weight_update_group"
"""SGLang's default name of a weight-update group."""


def build_init_weights_group_request(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "nccl",
) -> dict[str, Any]:
    """The /init_weights_update_group body: join the group whose rank 0 (the trainer) serves
    its store at master_address:master_port, as ranks rank_offset.. (one per server rank)."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def build_update_weights_from_distributed_request(
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    group_name: str,
    weight_version: int,
    abort_all_requests: bool = False,
    load_format: str | None = None,
    flush_cache: bool = True,
    lora_config: dict | None = None,
) -> dict[str, Any]:
    """The /update_weights_from_distributed body of one bucket: rank 0 broadcasts its tensors
    in the order of names while the request waits; report weight_version once applied.
    load_format None is SGLang's (one broadcast per tensor); "delta" areal's deltas
    (areal/weight_group.py) and "lora" adapter tensors (with lora_config: r, lora_alpha,
    target_modules), which only the embedded server takes. flush_cache: this bucket
    completes the version (SGLang then empties its prefix cache; vLLM applies the version's
    buckets, which it holds until then)."""
    if (load_format == LORA) != (lora_config is not None):
        raise ValueError(f"lora_config goes with load_format {LORA!r}, and only with it")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
            f"{len(shapes)})"
        )
    return {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [[int(d) for d in shape] for shape in shapes],
        "group_name": group_name,
        "flush_cache": bool(flush_cache),
        "abort_all_requests": abort_all_requests,
        "weight_version": format_weight_version(weight_version),
        "load_format": load_format,
        **({} if lora_config is None else {"lora_config": dict(lora_config)}),
    }


def build_destroy_weights_group_request(group_name: str = DEFAULT_GROUP_NAME) -> dict[str, Any]:
    return {"group_name": group_name}


def build_pause_request(mode: str = "abort") -> dict[str, Any]:
    return {"mode": mode}


def build_abort_request(rid: str | None = None, abort_all: bool = False) -> dict[str, Any]:
    return {"rid": rid or "", "abort_all": abort_all}


# LoRA (SGLang 0.5.x, docs "LoRA Serving"; the server runs --enable-lora --max-lora-rank R
# --lora-target-modules all): adapters load and unload at run time by name, and a /generate
# names the one it runs on in "lora_path" (one per prompt in the batch form).


def build_load_lora_request(name: str, path: str) -> dict[str, Any]:
    """The /load_lora_adapter body: serve the adapter directory `path` as `name`."""
    return {"lora_name": name, "lora_path": str(path)}


def build_unload_lora_request(name: str) -> dict[str, Any]:
    """The /unload_lora_adapter body."""
    return {"lora_name": name}


def build_update_weight_version_request(version: int) -> dict[str, Any]:
    """The /update_weight_version body: label outputs from now on (no weights change). Its
    abort_all_requests defaults to true on SGLang: the caller has aborted already."""
    return {"new_version": format_weight_version(version), "abort_all_requests": False}


def with_lora_path(body: dict[str, Any], adapter: str | None) -> dict[str, Any]:
    """A /generate body (single or batch form) naming the adapter it runs on (None: base)."""
    if adapter is not None:
        n = (
            len(body["input_ids"])
            if body["input_ids"] and isinstance(body["input_ids"][0], list)
            else 0
        )
        body["lora_path"] = [adapter] * n if n else adapter
    return body


def load_lora_problem(body: Any, name: str) -> str | None:
    """None when /load_lora_adapter answered success with `name` among loaded_adapters, else
    the server's reason."""
    if isinstance(body, dict) and body.get("success"):
        if name in (body.get("loaded_adapters") or {}):
            return None
        return f"the answer's loaded_adapters {body.get('loaded_adapters')} lack {name}"
    if isinstance(body, dict) and body.get("error_message"):
        return str(body["error_message"])
    return error_message(body)


# ---- client side: response parsers --------------------------------------------------------


def parse_generate_response(body: Any) -> GenerateOutput:
    """GenerateOutput from a /generate response; ValueError names the missing field."""
    if not isinstance(body, dict):
        raise ValueError(f"the /generate response must be a JSON object, got {type(body).__name__}")
    output_ids = _field(body, "output_ids", list, "")
    meta = _field(body, "meta_info", dict, "")
    reason = _field(meta, "finish_reason", dict, "meta_info.")
    kind = _field(reason, "type", str, "meta_info.finish_reason.")
    if kind not in FINISH_REASONS:
        raise ValueError(f"meta_info.finish_reason.type {kind!r} is not one of {FINISH_REASONS}")
    if "weight_version" not in meta:
        raise ValueError("the /generate response has no field meta_info.weight_version")
    entries = _field(meta, "output_token_logprobs", list, "meta_info.")
    if len(entries) != len(output_ids):
        raise ValueError(
            f"meta_info.output_token_logprobs has {len(entries)} entries "
            f"for {len(output_ids)} output_ids"
        )
    logprobs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, list | tuple) or len(entry) < 2 or entry[1] != output_ids[i]:
            raise ValueError(
                f"meta_info.output_token_logprobs[{i}] is not [logprob, {output_ids[i]}, ...]"
            )
        logprobs.append(float(entry[0]))
    return GenerateOutput(
        output_ids=[int(t) for t in output_ids],
        logprobs=logprobs,
        finish_reason=kind,
        weight_version=parse_weight_version(meta["weight_version"]),
        completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
        rid=meta.get("id"),
        message=str(reason.get("message", "")) if kind == "abort" else "",
    )


def parse_batch_generate_response(body: Any, n: int) -> list[GenerateOutput]:
    """The n outputs of a batched /generate, in the order of its prompts."""
    if not isinstance(body, list) or len(body) != n:
        raise ValueError(f"the batched /generate response must be a list of {n} outputs")
    return [parse_generate_response(r) for r in body]


def update_weights_problem(body: Any) -> str | None:
    """None when /update_weights_from_disk loaded the weights, else the server's reason."""
    return success_problem(body)


def success_problem(body: Any) -> str | None:
    """None when an answer says {"success": true} (the weight-update routes), else the
    server's reason."""
    if isinstance(body, dict) and body.get("success"):
        return None
    return error_message(body)


def error_message(body: Any) -> str:
    """The message inside an SGLang error body ({"error": {"message"}} or {"message"})."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)


def _field(obj: dict, key: str, kind: type, prefix: str) -> Any:
    if key not in obj or obj[key] is None:
        raise ValueError(f"the /generate response has no field {prefix}{key}")
    if not isinstance(obj[key], kind):
        raise ValueError(f"{prefix}{key} must be a {kind.__name__}, got {obj[key]!r}")
    return obj[key]


# ---- server side: request parsers ---------------------------------------------------------


@dataclass
class GenerateSpec:
    """One request of a (possibly batched) /generate call, validated."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    return_text_in_logprobs: bool
    skip_special_tokens: bool
    no_stop_trim: bool


def parse_sampling_params(raw: Any, where: str = "sampling_params") -> tuple[SamplingParams, dict]:
    """SamplingParams plus the text-shaping options, from SGLang's sampling_params dict."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be a JSON object, got {type(raw).__name__}")
    kwargs: dict[str, Any] = {}
    text_opts = {"skip_special_tokens": True, "no_stop_trim": False}
    for key, value in raw.items():
        name = f"{where}.{key}"
        if key in ("max_new_tokens", "min_new_tokens", "top_k"):
            kwargs[key] = _int(value, name)
        elif key in ("temperature", "top_p"):
            kwargs[key] = _float(value, name)
        elif key == "ignore_eos":
            kwargs[key] = _bool(value, name)
        elif key == "stop_token_ids":
            kwargs[key] = [] if value is None else _int_list(value, name)
        elif key == "stop":
            kwargs[key] = _stop_strings(value, name)
        elif key in _TEXT_PARAMS or key == "no_stop_trim":
            text_opts[key] = _bool(value, name)
        elif key in _NEUTRAL_PARAMS:
            if value is not None and value != _NEUTRAL_PARAMS[key]:
                raise BadRequest(
                    f"{name}={value!r} is not supported by the embedded server; "
                    f"leave it at {_NEUTRAL_PARAMS[key]!r}"
                )
        elif key not in _IGNORED_PARAMS:
            raise BadRequest(f"{name} is not a known sampling parameter")
    try:
        return SamplingParams(**kwargs), text_opts
    except ValueError as e:
        raise BadRequest(str(e)) from None


def parse_generate_body(body: Any, tokenizer: Any = None) -> tuple[list[GenerateSpec], bool]:
    """Validate a /generate body; returns the requests and whether it was a batch."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the embedded server; send stream=false")
    input_ids, text = body.get("input_ids"), body.get("text")
    if (input_ids is None) == (text is None):
        raise BadRequest("exactly one of text or input_ids must be provided")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest("input_ids must be a non-empty list of token ids (or of lists)")
        is_batch = isinstance(input_ids[0], list)
        prompts = (
            [_int_list(p, f"input_ids[{i}]") for i, p in enumerate(input_ids)]
            if is_batch
            else [_int_list(input_ids, "input_ids")]
        )
    else:
        if tokenizer is None:
            raise BadRequest("text needs a tokenizer and the model has none; send input_ids")
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        prompts = [tokenizer.encode(t) for t in texts]
    if any(not p for p in prompts):
        raise BadRequest("input_ids must not contain an empty prompt")
    n = len(prompts)
    sampling = _per_request(body.get("sampling_params"), n, "sampling_params", dict)
    rids = _per_request(body.get("rid"), n, "rid", str)
    logprob = _per_request(body.get("return_logprob", False), n, "return_logprob", bool)
    text_in_lp = _bool(body.get("return_text_in_logprobs", False), "return_text_in_logprobs")
    specs = []
    for i in range(n):
        where = f"sampling_params[{i}]" if is_batch else "sampling_params"
        params, opts = parse_sampling_params(sampling[i], where)
        specs.append(
            GenerateSpec(
                rid=rids[i] if rids[i] is not None else uuid.uuid4().hex,
                input_ids=prompts[i],
                params=params,
                return_logprob=bool(logprob[i]),
                return_text_in_logprobs=text_in_lp,
                skip_special_tokens=opts["skip_special_tokens"],
                no_stop_trim=opts["no_stop_trim"],
            )
        )
    if len({s.rid for s in specs}) < n:
        raise BadRequest("rid must be unique within a batch")
    return specs, is_batch


def parse_pause_body(body: dict) -> str:
    """The mode of a /pause_generation body (SGLang's default: abort)."""
    mode = body.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return mode


def parse_update_weights_body(body: dict) -> tuple[str, int | None, bool]:
    """(model_path, weight_version or None to keep the current one, abort_all_requests)."""
    model_path = body.get("model_path")
    if not isinstance(model_path, str) or not model_path:
        raise BadRequest("model_path must be a non-empty string")
    version = _optional_version(body.get("weight_version"))
    abort_all = _bool(body.get("abort_all_requests", False), "abort_all_requests")
    _bool(body.get("flush_cache", True), "flush_cache")  # no cache to flush, but check it
    return model_path, version, abort_all


@dataclass(frozen=True)
class WeightsGroupSpec:
    """A validated /init_weights_update_group body."""

    master_address: str
    master_port: int
    rank_offset: int
    """The server's (first) rank in the group; rank 0 is the trainer's."""
    world_size: int
    group_name: str
    backend: str


@dataclass(frozen=True)
class BucketSpec:
    """A validated /update_weights_from_distributed body: one bucket of tensors."""

    names: list[str]
    dtypes: list[str]
    """torch's names without the prefix ("bfloat16"); checked by the engine."""
    shapes: list[list[int]]
    group_name: str
    weight_version: int | None
    """None keeps the current version."""
    abort_all_requests: bool
    load_format: str | None = None
    """None: whole tensors; "delta": areal's deltas (areal/weight_group.py); "lora": adapter
    tensors (LORA)."""
    lora_config: dict | None = None
    """With load_format "lora": r, lora_alpha and target_modules (checked by the engine
    against the tensors received)."""


def parse_init_weights_group_body(body: dict) -> WeightsGroupSpec:
    """The group to join; the backend is the engine's to check (gloo, or nccl on cuda)."""
    address = body.get("master_address")
    if not isinstance(address, str) or not address:
        raise BadRequest("master_address must be a non-empty string (the trainer's host)")
    port = _int(body.get("master_port"), "master_port")
    if not 0 < port < 65536:
        raise BadRequest(f"master_port must be in 1..65535, got {port}")
    world_size = _int(body.get("world_size"), "world_size")
    rank_offset = _int(body.get("rank_offset"), "rank_offset")
    if not 0 < rank_offset < world_size:
        raise BadRequest(
            f"rank_offset must be in 1..world_size-1 (rank 0 is the trainer's), got "
            f"{rank_offset} for world_size {world_size}"
        )
    backend = body.get("backend", "nccl")
    if not isinstance(backend, str):
        raise BadRequest(f"backend must be a string, got {backend!r}")
    return WeightsGroupSpec(
        master_address=address,
        master_port=port,
        rank_offset=rank_offset,
        world_size=world_size,
        group_name=_group_name(body),
        backend=backend,
    )


def parse_update_weights_from_distributed_body(body: dict) -> BucketSpec:
    """The bucket to receive. Refused here (before any broadcast is received) only what
    cannot be received at all; names and shapes are checked against the model after."""
    names = body.get("names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise BadRequest("names must be a non-empty list of tensor names")
    if len(set(names)) < len(names):
        duplicated = sorted({n for n in names if names.count(n) > 1})
        raise BadRequest(f"names must be unique; {', '.join(duplicated)} appear more than once")
    dtypes = body.get("dtypes")
    if not isinstance(dtypes, list) or not all(isinstance(d, str) for d in dtypes):
        raise BadRequest('dtypes must be a list of dtype names ("bfloat16", "float32", ...)')
    shapes = body.get("shapes")
    if not isinstance(shapes, list):
        raise BadRequest("shapes must be a list of shapes (lists of integers)")
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest(
            f"names, dtypes and shapes must have one entry per tensor; got {len(names)}, "
            f"{len(dtypes)} and {len(shapes)}"
        )
    for name, shape in zip(names, shapes, strict=True):
        if not isinstance(shape, list) or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
        ):
            raise BadRequest(f"the shape of {name} must be a list of sizes >= 0, got {shape!r}")
    load_format = body.get("load_format")
    if load_format not in (None, DELTA, LORA):
        raise BadRequest(
            f"load_format {load_format!r} is not supported by the embedded server; send null "
            f"(SGLang's default: one broadcast per tensor, in the order of names), {DELTA!r}"
            f" (areal's deltas) or {LORA!r} (LoRA adapter tensors, with lora_config)"
        )
    lora_config = body.get("lora_config")
    if (load_format == LORA) != (lora_config is not None) or not isinstance(
        lora_config, dict | None
    ):
        raise BadRequest(
            f"lora_config (an object: r, lora_alpha, target_modules) goes with load_format "
            f"{LORA!r}, and only with it; got load_format {load_format!r} and lora_config "
            f"{lora_config!r}"
        )
    abort_all = _bool(body.get("abort_all_requests", False), "abort_all_requests")
    _bool(body.get("flush_cache", True), "flush_cache")  # no cache to flush, but check it
    return BucketSpec(
        names=names,
        dtypes=dtypes,
        shapes=shapes,
        group_name=_group_name(body),
        weight_version=_optional_version(body.get("weight_version")),
        abort_all_requests=abort_all,
        load_format=load_format,
        lora_config=lora_config,
    )


def parse_destroy_weights_group_body(body: dict) -> str:
    """The name of the group to leave."""
    return _group_name(body)


def _group_name(body: dict) -> str:
    name = body.get("group_name", DEFAULT_GROUP_NAME)
    if not isinstance(name, str) or not name:
        raise BadRequest(f"group_name must be a non-empty string, got {name!r}")
    return name


def _optional_version(version: Any) -> int | None:
    if version is None:
        return None
    try:
        return parse_weight_version(version)
    except ValueError:
        raise BadRequest(
            f'weight_version {version!r} must be an integer version (e.g. "7") or null'
        ) from None


def parse_abort_body(body: dict) -> tuple[str, bool]:
    """(rid, abort_all) of an /abort_request body; rid "" names no request."""
    rid = body.get("rid", "")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    return rid or "", _bool(body.get("abort_all", False), "abort_all")


# ---- server side: response formatting -----------------------------------------------------


def format_generate_output(
    result: GenerationResult, spec: GenerateSpec, tokenizer: Any
) -> dict[str, Any]:
    """The SGLang /generate response for one finished request."""
    matched = result.finish_reason.get("matched")
    text_ids = result.output_ids
    if isinstance(matched, int) and not spec.no_stop_trim and text_ids:
        text_ids = text_ids[:-1]  # SGLang leaves the matched stop token out of the text
    text = ""
    if tokenizer is not None:
        text = tokenizer.decode(text_ids, skip_special_tokens=spec.skip_special_tokens)
        if isinstance(matched, str) and not spec.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
    # The keys and order of SGLang's TokenizerManager._handle_batch_output (metrics off); see
    # tests/data/sglang_shapes.json.
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(result.prompt_ids),
        "weight_version": format_weight_version(result.weight_version),
        "num_retractions": 0,
    }
    if spec.return_logprob:

        def texts(ids: list[int]) -> list[str | None]:
            if spec.return_text_in_logprobs and tokenizer is not None:
                return [tokenizer.decode([t]) for t in ids]
            return [None] * len(ids)

        # By default SGLang starts input log-probs at the last prompt token, which has none.
        last = result.prompt_ids[-1:]
        meta["input_token_logprobs"] = [
            [None, t, x] for t, x in zip(last, texts(last), strict=True)
        ]
        meta["output_token_logprobs"] = [
            [lp, tok, txt]
            for lp, tok, txt in zip(
                result.logprobs, result.output_ids, texts(result.output_ids), strict=True
            )
        ]
        meta["output_token_logprobs_length"] = len(result.output_ids)
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = len(result.output_ids)
    meta["cached_tokens"] = 0
    meta["e2e_latency"] = result.e2e_latency
    return {"text": text, "output_ids": result.output_ids, "meta_info": meta}


def format_update_weights_response(
    success: bool, message: str, num_paused_requests: int
) -> tuple[dict[str, Any], int]:
    """SGLang's /update_weights_from_disk answer and its HTTP status (400 when refused)."""
    body = {"success": success, "message": message, "num_paused_requests": num_paused_requests}
    return body, 200 if success else 400


def format_success_response(success: bool, message: str) -> tuple[dict[str, Any], int]:
    """SGLang's answer to /init_weights_update_group, /update_weights_from_distributed and
    /destroy_weights_update_group, and its HTTP status (400 when refused)."""
    return {"success": success, "message": message}, 200 if success else 400


def format_pause_response() -> dict[str, Any]:
    return {"message": "Generation paused successfully.", "status": "ok"}


def format_continue_response() -> dict[str, Any]:
    return {"message": "Generation continued successfully.", "status": "ok"}


def format_model_info(model_path: str, tokenizer_path: str | None, weight_version: int) -> dict:
    """SGLang's /model_info (and /get_model_info) answer."""
    return {
        "model_path": model_path,
        "tokenizer_path": tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": format_weight_version(weight_version),
    }


def format_weight_version_response(weight_version: int) -> dict[str, Any]:
    """SGLang's /get_weight_version answer."""
    return {"weight_version": format_weight_version(weight_version)}


def format_server_info(
    *,
    model_path: str,
    tokenizer_path: str | None,
    context_length: int,
    max_running_requests: int,
    stats: dict[str, Any],
) -> dict[str, Any]:
    """/get_server_info: SGLang's is {**server_args, **scheduler_info, "internal_states": [...],
    "version"}; the DecodeEngine's counters (stats, with an integer weight_version) are also at the
    top level for tools that read them there."""
    stats = {**stats, "weight_version": format_weight_version(stats["weight_version"])}
    return {
        "model_path": model_path,
        "tokenizer_path": tokenizer_path,
        "context_length": context_length,
        "weight_version": stats["weight_version"],
        "max_running_requests": max_running_requests,
        "internal_states": [stats],
        "version": "areal-embedded",
        **stats,
    }


def format_error(error: BadRequest) -> tuple[dict[str, Any], int]:
    """SGLang's error body for a refused request, and its HTTP status."""
    return {"error": {"message": str(error)}}, error.status


# ---- field checks -------------------------------------------------------------------------


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number, got {value!r}")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}")
    return value


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or any(
        isinstance(v, bool) or not isinstance(v, int) for v in value
    ):
        raise BadRequest(f"{name} must be a list of integers")
    return value


def _stop_strings(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise BadRequest(f"{name} must be a string or a list of strings")
    return values


def _per_request(value: Any, n: int, name: str, kind: type) -> list[Any]:
    """SGLang lets a batch give one value for all requests or a list with one per request."""
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for {n} requests")
        values = value
    else:
        values = [value] * n
    for v in values:
        if v is not None and not isinstance(v, kind):
            raise BadRequest(f"{name} must be a {kind.__name__}, got {v!r}")
    return values
