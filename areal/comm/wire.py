"""The wire format: what every ZMQ frame between roles looks like.

    obj --pack--> body (msgpack) --seal--> [mac, body] --ZMQ--> unseal --> obj
                                            mac = HMAC-SHA256(experiment key, body)

Frames are msgpack, never pickle, so a peer can send data but never code. numpy arrays
travel as a msgpack ExtType holding (dtype string, shape, raw little-endian bytes) and come
back as writable arrays of the same dtype and shape. numpy scalars travel as plain Python
numbers. Every frame carries an HMAC over its body with the experiment's key, so a frame
from another experiment, a corrupted one, or a forged one fails `unseal` with `WireError`
and is dropped by the receiver.

Pure functions, no I/O: nothing here waits for anything.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from typing import Any

import msgpack
import numpy as np

_NDARRAY_EXT = 1
_MAC_SIZE = hashlib.sha256().digest_size
_DTYPE_NAMES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "float16",
    "float32",
    "float64",
)
# Canonical little-endian dtype strings ("<f4", "|b1", ...): a decoder checks membership
# before handing a peer's string to np.dtype, so nothing exotic is ever parsed.
_WIRE_DTYPES = {np.dtype(name).newbyteorder("<").str for name in _DTYPE_NAMES}


class WireError(Exception):
    """A value that cannot be sent, or a frame that cannot be trusted or decoded."""


def _encode(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, np.ndarray):
        if obj.dtype.newbyteorder("<").str not in _WIRE_DTYPES:
            raise WireError(
                f"cannot send a numpy array of dtype {obj.dtype}: only "
                f"{', '.join(_DTYPE_NAMES)} are supported; convert it first"
            )
        arr = obj.astype(obj.dtype.newbyteorder("<"), copy=False)
        # tobytes() is C order whatever the strides, so slices and transposes travel too.
        payload = msgpack.packb([arr.dtype.str, list(arr.shape), arr.tobytes()])
        return msgpack.ExtType(_NDARRAY_EXT, payload)
    if isinstance(obj, np.generic):
        return obj.item()
    raise WireError(f"cannot send an object of type {type(obj).__name__}")


def _decode(code: int, payload: bytes) -> Any:
    if code != _NDARRAY_EXT:
        raise WireError(f"unknown msgpack extension type {code}")
    dtype, shape, raw = msgpack.unpackb(payload, raw=False)
    if dtype not in _WIRE_DTYPES:
        raise WireError(f"array of unsupported dtype {dtype!r}")
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        raise WireError(f"array with invalid shape {shape!r}")
    dt = np.dtype(dtype)
    if len(raw) != math.prod(shape) * dt.itemsize:
        raise WireError(f"array of shape {shape} and dtype {dtype} with {len(raw)} bytes")
    # Copy out of the frame buffer: a read-only view surprises callers that write to it
    # (and torch.from_numpy warns about it).
    return np.frombuffer(raw, dtype=dt).reshape(tuple(shape)).copy()


def pack(obj: Any) -> bytes:
    """Encode dicts, lists, str, bytes, numbers, bool, None and numpy arrays as msgpack."""
    try:
        return msgpack.packb(obj, default=_encode, use_bin_type=True)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot pack value: {e}") from e


def unpack(data: bytes) -> Any:
    """Decode what `pack` produced; raise WireError for anything malformed."""
    try:
        # unpackb caps every string, list and map at the size of `data` itself, so a
        # malicious length prefix cannot make it allocate more than the frame holds.
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_decode)
    except WireError:
        raise
    except Exception as e:  # msgpack raises many types for bad input; all mean "malformed"
        raise WireError(f"undecodable frame body: {type(e).__name__}: {e}") from e


def _mac(body: bytes, key: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def seal(obj: Any, key: bytes) -> list[bytes]:
    """Pack obj and sign it: the frames [mac, body] to send as one multipart message."""
    body = pack(obj)
    return [_mac(body, key), body]


def unseal(frames: list[bytes], key: bytes) -> Any:
    """Check the mac of [mac, body] and decode the body; raise WireError if either fails."""
    if len(frames) != 2:
        raise WireError(f"expected 2 frames [mac, body], got {len(frames)}")
    mac, body = (bytes(f) for f in frames)
    if len(mac) != _MAC_SIZE or not hmac.compare_digest(mac, _mac(body, key)):
        raise WireError(
            "frame failed its HMAC check: forged, corrupted, or sent with another experiment's key"
        )
    return unpack(body)
