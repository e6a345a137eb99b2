"""PDConnector: vLLM's KV connector facade; the scheduler and worker halves do the work.

Load it out of tree with
    --kv-transfer-config '{"kv_connector": "PDConnector",
                           "kv_connector_module_path": "pdserve.connector",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_connector_extra_config": {...}}'
or by its bare name once pdserve is installed (vLLM plugin entry point `pdserve`).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pdserve.config import parse_connector_config
from pdserve.connector.kv_groups import KvGroups
from pdserve.connector.metadata import StepPlan
from pdserve.connector.registration import RouterRegistration
from pdserve.connector.scheduler import PDScheduler, scheduler_for
from pdserve.connector.stats import PDConnectorStats, PDPromMetrics
from pdserve.connector.support import check_supported
from pdserve.connector.worker.worker import PDWorker
from pdserve.placement import WorkerNews
from pdserve.transfer.ranks import Ranks
from pdserve.vllm_logging import route_logs_to_vllm


def _mamba_chunk(vllm_config) -> int | None:
    model_config = vllm_config.model_config
    return model_config.get_mamba_chunk_size() if getattr(model_config, "is_hybrid", False) else None


def _model_fingerprint(vllm_config, groups: KvGroups) -> dict:
    model_config = vllm_config.model_config
    hf_config = model_config.hf_config.to_json_string(use_diff=False)
    # mamba/linear-attention state is split between ranks in a layout PDConnector does not slice
    # (Gated DeltaNet's conv state interleaves q, k and v): P and D need one TP size
    state = {"state_tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size} if groups.has_state else {}
    return state | {
        "tp": _tensor_parallel(vllm_config).to_wire(),  # not compared: peers pair their ranks by it (ranks.py)
        "model_config": hashlib.sha256(hf_config.encode()).hexdigest()[:16],
        "dtype": str(model_config.dtype),
        "block_size": vllm_config.cache_config.block_size,
        "vllm": vllm.__version__,
    }


def _tensor_parallel(vllm_config) -> Ranks:
    """This worker's rank, its instance's TP size and the model's KV head count (MLA: one latent per
    token, which every rank holds whole, counted as one head)."""
    size = vllm_config.parallel_config.tensor_parallel_size
    rank = 0
    if size > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # lazy: TP > 1 only

        rank = get_tensor_model_parallel_rank()
    model = vllm_config.model_config
    return Ranks(rank, size, 1 if getattr(model, "use_mla", False) else model.get_total_num_kv_heads())


def _apply_load_failure_policy(transfer_config, policy: str) -> None:
    """pdserve's `load_failure_policy` (default "recompute") decides what vLLM does with a request
    whose KV did not arrive: prefill it on D (correct tokens, counted in
    pdserve:kv_recomputed_total) or fail it. vLLM's scheduler reads its own field right after
    creating this connector."""
    if transfer_config.kv_load_failure_policy != policy:
        logging.getLogger("pdserve.connector").info(
            "pdserve: kv_load_failure_policy %s (pdserve's load_failure_policy; vLLM's field said %s)",
            policy, transfer_config.kv_load_failure_policy)
    transfer_config.kv_load_failure_policy = policy


def _chunk_setter(scheduler_config):
    """How the scheduler half sets D's per-prompt prefill limit for the next step: vLLM's scheduler
    reads `long_prefill_token_threshold` from its config at the start of every step (and ignores it
    while only one request is running or waiting, when nobody can be starved)."""
    def set_chunk(tokens: int) -> None:
        scheduler_config.long_prefill_token_threshold = tokens
    return set_chunk


class PDWorkerNews(KVConnectorWorkerMetadata):
    """vLLM's worker -> scheduler metadata: carries the worker half's WorkerNews."""

    def __init__(self, news: WorkerNews):
        self.news = news

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        if isinstance(other, PDWorkerNews):
            self.news.merge(other.news)
        return self


class PDConnectorMetadata(KVConnectorMetadata):
    """vLLM's per-step connector metadata: carries the scheduler half's StepPlan to the worker."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


class PDConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.P2P  # vLLM's prompt_tokens_cached_by_source{source="p2p"}

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        route_logs_to_vllm()
        transfer_config = vllm_config.kv_transfer_config
        self._config = parse_connector_config(transfer_config.kv_role, transfer_config.kv_connector_extra_config,
                                              vllm_kv_buffer_device=transfer_config.kv_buffer_device,
                                              kv_device=vllm_config.device_config.device_type)
        check_supported(vllm_config, self._config.placement.adaptive)
        groups = KvGroups.from_kv_cache_config(kv_cache_config, vllm_config.cache_config.block_size,
                                               _mamba_chunk(vllm_config))
        self._scheduler: PDScheduler | None = None
        self._worker: PDWorker | None = None
        self._registration: RouterRegistration | None = None
        if role == KVConnectorRole.SCHEDULER:
            _apply_load_failure_policy(transfer_config, self._config.load_failure_policy)
            scheduler_config = vllm_config.scheduler_config
            self._scheduler = scheduler_for(self._config, vllm_config.cache_config.block_size,
                                          scheduler_config.max_num_batched_tokens,
                                          getattr(scheduler_config, "long_prefill_token_threshold", 0) or None,
                                          set_chunk=_chunk_setter(scheduler_config), groups=groups)
            if self._config.proxy_ip:
                self._registration = RouterRegistration(self._config)
        else:
            self._worker = PDWorker(self._config, _model_fingerprint(vllm_config, groups), groups)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """No layout required. vLLM asks this while it sets up attention, before it groups the KV
        cache: the first place a configuration PDConnector cannot serve is refused with its reason
        (a hybrid model otherwise fails later in vLLM with a message that does not say why)."""
        check_supported(vllm_config)
        return None

    # ---- scheduler side --------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request) -> None:
        self._scheduler.on_new_request(request)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return PDConnectorMetadata(self._scheduler.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        news = meta.news if isinstance(meta, PDWorkerNews) else None
        self._scheduler.update_connector_output(connector_output, news)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager: one block list per KV cache group (kv_groups.py)."""
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, PDConnectorMetadata)
        self._worker.bind(connector_metadata.plan)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass  # loads are asynchronous: requests wait in WAITING_FOR_REMOTE_KVS until they land

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # ditto: no forward pass ever reads KV that is still in flight

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished = self._worker.take_finished(finished_req_ids)
        return KVConnectorTransferResults(finished.sending, finished.recving, finished.failed_recving)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        news = self._worker.take_news() if self._worker is not None else None
        return PDWorkerNews(news) if news else None

    def get_kv_connector_stats(self):
        data = self._worker.take_stats() if self._worker is not None else None
        return PDConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return PDConnectorStats(data=data) if data is not None else PDConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return PDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._registration is not None:
            self._registration.stop()
        if self._worker is not None:
            self._worker.shutdown()
