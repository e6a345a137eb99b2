#!/usr/bin/env python
"""When vllm-router's MoRIIO WRITE mode lets the client see the decode leg's first token.

Both legs go out at once; the probe answers the prefill leg after a set delay and streams the
decode leg at once (a token every 50 ms), from two stub backends registered with the real
vllm-router over its discovery socket, and reports when the client saw its first byte and when
the prefill leg was answered. If the router streamed the decode leg as it came, the first byte
would come at ~0 ms whatever the delay; if it holds the stream until the prefill leg answers,
the first byte comes with that answer and the tokens decoded meanwhile arrive together.

Why it matters: a prompt that decode prefills itself (adaptive placement) still has a prefill leg
on P, cut to one token, and it answers only after a step of P's. Prints a table, writes JSON with
--out.

    .venv/bin/python scripts/router_hold_probe.py --delays-ms 0,120,500 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.control.registration import RegistrationHeartbeat  # noqa: E402
from pdserve.launch.router import router_binary  # noqa: E402

HOST = "127.0.0.1"
TOKENS = 5
TOKEN_EVERY_S = 0.05
ROUTER_READY_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _completion(text: str, finish: str | None) -> dict:
    return {"id": "probe", "object": "text_completion", "created": 0, "model": "probe",
            "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


class Stubs:
    """The two backends; `delay_s` is how long the prefill leg takes to answer."""

    def __init__(self):
        self.delay_s = 0.0
        self.prefill_answered: float | None = None
        self.decode_started: float | None = None

    async def prefill(self, request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(self.delay_s)
        self.prefill_answered = time.monotonic()
        answer = _completion("a", "length") | {"kv_transfer_params": body.get("kv_transfer_params"),
                                               "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        return web.json_response(answer)

    async def decode(self, request: web.Request) -> web.StreamResponse:
        await request.json()
        self.decode_started = time.monotonic()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(TOKENS):
            await response.write(f"data: {json.dumps(_completion(f't{i}', None))}\n\n".encode())
            await asyncio.sleep(TOKEN_EVERY_S)
        await response.write(b"data: [DONE]\n\n")
        return response

    @staticmethod
    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")


async def _serve(handler, port: int) -> web.AppRunner:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_get("/health", Stubs.health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, HOST, port).start()
    return runner


async def _one(session: aiohttp.ClientSession, url: str, stubs: Stubs) -> dict:
    sent = time.monotonic()
    arrivals = []
    async with session.post(url, json={"model": "probe", "prompt": "hi", "max_tokens": TOKENS, "stream": True},
                            timeout=aiohttp.ClientTimeout(total=30)) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                arrivals.append(time.monotonic() - sent)
    return {"delay_ms": stubs.delay_s * 1000, "first_byte_ms": arrivals[0] * 1000,
            "prefill_answered_ms": (stubs.prefill_answered - sent) * 1000,
            "decode_first_token_ms": (stubs.decode_started - sent) * 1000,
            "tokens_with_first": sum(1 for t in arrivals if t - arrivals[0] < 0.002)}


async def probe(delays_ms: list[float], repeats: int) -> list[dict]:
    stubs = Stubs()
    prefill_port, decode_port, router_port, prom_port, discovery_port = (free_port() for _ in range(5))
    runners = [await _serve(stubs.prefill, prefill_port), await _serve(stubs.decode, decode_port)]
    beats = [RegistrationHeartbeat(HOST, discovery_port, {
        "type": role, "http_address": f"{HOST}:{port}", "transfer_mode": "WRITE", "tp_size": 1, "dp_size": 1,
        "zmq_address": f"host:{HOST},handshake:{port + 1},notify:{port + 2}"}) for role, port in
        (("P", prefill_port), ("D", decode_port))]
    router = subprocess.Popen(
        [router_binary(), "--host", HOST, "--port", str(router_port), "--prometheus-host", HOST,
         "--prometheus-port", str(prom_port), "--policy", "round_robin", "--log-level", "warning",
         "--vllm-pd-disaggregation", "--kv-connector", "moriio", "--vllm-discovery-address",
         f"{HOST}:{discovery_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        url = f"http://{HOST}:{router_port}/v1/completions"
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + ROUTER_READY_S
            while True:  # the router answers 503 until both registrations arrived
                try:
                    stubs.delay_s = 0.0
                    await _one(session, url, stubs)
                    break
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"vllm-router did not serve within {ROUTER_READY_S:.0f} s") from None
                    await asyncio.sleep(0.5)
            for delay in delays_ms:
                for _ in range(repeats):
                    stubs.delay_s = delay / 1000
                    rows.append(await _one(session, url, stubs))
    finally:
        router.terminate()
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()
        for beat in beats:
            beat.stop()
        for runner in runners:
            await runner.cleanup()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays-ms", default="0,120,500", help="prefill leg answer delays, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = asyncio.run(probe([float(d) for d in args.delays_ms.split(",")], args.repeats))
    print(f"{'prefill answers at':>20} {'decode 1st token at':>20} {'client 1st byte at':>20} {'tokens with it':>15}")
    for row in rows:
        print(f"{row['prefill_answered_ms']:>17.0f} ms {row['decode_first_token_ms']:>17.0f} ms "
              f"{row['first_byte_ms']:>17.0f} ms {row['tokens_with_first']:>15d}")
    if args.out:
        args.out.write_text(json.dumps({"tokens": TOKENS, "token_every_ms": TOKEN_EVERY_S * 1000, "rows": rows},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
