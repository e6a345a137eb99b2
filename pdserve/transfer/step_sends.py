"""`StepSends`: P WRITE, the sends of the current engine step, whose layers are written to D as the
forward pass computes them (a send added in an earlier step has every layer computed)."""

from __future__ import annotations

from pdserve.transfer.kinds.write_send import WriteSend
from pdserve.transfer.record import Transfer


class StepSends:
    def __init__(self, write_send: WriteSend, num_layers: int):
        self._write_send = write_send
        self.num_layers = num_layers
        self.number = 0  # counts engine steps
        self._sends: list[Transfer] = []
        self._layers: set[int] = set()  # layers the current step computed so far

    def begin(self) -> None:
        self._sends = []
        self.number += 1
        self._layers = set()

    def layers_ready(self, step: int) -> set[int]:
        """The layers computed of a send added in engine step `step`."""
        return set(self._layers) if step == self.number else set(range(self.num_layers))

    def add(self, t: Transfer, step: int) -> None:
        """Track `t`, added in engine step `step` (its later layers are written as computed)."""
        if step == self.number:
            self._sends.append(t)

    def write(self, t: Transfer) -> None:
        self._write_send.try_write(t)

    def layer_ready(self, layer_index: int) -> None:
        """The forward pass has just computed `layer_index` for this step's sends."""
        self._layers.add(layer_index)
        for t in self._sends:
            if not t.state.is_terminal:
                t.copies.layers_ready.add(layer_index)
                self._write_send.try_write(t)
