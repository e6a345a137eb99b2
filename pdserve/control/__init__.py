"""Control plane: typed messages, one authenticated codec, ZMQ endpoints, addresses, router registration."""

from pdserve.control.address import PeerAddress, format_zmq_address, parse_request_id, parse_zmq_address
from pdserve.control.codec import Codec, Envelope
from pdserve.control.endpoint import Client, Server
from pdserve.control.messages import (
    MESSAGE_TYPES,
    HandshakeRefused,
    HandshakeReply,
    HandshakeRequest,
    Ping,
    Pong,
    Release,
    RemoteBlocks,
    WriteDone,
)
from pdserve.control.registration import RegistrationHeartbeat
from pdserve.control.secret import generate_secret_file, load_secret

__all__ = [
    "MESSAGE_TYPES",
    "Client",
    "Codec",
    "Envelope",
    "HandshakeRefused",
    "HandshakeReply",
    "HandshakeRequest",
    "PeerAddress",
    "Ping",
    "Pong",
    "RegistrationHeartbeat",
    "Release",
    "RemoteBlocks",
    "Server",
    "WriteDone",
    "format_zmq_address",
    "generate_secret_file",
    "load_secret",
    "parse_request_id",
    "parse_zmq_address",
]
