"""Defect 1 end to end: across two "hosts" (network namespaces, NIXL), P's copies are stalled
past D's fence by a fault plan. D gives those transfers up and recomputes; no stalled copy may
land in blocks D has handed back, so every 200 equals collocated serving."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.bench.hosts.two_host import TwoHostPD, metric
from pdserve.compare import compare_greedy
from tests.integration.pd_helpers import collocated_reference, prompts

pytestmark = pytest.mark.integration

PROMPTS = prompts(12, seed=4321)
WINDOW = {"transfer_timeout": 6, "defer_timeout": 12, "handshake_timeout": 10, "release_grace": 1}
STALL_S = WINDOW["transfer_timeout"] + WINDOW["release_grace"] + 2  # past D's fence
STALLS = 2


def test_copies_stalled_past_the_fence_across_hosts_never_change_the_output(greedy_reference, tmp_path):
    reference = collocated_reference(greedy_reference, "fence12", PROMPTS)
    plan = tmp_path / "plan.json"
    tmp_path.chmod(0o755)

    def write_plan(rules: list, generation: int) -> None:
        plan.write_text(json.dumps({"rules": rules, "generation": generation}))
        plan.chmod(0o644)
        time.sleep(1.0)  # instances re-read the plan every 0.2 s

    write_plan([], 1)
    with TwoHostPD(mode="write", connector_extra={**WINDOW, "test_fault_plan": str(plan)}) as pd:
        outcomes = pd.outcomes(PROMPTS[:4], timeout=240)  # NIXL between the hosts is up and moving KV
        moved = metric(pd.metrics("decode"), "pdserve:kv_transfers_completed_total")
        write_plan([{"action": "stall_copy", "role": "P", "seconds": STALL_S, "count": STALLS}], 2)
        before = metric(pd.metrics("decode"), "pdserve:kv_transfers_failed_total")
        outcomes += pd.outcomes(PROMPTS, timeout=240)  # copies stalled past the fence, the rest queued behind
        failed = metric(pd.metrics("decode"), "pdserve:kv_transfers_failed_total") - before
        write_plan([], 3)
        outcomes += pd.outcomes(PROMPTS[4:], timeout=240)
        p, d = pd.metrics("prefill"), pd.metrics("decode")
        log = (pd.log_dir / "prefill.log").read_text(errors="replace") if (pd.log_dir / "prefill.log").exists() else ""
    order = [*range(4), *range(len(PROMPTS)), *range(4, len(PROMPTS))]
    served = [(order[i], row) for i, row in enumerate(outcomes) if row["status"] == 200]
    print(f"fence run: {len(served)}/{len(outcomes)} answered 200; statuses {[row['status'] for row in outcomes]}; "
          f"D transfers completed {metric(d, 'pdserve:kv_transfers_completed_total'):.0f} (warm-up {moved:.0f}) "
          f"failed {metric(d, 'pdserve:kv_transfers_failed_total'):.0f} (during the stalls {failed:.0f}); "
          f"seconds {[row['seconds'] for row in outcomes]}")
    assert len(served) == len(outcomes), "a request was not answered 200"
    result = compare_greedy([reference[i] for i, _ in served], [row["steps"] for _, row in served])
    assert result.ok, result.mismatches()
    assert metric(p, "pdserve:kv_peers_attached_total", transport="nixl") >= 1, "P did not reach D over NIXL"
    assert moved >= 1, "no transfer moved KV over NIXL before the stalls"
    assert failed >= 1, "no copy was stalled past D's fence"
    assert metric(d, "pdserve:kv_transfers_completed_total") > moved, "no transfer moved KV after the stalls"
    if log:
        assert "stall_copy" in log, "the fault plan never stalled a copy"
