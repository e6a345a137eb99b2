"""parse_transfer_params: router-shaped and explicit params in, a frozen TransferParams out."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.config import Role
from pdserve.control.address import PeerAddress
from pdserve.errors import ProtocolError
from pdserve.params import TransferParams, parse_transfer_params

HEX = "0123456789abcdef0123456789abcdef"
PREFILL = PeerAddress("127.0.0.1", 6301, 6401)
DECODE = PeerAddress("127.0.0.1", 6302, 6402)
ROUTER_ID = (
    "cmpl-___prefill_addr_host:127.0.0.1,handshake:6301,notify:6401"
    f"___decode_addr_host:127.0.0.1,handshake:6302,notify:6402_{HEX}-0-abcdef12"
)
ROUTER_P = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
            "transfer_id": "tx-1", "remote_dp_size": 1, "remote_tp_size": 1}
ROUTER_D = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": None,
            "remote_block_ids": None, "transfer_id": "tx-1", "remote_dp_size": 1, "remote_tp_size": 1,
            "remote_dp_rank": 0}


@pytest.mark.parametrize("request_id", [ROUTER_ID, ROUTER_ID.removeprefix("cmpl-"), ROUTER_ID[:-len("-0-abcdef12")],
                                        ROUTER_ID.replace("-0-abcdef12", "-abcdef12")])
def test_router_params_take_the_peer_from_the_request_id(request_id):
    p = parse_transfer_params(ROUTER_P, request_id, Role.PRODUCER)
    d = parse_transfer_params(ROUTER_D, request_id, Role.CONSUMER)
    assert p == TransferParams("tx-1", DECODE, None, None), "P's peer is the decode instance"
    assert d == TransferParams("tx-1", PREFILL, None, None), "D's peer is the prefill instance"


def test_explicit_peer_fields_win_over_the_request_id():
    raw = {**ROUTER_D, "remote_host": "10.1.2.3", "remote_handshake_port": 7000, "remote_notify_port": 7001,
           "remote_block_ids": [3, 4, 5], "hold_expires_at": 1700000000}
    params = parse_transfer_params(raw, ROUTER_ID, Role.CONSUMER)
    assert params == TransferParams("tx-1", PeerAddress("10.1.2.3", 7000, 7001), (3, 4, 5), 1700000000.0)
    assert isinstance(params.hold_expires_at, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.transfer_id = "other"


def test_no_peer_anywhere_parses_but_require_peer_says_how_to_fix_it():
    params = parse_transfer_params(ROUTER_D, "cmpl-abc-0", Role.CONSUMER)
    assert params.peer is None
    with pytest.raises(ProtocolError, match="remote_host"):
        params.require_peer()


@pytest.mark.parametrize("raw, role", [
    (None, Role.PRODUCER), (None, Role.CONSUMER), ({}, Role.CONSUMER),
    (ROUTER_P, Role.CONSUMER), (ROUTER_D, Role.PRODUCER),
    ({"do_remote_prefill": None, "transfer_id": "x"}, Role.CONSUMER),
])
def test_requests_not_disaggregated_on_this_side_give_none(raw, role):
    assert parse_transfer_params(raw, ROUTER_ID, role) is None


@pytest.mark.parametrize("raw, field", [
    ({**ROUTER_D, "do_remote_prefill": "true"}, "do_remote_prefill"),
    ({**ROUTER_D, "transfer_id": None}, "transfer_id"),
    ({**ROUTER_D, "transfer_id": ""}, "transfer_id"),
    ({**ROUTER_D, "transfer_id": 12}, "transfer_id"),
    ({**ROUTER_D, "transfer_id": "x" * 300}, "transfer_id"),
    ({**ROUTER_D, "remote_block_ids": [1, -2]}, "remote_block_ids"),
    ({**ROUTER_D, "remote_block_ids": [1, True]}, "remote_block_ids"),
    ({**ROUTER_D, "remote_block_ids": [[1, 2]]}, "remote_block_ids"),
    ({**ROUTER_D, "remote_block_ids": "1,2"}, "remote_block_ids"),
    ({**ROUTER_D, "hold_expires_at": "soon"}, "hold_expires_at"),
    ({**ROUTER_D, "hold_expires_at": True}, "hold_expires_at"),
    ({**ROUTER_D, "remote_host": 5}, "remote_host"),
    ({**ROUTER_D, "remote_host": ""}, "remote_host"),
    ({**ROUTER_D, "remote_host": "h", "remote_notify_port": 1}, "remote_handshake_port"),
    ({**ROUTER_D, "remote_host": "h", "remote_handshake_port": 1, "remote_notify_port": 70000}, "remote_notify_port"),
    ({**ROUTER_D, "remote_host": "h", "remote_handshake_port": True, "remote_notify_port": 1}, "remote_handshake_port"),
    ({**ROUTER_D, "remote_host": "h", "remote_handshake_port": "6301", "remote_notify_port": 1}, "remote_handshake_port"),
])
def test_malformed_fields_raise_protocol_error_naming_the_field(raw, field):
    with pytest.raises(ProtocolError) as info:
        parse_transfer_params(raw, ROUTER_ID, Role.CONSUMER)
    assert field in str(info.value)


def test_non_mapping_params_are_rejected():
    with pytest.raises(ProtocolError, match="object"):
        parse_transfer_params(["do_remote_prefill"], ROUTER_ID, Role.CONSUMER)


def test_malformed_router_address_in_the_request_id_is_a_protocol_error():
    bad = ROUTER_ID.replace("handshake:6301", "handshake:63x1")
    with pytest.raises(ProtocolError, match="63x1"):
        parse_transfer_params(ROUTER_D, bad, Role.CONSUMER)


@pytest.mark.parametrize("raw, field", [
    ({**ROUTER_D, "hold_expires_at": float("nan")}, "hold_expires_at"),
    ({**ROUTER_D, "hold_expires_at": float("inf")}, "hold_expires_at"),
    ({**ROUTER_D, "hold_expires_at": -1}, "hold_expires_at"),
    ({**ROUTER_D, "remote_block_ids": [1 << 62]}, "remote_block_ids"),
    ({**ROUTER_D, "remote_host": "a b", "remote_handshake_port": 1, "remote_notify_port": 1}, "remote_host"),
    ({**ROUTER_D, "remote_host": "evil/../x", "remote_handshake_port": 1, "remote_notify_port": 1}, "remote_host"),
    ({**ROUTER_D, "remote_host": "h" * 300, "remote_handshake_port": 1, "remote_notify_port": 1}, "remote_host"),
])
def test_values_that_pass_a_type_check_but_not_a_range_check_are_rejected(raw, field):
    with pytest.raises(ProtocolError) as info:
        parse_transfer_params(raw, ROUTER_ID, Role.CONSUMER)
    assert field in str(info.value)


def test_a_prompt_hash_with_a_trailing_newline_is_rejected():
    raw = {**ROUTER_D, "prompt_hash": "0123456789abcdef0123456789abcdef\n"}
    with pytest.raises(ProtocolError, match="prompt_hash"):
        parse_transfer_params(raw, ROUTER_ID, Role.CONSUMER)


def test_a_router_id_with_a_port_in_other_digits_is_a_protocol_error():
    bad = ROUTER_ID.replace("handshake:6301", "handshake:\u00b2")  # str.isdigit() says yes, int() says no
    with pytest.raises(ProtocolError, match="bad port"):
        parse_transfer_params(ROUTER_D, bad, Role.CONSUMER)
