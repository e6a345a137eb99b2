"""Device check of pdserve's GPU transport (gpu-ipc): two processes on one GPU, KV-shaped tensors.

Each instance process holds a KV cache in vLLM's FlashAttention layout, one tensor per layer of
[2, num_blocks, block_size, num_kv_heads, head_size], registered with GpuIpcTransport; the two
attach each other's IPC handles. The check then runs, with a prompt of --tokens tokens:
- WRITE layer by layer: P "computes" each layer (a busy kernel, then the layer's KV written on its
  compute stream) and submits that layer at once; the copy must wait for the layer's event, or D
  receives the stale bytes P held before. D verifies every block of every layer;
- READ: D pulls all layers of P's blocks in one batch and verifies them;
- both with contiguous and with scattered block ids (a copy per run, or one gather and scatter);
- bandwidth: the same transfers back to back, beside one plain device-to-device copy of the
  same bytes in one process;
- a peer killed mid-transfer, both ways: the survivor's transfer must fail before its deadline,
  and the survivor must hold nothing of the dead peer afterwards (no mapping, no copy).
It prints one summary line and writes it, with every number, to OUT_DIR (summary.txt,
gpu_check.json); the exit status is 0 only when every check passed. PyTorch only: no vLLM, no NIXL.
With --device cpu, CPU tensors stand in for device memory (shm segments for IPC, no streams), so
the logic runs anywhere; its numbers say nothing about a GPU.

Usage: python scripts/gpu_check.py OUT_DIR [--device cuda|cpu] [--tokens 2000] [--layers N] ...
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # pdserve from this checkout

SENTINEL = 1000.0  # what a cache holds before a test writes it: outside the pattern's -125..125
ROLES = ("kv", "block", "token", "head", "content")
DEFAULTS = {  # per device: layers, kv heads, head size, blocks per layer, timed repeats
    "cuda": dict(layers=32, heads=8, head_size=128, num_blocks=512, repeats=10),
    "cpu": dict(layers=4, heads=2, head_size=64, num_blocks=256, repeats=3),
}


# ---- instance process ---------------------------------------------------------------------------

class Instance:
    """One P or D: its KV cache, transport and the commands the orchestrator sends."""

    def __init__(self, conn, config: dict):
        import torch

        from pdserve.transfer.device_layout import KvTensorLayout
        from pdserve.transport.device import MemoryDevice
        from pdserve.transport.device_transport import backend_for
        from pdserve.transport.gpu_ipc import GpuIpcTransport

        self.torch, self.conn, self.config = torch, conn, config
        self.cuda = config["device"] == "cuda"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(0)
            self.compute = torch.cuda.Stream()
            torch.cuda.set_stream(self.compute)  # the model's stream: ready events are recorded here
        shape = (2, config["num_blocks"], config["block_size"], config["heads"], config["head_size"])
        self.kv = [torch.full(shape, SENTINEL, dtype=torch.bfloat16, device=self.device) for _ in range(config["layers"])]
        self.transport = GpuIpcTransport(backend_for(MemoryDevice.of_tensor(self.kv[0]), f"chk{os.getpid()}"))
        for layer, tensor in enumerate(self.kv):
            self.transport.register_tensor(layer, tensor)
        self.runs = [KvTensorLayout.from_tensor(t, ROLES, region_id=i).blocks() for i, t in enumerate(self.kv)]
        self.peer_runs: dict[str, list] = {}

    def serve(self) -> None:
        while True:
            command, kwargs = self.conn.recv()
            if command == "exit":
                self.transport.close()
                self.conn.send(("result", {}))
                return
            try:
                result = getattr(self, command)(**kwargs)
            except Exception as exc:  # noqa: BLE001 - reported to the orchestrator as a failed check
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            self.conn.send(("result", result))

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def hello(self) -> dict:
        from dataclasses import asdict
        return {"pid": os.getpid(), "descriptors": [d.to_wire() for d in self.transport.local_descriptors()],
                "runs": [asdict(r) for r in self.runs],
                "gpu": self.torch.cuda.get_device_name(0) if self.cuda else None}

    def attach(self, peer: str, descriptors: list, runs: list) -> dict:
        from pdserve.transfer.device_layout import BlockRuns
        from pdserve.transport import RegionDescriptor
        self.transport.attach_peer(peer, [RegionDescriptor.from_wire(d) for d in descriptors])
        self.peer_runs[peer] = [BlockRuns(**{**r, "run_offsets": tuple(r["run_offsets"])}) for r in runs]
        return {"ok": True}

    def pattern(self, layer: int, blocks: list[int], seed: int):
        """The KV the test writes into `blocks` of `layer`, as [2, n, block_size, heads, head_size]."""
        torch, c = self.torch, self.config
        per_half = c["block_size"] * c["heads"] * c["head_size"]
        ids = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        values = ((ids * 104729 + layer * 7919 + seed * 131)[:, None, None]
                  + torch.arange(2, device=self.device)[None, :, None] * 65537
                  + torch.arange(per_half, device=self.device)[None, None, :]) % 251 - 125
        shape = (len(blocks), 2, c["block_size"], c["heads"], c["head_size"])
        return values.to(torch.bfloat16).view(shape).transpose(0, 1)

    def fill(self, blocks: list[int], seed: int) -> dict:
        for layer, tensor in enumerate(self.kv):
            tensor.fill_(SENTINEL)
            if blocks:
                tensor[:, blocks] = self.pattern(layer, blocks, seed)
        self.sync()
        return {"ok": True}

    def verify(self, pairs: list, seed: int) -> dict:
        """Compare our block a with the pattern of the peer's block b, for each (a, b), bit for bit."""
        mine, theirs = [a for a, _ in pairs], [b for _, b in pairs]
        bad = []
        for layer, tensor in enumerate(self.kv):
            got = tensor[:, mine].view(self.torch.int16)
            expected = self.pattern(layer, theirs, seed).contiguous().view(self.torch.int16)
            wrong = (got != expected).flatten(2).any(dim=2).any(dim=0).nonzero().flatten().tolist()
            bad += [(layer, mine[i]) for i in wrong]
        return {"ok": not bad, "blocks_checked": len(pairs) * len(self.kv), "blocks_wrong": len(bad), "first": bad[:5]}

    def _busy(self, busy_ms: float) -> None:
        if busy_ms and self.cuda:
            self.torch.cuda._sleep(int(busy_ms * 1e6))  # ~1e6 cycles a ms: the layer's compute

    def write(self, peer: str, pairs: list, seed: int, deadline_s: float, pace_s: float = 0.0, busy_ms: float = 0.0,
              progress: bool = False, compute: bool = True) -> dict:
        """WRITE layer by layer: each layer's KV computed on the compute stream (after SENTINEL
        everywhere), then submitted. Without `compute`, the blocks are sent as they are."""
        from pdserve.transport import Direction
        if compute:
            self.fill([], 0)  # every block holds SENTINEL until its layer is "computed"
        ours = [a for a, _ in pairs]
        batches = [[mine.copy_ops(theirs, pairs)] for mine, theirs in zip(self.runs, self.peer_runs[peer])]
        not_after = time.monotonic() + deadline_s
        handles = []
        for layer, tensor in enumerate(self.kv):
            if pace_s:
                time.sleep(pace_s)
            if compute:
                self._busy(busy_ms)
                tensor[:, ours] = self.pattern(layer, ours, seed)
            handles.append(self.transport.submit(peer, Direction.WRITE, batches[layer], not_after=not_after))
            if progress:
                self.conn.send(("progress", layer))
        return self._settle(handles, not_after)

    def read(self, peer: str, pairs: list, deadline_s: float, loop_s: float = 0.0) -> dict:
        """READ every layer of the peer's blocks in one batch; with `loop_s`, again and again until
        one fails or the time is up (the peer is killed meanwhile)."""
        from pdserve.transport import Direction, TransferStatus
        batch = [self.runs[i].copy_ops(self.peer_runs[peer][i], pairs) for i in range(len(self.kv))]
        done, end = 0, time.monotonic() + loop_s
        while True:
            not_after = time.monotonic() + deadline_s
            result = self._settle([self.transport.submit(peer, Direction.READ, batch, not_after=not_after)], not_after)
            if result["status"] != TransferStatus.DONE.name or time.monotonic() > end:
                return {**result, "transfers_done": done}
            done += 1
            if done == 1 and loop_s:
                self.conn.send(("progress", done))

    def _settle(self, handles, not_after: float) -> dict:
        from pdserve.transport import TransferStatus
        for handle in handles:
            handle.wait(max(0.0, not_after - time.monotonic()) + 10.0)
        failed = [h for h in handles if h.status is not TransferStatus.DONE]
        ended = [h.finished for h in handles if h.finished is not None]
        return {
            "ok": not failed, "status": failed[0].status.name if failed else "DONE",
            "errors": sorted({h.error or "still pending" for h in failed})[:3],
            "first_failure": min((h.finished for h in failed if h.finished), default=None),
            "not_after": not_after, "bytes": sum(h.num_bytes for h in handles),
            "seconds": (max(ended) - handles[0].started) if len(ended) == len(handles) else None,
        }

    def plain_copy(self, num_bytes: int, repeats: int) -> dict:
        """One device-to-device copy of `num_bytes`, best of `repeats`."""
        torch = self.torch
        src = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        times = []
        for _ in range(repeats + 1):
            began = time.perf_counter()
            dst.copy_(src)
            self.sync()
            times.append(time.perf_counter() - began)
        return {"ok": True, "seconds": min(times[1:]), "bytes": num_bytes}

    def usage(self) -> dict:
        usage = self.transport.usage()._asdict()
        if self.cuda:
            usage["cuda_allocated"] = self.torch.cuda.memory_allocated()
        return usage

    def detach(self, peer: str) -> dict:
        self.transport.detach_peer(peer)
        return self.usage()

    def health(self) -> dict:
        """A device op after everything: a context broken by a copy would fail here."""
        probe = self.torch.ones(1 << 20, device=self.device)
        return {"ok": float(probe.sum()) == float(1 << 20)}


def instance_main(conn, config: dict) -> None:
    Instance(conn, config).serve()


# ---- orchestrator -------------------------------------------------------------------------------

class Peer:
    def __init__(self, ctx, config: dict, timeout_s: float):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=instance_main, args=(child, config), daemon=True)
        self.process.start()
        self.timeout_s = timeout_s
        self.hello = self.call("hello")
        self.id = f"instance-{self.hello['pid']}"

    def send(self, command: str, **kwargs) -> None:
        self.conn.send((command, kwargs))

    def receive(self) -> tuple:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"instance {self.process.pid} did not answer within {self.timeout_s:.0f} s")
        try:
            return self.conn.recv()
        except EOFError:
            raise RuntimeError(f"instance {self.process.pid} ended (exit code {self.process.exitcode})") from None

    def call(self, command: str, **kwargs) -> dict:
        """Run `command` in the instance; RuntimeError when it raised there."""
        self.send(command, **kwargs)
        result = self.receive()[1]
        if "error" in result:
            raise RuntimeError(f"{command} failed in instance {self.process.pid}: {result['error']}")
        return result

    def attach(self, other: Peer) -> None:
        self.call("attach", peer=other.id, descriptors=other.hello["descriptors"], runs=other.hello["runs"])

    def kill(self) -> float:
        """SIGKILL; returns the time just before it."""
        now = time.monotonic()
        os.kill(self.process.pid, signal.SIGKILL)
        return now

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit")
            except (OSError, EOFError, TimeoutError):
                pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


def block_pairs(kind: str, n: int, num_blocks: int, seed: int) -> list[tuple[int, int]]:
    """(P block, D block) for a prompt of `n` blocks: neighbours, or scattered at random."""
    if kind == "contiguous":
        return [(7 + i, 100 % (num_blocks - n) + i) for i in range(n)]
    rng = random.Random(seed)
    return list(zip(rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)))


def killed_mid_transfer(survivor: Peer, victim: Peer, kill_at: int, num_regions: int, command: str, **kwargs) -> dict:
    """Run `command` on the survivor, kill the victim when it reports progress `kill_at`, and check
    that the survivor's transfer failed before its deadline, and that once it failed the survivor
    held nothing of the victim (no mapping, no copy, its device memory back where it was)."""
    before = survivor.call("usage")
    survivor.send(command, **kwargs)
    killed_at = None
    while True:
        kind, payload = survivor.receive()
        if kind == "result":
            result = payload
            break
        if killed_at is None and payload >= kill_at:
            killed_at = victim.kill()  # not reaped until the survivor is done: it sees a zombie first
    after = survivor.call("usage")  # before detaching: a dead peer's mappings go by themselves
    survivor.call("detach", peer=victim.id)
    health = survivor.call("health")
    victim.process.join(10)
    first = result.get("first_failure")
    checks = {
        "killed": killed_at is not None,
        "failed": result.get("status") == "FAILED",
        "before_deadline": first is not None and first <= result["not_after"],
        "nothing_held": after.get("mapped_regions") == before.get("mapped_regions", 0) - num_regions
        and after.get("copies") == 0,
        "device_memory_back": after.get("cuda_allocated", 0) <= before.get("cuda_allocated", 0),
        "survivor_healthy": health.get("ok") is True,
    }
    return {"ok": all(checks.values()), "checks": checks, "result": result,
            "fail_after_kill_s": None if first is None or killed_at is None else round(first - killed_at, 4),
            "deadline_after_kill_s": None if killed_at is None else round(result["not_after"] - killed_at, 4),
            "usage_before": before, "usage_after_failure": after}


def gbps(result: dict) -> float | None:
    return None if not result.get("seconds") else round(result["bytes"] / result["seconds"] / 1e9, 2)


def run_checks(args, config: dict, out: dict) -> None:
    ctx = mp.get_context("spawn")
    n = -(-args.tokens // args.block_size)
    prefill = decode = late = reader = None
    try:
        prefill, decode = Peer(ctx, config, args.timeout_s), Peer(ctx, config, args.timeout_s)
        decode.attach(prefill)
        prefill.attach(decode)
        checks, bandwidth = out["checks"], out["bandwidth"]
        for kind in ("contiguous", "scattered"):
            pairs = block_pairs(kind, n, args.num_blocks, args.seed)
            decode.call("fill", blocks=[], seed=0)
            read_pairs = [(d, p) for p, d in pairs]  # D's view: (local block, the peer's)
            written = prefill.call("write", peer=decode.id, pairs=pairs, seed=1, deadline_s=30.0, busy_ms=args.busy_ms)
            checks[f"write_{kind}"] = {**written, "verify": decode.call("verify", pairs=read_pairs, seed=1)}
            checks[f"write_{kind}"]["ok"] = written["ok"] and checks[f"write_{kind}"]["verify"]["ok"]
            prefill.call("fill", blocks=[p for p, _ in pairs], seed=2)
            decode.call("fill", blocks=[], seed=0)
            read = decode.call("read", peer=prefill.id, pairs=read_pairs, deadline_s=30.0)
            checks[f"read_{kind}"] = {**read, "verify": decode.call("verify", pairs=read_pairs, seed=2)}
            checks[f"read_{kind}"]["ok"] = read["ok"] and checks[f"read_{kind}"]["verify"]["ok"]
            writes = [prefill.call("write", peer=decode.id, pairs=pairs, seed=2, deadline_s=30.0, compute=False)
                      for _ in range(args.repeats)]
            reads = [decode.call("read", peer=prefill.id, pairs=read_pairs, deadline_s=30.0) for _ in range(args.repeats)]
            bandwidth[f"write_{kind}_GBps"] = statistics.median(gbps(w) or 0.0 for w in writes)
            bandwidth[f"read_{kind}_GBps"] = statistics.median(gbps(r) or 0.0 for r in reads)
            bandwidth["transfer_bytes"] = writes[0]["bytes"]
            checks[f"bursts_{kind}"] = {"ok": all(w["ok"] for w in writes + reads),
                                        "verify": decode.call("verify", pairs=read_pairs, seed=2)}
            checks[f"bursts_{kind}"]["ok"] &= checks[f"bursts_{kind}"]["verify"]["ok"]
        plain = prefill.call("plain_copy", num_bytes=bandwidth["transfer_bytes"], repeats=args.repeats)
        bandwidth["plain_copy_GBps"] = gbps(plain)
        late = Peer(ctx, config, args.timeout_s)  # a D for P to lose mid-WRITE
        late.attach(prefill)
        prefill.attach(late)
        checks["kill_decode_during_write"] = killed_mid_transfer(
            prefill, late, args.layers // 2, args.layers, "write", peer=late.id, pairs=block_pairs("scattered", n, args.num_blocks, 4), seed=4,
            deadline_s=args.kill_deadline_s, pace_s=args.pace_s, busy_ms=args.busy_ms, progress=True)
        reader = Peer(ctx, config, args.timeout_s)  # a D that loses P mid-READ
        reader.attach(prefill)
        prefill.attach(reader)
        checks["kill_prefill_during_read"] = killed_mid_transfer(
            reader, prefill, 1, args.layers, "read", peer=prefill.id, pairs=block_pairs("scattered", n, args.num_blocks, 5),
            deadline_s=args.kill_deadline_s, loop_s=args.timeout_s / 2)
        out["environment"]["gpu"] = prefill.hello["gpu"]
    finally:
        for peer in (prefill, decode, late, reader):
            if peer is not None:
                peer.stop()


def environment(device: str) -> dict:
    import torch
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device == "cuda":  # the GPU's name comes from an instance: this process stays off the GPU
        env.update(cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None))
    return env


def summary_line(out: dict) -> str:
    checks, bw = out["checks"], out["bandwidth"]
    status = " ".join(f"{name}={'ok' if c.get('ok') else 'FAIL'}" for name, c in checks.items())
    kill = checks.get("kill_decode_during_write", {}).get("fail_after_kill_s")
    return (f"gpu_check {out['verdict']} device={out['environment']['device']} "
            f"gpu={out['environment'].get('gpu')!r} torch={out['environment']['torch']} "
            f"layers={out['config']['layers']} tokens={out['tokens']} {status} "
            f"write={bw.get('write_scattered_GBps')}/{bw.get('write_contiguous_GBps')} GB/s "
            f"read={bw.get('read_scattered_GBps')}/{bw.get('read_contiguous_GBps')} GB/s (scattered/contiguous) "
            f"plain_copy={bw.get('plain_copy_GBps')} GB/s kill_fail_after={kill}s wall={out['wall_s']}s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=16)
    for name in ("layers", "heads", "head_size", "num_blocks", "repeats"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--busy-ms", type=float, default=2.0, help="GPU busy time per layer before its KV is written")
    parser.add_argument("--pace-s", type=float, default=0.05, help="host time between layers in the kill run")
    parser.add_argument("--kill-deadline-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per command")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    config = {"device": args.device, "block_size": args.block_size,
              **{k: getattr(args, k) for k in ("layers", "heads", "head_size", "num_blocks")}}
    out = {"config": config, "tokens": args.tokens, "checks": {}, "bandwidth": {}, "environment": environment(args.device)}
    began = time.monotonic()
    try:
        run_checks(args, config, out)
    except Exception as exc:  # noqa: BLE001 - every outcome is written down
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["wall_s"] = round(time.monotonic() - began, 1)
    out["verdict"] = "PASS" if out["checks"] and "error" not in out and all(
        c.get("ok") for c in out["checks"].values()) else "FAIL"
    out["summary"] = summary_line(out)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gpu_check.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    (args.out_dir / "summary.txt").write_text(out["summary"] + "\n")
    print(out["summary"], flush=True)
    return 0 if out["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
