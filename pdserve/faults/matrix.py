"""The fault matrix: faults × {WRITE, READ} on real vLLM, each cell judged by one rule.

A cell injects one fault (a fault-plan rule, a killed or restarted instance, a client that
hangs up) while a burst of requests goes through the front and vllm-router, as `pdserve up` runs
them, then checks:
- every request ended within its deadline (+5 s), with a 200 whose tokens equal collocated
  serving's: no error, a killed instance's requests included (the other instance is live, and the
  front resends or continues them there);
- not one 200 with tokens that differ from collocated serving;
- the survivors' KV usage returned to idle, and the next requests are served correctly.

`scripts/fault_matrix.py` runs every cell and writes the results; the integration tests run a
representative part. One deployment per mode serves all of its cells (the fault plan file is
re-read by the instances whenever it changes; killed instances are restarted by the cluster's
supervisor).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from pdserve.compare import Generation, compare_greedy, parse_choice

MAX_TOKENS = 16
DEADLINE_MARGIN_S = 5.0
# Short deadlines, so a cell that waits for one ends in seconds.
KILL_REPEAT = 30  # ~5 s of requests: the kill lands 1 s in, with transfers in flight
TIMEOUTS = {"transfer_timeout": 8.0, "defer_timeout": 10.0, "handshake_timeout": 5.0, "release_grace": 1.0}


@dataclass(frozen=True)
class Cell:
    name: str
    rules: tuple[dict, ...] = ()  # fault-plan rules in force during the burst
    kill: str = ""  # "prefill" | "decode": SIGKILL its process group during the burst
    kill_rank: int | None = None  # with kill: SIGKILL only this tensor-parallel rank's worker process
    restart_first: str = ""  # "prefill" | "decode": kill and let it restart *before* the burst
    disconnect: bool = False  # clients hang up after the first tokens
    max_tokens: int = MAX_TOKENS
    repeat: int = 1  # send the prompts this many times (a kill must land while requests are in flight)


def cells(mode: str, prefill_tp: int = 1, timeouts: dict = TIMEOUTS) -> list[Cell]:
    """Every cell of the matrix for `mode` ("write" | "read") on a deployment with `timeouts`;
    with a prefill of `prefill_tp` > 1 ranks, also one where P's last rank alone is killed
    mid-transfer."""
    slow = timeouts["release_grace"] + 1.5
    past = timeouts["transfer_timeout"] + 2
    if mode == "write":
        messages = [("remote_blocks", "D"), ("write_done", "P")]
        copier = "P"
    else:
        messages = [("read_done", "D"), ("read_ack", "P")]
        copier = "D"
    out = [Cell("baseline")]
    for tag, role in messages:
        out += [
            Cell(f"drop {tag}", ({"action": "drop", "message": tag, "role": role},)),
            Cell(f"delay {tag} past its deadline", ({"action": "delay", "message": tag, "role": role, "seconds": past},)),
            Cell(f"duplicate {tag}", ({"action": "duplicate", "message": tag, "role": role},)),
            Cell(f"reorder {tag}", ({"action": "reorder", "message": tag, "role": role},)),
        ]
    out += [
        Cell("drop release", ({"action": "drop", "message": "release", "role": "D"},
                              {"action": "drop", "message": messages[0][0], "role": messages[0][1]})),
        Cell("copy fails mid-layer", ({"action": "fail_copy", "role": copier, "count": 2},)),
        Cell("copy queue slower than release_grace", ({"action": "slow_copy", "role": copier, "seconds": slow},)),
        Cell("client disconnect", disconnect=True),
        Cell("prefill killed", kill="prefill", repeat=KILL_REPEAT),
        Cell("decode killed", kill="decode", repeat=KILL_REPEAT),
        Cell("prefill restarted", restart_first="prefill"),
        Cell("decode restarted", restart_first="decode"),
    ]
    if prefill_tp > 1:
        out.append(Cell(f"prefill rank {prefill_tp - 1} killed", kill="prefill", kill_rank=prefill_tp - 1,
                        repeat=KILL_REPEAT))
    return out


def restart_and_kill_cells(mode: str, prefill_tp: int = 1) -> list[Cell]:
    """The cells that kill or restart an instance (or one of its ranks)."""
    return [c for c in cells(mode, prefill_tp) if c.kill or c.restart_first]


@dataclass
class CellResult:
    mode: str
    cell: str
    requests: int = 0
    correct: int = 0
    errors: list[str] = field(default_factory=list)
    wrong: int = 0  # 200 with tokens that differ from collocated serving: must stay 0
    late: int = 0  # ended after deadline + 5 s
    max_seconds: float = 0.0
    idle_seconds: float | None = None
    next_ok: bool = False
    recomputed: float = 0.0
    fenced: float = 0.0
    preemptions: float = 0.0
    passed: bool = False
    note: str = ""


class Matrix:
    """Runs cells against one running PD cluster (Cluster with restart="on-failure")."""

    def __init__(self, cluster, mode: str, plan_path: Path, prompts: list[list[int]], reference: list[Generation],
                 model: str, concurrency: int = 4, timeouts: dict = TIMEOUTS):
        self.cluster, self.mode, self.plan_path = cluster, mode, plan_path
        self.timeouts = timeouts  # the deployment's connector deadlines
        self.concurrency = concurrency
        self.reference_tokens = len(reference[0]) if reference else MAX_TOKENS
        self.prompts, self.reference, self.model = prompts, reference, model
        self.prefill_url = cluster.instance_urls["prefill"]
        self.decode_url = cluster.instance_urls["decode"]
        self._generation = 0

    # ---- plan ------------------------------------------------------------------------------

    def set_rules(self, rules) -> None:
        self._generation += 1
        tmp = self.plan_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rules": list(rules), "generation": self._generation}))
        os.replace(tmp, self.plan_path)
        time.sleep(0.6)  # instances re-read the plan every 0.2 s

    # ---- one cell --------------------------------------------------------------------------

    def run(self, cell: Cell) -> CellResult:
        result = CellResult(self.mode, cell.name)
        before = {url: metrics_by_name(url) for url in (self.prefill_url, self.decode_url)}
        if cell.restart_first:
            self._kill(cell.restart_first)
            self._wait_back(cell.restart_first)
        self.set_rules(cell.rules)
        limit = self.timeouts["transfer_timeout"] + self.timeouts["release_grace"] + 30 + DEADLINE_MARGIN_S + cell.max_tokens * 0.2
        try:
            outcomes = self._burst(cell, limit)
        finally:
            self.set_rules(())
        for index, (status, seconds, payload) in enumerate(outcomes):
            index %= len(self.prompts)
            result.requests += 1
            result.max_seconds = max(result.max_seconds, seconds)
            result.late += seconds > limit
            if status == 200 and cell.disconnect:
                result.correct += 1
            elif status == 200:
                ok = compare_greedy([self.reference[index]], [payload]).ok
                result.correct += ok
                result.wrong += not ok
            else:
                result.errors.append(f"{status}: {str(payload)[:160]}")
        if cell.kill:
            self._wait_back(cell.kill)
        result.idle_seconds = self._wait_idle(self.timeouts["defer_timeout"] + 20)
        if cell.kill:
            what = cell.kill if cell.kill_rank is None else f"{cell.kill} rank {cell.kill_rank}"
            result.note = f"killed {what} 1 s into {len(outcomes)} requests"
        result.next_ok = self._next_ok()
        after = {url: metrics_by_name(url) for url in (self.prefill_url, self.decode_url)}
        if not (cell.kill or cell.restart_first):
            result.recomputed = _delta(before, after, self.decode_url, "pdserve:kv_recomputed_total")
            result.fenced = sum(_delta(before, after, u, "pdserve:kv_transfers_fenced_total") for u in after)
            result.preemptions = sum(_delta(before, after, u, "vllm:num_preemptions_total") for u in after)
        result.passed = (result.wrong == 0 and result.late == 0 and not result.errors
                         and result.idle_seconds is not None and result.next_ok)
        return result

    def _burst(self, cell: Cell, limit: float) -> list[tuple[int, float, object]]:
        def one(prompt):
            started = time.monotonic()
            body = {"model": self.model, "prompt": prompt, "max_tokens": cell.max_tokens, "temperature": 0, "logprobs": 2,
                    "return_token_ids": True, "ignore_eos": True}
            try:
                if cell.disconnect:
                    with requests.post(f"{self.cluster.endpoint}/v1/completions", json={**body, "stream": True},
                                       stream=True, timeout=limit) as response:
                        next(response.iter_lines(), None)
                        return response.status_code, time.monotonic() - started, None
                response = requests.post(f"{self.cluster.endpoint}/v1/completions", json=body, timeout=limit)
            except requests.RequestException as exc:
                return 0, time.monotonic() - started, f"{type(exc).__name__}: {exc}"
            seconds = time.monotonic() - started
            if response.status_code != 200:
                return response.status_code, seconds, response.text
            return 200, seconds, parse_choice(response.json()["choices"][0])

        killer = None
        if cell.kill:
            killer = threading.Timer(1.0, self._kill, args=(cell.kill, cell.kill_rank))
            killer.start()
        with ThreadPoolExecutor(self.concurrency) as pool:
            outcomes = list(pool.map(one, self.prompts * cell.repeat))
        if killer is not None:
            killer.join()
        return outcomes

    # ---- instances -------------------------------------------------------------------------

    def _process(self, name: str):
        return next(p for p in self.cluster.instances if p.spec.name == name)

    def _kill(self, name: str, rank: int | None = None) -> None:
        """SIGKILL instance `name` (its process group), or only its rank `rank`'s worker process."""
        try:
            group = self._process(name).pid
            if rank is None:
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(rank_worker(group, rank), signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass

    def _wait_back(self, name: str, timeout: float = 240) -> None:
        """Until the supervisor restarted `name` and a request is served again."""
        url = self.prefill_url if name == "prefill" else self.decode_url
        deadline = time.monotonic() + timeout
        time.sleep(1.0)
        while not _healthy(url):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not come back within {timeout} s")
            time.sleep(1.0)
        body = {"model": self.model, "prompt": [11, 12, 13], "max_tokens": 1}
        while True:
            try:
                if requests.post(f"{self.cluster.endpoint}/v1/completions", json=body, timeout=60).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router does not route to {name} again within {timeout} s")
            time.sleep(0.5)

    def _wait_idle(self, timeout: float) -> float | None:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if all(_idle(url) for url in (self.prefill_url, self.decode_url)):
                return round(time.monotonic() - started, 2)
            time.sleep(0.5)
        return None

    def warm_up(self, max_tokens: int = MAX_TOKENS) -> None:
        """One unchecked burst: the first long prompts of a fresh instance are slow (one-time setup)."""
        self._burst(Cell("warm-up", max_tokens=max_tokens), 300)

    def _next_ok(self) -> bool:
        outcomes = self._burst(Cell("check", max_tokens=self.reference_tokens), 300)[:3]
        return all(status == 200 and compare_greedy([self.reference[i]], [payload]).ok
                   for i, (status, _, payload) in enumerate(outcomes))


def metrics_by_name(url: str) -> dict[str, float]:
    """The samples of `url`/metrics summed by series name over their labels (empty if it does not answer)."""
    out: dict[str, float] = {}
    try:
        text = requests.get(f"{url}/metrics", timeout=10).text
    except requests.RequestException:
        return out
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            base = key.partition("{")[0]
            out[base] = out.get(base, 0.0) + float(value)
    return out


def _delta(before: dict, after: dict, url: str, name: str) -> float:
    return after.get(url, {}).get(name, 0.0) - before.get(url, {}).get(name, 0.0)


def _healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def _idle(url: str) -> bool:
    samples = metrics_by_name(url)
    busy = samples.get("vllm:num_requests_running", 1) + samples.get("vllm:num_requests_waiting", 1)
    return bool(samples) and samples.get("vllm:kv_cache_usage_perc", 1) == 0 and busy == 0


def as_dict(result: CellResult) -> dict:
    return asdict(result)


def rank_worker(group: int, rank: int) -> int:
    """The pid of tensor-parallel rank `rank`'s worker in process group `group` (vLLM names it
    VLLM::Worker_TP<rank>); ProcessLookupError if there is none."""
    title = f"VLLM::Worker_TP{rank}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == group and (entry / "cmdline").read_bytes().split(b"\0")[0] == title:
                return int(entry.name)
        except (OSError, ValueError):
            continue
    raise ProcessLookupError(f"no worker of rank {rank} in process group {group}")
