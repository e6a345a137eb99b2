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
from typing import Any, Callable

from pdserve.config import ConnectorConfig, Role, TransferMode
from pdserve.connector.chunk_costs import ChunkCosts
from pdserve.connector.decode_load import DecodeLoad, uncomputed_prompt_tokens
from pdserve.connector.decode_status import status_of
from pdserve.connector.eager_prefill import EAGER_LABEL, StartedLegs, prefill_idle
from pdserve.connector.guard import guarded
from pdserve.connector.leg_truncation import truncate_to_one_token
from pdserve.connector.local_chunk import MIN_CHUNK, OVER, WITHIN, chunk_tokens, threshold
from pdserve.connector.metadata import AwaitSpec, CancelSpec, HoldSpec, RecvSpec, SendSpec, StepPlan
from pdserve.connector.placement import AdaptivePolicy, Decision, Placement, Reason, make_policy
from pdserve.connector.prefill_gate import PrefillGate, Verdict
from pdserve.connector.prefill_share import PrefillShare
from pdserve.connector.placement_inbox import PUBLISH_EVERY_S
from pdserve.connector.prompt_digest import prompt_digest
from pdserve.connector.read_placement import ReadPlacement, next_step_seconds, peer_key
from pdserve.connector.serve_gate import STATUS_EVERY_S
from pdserve.connector.step_costs import StepCosts
from pdserve.connector.whole_requests import SERVED_WHOLE, PromptTurns, addressed_to_self
from pdserve.control.address import PeerAddress
from pdserve.control.messages import MAX_COUNTED_TRANSFERS, MAX_PREFILL_PEERS, DecodeStatus, PrefillLoad
from pdserve.errors import ProtocolError
from pdserve.params import TransferParams, parse_transfer_params

logger = logging.getLogger("pdserve.connector")
PLACEMENT_LOG_EVERY_S = 5.0


@dataclass
class _PendingSend:
    request: Any  # vllm Request
    params: TransferParams


class PDScheduler:
    """Called by vLLM's scheduler; see vLLM's KVConnectorBase_V1 for when each hook runs."""

    def __init__(self, config: ConnectorConfig, block_size: int, budget: int = 2048, chunk: int | None = None,
                 set_chunk: Callable[[int], None] | None = None):
        self._config = config
        self._set_chunk = set_chunk  # D, adaptive: sets vLLM's per-prompt prefill limit for the next step
        self._chunk_limit: int | None = None  # the limit it last set
        self._block_size = block_size
        self._budget = budget  # this instance's --max-num-batched-tokens
        self._step_prefill = budget  # P: prompt tokens its next step computes at most (published to D)
        self._kv_cache_manager = None
        self._step: tuple[float, int, int, int] | None = None  # this step's start, prefill tokens, decodes, streams
        self._landing_planned = False  # D: the next step's chunk was sized for first tokens of landed requests
        self._step_landing = False  # D: this step's was
        # P, adaptive placement: WRITE, D decides and P's legs wait for its word; READ, P decides
        adaptive = config.placement.adaptive
        producer = adaptive and config.role is Role.PRODUCER
        write = config.mode is TransferMode.WRITE
        self._policy = make_policy(config.placement)
        self._gate = PrefillGate(config.placement.wait_s) if producer and write else None
        self._read = (ReadPlacement(self._policy, peer_key(config.host_ip, config.handshake_port))
                      if producer and not write else None)
        self._costs = StepCosts()
        # P with serve_decode: a prompt token's cost in its chunk steps beside its own streams (chunk_costs.py)
        self._chunk_costs = ChunkCosts() if producer and config.placement.serve_decode else None
        self._prefill_share = PrefillShare()  # P: its time in prefill steps (published in its load, serve_gate.py)
        self._accepted: dict[str, Any] = {}  # legs D wants prefilled here, until their prompt is computed
        self._accepted_transfers: dict[str, str] = {}  # WRITE: request id -> transfer id of each accepted leg
        self._whole: dict[str, Any] = {}  # requests served whole here (not legs), until their prompt is computed
        self._legs: dict[str, Any] = {}  # legs waiting for D's word
        # P with serve_decode: its prompts take turns while it decodes streams (whole_requests.py)
        self._turns = PromptTurns() if producer and write and config.placement.serve_decode else None
        self._own_stream_count = 0  # P: the streams of requests it serves whole in its last step
        # D, placement
        self._publishes_status = adaptive and config.role is Role.CONSUMER
        self._status_every_s = STATUS_EVERY_S if write else PUBLISH_EVERY_S
        self._next_status = 0.0
        self._placed_local: dict[str, int] = {}  # READ: per prefill instance, the prompts it left us that we took
        self._decode_load = DecodeLoad(budget, config.placement.stream_itl_s, chunk=chunk)
        self._decisions: dict[str, Decision] = {}
        self._started = StartedLegs(config.defer_timeout)  # transfers P started before our word
        self._next_placement_log = 0.0
        # P
        self._pending_sends: dict[str, _PendingSend] = {}  # WRITE: prompt not yet complete
        self._sending: dict[str, TransferParams] = {}  # WRITE: SendSpec emitted, request still running
        self._preempted: set[str] = set()  # WRITE: send cancelled by a preemption; no second send
        self._held: set[str] = set()  # returned delay_free=True; waiting for finished_sending
        # D
        self._recv_params: dict[str, TransferParams | ProtocolError] = {}
        self._rejected: dict[str, TransferParams] = {}  # READ: params that parsed but do not fit the request
        self._receiving: set[str] = set()  # RecvSpec emitted
        self._received: set[str] = set()  # the worker reported the transfer over
        self._cancelled: set[str] = set()
        self._awaiting_turn: set[str] = set()  # local prompts waiting for the one D prefills now (_queue_local)
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
        new = {r.req_id for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ()}
        self._start_step(scheduler_output.num_scheduled_tokens, new)
        self._apply_chunk()
        if self._gate is not None or self._read is not None:
            self._meta.load = self._prefill_load()
        if self._read is not None:
            self._read.end_pass()
        if self._publishes_status:
            self._meta.status = self._decode_status()
        meta, self._meta = self._meta, StepPlan()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    @guarded()
    def update_connector_output(self, connector_output, news=None) -> None:
        self._end_step()
        for request_id in connector_output.finished_sending or ():
            self._held.discard(request_id)
        landed = 0
        for request_id in connector_output.finished_recving or ():
            if request_id in self._receiving and request_id not in self._received:
                self._received.add(request_id)
                landed += 1
            self._decode_load.landed(request_id)
        if news is not None:
            if self._gate is not None:
                self._gate.on_decisions(self._shrink_dropped(news.decided))
            self._decode_load.on_loads(news.loads)
            if news.statuses and self._read is not None:
                self._read.on_statuses(news.statuses)
            if news.started:
                self._started.add(news.started)
        if landed:
            self._shorten_for_first_tokens(landed)

    def _start_step(self, num_scheduled_tokens: dict[str, int], new: set[str]) -> None:
        prefill = sum(n for n in num_scheduled_tokens.values() if n > 1)
        decodes = sum(1 for n in num_scheduled_tokens.values() if n == 1)
        self._decode_load.running_decodes = self._decode_load.streams_after(num_scheduled_tokens)
        streams = self._own_streams(num_scheduled_tokens, new) if self._config.role is Role.PRODUCER else decodes
        self._own_stream_count = streams
        self._step = (time.monotonic(), prefill, decodes, streams) if prefill or decodes else None
        self._step_landing, self._landing_planned = self._landing_planned, False

    def _own_streams(self, scheduled: dict[str, int], new: set[str]) -> int:
        """P: the requests this step gives a generated token, the streams of those P serves whole.
        A one-token step is not always one: a leg D prefills itself runs here as the one-token prompt it
        was cut to (scheduled for the first time, like any new request), and a prompt's last chunk
        may be one token."""
        uncomputed_prompt_tokens(self._accepted)
        uncomputed_prompt_tokens(self._whole)
        prompts = self._accepted.keys() | self._whole.keys()
        return sum(1 for rid, n in scheduled.items() if n == 1 and rid not in new and rid not in prompts)

    def _apply_chunk(self) -> None:
        """Adaptive: the next step's limit on one prompt's prefill tokens, from the streams of this
        one (local_chunk.py), on an instance that decodes: D (its local prompts never stretch a step
        past max_step_ms) and, with serve_decode, P (the prompts it prefills never stretch a step of
        the requests it serves whole past max_step_ms)."""
        if self._set_chunk is None or not isinstance(self._policy, AdaptivePolicy):
            return
        if self._config.role is Role.CONSUMER:
            self._chunk_limit = self._local_chunk_limit()
        elif self._config.placement.serve_decode:
            streams = self._own_stream_count  # this step's, counted by _start_step
            prompts = self._turns.in_progress() if self._turns is not None else 1
            learnt = self._chunk_costs
            chunk = chunk_tokens(learnt.costs(self._costs.coefficients()), streams,
                                 self._config.placement.max_step_ms / 1000, self._budget,
                                 headroom=learnt.headroom.headroom())
            self._chunk_limit = threshold(chunk, prompts) if streams else self._budget
            self._step_prefill = max(MIN_CHUNK, chunk) if streams else self._budget
        else:
            return
        self._set_chunk(self._chunk_limit)

    def _shorten_for_first_tokens(self, landed: int) -> None:
        """D, adaptive: requests whose KV just landed take their first token in the next step, so a
        local chunk in it is sized to a stream's step (`landing_step_s`), not the response bound:
        their TTFT is P's prefill plus that step. Set after the step's output, before vLLM
        schedules the next one (local_chunk.py)."""
        if self._set_chunk is None or not isinstance(self._policy, AdaptivePolicy) or \
                self._config.role is not Role.CONSUMER:
            return
        if not self._decode_load.local_prompts():
            return
        self._chunk_limit = min(self._chunk_limit or self._budget, self._local_chunk_limit(landed))
        self._landing_planned = True
        self._set_chunk(self._chunk_limit)

    def _local_chunk_limit(self, landed: int = 0) -> int:
        """D: vLLM's per-prompt limit for its next step, the whole local chunk (one local prompt
        computes at a time: _queue_local), with `landed` first tokens in the step."""
        load = self._decode_load
        view, some = load.view(None), load.some_load()
        return threshold(self._policy.chunk(view, self._policy.local_costs(view, some), some, landed), 1)

    def _end_step(self) -> None:
        if self._step is not None:
            started, prefill, decodes, streams = self._step
            took = time.monotonic() - started
            consumer = self._config.role is Role.CONSUMER
            (self._decode_load.costs if consumer else self._costs).observe(took, prefill, decodes)
            if consumer:
                self._decode_load.on_step(took, decodes, prefill)
                self._judge_chunk_step(took, prefill, decodes)
                self._meta.remote_paths.extend(self._decode_load.remote_path.step_ended())
            else:
                self._prefill_share.on_step(started, took, prefill, streams)
                if streams and self._chunk_costs is not None:  # a step whose chunk _apply_chunk sized
                    self._chunk_costs.on_step(took, self._costs, decodes, prefill)
                    if prefill >= MIN_CHUNK:  # on /metrics as D's are: did P's streams wait past the bound?
                        bound = self._config.placement.max_step_ms / 1000
                        self._meta.chunk_steps.append(OVER if took > bound else WITHIN)
            self._step = None

    def _judge_chunk_step(self, took: float, prefill: int, decodes: int) -> None:
        """D, adaptive: whether a step with a local chunk kept the bound its chunk was sized for
        (on /metrics: how often a local prefill made streams wait past max_step_ms)."""
        if prefill < MIN_CHUNK or not isinstance(self._policy, AdaptivePolicy):
            return
        bound = self._policy.step_bound(decodes, self._decode_load.some_load(), self._step_landing)
        if math.isfinite(bound):
            self._meta.chunk_steps.append(OVER if took > bound else WITHIN)

    @guarded()
    def on_new_request(self, request) -> None:
        """vLLM added a request to its waiting queue. P, READ, adaptive: place its prompt now."""
        if self._read is not None:
            self._place_read_leg(request)

    def has_pending_push_work(self) -> bool:
        return bool(self._held or self._meta.cancels or self._meta.holds)

    @guarded(lambda: (0, False))
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if self._config.role is Role.PRODUCER:
            if self._read is not None:
                return (0, False) if self._read.admit(rid) else (None, False)
            return self._gate_prefill(request, num_computed_tokens)
        if rid in self._awaiting_turn:
            return self._take_turn(rid)
        if rid in self._receiving or rid in self._cancelled:
            return 0, False
        params = self._consumer_params(request)
        if params is None:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        if isinstance(params, TransferParams):
            if self._config.mode is TransferMode.READ:  # P placed it (read_placement.py)
                decision = params.decision or Decision(Placement.REMOTE, Reason.STATIC)
            elif params.transfer_id in self._started and isinstance(self._policy, AdaptivePolicy):
                decision = Decision(Placement.REMOTE, Reason.PREFILL_STARTED)
            else:
                decision = self._policy.decide(count, self._decode_load.view(params.peer),
                                               self._decode_load.load_of(params.peer))
            self._decisions[rid] = decision  # counted once blocks are allocated (vLLM may ask again)
            if decision.placement is Placement.LOCAL:
                return self._queue_local(request)
        return count, True

    def _queue_local(self, request) -> tuple[int | None, bool]:
        """D prefills `request` itself: now if no prompt of its own is still being prefilled,
        otherwise after those (decode_load.py's `local_turn`). A prompt that waits is told to P at
        once (its leg ends without running), holds no blocks, and counts in D's local backlog."""
        if not self._decode_load.local_prompts():
            return 0, False  # tracked once blocks are allocated (_place)
        rid = request.request_id
        self._decode_load.add_local(request)
        self._awaiting_turn.add(rid)
        self._release_leg(rid, self._recv_params.get(rid))
        return self._take_turn(rid)

    def _take_turn(self, rid: str) -> tuple[int | None, bool]:
        if not self._decode_load.local_turn(rid):
            return None, False  # vLLM asks again next step
        self._awaiting_turn.discard(rid)
        return 0, False

    @guarded()
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self._config.role is Role.PRODUCER:
            if self._read is not None:
                self._read.admitted(request.request_id)
            if self._gate is not None and self._gate.dropped(request.request_id):
                return  # a one-token leg: nothing to send
            self._track_send(request)
        else:
            self._place(request, num_external_tokens)
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

    def _gate_prefill(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Adaptive placement: hold a prefill leg until D decided, unless P has nothing else to
        prefill (eager_prefill.py); one D prefills itself has been cut to a one-token prompt
        (leg_truncation.py) and runs as that."""
        if self._gate is None:
            return 0, False
        rid = request.request_id
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.PRODUCER)
            if params is not None:
                params.require_peer()
        except ProtocolError:
            return 0, False  # _track_send names the problem
        if params is None:  # not a prefill leg: a request served whole here (serve_decode, or sent to P
            self._whole[rid] = request  # directly); its prompt is in P's queue like an accepted leg's
            return self._take_prompt_turn(request)
        verdict = self._gate.verdict(rid)
        if verdict is Verdict.ASK and addressed_to_self(params, self._config):
            # its decode leg was sent here too (serve_decode) and is served whole: drop this one. vLLM
            # looked up the full prompt's prefix-cache hits for this pass already, so the cut leg
            # waits one step and is looked up again as the one-token prompt it now is
            dropped = truncate_to_one_token(request)
            self._gate.on_decisions({rid: not dropped})
            if dropped:
                self._meta.placements.append(SERVED_WHOLE)
                return None, False
            verdict = self._gate.verdict(rid)
        if (verdict is Verdict.ASK and self._config.placement.eager
                and prefill_idle(self._accepted, self._whole) and self._gate.start(rid)):
            self._meta.eager.append(AwaitSpec(rid, params.transfer_id, params.peer))
            self._meta.placements.append(EAGER_LABEL)
            verdict = Verdict.PREFILL
        if verdict is Verdict.ASK:
            self._meta.awaits.append(AwaitSpec(rid, params.transfer_id, params.peer))
            self._legs[rid] = request
        if verdict in (Verdict.ASK, Verdict.WAIT):
            return None, False
        self._legs.pop(rid, None)
        if verdict is Verdict.PREFILL:
            self._accepted[rid] = request
            self._accepted_transfers[rid] = params.transfer_id
            return self._take_prompt_turn(request)
        return 0, False

    def _take_prompt_turn(self, request) -> tuple[int | None, bool]:
        """P with serve_decode: a prompt waits while another is computed beside P's own streams
        (whole_requests.py's PromptTurns); it stays in P's queue meanwhile."""
        if self._turns is None or self._turns.may_start(request, self._own_stream_count):
            return 0, False
        return None, False  # vLLM asks again next step

    def _place_read_leg(self, request) -> None:
        """READ: decide where this leg's prompt is prefilled (read_placement.py). One left to D is cut
        to its first token now, while nothing of it is computed or allocated."""
        rid = request.request_id
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.PRODUCER)
            peer = params.require_peer() if params is not None else None
        except ProtocolError:
            return  # _finish_read_send names the problem
        if params is None or addressed_to_self(params, self._config):
            self._whole[rid] = request  # served whole here: its prompt is in P's queue
            return
        # P's prefix-cache hits are looked up only when vLLM schedules the leg: the whole prompt counts
        tokens = request.num_prompt_tokens
        load = self._prefill_load()
        started = sum(r.num_prompt_tokens - r.num_computed_tokens
                      for r in (*self._accepted.values(), *self._whole.values()) if r.num_computed_tokens > 0)
        decision = self._read.decide(tokens, peer, load, next_step_seconds(load, started))
        if decision.placement is Placement.LOCAL and not truncate_to_one_token(request):
            decision = Decision(Placement.REMOTE, decision.reason)
        self._read.placed(rid, peer, decision, tokens)
        if decision.placement is Placement.REMOTE:
            self._accepted[rid] = request

    def _shrink_dropped(self, decided: dict[str, bool]) -> dict[str, bool]:
        """D's decisions for waiting legs; a leg D prefills itself is cut to one token now, between
        steps, or, if that cannot be done, prefilled after all."""
        out = {}
        for rid, prefill_here in decided.items():
            request = self._legs.get(rid)
            if request is None:
                continue
            out[rid] = prefill_here or not truncate_to_one_token(request)
        return out

    def _prefill_load(self) -> PrefillLoad | None:
        costs = self._costs.coefficients()
        if costs is None:
            return None
        queued = uncomputed_prompt_tokens(self._accepted) + uncomputed_prompt_tokens(self._whole)
        for rid in self._accepted_transfers.keys() - self._accepted.keys():
            del self._accepted_transfers[rid]  # computed: no longer in the queue
        counted = list(self._accepted_transfers.values())[:MAX_COUNTED_TRANSFERS]
        return PrefillLoad(self._config.host_ip, self._config.handshake_port, queued, costs.per_prefill_token_s,
                           costs.overhead_s, self._step_prefill, time.time(), self._prefill_share.share(),
                           self._prefill_share.streams(), counted)

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
        if params is not None and addressed_to_self(params, self._config):
            logger.warning("pdserve: request %s names this instance as its decode instance: its KV stays here", rid)
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
        self._accepted.pop(rid, None)
        self._accepted_transfers.pop(rid, None)
        self._whole.pop(rid, None)
        self._legs.pop(rid, None)
        if self._turns is not None:
            self._turns.forget(rid)
        if self._gate is not None:
            self._gate.forget(rid)
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
        self._accepted.pop(rid, None)
        self._whole.pop(rid, None)
        decision = self._read.finished(rid) if self._read is not None else None
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.PRODUCER)
        except ProtocolError as exc:
            logger.error("pdserve: request %s: bad kv_transfer_params, not holding its KV: %s", rid, exc)
            return False, None
        address = {"remote_engine_id": self._config.engine_id, "remote_host": self._config.host_ip,
                   "remote_handshake_port": self._config.handshake_port,
                   "remote_notify_port": self._config.notify_port}
        placement = {"placement": decision.label} if decision is not None else {}
        if decision is not None and decision.placement is Placement.LOCAL:
            if params is None or not _prefill_complete(request):
                return False, None
            # a one-token leg: nothing is held; D prefills the prompt itself
            return False, {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": params.transfer_id,
                           **address, **placement}
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
            **address,
            "remote_block_ids": list(block_ids),
            "hold_expires_at": expires_at,
            "prompt_hash": digest,
            **placement,
        }

    # ---- D ---------------------------------------------------------------------------------

    def _place(self, request, num_external_tokens: int) -> None:
        """Count the decision that took effect and track the load it adds."""
        decision = self._decisions.pop(request.request_id, None)
        params = self._recv_params.get(request.request_id)
        if isinstance(params, TransferParams):
            self._started.forget(params.transfer_id)
        if decision is None or not isinstance(params, TransferParams) or request.request_id in self._receiving:
            return
        self._meta.placements.append(decision.label)
        self._log_placement(decision, params)
        if params.local:
            self._count_placed_local(params.peer)
        if num_external_tokens == 0:
            self._decode_load.add_local(request)
        else:
            self._decode_load.add_remote(request.request_id, params.peer, num_external_tokens, params.transfer_id,
                                         decision.compute_s)

    def _consumer_params(self, request) -> TransferParams | ProtocolError | None:
        rid = request.request_id
        if rid not in self._recv_params:
            try:
                params = parse_transfer_params(request.kv_transfer_params, rid, Role.CONSUMER)
                if params is not None:
                    params.require_peer()
                    if self._config.mode is TransferMode.READ and not params.local:
                        try:
                            self._check_read_params(request, params)
                        except ProtocolError:
                            self._rejected[rid] = params  # P holds KV under them: release it
                            raise
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
            self._release_leg(rid, params)
            return
        block_ids = blocks.get_block_ids()[0][: self._num_prompt_blocks(request)]
        first_block = (request.num_prompt_tokens - num_external_tokens) // self._block_size
        self._receiving.add(rid)
        if isinstance(params, ProtocolError):
            self._meta.recvs.append(RecvSpec(rid, "", self._config.mode, None, tuple(block_ids),
                                             first_block, None, None, error=str(params)))
            self._cancel_recv(rid, f"decode rejected the prefill's kv_transfer_params: {params}")
            return
        self._meta.recvs.append(
            RecvSpec(rid, params.transfer_id, self._config.mode, params.peer, tuple(block_ids),
                     first_block, params.remote_block_ids, params.hold_expires_at,
                     prompt_digest(request.prompt_token_ids))
        )

    def _release_leg(self, rid: str, params) -> None:
        """D prefills `rid` itself: P is told, unless P left it to us (READ) and holds nothing."""
        if isinstance(params, TransferParams) and params.local:
            self._cancelled.add(rid)
        else:
            self._cancel_recv(rid, "decode computes this prompt itself")

    def _cancel_recv(self, rid: str, reason: str) -> None:
        params = self._recv_params.get(rid)
        if isinstance(params, ProtocolError):
            params = self._rejected.get(rid)
        self._cancelled.add(rid)
        if isinstance(params, TransferParams):
            self._meta.cancels.append(CancelSpec(params.transfer_id, params.peer, reason))

    def _count_placed_local(self, prefill: PeerAddress) -> None:
        """READ: one more prompt `prefill` left to us taken in (read_placement.py counts the rest as
        on their way); the least recently counted instance is forgotten beyond MAX_PREFILL_PEERS."""
        key = peer_key(prefill.host, prefill.handshake_port)
        self._placed_local[key] = self._placed_local.pop(key, 0) + 1
        while len(self._placed_local) > MAX_PREFILL_PEERS:
            del self._placed_local[next(iter(self._placed_local))]

    def _decode_status(self) -> DecodeStatus | None:
        """READ: our side of P's placement decisions, every PUBLISH_EVERY_S (decode_status.py).
        WRITE: how loaded our streams are, for a P that serves whole requests while they are
        (serve_gate.py), every STATUS_EVERY_S."""
        now = time.monotonic()
        if now < self._next_status:
            return None
        self._next_status = now + self._status_every_s
        return status_of(self._decode_load.view(None), self._config.host_ip, self._config.handshake_port,
                         time.time(), self._placed_local)

    def _log_placement(self, decision: Decision, params: TransferParams) -> None:
        """Every PLACEMENT_LOG_EVERY_S: the decision just taken and what it was based on."""
        now = time.monotonic()
        if now < self._next_placement_log or not self._config.placement.adaptive:
            return
        self._next_placement_log = now + PLACEMENT_LOG_EVERY_S
        view = self._decode_load.view(params.peer)
        fmt = lambda v: "-" if v is None else f"{1000 * v:.0f} ms"
        logger.info("pdserve: placement %s (local %s, remote %s, path %s); decode: %d running, %d backlog tokens, "
                    "chunk %s, mean ITL %s over the last %.0f-token stream, costs %s; prefill %s:%d: %s", decision.label,
                    fmt(decision.ttft_local_s), fmt(decision.ttft_remote_s), fmt(view.remote_path_s),
                    view.running_decodes,
                    view.local_backlog_tokens, self._chunk_limit, fmt(view.recent_itl_s), view.stream_tokens,
                    view.costs, params.peer.host,
                    params.peer.handshake_port, self._decode_load.load_of(params.peer))

    def _finish_recv(self, request) -> None:
        rid = request.request_id
        self._decode_load.forget(rid)
        self._decode_load.on_finished(getattr(request, "num_output_tokens", 0))
        self._decisions.pop(rid, None)
        if isinstance(self._recv_params.get(rid), TransferParams):
            self._started.forget(self._recv_params[rid].transfer_id)
        if rid not in self._recv_params:  # aborted before it was ever scheduled: P may hold its KV
            self._consumer_params(request)
        params = self._recv_params.get(rid)
        if isinstance(params, TransferParams) and params.local:
            self._cancelled.add(rid)  # READ, left to us: P holds nothing of it
        if rid in self._recv_params and rid not in self._cancelled:
            if rid not in self._receiving:
                self._cancel_recv(rid, "request ended before decode allocated its blocks")
            elif rid not in self._received:
                self._cancel_recv(rid, "request ended while its KV was on the way")
        self._recv_params.pop(rid, None)
        self._rejected.pop(rid, None)
        self._receiving.discard(rid)
        self._received.discard(rid)
        self._cancelled.discard(rid)
        self._awaiting_turn.discard(rid)


def _prefill_complete(request) -> bool:
    """A prefill leg that computed its whole prompt and ended normally (its max_tokens, or a stop
    or EOS token as its first token) hands over its KV; one aborted or failed does not."""
    finished_normally = getattr(request.status, "name", None) in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
    return finished_normally and request.num_computed_tokens >= request.num_prompt_tokens
