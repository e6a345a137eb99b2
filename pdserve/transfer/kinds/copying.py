"""The kinds that move KV themselves (WRITE's sender, READ's receiver): what both are built with."""

from __future__ import annotations

from pdserve.config import ConnectorConfig
from pdserve.transfer.binding import PeerBinding
from pdserve.transfer.copier import Copier
from pdserve.transfer.endings import Endings
from pdserve.transfer.kinds.base import TransferKind
from pdserve.transfer.messenger import Messenger
from pdserve.transfer.verify import Verifier


class CopyingKind(TransferKind):
    """A kind whose side posts the copies: its peer's binding, the copier, the digest verifier."""

    def __init__(self, messenger: Messenger, endings: Endings, *, config: ConnectorConfig, binding: PeerBinding,
                 copier: Copier, verifier: Verifier, num_layers: int):
        super().__init__(messenger, endings)
        self._config = config
        self._binding = binding
        self._copier = copier
        self._verifier = verifier
        self._num_layers = num_layers
