"""Two real PDWorkers (control-plane servers on real sockets) whose KV cache is "on a device":
CPU tensors driven through CpuStandIn, the CPU stand-in for the GPU backend, so the worker takes
its device path (device_transport.py): gpu-ipc, or host staging (kv_buffer_device cpu) with P
staging held blocks and D landing written ones. Each test moves blocks and compares bytes."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest
import torch

from pdserve.config import TransferMode, parse_connector_config
from pdserve.connector.metadata import StageSpec, StepPlan
from pdserve.connector.worker.worker import PDWorker
from pdserve.control.address import PeerAddress
from pdserve.faults.rig import RIG_NAME, register
from pdserve.rigs import unregister_rig
from pdserve.transfer.layout import KvLayout, LayerPlacement
from pdserve.transfer.specs import HoldSpec, RecvSpec, SendSpec
from pdserve.transport.base import Direction, TransferHandle, TransferStatus
from pdserve.transport.cpu_backend import CpuStandIn
from pdserve.transport.nixl_auto import RoutedTransport
from pdserve.transport.staged import StagedTransport
from tests.unit.connector.harness import secret_file

FINGERPRINT = {"model": "device-test"}
NUM_LAYERS, NUM_BLOCKS, HEADS, TOKENS, CONTENT = 2, 6, 2, 4, 8
P_BLOCKS, D_BLOCKS = (4, 1, 2), (0, 3, 5)
PROMPT_HASH = "ab" * 16
WAIT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_caches(order: tuple[int, ...] = (0, 1, 2, 3)) -> dict[str, torch.Tensor]:
    """vLLM's per-layer views [blocks, heads, tokens, content], allocated in `order` (outermost
    first) and viewed back, as vLLM >= 0.32's backends do."""
    shape = (NUM_BLOCKS, HEADS, TOKENS, CONTENT)
    layers = {}
    for i in range(NUM_LAYERS):
        allocated = torch.zeros([shape[d] for d in order], dtype=torch.bfloat16)
        layers[f"layer.{i}"] = allocated.permute([order.index(d) for d in range(4)])
    return layers


def fill(caches: dict[str, torch.Tensor], seed: int) -> None:
    for i, tensor in enumerate(caches.values()):
        values = torch.arange(tensor.numel(), dtype=torch.float32).reshape(tensor.shape) + 1000 * i + seed
        tensor.copy_(values.to(tensor.dtype))


def blocks_of(caches: dict[str, torch.Tensor], block_ids) -> list[torch.Tensor]:
    return [tensor[list(block_ids)].clone() for tensor in caches.values()]


@dataclasses.dataclass
class Side:
    worker: PDWorker
    address: PeerAddress
    caches: dict[str, torch.Tensor]
    finished: list = dataclasses.field(default_factory=list)
    ended: set[str] = dataclasses.field(default_factory=set)  # requests vLLM finished (P: their blocks may go)

    def step(self, plan: StepPlan | None = None, layers: bool = False) -> None:
        """One engine step: bind `plan`; with `layers`, report every layer computed."""
        self.worker.bind(plan or StepPlan())
        if layers:
            for name in self.caches:
                self.worker.save_kv_layer(name)
            self.worker.wait_for_save()
        self.finished.append(self.worker.take_finished(self.ended))

    def reported(self, what: str) -> set[str]:
        return {rid for f in self.finished for rid in getattr(f, what)}


@pytest.fixture
def start(tmp_path):
    secret = secret_file(tmp_path, "device-test-secret\n")
    started: list[PDWorker] = []

    def start_side(kv_role: str, mode: TransferMode, order=(0, 1, 2, 3), device: bool = True, **extra) -> Side:
        address = PeerAddress("127.0.0.1", free_port(), free_port())
        config = parse_connector_config(kv_role, {
            "handshake_port": address.handshake_port, "notify_port": address.notify_port,
            "read_mode": mode is TransferMode.READ, "transfer_timeout": 5.0, "defer_timeout": 5.0, **extra,
        }, env={"PDSERVE_SECRET_FILE": str(secret)}, kv_device="cuda" if device else "cpu")
        backend = (lambda tensor, token: CpuStandIn(token)) if device else (lambda tensor, token: None)
        worker = PDWorker(config, FINGERPRINT, device_backend=backend)
        started.append(worker)
        caches = kv_caches(order)
        with torch.inference_mode():
            worker.register_kv_caches(caches)
        return Side(worker, address, caches)

    yield start_side
    for worker in started:
        worker.shutdown()


def run_until(condition, *sides: Side) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, [s.finished[-3:] for s in sides]
        for side in sides:
            side.step()
        time.sleep(0.005)


def write(p: Side, d: Side, rid: str = "req-1") -> None:
    """D announces D_BLOCKS for P's P_BLOCKS; P computes its layers and writes them."""
    p.ended.add(rid)
    d.step(StepPlan(recvs=[RecvSpec(rid, f"tx-{rid}", TransferMode.WRITE, p.address, D_BLOCKS, 0, None, None,
                                    PROMPT_HASH)]))
    p.step(StepPlan(sends=[SendSpec(rid, f"tx-{rid}", d.address, P_BLOCKS, PROMPT_HASH)]), layers=True)
    run_until(lambda: rid in d.reported("recving") | d.reported("failed_recving") and rid in p.reported("sending"),
              p, d)


def read(p: Side, d: Side, stage: bool = True, rid: str = "req-1") -> None:
    """P computes the prompt (staging its blocks), holds them; D reads them into D_BLOCKS."""
    tid = f"tx-{rid}"
    p.ended.add(rid)
    p.step(StepPlan(stages=[StageSpec(rid, tid, P_BLOCKS)] if stage else []), layers=True)
    expires = time.time() + 5.0
    p.step(StepPlan(holds=[HoldSpec(rid, tid, P_BLOCKS, expires, PROMPT_HASH)]))
    d.step(StepPlan(recvs=[RecvSpec(rid, tid, TransferMode.READ, p.address, D_BLOCKS, 0, P_BLOCKS, expires,
                                    PROMPT_HASH)]))
    run_until(lambda: rid in d.reported("recving") | d.reported("failed_recving") and rid in p.reported("sending"),
              p, d)


def test_gpu_ipc_writes_device_kv_between_two_workers(start):
    d = start("kv_consumer", TransferMode.WRITE, transport="gpu-ipc", kv_buffer_device="cuda")
    p = start("kv_producer", TransferMode.WRITE, transport="gpu-ipc", kv_buffer_device="cuda")
    assert type(p.worker._transport) is RoutedTransport and p.worker._transport.policy == "gpu-ipc"
    fill(p.caches, seed=7)
    write(p, d)
    assert "req-1" in d.reported("recving") and not d.reported("failed_recving")
    for theirs, ours in zip(blocks_of(p.caches, P_BLOCKS), blocks_of(d.caches, D_BLOCKS)):
        assert torch.equal(theirs, ours)
    assert not blocks_of(d.caches, (1,))[0].any(), "a block outside the transfer was written"


def test_block_runs_travel_on_the_handshake_and_move_byte_exact(start):
    """Heads outermost in memory ([heads, blocks, ...]): a block is one run per head, so each
    layer's placement is BlockRuns on both sides and on the wire."""
    order = (1, 0, 2, 3)
    d = start("kv_consumer", TransferMode.WRITE, order=order, transport="gpu-ipc", kv_buffer_device="cuda")
    p = start("kv_producer", TransferMode.WRITE, order=order, transport="gpu-ipc", kv_buffer_device="cuda")
    layer = p.worker._kv.layout.layers[0]
    assert not isinstance(layer, LayerPlacement) and len(layer.run_offsets) == HEADS
    parsed = KvLayout.from_wire(p.worker._kv.layout.to_wire())
    assert parsed.layers == p.worker._kv.layout.layers
    fill(p.caches, seed=3)
    write(p, d)
    assert "req-1" in d.reported("recving")
    for theirs, ours in zip(blocks_of(p.caches, P_BLOCKS), blocks_of(d.caches, D_BLOCKS)):
        assert torch.equal(theirs, ours)


def test_staged_write_lands_in_the_device_kv(start):
    d = start("kv_consumer", TransferMode.WRITE, transport="shm", kv_buffer_device="cpu")
    p = start("kv_producer", TransferMode.WRITE, transport="shm", kv_buffer_device="cpu")
    assert isinstance(d.worker._transport, StagedTransport) and d.worker._engine.staging is d.worker._transport
    fill(p.caches, seed=11)
    write(p, d)
    assert "req-1" in d.reported("recving") and not d.reported("failed_recving")
    # P wrote D's host mirror; only D's land puts the bytes into its device KV
    for theirs, ours in zip(blocks_of(p.caches, P_BLOCKS), blocks_of(d.caches, D_BLOCKS)):
        assert torch.equal(theirs, ours)


def test_staged_read_reads_what_p_staged_when_the_prompt_was_computed(start):
    p = start("kv_producer", TransferMode.READ, transport="auto", kv_buffer_device="cpu")
    d = start("kv_consumer", TransferMode.READ, transport="auto", kv_buffer_device="cpu")
    fill(p.caches, seed=5)
    staged = blocks_of(p.caches, P_BLOCKS)
    p.step(StepPlan(stages=[StageSpec("req-1", "tx-req-1", P_BLOCKS)]), layers=True)
    fill(p.caches, seed=99)  # the device changes after the stage: D must see what was staged
    expires = time.time() + 5.0
    p.step(StepPlan(holds=[HoldSpec("req-1", "tx-req-1", P_BLOCKS, expires, PROMPT_HASH)]))
    d.step(StepPlan(recvs=[RecvSpec("req-1", "tx-req-1", TransferMode.READ, p.address, D_BLOCKS, 0, P_BLOCKS,
                                    expires, PROMPT_HASH)]))
    p.ended.add("req-1")
    run_until(lambda: "req-1" in d.reported("recving") | d.reported("failed_recving"), p, d)
    assert "req-1" in d.reported("recving") and not d.reported("failed_recving")
    for before, ours in zip(staged, blocks_of(d.caches, D_BLOCKS)):
        assert torch.equal(before, ours)
    run_until(lambda: "req-1" in p.reported("sending"), p, d)
    assert not p.worker._engine.staged, "a hold that ended is still remembered as staged"


def test_a_hold_whose_staging_failed_refuses_the_read(start, monkeypatch):
    p = start("kv_producer", TransferMode.READ, transport="auto", kv_buffer_device="cpu")
    d = start("kv_consumer", TransferMode.READ, transport="auto", kv_buffer_device="cpu")

    def failing_stage(batch, *, not_after=None):
        handle = real_stage(batch, not_after=time.monotonic() - 1.0)  # past its deadline: it fails
        handle.wait(5.0)
        return handle

    real_stage = p.worker._transport.stage
    monkeypatch.setattr(p.worker._transport, "stage", failing_stage)
    read(p, d)
    assert "req-1" in d.reported("failed_recving"), "D used KV that never reached P's host mirror"
    assert "tx-req-1" not in p.worker._engine.staged


def test_a_hold_never_staged_is_refused_however_many_stagings_failed_before(start, monkeypatch):
    """Failures are not what is remembered: after 4,097 of them a hold never staged is still refused."""
    p = start("kv_producer", TransferMode.READ, transport="auto", kv_buffer_device="cpu")
    d = start("kv_consumer", TransferMode.READ, transport="auto", kv_buffer_device="cpu")

    def failed_stage(batch, *, not_after=None):
        handle = TransferHandle("", Direction.WRITE, 0)
        handle.finish(TransferStatus.FAILED, "the device copy failed")
        return handle

    monkeypatch.setattr(p.worker._transport, "stage", failed_stage)
    for i in range(4097):
        p.worker._stage([StageSpec(f"other-{i}", f"tx-other-{i}", P_BLOCKS)])
    read(p, d, stage=False)
    assert "req-1" in d.reported("failed_recving"), "D read a hold that was never staged"
    assert not p.worker._engine.staged


def test_an_exception_inside_staging_fails_the_hold(start, monkeypatch):
    p = start("kv_producer", TransferMode.READ, transport="auto", kv_buffer_device="cpu")
    d = start("kv_consumer", TransferMode.READ, transport="auto", kv_buffer_device="cpu")

    def broken_stage(batch, *, not_after=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(p.worker._transport, "stage", broken_stage)
    read(p, d)
    assert "req-1" in d.reported("failed_recving"), "a staging that raised passed for staged"
    assert "tx-req-1" not in p.worker._engine.staged


def test_host_kv_never_calls_staging(start, monkeypatch):
    calls = []
    monkeypatch.setattr(StagedTransport, "stage", lambda *a, **k: calls.append("stage"))
    monkeypatch.setattr(StagedTransport, "land", lambda *a, **k: calls.append("land"))
    p = start("kv_producer", TransferMode.READ, device=False, kv_buffer_device="cpu")
    d = start("kv_consumer", TransferMode.READ, device=False, kv_buffer_device="cpu")
    assert p.worker._engine.staging is None and not p.worker._config.host_staging
    fill(p.caches, seed=1)
    read(p, d, stage=True)  # a plan naming blocks to stage changes nothing for host KV
    assert "req-1" in d.reported("recving")
    for theirs, ours in zip(blocks_of(p.caches, P_BLOCKS), blocks_of(d.caches, D_BLOCKS)):
        assert torch.equal(theirs, ours)
    assert calls == []


def test_host_kv_keeps_its_fingerprint_and_wire_form(start):
    p = start("kv_producer", TransferMode.WRITE, device=False)
    fingerprint = p.worker._kv.fingerprint
    assert "cpu_isa" in fingerprint and "kv_block_format" not in fingerprint and "kv_device" not in fingerprint
    assert all(len(layer) == 4 for layer in p.worker._kv.layout.to_wire())


def test_peers_with_other_block_formats_are_refused_naming_the_format(start):
    p = start("kv_producer", TransferMode.WRITE, order=(0, 2, 1, 3), transport="gpu-ipc", kv_buffer_device="cuda")
    d = start("kv_consumer", TransferMode.WRITE, transport="gpu-ipc", kv_buffer_device="cuda")
    assert p.worker._kv.fingerprint["kv_block_format"] != d.worker._kv.fingerprint["kv_block_format"]
    result = d.worker._handshake.meet(p.address)
    assert result.error and "kv_block_format" in result.error, result.error
    assert "block:token4:head:content8:2B" in result.error and "block:head:token4:content8:2B" in result.error


def test_device_kv_and_host_kv_peers_are_refused(start):
    p = start("kv_producer", TransferMode.WRITE, device=False)
    d = start("kv_consumer", TransferMode.WRITE, transport="auto", kv_buffer_device="cuda")
    result = d.worker._handshake.meet(p.address)
    assert result.error and "kv_block_format" in result.error and "cpu_isa" in result.error


@pytest.fixture
def corrupt_plan(tmp_path):
    """A fault plan corrupting every copy as it lands, read by workers started with it (the fault rig)."""

    plan = tmp_path / "faults.json"
    plan.write_text('{"rules": [{"action": "corrupt_copy"}]}')
    register()
    yield str(plan)
    unregister_rig(RIG_NAME)


def _digest_stats(side: Side) -> tuple[list[str], float]:
    stats = side.worker.take_stats() or {}
    return stats.get("digest_mismatches", []), stats.get("digest_seconds", 0.0)


@pytest.mark.parametrize("device", [False, True], ids=["host-kv", "host-staging"])
@pytest.mark.parametrize("mode", [TransferMode.WRITE, TransferMode.READ], ids=lambda m: m.value)
def test_workers_verify_the_digest_over_real_sockets_and_catch_a_corrupting_plan(start, corrupt_plan, mode, device):
    """kv_verify's default, the codec carrying kv_digest, the fault rig's corrupt_copy: a healthy
    transfer passes, then every corrupted one fails on D and is counted."""
    extra = {"transport": "shm", "kv_buffer_device": "cpu"} if device else {"transport": "shm"}
    d = start("kv_consumer", mode, device=device, **extra)
    p = start("kv_producer", mode, device=device, test_fault_plan=corrupt_plan + ".off", **extra)
    move = write if mode is TransferMode.WRITE else read
    fill(p.caches, seed=5)
    move(p, d, rid="req-1")
    assert "req-1" in d.reported("recving") and not d.reported("failed_recving")
    assert _digest_stats(d)[1] > 0 and _digest_stats(p)[0] == []
    copier = p if mode is TransferMode.WRITE else d
    copier.worker.shutdown()  # the copier restarts with the plan in force
    copier = start("kv_producer" if copier is p else "kv_consumer", mode, device=device, test_fault_plan=corrupt_plan,
                   **extra)
    if mode is TransferMode.WRITE:
        p = copier
        fill(p.caches, seed=5)
    else:
        d = copier
    move(p, d, rid="req-2")
    assert "req-2" in d.reported("failed_recving")
    assert _digest_stats(d)[0] == [f"shm:{mode.value.lower()}"]
