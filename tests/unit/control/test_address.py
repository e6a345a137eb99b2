import pytest

from pdserve.control.address import PeerAddress, format_zmq_address, parse_request_id, parse_zmq_address
from pdserve.errors import ProtocolError

P = "host:127.0.0.1,handshake:6301,notify:6401"
D = "host:127.0.0.1,handshake:6302,notify:6402"
UID = "0123456789abcdef0123456789abcdef"


def test_parse_and_format_round_trip():
    peer = parse_zmq_address(P)
    assert peer == PeerAddress("127.0.0.1", 6301, 6401)
    assert format_zmq_address(peer) == P


def test_ipv6_hosts_split_on_the_first_colon_only():
    assert parse_zmq_address("host:::1,handshake:1,notify:2") == PeerAddress("::1", 1, 2)
    assert parse_zmq_address("notify:2,host:fe80::1:2,handshake:1").host == "fe80::1:2"
    assert parse_zmq_address("host:[::1],handshake:1,notify:2").host == "::1"


@pytest.mark.parametrize(
    "text, error",
    [
        ("host:1.2.3.4,handshake:1", "missing notify"),
        ("host:1.2.3.4,handshake:x,notify:2", "bad port 'x'"),
        ("host:1.2.3.4,handshake:70000,notify:2", "bad port '70000'"),
        ("host:1.2.3.4,handshake:1,notify:2,color:red", "unknown key 'color'"),
        ("host:1.2.3.4,host:1.2.3.5,handshake:1,notify:2", "given twice"),
        ("127.0.0.1:28101", "unknown key '127.0.0.1'"),
        ("host,handshake:1,notify:2", "is not key:value"),
    ],
)
def test_malformed_addresses_are_rejected(text, error):
    with pytest.raises(ProtocolError, match=error):
        parse_zmq_address(text)


@pytest.mark.parametrize(
    "request_id",
    [
        f"___prefill_addr_{P}___decode_addr_{D}_{UID}",
        f"cmpl-___prefill_addr_{P}___decode_addr_{D}_{UID}-0-abcdef12",
        f"chatcmpl-___prefill_addr_{P}___decode_addr_{D}_{UID}-abcdef12",
    ],
)
def test_request_id_with_vllm_prefixes_and_suffixes(request_id):
    prefill, decode = parse_request_id(request_id)
    assert prefill == PeerAddress("127.0.0.1", 6301, 6401)
    assert decode == PeerAddress("127.0.0.1", 6302, 6402)


def test_request_id_with_ipv6_addresses():
    p6, d6 = "host:::1,handshake:7001,notify:7002", "host:fe80::2,handshake:7003,notify:7004"
    prefill, decode = parse_request_id(f"___prefill_addr_{p6}___decode_addr_{d6}_{UID}-0-1a2b3c4d")
    assert (prefill.host, decode.host, decode.notify_port) == ("::1", "fe80::2", 7004)


def test_request_ids_without_router_addresses_give_none():
    assert parse_request_id("cmpl-5f3a-0-abcdef12") is None
    assert parse_request_id(f"___prefill_addr_{P}___decode_addr_{D}_shorthex") is None


def test_router_shaped_request_id_with_bad_address_raises():
    with pytest.raises(ProtocolError, match="unknown key '127.0.0.1'"):
        parse_request_id(f"___prefill_addr_127.0.0.1:28101___decode_addr_{D}_{UID}")


@pytest.mark.parametrize(
    "text, error",
    [
        ("host:1.2.3.4,handshake:\u00b2,notify:2", "bad port"),  # isdigit() but not int()-able
        ("host:1.2.3.4,handshake:\u0663,notify:2", "bad port"),  # an Arabic-Indic digit
        ("host:1.2.3.4,handshake:0,notify:2", "bad port '0'"),
        ("host:[],handshake:1,notify:2", "bad host ''"),
        ("host:a b,handshake:1,notify:2", "bad host 'a b'"),
        ("host:evil/path,handshake:1,notify:2", "bad host"),
        ("host:" + "a" * 300 + ",handshake:1,notify:2", "bad host"),
    ],
)
def test_malformed_ports_and_hosts_are_protocol_errors(text, error):
    with pytest.raises(ProtocolError, match=error):
        parse_zmq_address(text)


def test_long_router_shaped_request_ids_are_refused_quickly():
    """Request ids come from clients; the old lazy pattern took seconds on ids like this."""
    import time

    near_miss = "___prefill_addr_a___decode_addr_b_" + "0" * 31 + "g"
    start = time.monotonic()
    assert parse_request_id(near_miss * 15) is None
    with pytest.raises(ProtocolError, match="characters carries router addresses"):
        parse_request_id(near_miss * 400)
    assert parse_request_id("x" * 100_000) is None
    assert time.monotonic() - start < 0.5
