"""Which peer hosts an instance may contact.

A peer address reaches an instance through `X-Request-ID` or `kv_transfer_params`, which any HTTP
client that reaches the instance can write. So before a handshake or a notify, the address is
checked against `allowed_peers` (IP networks or exact host names; `pdserve up` sets this host):
an allowed peer works, any other is refused with an error naming it, and nothing is sent to it.
"""

from __future__ import annotations

import ipaddress


class PeerAllowList:
    def __init__(self, entries: tuple[str, ...]):
        self._networks = []
        self._names = set()
        for entry in entries:
            try:
                self._networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self._names.add(entry.lower())
        self.entries = entries

    def allows(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return host.lower() in self._names
        return any(address.version == net.version and address in net for net in self._networks)

    def refusal(self, host: str) -> str:
        return (f"peer host {host!r} is not in allowed_peers ({', '.join(self.entries)}); "
                "refusing to contact it")
