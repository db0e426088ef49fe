"""The wire format: msgpack round trips with numpy arrays, and the HMAC seal."""

from __future__ import annotations

import hashlib
import hmac

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal.comm.wire import WireError, pack, seal, unpack, unseal

KEY = b"k" * 32
DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64"]


def assert_same(a, b) -> None:
    """Deep equality that also checks arrays keep dtype and shape."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert type(a) is type(b) and a == b


@pytest.mark.parametrize("dtype", DTYPES)
def test_arrays_of_every_dtype_round_trip_in_nested_structures(dtype: str) -> None:
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal((3, 4)) * 50).astype(dtype)
    obj = {
        "batch": {"x": arr, "rows": [arr[0], arr[:, 1:3]]},  # a non-contiguous slice too
        "scalar": np.array(7, dtype=dtype),
        "empty": np.zeros((0, 5), dtype=dtype),
        "meta": [1, "two", None, 3.5, True, b"\x00\xff"],
        7: "int keys survive",
    }
    out = unpack(pack(obj))
    assert_same(obj, out)
    out["batch"]["x"][0, 0] = 1  # decoded arrays are writable, not views of the frame


def test_big_endian_arrays_and_numpy_scalars_travel() -> None:
    arr = np.arange(6, dtype=">i4").reshape(2, 3)
    out = unpack(pack({"a": arr, "s": np.float32(1.5), "i": np.int64(3)}))
    np.testing.assert_array_equal(out["a"], arr)
    assert out["a"].dtype == np.int32 and out["s"] == 1.5 and out["i"] == 3


@pytest.mark.parametrize("bad", [np.array([object(), 1], dtype=object), np.array(["a", "b"])])
def test_unsupported_dtypes_are_refused_with_the_supported_list(bad: np.ndarray) -> None:
    with pytest.raises(WireError, match="only bool, int8.*float64 are supported"):
        pack({"x": bad})


def test_unknown_types_are_refused() -> None:
    with pytest.raises(WireError, match="set"):
        pack({1, 2})


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@given(json_like)
def test_pack_unpack_round_trip(obj) -> None:
    assert_same(obj, unpack(pack(obj)))


def test_seal_round_trip() -> None:
    obj = {"id": 3, "arr": np.ones(4, dtype=np.float32)}
    assert_same(obj, unseal(seal(obj, KEY), KEY))


def _flip(b: bytes, i: int) -> bytes:
    return b[:i] + bytes([b[i] ^ 1]) + b[i + 1 :]


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param(lambda mac, body: [mac, _flip(body, len(body) - 1)], id="tampered-body"),
        pytest.param(lambda mac, body: [_flip(mac, 0), body], id="tampered-mac"),
        pytest.param(lambda mac, body: [mac[:16], body], id="short-mac"),
        pytest.param(lambda mac, body: seal({"x": 1}, b"other key"), id="wrong-key"),
    ],
)
def test_frames_failing_the_mac_are_refused(frames) -> None:
    mac, body = seal({"x": 1, "y": [1, 2, 3]}, KEY)
    with pytest.raises(WireError, match="failed its HMAC check"):
        unseal(frames(mac, body), KEY)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_wrong_frame_count_is_refused(n: int) -> None:
    mac, body = seal({"x": 1}, KEY)
    with pytest.raises(WireError, match=f"expected 2 frames.*got {n}"):
        unseal([mac, body, body][:n], KEY)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xc1",  # a byte msgpack never uses
        b"\x92\x01",  # a 2-list that stops after one item
        b"\xdb\xff\xff\xff\xff",  # a 4 GiB string in 5 bytes
        b"\xc7\x03\x05abc",  # an extension type we do not know
        pack({"x": 1}) + b"trailing",
    ],
)
def test_garbage_bodies_are_refused(garbage: bytes) -> None:
    with pytest.raises(WireError):
        unpack(garbage)
    # Even correctly signed, a body that does not decode is refused.
    mac = hmac.new(KEY, garbage, hashlib.sha256).digest()
    with pytest.raises(WireError, match="undecodable|extension"):
        unseal([mac, garbage], KEY)


def test_forged_array_header_is_refused() -> None:
    def ext(dtype, shape, raw) -> bytes:
        payload = msgpack.packb([dtype, shape, raw])
        return msgpack.packb(msgpack.ExtType(1, payload))

    with pytest.raises(WireError, match="dtype"):
        unpack(ext("|O", [1], b"\x00" * 8))
    with pytest.raises(WireError, match="bytes"):
        unpack(ext("<f4", [1000], b"\x00" * 8))
    with pytest.raises(WireError, match="shape"):
        unpack(ext("<f4", [-2], b""))
