"""How big a frame each control-plane socket accepts, and how many it queues, each from the traffic it
carries. ZMQ drops a connection that sends a frame above the receiving socket's bound
(ZMQ_MAXMSGSIZE) before buffering it, so an unauthenticated peer can make a socket hold at most
its receive queue times its bound. tests/unit/control/test_limits.py builds the largest legitimate
message of each kind at the limits messages.py validates and pins every bound against it.

Frame bounds (bytes; measured with 256-character identities, the codec's longest):
- MAX_FRAME_BYTES, the codec's own and the handshake client's: the largest message, a handshake
  reply of 1024 layers and 1024 regions (each with a CUDA IPC handle) with 256 KiB of NIXL agent
  metadata, measures 0.81 MiB.
- MAX_REQUEST_FRAME_BYTES, a server's (handshake and notify ports): the largest message a server
  receives, RemoteBlocks or ReadDone naming MAX_BLOCKS block ids, measures 0.31 MiB; a
  handshake request (the fingerprint of 1024 layers) 4.2 KiB.
- MAX_REGISTRATION_FRAME_BYTES, the registrar's: a registration at its fields' limits measures
  1.2 KiB.
- MAX_NOTICE_FRAME_BYTES, sockets that only send (registration heartbeat, the client's cached
  senders): the one frame they receive, a ClockSkew notice, measures 0.63 KiB.
"""

KIB = 1024

MAX_FRAME_BYTES = 1024 * KIB
MAX_REQUEST_FRAME_BYTES = 512 * KIB
MAX_REGISTRATION_FRAME_BYTES = 2 * KIB
MAX_NOTICE_FRAME_BYTES = 1 * KIB

# Queue depths (messages; ZMQ's high-water marks, per connection).
# A client's cached sender to one peer: one engine step's messages to it, at most one per running
# request (RemoteBlocks, WriteDone, ReadDone, ...), at vLLM's largest default --max-num-seqs.
SEND_QUEUE = 1024
# A server's receive queue per connection: the peer's own send queue holds the rest of a burst
# (ZMQ moves it as the server reads), so this only keeps the handler fed.
SERVER_RECEIVE_QUEUE = 64
# A server's replies per connection: one per request (each exchange has a connection of its own),
# or a ClockSkew notice per skewed frame.
SERVER_REPLY_QUEUE = 8
# An exchange: one request, one reply.
EXCHANGE_QUEUE = 1
# Sockets that receive nothing but ClockSkew notices (read after each send).
NOTICE_QUEUE = 4
