"""D: decode legs, whose prompt's KV comes from P (or which D computes itself, placement decides).

DecodeScheduler calls these from vLLM's hooks on a consumer; each looks the `Leg` up and moves it along
one of legs/base.py's transitions. Placement (WRITE: D decides here; READ: P decided, in the params) only
chooses between receiving and computing locally; decode_load.py keeps the load either adds.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

from pdserve.config import ConnectorConfig, Role, TransferMode
from pdserve.connector.kv_groups import ONE_GROUP, KvGroups
from pdserve.connector.metadata import StepPlan
from pdserve.connector.scheduler.legs.base import Leg, LegStatus
from pdserve.connector.scheduler.prompt_digest import request_digest
from pdserve.control.address import PeerAddress
from pdserve.errors import ProtocolError
from pdserve.params import TransferParams, parse_transfer_params
from pdserve.placement import (
    MAX_PREFILL_PEERS,
    PUBLISH_EVERY_S,
    STATUS_EVERY_S,
    Decision,
    DecodeLoad,
    DecodeStatus,
    Placement,
    PlacementPolicy,
    Reason,
    peer_key,
    status_of,
)
from pdserve.transfer.specs import CancelSpec, RecvSpec

logger = logging.getLogger("pdserve.connector")
PLACEMENT_LOG_EVERY_S = 5.0


class DecodeReceive:
    def __init__(self, config: ConnectorConfig, block_size: int, policy: PlacementPolicy, load: DecodeLoad,
                 plan: Callable[[], StepPlan], chunk_limit: Callable[[], int | None], groups: KvGroups = ONE_GROUP):
        self._config = config
        self._block_size = block_size
        self._policy = policy
        self._load = load
        self._plan = plan  # the StepPlan being built
        self._chunk_limit = chunk_limit  # vLLM's per-prompt prefill limit as last set (logged)
        self._groups = groups  # KV cache groups: a block list names each group's blocks (kv_groups.py)
        self._legs: dict[str, Leg] = {}
        self._placed_local: dict[str, int] = {}  # READ: per prefill instance, the prompts it left us that we took
        self._next_placement_log = 0.0
        self._status_every_s = STATUS_EVERY_S if config.mode is TransferMode.WRITE else PUBLISH_EVERY_S
        self._next_status = 0.0 if config.placement.adaptive else math.inf  # static placement publishes none

    # ---- vLLM's hooks ----------------------------------------------------------------------

    def matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        leg = self._leg(request)
        if leg is None or leg.status is LegStatus.RECEIVING or leg.status is LegStatus.REJECTED:
            return 0, False
        if leg.status is LegStatus.AWAITING_TURN:
            return self._take_turn(leg)
        if leg.status is not LegStatus.NEW:
            return 0, False
        count = self._groups.moved_tokens(request.num_prompt_tokens) - num_computed_tokens
        if count <= 0:
            return 0, False
        if leg.params is not None:
            if self._config.mode is TransferMode.READ:  # P placed it (placement/read_mode.py)
                leg.decision = leg.params.decision or Decision(Placement.REMOTE, Reason.STATIC)
            else:
                leg.decision = self._policy.decide(count, self._load.view(leg.params.peer),
                                                   self._load.load_of(leg.params.peer))
            if leg.decision.placement is Placement.LOCAL:
                return self._queue_local(leg)
        return count, True

    def allocated(self, request, blocks, num_external_tokens: int) -> None:
        leg = self._legs.get(request.request_id)
        if leg is None:
            return
        self._place(leg, num_external_tokens)
        if leg.status is not LegStatus.NEW:
            return
        if num_external_tokens == 0:
            self._release(leg)
            return
        block_ids = self._groups.prompt_blocks(blocks.get_block_ids(), self._num_prompt_blocks(request))
        first_block = (self._groups.moved_tokens(request.num_prompt_tokens) - num_external_tokens) // self._block_size
        if leg.params is not None:
            try:
                digest = request_digest(request, self._groups.moved_tokens(request.num_prompt_tokens))
            except Exception as exc:  # noqa: BLE001 - vLLM waits for this request's RecvSpec: fail it, never drop it
                (logger.error if isinstance(exc, ProtocolError) else logger.exception)(
                    "pdserve: request %s: cannot receive its KV, recomputing it: %s", leg.request_id, exc)
                leg.error = ProtocolError(f"decode cannot receive this request's KV: {exc}")
        if leg.error is not None:
            leg.to(LegStatus.REJECTED)
            self._plan().recvs.append(RecvSpec(leg.request_id, "", self._config.mode, None, block_ids,
                                               first_block, None, None, error=str(leg.error)))
            self._cancel(leg, f"decode rejected the prefill's kv_transfer_params: {leg.error}")
            return
        leg.to(LegStatus.RECEIVING)
        params = leg.params
        self._plan().recvs.append(RecvSpec(leg.request_id, params.transfer_id, self._config.mode, params.peer,
                                           block_ids, first_block, params.remote_block_ids, params.hold_expires_at,
                                           digest))

    def landed(self, request_id: str) -> bool:
        """The worker reported the leg's transfer over; whether it was one D waited for."""
        leg = self._legs.get(request_id)
        if leg is None or leg.status not in (LegStatus.RECEIVING, LegStatus.REJECTED):
            return False
        leg.to(LegStatus.RECEIVED)
        return True

    def received(self, request_id: str) -> bool:
        leg = self._legs.get(request_id)
        return leg is not None and leg.status is LegStatus.RECEIVED

    def receiving(self, request_id: str) -> bool:
        leg = self._legs.get(request_id)
        return leg is not None and leg.status in (LegStatus.RECEIVING, LegStatus.REJECTED)

    def finished(self, request) -> None:
        rid = request.request_id
        self._load.forget(rid)
        self._load.on_finished(getattr(request, "num_output_tokens", 0))
        leg = self._leg(request)  # aborted before it was ever scheduled: P may hold its KV
        self._legs.pop(rid, None)
        if leg is None or (leg.params is not None and leg.params.local):
            return  # READ, left to us: P holds nothing of it
        if leg.status is LegStatus.NEW:
            self._cancel(leg, "request ended before decode allocated its blocks")
        elif leg.status is LegStatus.RECEIVING:
            self._cancel(leg, "request ended while its KV was on the way")

    def status(self) -> DecodeStatus | None:
        """Adaptive placement, when due. READ: our side of P's placement decisions, every
        PUBLISH_EVERY_S (placement/status_view.py). WRITE: how loaded our streams are, for a P that
        serves whole requests while they are (serve_gate.py), every STATUS_EVERY_S."""
        now = time.monotonic()
        if now < self._next_status:
            return None
        self._next_status = now + self._status_every_s
        return status_of(self._load.view(None), self._config.host_ip, self._config.handshake_port, time.time(),
                         self._placed_local)

    # ---- the leg's life --------------------------------------------------------------------

    def _leg(self, request) -> Leg | None:
        """The request's leg, parsed on first sight; None for a request that is not a decode leg."""
        rid = request.request_id
        leg = self._legs.get(rid)
        if leg is not None:
            return leg
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.CONSUMER)
        except ProtocolError as exc:
            leg = Leg(request, None, error=exc)
        else:
            if params is None:
                return None
            leg = Leg(request, params)
            try:
                params.require_peer()
                if self._config.mode is TransferMode.READ and not params.local:
                    self._check_read_params(request, params)
            except ProtocolError as exc:
                leg = Leg(request, None, error=exc, rejected=params)  # P may hold KV under them: release it
        self._legs[rid] = leg
        return leg

    def _check_read_params(self, request, params: TransferParams) -> None:
        if not params.remote_block_ids:
            raise ProtocolError("kv_transfer_params.remote_block_ids is missing: in READ mode D needs the "
                                "prefill response's kv_transfer_params")
        needed = self._groups.num_groups * self._num_prompt_blocks(request)
        if len(params.remote_block_ids) != needed:
            raise ProtocolError(f"kv_transfer_params.remote_block_ids names {len(params.remote_block_ids)} blocks; "
                                f"this prompt needs {needed} ({self._groups.num_groups} KV cache groups)")
        if params.prompt_hash != request_digest(request, self._groups.moved_tokens(request.num_prompt_tokens)):
            raise ProtocolError("kv_transfer_params.prompt_hash is missing or names another prompt than this "
                                "request's: the prefill computed different tokens")

    def _queue_local(self, leg: Leg) -> tuple[int | None, bool]:
        """D prefills the prompt itself: now if no prompt of its own is still being prefilled,
        otherwise after those (placement/decode_load.py's `local_turn`). A prompt that waits is told to P at
        once (its leg ends without running), holds no blocks, and counts in D's local backlog."""
        if not self._load.local_prompts():
            return 0, False  # tracked once blocks are allocated (_place)
        self._load.add_local(leg.request)
        self._tell_released(leg)
        leg.to(LegStatus.AWAITING_TURN)
        return self._take_turn(leg)

    def _take_turn(self, leg: Leg) -> tuple[int | None, bool]:
        if not self._load.local_turn(leg.request_id):
            return None, False  # vLLM asks again next step
        leg.to(LegStatus.RELEASED)
        return 0, False

    def _release(self, leg: Leg) -> None:
        """D prefills the leg itself."""
        self._tell_released(leg)
        leg.to(LegStatus.RELEASED)

    def _tell_released(self, leg: Leg) -> None:
        """P is told, unless P left the prompt to us (READ) and holds nothing."""
        if leg.params is None or not leg.params.local:
            self._cancel(leg, "decode computes this prompt itself")

    def _cancel(self, leg: Leg, reason: str) -> None:
        params = leg.told_peer
        if params is not None:
            self._plan().cancels.append(CancelSpec(params.transfer_id, params.peer, reason))

    def _place(self, leg: Leg, num_external_tokens: int) -> None:
        """Count the decision that took effect and track the load it adds."""
        decision, leg.decision = leg.decision, None
        params = leg.params
        if decision is None or params is None:
            return
        self._plan().placements.append(decision)
        self._log_placement(decision, params)
        if params.local:
            self._count_placed_local(params.peer)
        if num_external_tokens == 0:
            self._load.add_local(leg.request)
        else:
            self._load.add_remote(leg.request_id, params.peer, num_external_tokens, params.transfer_id,
                                  decision.compute_s)

    def _count_placed_local(self, prefill: PeerAddress) -> None:
        """READ: one more prompt `prefill` left to us taken in (placement/read_mode.py counts the rest as
        on their way); the least recently counted instance is forgotten beyond MAX_PREFILL_PEERS."""
        key = peer_key(prefill.host, prefill.handshake_port)
        self._placed_local[key] = self._placed_local.pop(key, 0) + 1
        while len(self._placed_local) > MAX_PREFILL_PEERS:
            del self._placed_local[next(iter(self._placed_local))]

    def _log_placement(self, decision: Decision, params: TransferParams) -> None:
        """Every PLACEMENT_LOG_EVERY_S: the decision just taken and what it was based on."""
        now = time.monotonic()
        if now < self._next_placement_log or not self._config.placement.adaptive:
            return
        self._next_placement_log = now + PLACEMENT_LOG_EVERY_S
        view = self._load.view(params.peer)
        fmt = lambda v: "-" if v is None else f"{1000 * v:.0f} ms"  # noqa: E731
        logger.info("pdserve: placement %s (local %s, remote %s, path %s); decode: %d running, %d backlog tokens, "
                    "chunk %s, mean ITL %s over the last %.0f-token stream, costs %s; prefill %s:%d: %s",
                    decision.label, fmt(decision.ttft_local_s), fmt(decision.ttft_remote_s), fmt(view.remote_path_s),
                    view.running_decodes, view.local_backlog_tokens, self._chunk_limit(), fmt(view.recent_itl_s),
                    view.stream_tokens, view.costs, params.peer.host, params.peer.handshake_port,
                    self._load.load_of(params.peer))

    def _num_prompt_blocks(self, request) -> int:
        return math.ceil(self._groups.moved_tokens(request.num_prompt_tokens) / self._block_size)
