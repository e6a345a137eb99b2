"""pdserve's exception hierarchy, grouped by kind of failure.

Third-party errors (zmq, msgpack, OS) are mapped into these at the boundary where they occur;
callers catch these, never the third-party ones.
"""


class PDServeError(Exception):
    """Base class of every error pdserve raises on purpose."""


class ConfigError(PDServeError):
    """A parameter, config key or command-line value is missing or malformed."""


class ProtocolError(PDServeError):
    """A wire message does not decode, has an unknown type, or has malformed fields."""


class AuthenticationError(ProtocolError):
    """A wire message failed authentication (bad MAC, stale timestamp, replayed nonce)."""


class FencedError(AuthenticationError):
    """An authentic wire message addressed to another instance (or to nobody, where its type
    must name one): a message for a peer's earlier incarnation must not reach its successor."""


class HandshakeError(PDServeError):
    """The handshake with a peer failed or did not answer in time."""


class IncompatiblePeerError(HandshakeError):
    """The peer's KV layout fingerprint differs from ours (model, dtype, block size, layout, ISA)."""


class TransferError(PDServeError):
    """Moving KV blocks failed."""


class TransferTimeout(TransferError):
    """A transfer did not complete before its deadline."""


class LaunchError(PDServeError):
    """A process of a deployment could not be started or did not become healthy."""


class AddressInUseError(ConfigError):
    """A port pdserve was told to bind is already taken by another process."""
