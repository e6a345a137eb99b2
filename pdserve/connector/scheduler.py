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
from pdserve.connector.guard import guarded
from pdserve.connector.leg_truncation import truncate_to_one_token
from pdserve.connector.legs.decode_receive import DecodeReceive
from pdserve.connector.metadata import AwaitSpec, CancelSpec, HoldSpec, SendSpec, StepPlan
from pdserve.connector.prompt_digest import request_digest
from pdserve.connector.siblings import Family, Siblings
from pdserve.connector.whole_requests import SERVED_WHOLE, PromptTurns, addressed_to_self
from pdserve.control.address import PeerAddress
from pdserve.errors import ProtocolError
from pdserve.params import Held, TransferParams, build_transfer_params, parse_transfer_params
from pdserve.placement.chunk_costs import ChunkCosts
from pdserve.placement.chunk_size import MIN_CHUNK, OVER, WITHIN, chunk_tokens, threshold
from pdserve.placement.decision import Decision, Placement, Reason
from pdserve.placement.decode_load import DecodeLoad, uncomputed_prompt_tokens
from pdserve.placement.inbox import PUBLISH_EVERY_S
from pdserve.placement.messages import MAX_COUNTED_TRANSFERS, DecodeStatus, PrefillLoad
from pdserve.placement.policy import AdaptivePolicy, make_policy
from pdserve.placement.prefill_gate import PrefillGate, Verdict
from pdserve.placement.prefill_share import PrefillShare
from pdserve.placement.read_mode import ReadPlacement, next_step_seconds, peer_key
from pdserve.placement.serve_gate import STATUS_EVERY_S
from pdserve.placement.step_costs import StepCosts

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
        self._decode_load = DecodeLoad(budget, config.placement.stream_itl_s, chunk=chunk)
        self._decode = (DecodeReceive(config, block_size, self._policy, self._decode_load, lambda: self._meta,
                                      lambda: self._chunk_limit) if config.role is Role.CONSUMER else None)
        # P
        self._pending_sends: dict[str, _PendingSend] = {}  # WRITE: prompt not yet complete
        self._sending: dict[str, TransferParams] = {}  # WRITE: SendSpec emitted, request still running
        self._preempted: set[str] = set()  # WRITE: send cancelled by a preemption; no second send
        self._held: set[str] = set()  # returned delay_free=True; waiting for finished_sending
        self._siblings = Siblings()  # the legs of requests with n > 1, which share a transfer (siblings.py)
        self._meta = StepPlan()

    # ---- shared ----------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def _num_prompt_blocks(self, request) -> int:
        return math.ceil(request.num_prompt_tokens / self._block_size)

    def build_connector_meta(self, scheduler_output) -> StepPlan:
        """The step's plan; what the hooks planned goes out even if planning the rest failed."""
        try:
            self._plan_step(scheduler_output)
        except Exception:  # noqa: BLE001 - the process boundary with vLLM
            logger.exception("pdserve: internal error in build_connector_meta (sending the plan as far as it got)")
        meta, self._meta = self._meta, StepPlan()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def _plan_step(self, scheduler_output) -> None:
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

    @guarded()
    def update_connector_output(self, connector_output, news=None) -> None:
        self._end_step()
        for request_id in connector_output.finished_sending or ():
            self._held.discard(request_id)
        landed = 0
        for request_id in connector_output.finished_recving or ():
            if self._decode is not None and self._decode.landed(request_id):
                landed += 1
            self._decode_load.landed(request_id)
        if news is not None:
            if self._gate is not None:
                self._gate.on_decisions(self._shrink_dropped(news.decided))
            self._decode_load.on_loads(news.loads)
            if news.statuses and self._read is not None:
                self._read.on_statuses(news.statuses)
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
        one (placement/chunk_size.py), on an instance that decodes: D (its local prompts never stretch a step
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
        schedules the next one (placement/chunk_size.py)."""
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
        if self._follows(request) is not None:
            return
        if self._read is not None:
            self._place_read_leg(request)

    def _follows(self, request) -> Family | None:
        """The family whose leader `request` follows (siblings.py), joining it on first sight; a
        follower on P is cut to one token then (it moves nothing)."""
        rid = request.request_id
        if rid in self._siblings:
            return self._siblings.follower(rid)
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, self._config.role)
        except ProtocolError:
            return None  # the hooks name the problem
        if params is None or (self._config.role is Role.PRODUCER and addressed_to_self(params, self._config)):
            return None
        family = self._siblings.join(request, params.transfer_id)
        if family is not None and self._config.role is Role.PRODUCER:
            truncate_to_one_token(request)
        return family

    def _follower_turn(self, family: Family, request) -> tuple[int | None, bool]:
        """Whether a follower may run now. P, READ: after its leader ended, whose kv_transfer_params
        it answers with. D: once its leader's prompt is in D's cache, from which it takes it."""
        if self._config.role is Role.PRODUCER:
            ready = family.leader_done or self._config.mode is TransferMode.WRITE
        else:
            leader = family.leader
            rid = leader.request_id
            computed = not self._decode.receiving(rid) and leader.num_computed_tokens >= leader.num_prompt_tokens
            ready = family.leader_done or self._decode.received(rid) or computed
        return (0, False) if ready else (None, False)

    def has_pending_push_work(self) -> bool:
        return bool(self._held or self._meta.cancels or self._meta.holds)

    @guarded(lambda: (0, False))
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        joined = rid in self._siblings
        family = self._follows(request)
        if family is not None:
            # P: a follower cut just now was looked up in vLLM's prefix cache as the whole prompt
            return (None, False) if not joined and self._config.role is Role.PRODUCER else \
                self._follower_turn(family, request)
        if self._config.role is Role.PRODUCER:
            if self._read is not None:
                return (0, False) if self._read.admit(rid) else (None, False)
            return self._gate_prefill(request, num_computed_tokens)
        return self._decode.matched_tokens(request, num_computed_tokens)

    @guarded()
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self._follows(request) is not None:
            return  # moves nothing
        if self._config.role is Role.PRODUCER:
            if self._read is not None:
                self._read.admitted(request.request_id)
            if self._gate is not None and self._gate.dropped(request.request_id):
                return  # a one-token leg: nothing to send
            self._track_send(request)
        else:
            self._decode.allocated(request, blocks, num_external_tokens)

    @guarded(lambda: (False, None))
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        family = self._siblings.follower(rid)
        if family is not None:
            self._siblings.leave(rid)
            answer = family.answer if self._config.role is Role.PRODUCER else None
            return False, dict(answer) if answer is not None else None
        held, answer = False, None
        try:
            if self._config.role is Role.CONSUMER:
                self._decode.finished(request)
            elif self._config.mode is TransferMode.WRITE:
                held, answer = self._finish_write_send(request)
            else:
                held, answer = self._finish_read_send(request, block_ids)
        finally:  # its followers must not wait for a leader that failed
            self._siblings.leader_finished(rid, answer)
            self._siblings.leave(rid)
        return held, answer

    # ---- P ---------------------------------------------------------------------------------

    def _gate_prefill(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Adaptive placement: hold a prefill leg until D decided; one D prefills itself has been
        cut to a one-token prompt (leg_truncation.py) and runs as that."""
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
        timed_out = self._gate.num_timed_out
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
        if verdict is Verdict.ASK:
            self._meta.awaits.append(AwaitSpec(rid, params.transfer_id, params.peer))
            self._legs[rid] = request
        elif self._gate.num_timed_out > timed_out:  # heard nothing from D in wait_s (on P's /metrics)
            self._meta.placements.append(Decision(Placement.REMOTE, Reason.NO_WORD).label)
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
        """READ: decide where this leg's prompt is prefilled (placement/read_mode.py). One left to D is cut
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
            del self._pending_sends[rid]
            try:
                block_ids = self._kv_cache_manager.get_blocks(rid).get_block_ids()[0]
                send = SendSpec(rid, pending.params.transfer_id, pending.params.peer,
                                tuple(block_ids[: self._num_prompt_blocks(request)]), request_digest(request))
            except Exception as exc:  # noqa: BLE001 - this request's fault or not, the others' sends go on
                log = logger.error if isinstance(exc, ProtocolError) else logger.exception
                log("pdserve: request %s: cannot send its KV, decode recomputes it: %s", rid, exc)
                self._meta.cancels.append(CancelSpec(pending.params.transfer_id, pending.params.peer,
                                                     f"prefill cannot send this request's KV: {exc}"))
                continue
            self._meta.sends.append(send)
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
        own = PeerAddress(self._config.host_ip, self._config.handshake_port, self._config.notify_port)
        if decision is not None and decision.placement is Placement.LOCAL:
            if params is None or not _prefill_complete(request):
                return False, None
            # a one-token leg: nothing is held; D prefills the prompt itself
            return False, build_transfer_params(params.transfer_id, self._config.engine_id, own, None, decision)
        num_blocks = self._num_prompt_blocks(request)
        if params is None or len(block_ids) < num_blocks or not _prefill_complete(request):
            return False, None
        held = Held(tuple(block_ids[:num_blocks]), time.time() + self._config.defer_timeout, request_digest(request))
        self._held.add(rid)
        self._meta.holds.append(HoldSpec(rid, params.transfer_id, held.block_ids, held.expires_at, held.prompt_hash))
        return True, build_transfer_params(params.transfer_id, self._config.engine_id, own, held, decision)

    def _decode_status(self) -> DecodeStatus | None:
        """READ: our side of P's placement decisions, every PUBLISH_EVERY_S (placement/status_view.py).
        WRITE: how loaded our streams are, for a P that serves whole requests while they are
        (serve_gate.py), every STATUS_EVERY_S."""
        now = time.monotonic()
        if now < self._next_status:
            return None
        self._next_status = now + self._status_every_s
        return self._decode.status()


def _prefill_complete(request) -> bool:
    """A prefill leg that computed its whole prompt and ended normally (its max_tokens, or a stop
    or EOS token as its first token) hands over its KV; one aborted or failed does not."""
    finished_normally = getattr(request.status, "name", None) in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
    return finished_normally and request.num_computed_tokens >= request.num_prompt_tokens
