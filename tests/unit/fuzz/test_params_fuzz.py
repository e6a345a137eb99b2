"""Fuzzing the request edge: `kv_transfer_params` (any JSON a client may send) and request ids
shaped like vllm-router's. Refused with ProtocolError, ignored (None), or parsed within range."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from pdserve.config import Role
from pdserve.control.address import MAX_HOST_CHARS, PeerAddress, parse_request_id
from pdserve.errors import ProtocolError
from pdserve.params import MAX_BLOCK_ID, MAX_TRANSFER_ID_CHARS, TransferParams, parse_transfer_params
from tests.unit.fuzz.strategies import EDGE_INT, FLOAT, TEXT, fuzz_settings

pytestmark = pytest.mark.timeout(120)

_HOST = re.compile(r"\A[A-Za-z0-9.:%-]+\Z")
JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), EDGE_INT, FLOAT, TEXT)
JSON = st.recursive(
    JSON_SCALAR,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)),
    max_leaves=8,
)
HOST = st.one_of(st.sampled_from(["127.0.0.1", "::1", "[::1]", "fe80::1%eth0", "host-a.example", "", "[]", "a b", "a/b", "a_b"]), TEXT)
PORT_TEXT = st.one_of(st.integers(-1, 70_000).map(str), st.sampled_from(["", "6301", "00006301", "\u00b2", "\u0663", "1e3", " 1"]), TEXT)


GOOD_HOST = st.sampled_from(["127.0.0.1", "::1", "[::1]", "fe80::1%eth0", "host-a.example", "10.0.0.2"])
GOOD_PORT = st.integers(0, 65_536).map(str)


@st.composite
def zmq_addresses(draw) -> str:
    if draw(st.integers(0, 9)) == 0:
        return draw(TEXT)
    if draw(st.booleans()):  # plausible: mostly what the router sends
        parts = [f"host:{draw(GOOD_HOST)}", f"handshake:{draw(GOOD_PORT)}", f"notify:{draw(GOOD_PORT)}"]
    else:
        parts = [f"host:{draw(HOST)}", f"handshake:{draw(PORT_TEXT)}", f"notify:{draw(PORT_TEXT)}"]
    if draw(st.booleans()):
        parts = draw(st.permutations(parts))
    if draw(st.integers(0, 9)) == 0:
        parts.append(draw(TEXT))
    return ",".join(parts)


UID = st.one_of(st.from_regex(r"\A[0-9a-fA-F]{32}\Z"), st.from_regex(r"\A[0-9a-fA-F]{32}\Z"), TEXT)
SUFFIX = st.one_of(st.just(""), st.sampled_from(["-0-abcdef12", "-abcdef12", "-", "_x"]), st.sampled_from(["", "-0-1a2b3c4d"]), TEXT)


@st.composite
def router_request_ids(draw) -> str:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.text(max_size=200))
    prefix = draw(st.sampled_from(["", "cmpl-", "chatcmpl-"]) | TEXT)
    body = f"___prefill_addr_{draw(zmq_addresses())}___decode_addr_{draw(zmq_addresses())}_{draw(UID)}{draw(SUFFIX)}"
    return prefix + body * draw(st.sampled_from([1, 1, 1, 2, 40]))


def _check_peer(peer: PeerAddress) -> None:
    assert isinstance(peer.host, str) and 0 < len(peer.host) <= MAX_HOST_CHARS and _HOST.match(peer.host)
    for port in (peer.handshake_port, peer.notify_port):
        assert isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536


@fuzz_settings(max_examples=1000)
@given(router_request_ids())
def test_router_shaped_request_ids_are_ignored_refused_or_parsed_within_range(request_id):
    try:
        pair = parse_request_id(request_id)
    except ProtocolError:
        event("refused")
        return
    event("no router addresses" if pair is None else "parsed")
    if pair is not None:
        for peer in pair:
            _check_peer(peer)


KEYS = ["do_remote_decode", "do_remote_prefill", "transfer_id", "remote_block_ids", "hold_expires_at",
        "remote_host", "remote_handshake_port", "remote_notify_port", "prompt_hash", "remote_engine_id"]
PLAUSIBLE = {
    "do_remote_decode": st.one_of(st.booleans(), JSON_SCALAR),
    "do_remote_prefill": st.one_of(st.booleans(), JSON_SCALAR),
    "transfer_id": st.one_of(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20), st.just("x" * 257), JSON_SCALAR),
    "remote_block_ids": st.one_of(st.none(), st.lists(st.one_of(st.integers(-2, 100), EDGE_INT, st.booleans()), max_size=6), JSON),
    "hold_expires_at": st.one_of(st.none(), st.floats(), st.integers(-5, 2**62), st.booleans(), TEXT),
    "remote_host": st.one_of(st.none(), HOST, JSON_SCALAR),
    "remote_handshake_port": st.one_of(st.integers(-1, 70_000), JSON_SCALAR),
    "remote_notify_port": st.one_of(st.integers(-1, 70_000), JSON_SCALAR),
    "prompt_hash": st.one_of(st.none(), st.from_regex(r"\A[0-9a-f]{32}\n?\Z"), TEXT),
    "remote_engine_id": JSON,
}
FLAGS = st.fixed_dictionaries({"do_remote_decode": st.just(True), "do_remote_prefill": st.just(True),
                               "transfer_id": st.text(min_size=1, max_size=20)})
RAW = st.one_of(
    st.tuples(FLAGS, st.fixed_dictionaries({}, optional=PLAUSIBLE)).map(lambda parts: {**parts[0], **parts[1]}),
    st.tuples(FLAGS, st.fixed_dictionaries({}, optional=PLAUSIBLE)).map(lambda parts: {**parts[1], **parts[0]}),
    st.fixed_dictionaries({}, optional=PLAUSIBLE),
    st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), JSON, max_size=8),
    JSON,
)
ROLE = st.sampled_from([Role.PRODUCER, Role.CONSUMER])


def _check_params(params: TransferParams) -> None:
    assert isinstance(params.transfer_id, str) and 0 < len(params.transfer_id) <= MAX_TRANSFER_ID_CHARS
    if params.peer is not None:
        _check_peer(params.peer)
    if params.remote_block_ids is not None:
        assert isinstance(params.remote_block_ids, tuple)
        assert all(type(b) is int and 0 <= b <= MAX_BLOCK_ID for b in params.remote_block_ids)
    if params.hold_expires_at is not None:
        assert type(params.hold_expires_at) is float and math.isfinite(params.hold_expires_at)
        assert params.hold_expires_at >= 0
    prompt_hash = getattr(params, "prompt_hash", None)
    assert prompt_hash is None or re.fullmatch(r"[0-9a-f]{32}", prompt_hash)


@fuzz_settings(max_examples=1800)
@given(RAW, st.one_of(router_request_ids(), TEXT), ROLE)
def test_transfer_params_are_ignored_refused_or_parsed_within_range(raw, request_id, role):
    try:
        params = parse_transfer_params(raw, request_id, role)
    except ProtocolError:
        event("refused")
        return
    event("not disaggregated here" if params is None else "parsed")
    if params is not None:
        _check_params(params)
