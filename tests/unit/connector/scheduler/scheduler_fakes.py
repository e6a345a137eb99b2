"""Just enough of vLLM's Request, block and scheduler-output objects for PDScheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.config import TransferMode
from pdserve.connector.scheduler import PDScheduler, scheduler_for
from pdserve.connector.scheduler.prompt_digest import prompt_digest
from tests.unit.connector.harness import make_config
from tests.unit.connector.request_status import RequestStatus

BLOCK_SIZE = 16
HEX = "0123456789abcdef0123456789abcdef"
ROUTER_ID = (
    "cmpl-___prefill_addr_host:127.0.0.1,handshake:6301,notify:6401"
    f"___decode_addr_host:127.0.0.1,handshake:6302,notify:6402_{HEX}-0-abcdef12"
)


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict | None
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.RUNNING
    prompt_token_ids: list[int] | None = None  # default: 0, 1, ... num_prompt_tokens - 1
    num_output_tokens: int = 0

    def __post_init__(self):
        if self.prompt_token_ids is None:
            self.prompt_token_ids = list(range(self.num_prompt_tokens))

    @property
    def prompt_hash(self) -> str:
        return prompt_digest(self.prompt_token_ids)


@dataclass
class VllmLikeRequest(FakeRequest):
    """The fields of vLLM's Request that leg_truncation.py changes."""

    prompt_embeds: object = None
    prompt_is_token_ids: object = None

    def __post_init__(self):
        super().__post_init__()
        self._all_token_ids = list(self.prompt_token_ids)
        self.block_hashes = [f"h{i}" for i in range(self.num_prompt_tokens // BLOCK_SIZE)]


class FakeBlocks:
    def __init__(self, ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (list(self.ids),)


class FakeKvCacheManager:
    def __init__(self):
        self.blocks: dict[str, list[int]] = {}

    def get_blocks(self, request_id: str) -> FakeBlocks:
        return FakeBlocks(self.blocks[request_id])


@dataclass(frozen=True)
class NewRequestData:
    req_id: str


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)  # scheduled for the first time

    def __post_init__(self):
        self.total_num_scheduled_tokens = sum(self.num_scheduled_tokens.values())


@dataclass
class ConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None


@dataclass
class Scheduler:
    """A PDScheduler with its fake kv cache manager."""

    scheduler: PDScheduler
    kv: FakeKvCacheManager = field(default_factory=FakeKvCacheManager)

    def __post_init__(self):
        self.scheduler.bind_kv_cache_manager(self.kv)


def make_scheduler(kv_role: str, mode: TransferMode, **timeouts) -> Scheduler:
    return Scheduler(scheduler_for(make_config(kv_role, mode, **timeouts), BLOCK_SIZE))


def producer_params(**extra) -> dict:
    """What vllm-router 0.1.17 sends the prefill leg."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
            "transfer_id": "tx-1", "remote_dp_size": 1, "remote_tp_size": 1, **extra}


def consumer_params(**extra) -> dict:
    """What vllm-router 0.1.17 sends the decode leg (WRITE mode)."""
    return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": None,
            "remote_block_ids": None, "transfer_id": "tx-1", "remote_dp_size": 1, "remote_tp_size": 1, **extra}


def labels(decisions) -> list[str]:
    """The labels ("local:local_faster") of a plan's placement decisions."""
    return [decision.label for decision in decisions]
