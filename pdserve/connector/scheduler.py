"""The scheduler half of PDConnector: decides, per request, what the worker half must move.

It runs in vLLM's EngineCore process, sees `Request` objects and block ids, and tells the
worker half what to do through a `StepPlan` once per step. It opens no data-plane
socket; the only network it touches is the router registration heartbeat.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from pdserve.config import ConnectorConfig, Role, TransferMode
from pdserve.connector.guard import guarded
from pdserve.connector.metadata import CancelSpec, HoldSpec, RecvSpec, SendSpec, StepPlan
from pdserve.connector.prompt_digest import prompt_digest
from pdserve.errors import ProtocolError
from pdserve.params import TransferParams, parse_transfer_params

logger = logging.getLogger("pdserve.connector")


@dataclass
class _PendingSend:
    request: Any  # vllm Request
    params: TransferParams


class PDScheduler:
    """Called by vLLM's scheduler; see vLLM's KVConnectorBase_V1 for when each hook runs."""

    def __init__(self, config: ConnectorConfig, block_size: int):
        self._config = config
        self._block_size = block_size
        self._kv_cache_manager = None
        # P
        self._pending_sends: dict[str, _PendingSend] = {}  # WRITE: prompt not yet complete
        self._sending: dict[str, TransferParams] = {}  # WRITE: SendSpec emitted, request still running
        self._preempted: set[str] = set()  # WRITE: send cancelled by a preemption; no second send
        self._held: set[str] = set()  # returned delay_free=True; waiting for finished_sending
        # D
        self._recv_params: dict[str, TransferParams | ProtocolError] = {}
        self._receiving: set[str] = set()  # RecvSpec emitted
        self._received: set[str] = set()  # the worker reported the transfer over
        self._cancelled: set[str] = set()
        self._meta = StepPlan()

    # ---- shared ----------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def _num_prompt_blocks(self, request) -> int:
        return math.ceil(request.num_prompt_tokens / self._block_size)

    @guarded(StepPlan)
    def build_connector_meta(self, scheduler_output) -> StepPlan:
        if self._config.role is Role.PRODUCER:
            self._cancel_preempted_sends(getattr(scheduler_output, "preempted_req_ids", None) or ())
            self._emit_due_sends(scheduler_output.num_scheduled_tokens)
        meta, self._meta = self._meta, StepPlan()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    @guarded()
    def update_connector_output(self, connector_output) -> None:
        for request_id in connector_output.finished_sending or ():
            self._held.discard(request_id)
        for request_id in connector_output.finished_recving or ():
            if request_id in self._receiving:
                self._received.add(request_id)

    def has_pending_push_work(self) -> bool:
        return bool(self._held or self._meta.cancels or self._meta.holds)

    @guarded(lambda: (0, False))
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        if self._config.role is Role.PRODUCER or rid in self._receiving or rid in self._cancelled:
            return 0, False
        params = self._consumer_params(request)
        if params is None:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    @guarded()
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self._config.role is Role.PRODUCER:
            self._track_send(request)
        else:
            self._start_recv(request, blocks, num_external_tokens)

    @guarded(lambda: (False, None))
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._config.role is Role.CONSUMER:
            self._finish_recv(request)
            return False, None
        if self._config.mode is TransferMode.WRITE:
            return self._finish_write_send(request)
        return self._finish_read_send(request, block_ids)

    # ---- P ---------------------------------------------------------------------------------

    def _track_send(self, request) -> None:
        rid = request.request_id
        if (self._config.mode is not TransferMode.WRITE or rid in self._pending_sends or rid in self._sending
                or rid in self._preempted):
            return
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.PRODUCER)
            if params is not None:
                params.require_peer()
        except ProtocolError as exc:
            logger.error("pdserve: request %s: bad kv_transfer_params, prefilling without transfer: %s", rid, exc)
            return
        if params is not None:
            self._pending_sends[rid] = _PendingSend(request, params)

    def _emit_due_sends(self, num_scheduled_tokens: dict[str, int]) -> None:
        for rid, pending in list(self._pending_sends.items()):
            request = pending.request
            scheduled = num_scheduled_tokens.get(rid, 0)
            if not scheduled or request.num_computed_tokens + scheduled < request.num_prompt_tokens:
                continue
            block_ids = self._kv_cache_manager.get_blocks(rid).get_block_ids()[0]
            self._meta.sends.append(
                SendSpec(rid, pending.params.transfer_id, pending.params.peer,
                         tuple(block_ids[: self._num_prompt_blocks(request)]), prompt_digest(request.prompt_token_ids))
            )
            del self._pending_sends[rid]
            self._sending[rid] = pending.params

    def _cancel_preempted_sends(self, preempted_req_ids) -> None:
        """vLLM frees a preempted request's blocks at once: a send planned from them must stop
        before its copies read reused blocks; D is told, and recomputes (or fails) the request.
        The request stays held at its end so the worker's report of the cancelled send matches."""
        for rid in preempted_req_ids:
            params = self._sending.pop(rid, None)
            if params is not None:
                self._preempted.add(rid)
                self._meta.cancels.append(CancelSpec(params.transfer_id, params.peer,
                                                     "the prefill request was preempted before its KV was sent"))

    def _finish_write_send(self, request) -> tuple[bool, None]:
        rid = request.request_id
        if rid in self._sending or rid in self._preempted:
            self._sending.pop(rid, None)
            self._preempted.discard(rid)
            self._held.add(rid)
            return True, None
        pending = self._pending_sends.pop(rid, None)
        if pending is not None:
            self._meta.cancels.append(
                CancelSpec(pending.params.transfer_id, pending.params.peer,
                           "prefill ended before its KV was complete")
            )
        return False, None

    def _finish_read_send(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.PRODUCER)
        except ProtocolError as exc:
            logger.error("pdserve: request %s: bad kv_transfer_params, not holding its KV: %s", rid, exc)
            return False, None
        num_blocks = self._num_prompt_blocks(request)
        if params is None or len(block_ids) < num_blocks or not _prefill_complete(request):
            return False, None
        block_ids = list(block_ids[:num_blocks])
        digest = prompt_digest(request.prompt_token_ids)
        expires_at = time.time() + self._config.defer_timeout
        self._held.add(rid)
        self._meta.holds.append(HoldSpec(rid, params.transfer_id, tuple(block_ids), expires_at, digest))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": params.transfer_id,
            "remote_engine_id": self._config.engine_id,
            "remote_block_ids": list(block_ids),
            "remote_host": self._config.host_ip,
            "remote_handshake_port": self._config.handshake_port,
            "remote_notify_port": self._config.notify_port,
            "hold_expires_at": expires_at,
            "prompt_hash": digest,
        }

    # ---- D ---------------------------------------------------------------------------------

    def _consumer_params(self, request) -> TransferParams | ProtocolError | None:
        rid = request.request_id
        if rid not in self._recv_params:
            try:
                params = parse_transfer_params(request.kv_transfer_params, rid, Role.CONSUMER)
                if params is not None:
                    params.require_peer()
                    if self._config.mode is TransferMode.READ:
                        self._check_read_params(request, params)
            except ProtocolError as exc:
                params = exc
            if params is None:
                return None
            self._recv_params[rid] = params
        return self._recv_params[rid]

    def _check_read_params(self, request, params: TransferParams) -> None:
        if not params.remote_block_ids:
            raise ProtocolError("kv_transfer_params.remote_block_ids is missing: in READ mode D needs the "
                                "prefill response's kv_transfer_params")
        if len(params.remote_block_ids) != self._num_prompt_blocks(request):
            raise ProtocolError(f"kv_transfer_params.remote_block_ids names {len(params.remote_block_ids)} blocks; "
                                f"this prompt needs {self._num_prompt_blocks(request)}")
        if params.prompt_hash != prompt_digest(request.prompt_token_ids):
            raise ProtocolError("kv_transfer_params.prompt_hash is missing or names another prompt than this "
                                "request's: the prefill computed different tokens")

    def _start_recv(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        params = self._recv_params.get(rid)
        if params is None or rid in self._receiving or rid in self._cancelled:
            return
        if num_external_tokens == 0:
            self._cancel_recv(rid, "decode computes this prompt itself")
            return
        block_ids = blocks.get_block_ids()[0][: self._num_prompt_blocks(request)]
        first_block = (request.num_prompt_tokens - num_external_tokens) // self._block_size
        self._receiving.add(rid)
        if isinstance(params, ProtocolError):
            self._meta.recvs.append(RecvSpec(rid, "", self._config.mode, None, tuple(block_ids),
                                             first_block, None, None, error=str(params)))
            return
        self._meta.recvs.append(
            RecvSpec(rid, params.transfer_id, self._config.mode, params.peer, tuple(block_ids),
                     first_block, params.remote_block_ids, params.hold_expires_at,
                     prompt_digest(request.prompt_token_ids))
        )

    def _cancel_recv(self, rid: str, reason: str) -> None:
        params = self._recv_params.get(rid)
        self._cancelled.add(rid)
        if isinstance(params, TransferParams):
            self._meta.cancels.append(CancelSpec(params.transfer_id, params.peer, reason))

    def _finish_recv(self, request) -> None:
        rid = request.request_id
        if rid not in self._recv_params:  # aborted before it was ever scheduled: P may hold its KV
            self._consumer_params(request)
        if rid in self._recv_params and rid not in self._cancelled:
            if rid not in self._receiving:
                self._cancel_recv(rid, "request ended before decode allocated its blocks")
            elif rid not in self._received:
                self._cancel_recv(rid, "request ended while its KV was on the way")
        self._recv_params.pop(rid, None)
        self._receiving.discard(rid)
        self._received.discard(rid)
        self._cancelled.discard(rid)


def _prefill_complete(request) -> bool:
    """A prefill leg that computed its whole prompt and ended normally (its max_tokens, or a stop
    or EOS token as its first token) hands over its KV; one aborted or failed does not."""
    finished_normally = getattr(request.status, "name", None) in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
    return finished_normally and request.num_computed_tokens >= request.num_prompt_tokens
