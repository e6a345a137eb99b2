"""The registrar: the only way into vllm-router's service discovery, for holders of the secret.

    instance --Registration, signed--> registrar (router's host, the discovery address instances
    are given) --checked, forwarded--> vllm-router's discovery socket (127.0.0.1 only)

Security model. vllm-router 0.1.17 takes any msgpack map on its discovery socket as a P or D
instance and sends it prompts, so that socket binds loopback and only the registrar, on the same
host, talks to it. The registrar forwards a registration only if it carries a valid HMAC-SHA256
under the deployment's secret file (the control plane's key: control/codec.py), a timestamp within
the codec's skew window, a nonce it has not seen, and sane fields (role P or D, addresses that
parse, transfer mode READ or WRITE, control/registration.py). Everything else is counted and logged
(rate-limited) with its reason, never forwarded.

So: whoever holds the secret file can register an instance (every process of the deployment must
read it; keep it mode 0600). A frame captured on the wire can be replayed to nobody's gain: it is
refused once seen, or once it leaves the skew window, and it only ever names the instance that
signed it. Registrations are authenticated, not encrypted: an eavesdropper learns the instances'
addresses. The instances' own control plane (handshake, notify) checks the same secret, and an
instance contacts only the peers in its `allowed_peers`, whatever a request names.

What remains open: any process on the router's host can reach the loopback socket; the OpenAI
HTTP ports of the front, the router and the instances are unauthenticated, as vLLM's own are
(keep them behind your network policy); whoever reads the secret file can register anything.

The registrar is a process that runs vllm-router as its child (`python -m pdserve.registrar`,
__main__.py; spec.py builds its argv), so launchers start, supervise, restart and stop the two as one.
"""

from pdserve.registrar.forwarder import Registrar
from pdserve.registrar.spec import LOOPBACK, RegistrarSpec

__all__ = ["LOOPBACK", "Registrar", "RegistrarSpec"]
