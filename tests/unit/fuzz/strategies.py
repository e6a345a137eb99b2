"""Hypothesis strategies shared by the fuzz tests: wire values and values shaped like a field."""

from __future__ import annotations

import functools
import types
import typing
from datetime import timedelta

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

MSGPACK_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)
EDGE_INT = st.sampled_from([-(2**63), -(2**31), -1, 0, 1, 2, 255, 4096, 65535, 65536, 2**31, 2**40, 2**48, 2**63, 2**64 - 1])
INT = st.one_of(st.integers(min_value=-3, max_value=70_000), EDGE_INT, MSGPACK_INT)
FLOAT = st.floats(allow_nan=True, allow_infinity=True)
TEXT = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", "tx-1", "0123456789abcdef0123456789abcdef", "127.0.0.1", "::1", "a/b", "\0", "x" * 300]),
)

# Anything msgpack can carry (maps keyed by strings, as the codec's unpacker insists).
WIRE_VALUE = st.recursive(
    st.one_of(st.none(), st.booleans(), MSGPACK_INT, FLOAT, TEXT, st.binary(max_size=20)),
    lambda children: st.one_of(st.lists(children, max_size=5), st.dictionaries(st.text(max_size=8), children, max_size=5)),
    max_leaves=8,
)


@functools.lru_cache(maxsize=None)
def shaped_like(annotation) -> st.SearchStrategy:
    """Values of the annotation's type, edge cases included (not necessarily in range).
    Cached: building strategies per draw costs more than drawing from them."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is typing.Any:
        return WIRE_VALUE
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(shaped_like(a) for a in args))
    if annotation is type(None):
        return st.none()
    if origin is list or annotation is list:
        return st.lists(shaped_like(args[0]) if args else WIRE_VALUE, max_size=8)
    if origin is dict or annotation is dict:
        values = shaped_like(args[1]) if args else WIRE_VALUE
        return st.dictionaries(st.text(max_size=12), values, max_size=6)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return INT
    if annotation is float:
        return st.one_of(FLOAT, INT)
    if annotation is str:
        return TEXT
    if annotation is bytes:
        return st.binary(max_size=64)
    raise TypeError(f"no strategy for {annotation!r}: teach tests/unit/fuzz/strategies.py this field type")


def fuzz_settings(max_examples: int):
    """Reproducible (derandomized, no example database), and an example slower than 5 s is a
    hang: the inputs here are small and each is parsed in well under a millisecond."""
    return settings(
        max_examples=max_examples,
        deadline=timedelta(seconds=5),
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
