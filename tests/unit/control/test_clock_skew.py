"""An instance whose clock is further off than the control plane's skew window learns it, with the
measured offset, and logs it (control/clock_skew.py), instead of never being registered or served and
saying nothing."""

from __future__ import annotations

import logging
import re
import time

import pytest
import zmq

from pdserve.control.codec import ClockSkewError, Codec
from pdserve.control.endpoint import Client, Server
from pdserve.control.messages import ClockSkew, Ping, Release
from pdserve.control.registration import Registration, RegistrationHeartbeat

SECRET = b"k" * 32
SKEW_S = 45.0
REGISTRATION = Registration("D", "127.0.0.1:8200", "host:127.0.0.1,handshake:6302,notify:6402", "WRITE")


def skewed(sender_id: str, offset_s: float) -> Codec:
    return Codec(SECRET, sender_id, clock=lambda: time.time() + offset_s)


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_an_authentic_frame_outside_the_window_is_refused_with_the_measured_offset():
    frame = skewed("instance", SKEW_S).encode(Ping())
    with pytest.raises(ClockSkewError, match="message from the future: 45") as refused:
        Codec(SECRET, "registrar").decode(frame)
    assert refused.value.sender == "instance"
    assert refused.value.offset_s == pytest.approx(SKEW_S, abs=1.0)
    with pytest.raises(ClockSkewError, match="stale message") as behind:
        Codec(SECRET, "registrar").decode(skewed("instance", -SKEW_S).encode(Ping()))
    assert behind.value.offset_s == pytest.approx(-SKEW_S, abs=1.0)


def test_a_heartbeat_to_a_registrar_whose_clock_is_off_logs_the_offset(caplog):
    registrar = Server("127.0.0.1", 0, skewed("registrar", SKEW_S), lambda envelope: None, name="registrar")
    heartbeat = RegistrationHeartbeat("127.0.0.1", registrar.port, REGISTRATION, Codec(SECRET, "instance"), 0.05)
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.control"):
            assert wait_for(lambda: heartbeat.clock_offset_s is not None), "the instance never learned of the skew"
        assert heartbeat.clock_offset_s == pytest.approx(SKEW_S, abs=1.0)
        (warning,) = [r.getMessage() for r in caplog.records if "refuses this instance's registrations" in r.getMessage()]
        assert f"the registrar at 127.0.0.1:{registrar.port}" in warning
        assert re.search(r"its clock is 4[45]\.\d s ahead of this host's, beyond .* skew window \(30 s here\)", warning)
        assert registrar.num_handled == 0 and registrar.num_rejected >= 1
    finally:
        heartbeat.stop()
        registrar.close()


def test_a_heartbeat_within_the_window_learns_of_no_skew():
    received = []
    registrar = Server("127.0.0.1", 0, skewed("registrar", 5.0), received.append, name="registrar")
    heartbeat = RegistrationHeartbeat("127.0.0.1", registrar.port, REGISTRATION, Codec(SECRET, "instance"), 0.05)
    try:
        assert wait_for(lambda: len(received) >= 3)
        assert heartbeat.clock_offset_s is None
    finally:
        heartbeat.stop()
        registrar.close()


def test_a_peer_whose_clock_is_off_tells_the_sender_after_its_next_send(caplog):
    peer = Server("127.0.0.1", 0, skewed("decode", -SKEW_S), lambda envelope: None, name="notify")
    client = Client(Codec(SECRET, "prefill"))
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.control"):
            client.send("127.0.0.1", peer.port, Release("tx-1"), "decode")
            assert wait_for(lambda: peer.num_rejected == 1)
            time.sleep(0.2)  # the notice is on its way back
            client.send("127.0.0.1", peer.port, Release("tx-2"), "decode")
        offset = client.skew.offsets[f"peer 127.0.0.1:{peer.port}"]
        assert offset == pytest.approx(-SKEW_S, abs=1.0)
        assert re.search(r"its clock is 4[45]\.\d s behind this host's", caplog.text)
    finally:
        client.close()
        peer.close()


def test_a_handshake_with_a_peer_whose_clock_is_off_fails_naming_the_skew():
    peer = Server("127.0.0.1", 0, skewed("prefill", SKEW_S), lambda envelope: None, name="handshake")
    client = Client(Codec(SECRET, "decode"))
    try:
        with pytest.raises(ClockSkewError, match="from the future"):
            client.request("127.0.0.1", peer.port, Ping(), timeout_s=5.0)
    finally:
        client.close()
        peer.close()


def test_frames_that_fail_authentication_get_no_answer():
    server = Server("127.0.0.1", 0, Codec(SECRET, "registrar"), lambda envelope: None)
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(f"tcp://127.0.0.1:{server.port}")
        raw.send(Codec(b"another secret", "x", clock=lambda: time.time() + SKEW_S).encode(ClockSkew(1.0), "registrar"))
        assert wait_for(lambda: server.num_rejected == 1)
        assert not raw.poll(300), "the server answered a frame it could not authenticate"
    finally:
        raw.close(0)
        context.term()
        server.close()
