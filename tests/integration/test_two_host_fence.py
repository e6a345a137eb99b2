"""Defect 1 end to end: across two "hosts" (network namespaces, NIXL), P's copies are stalled
past D's fence by a fault plan. D gives those transfers up and recomputes; no stalled copy may
land in blocks D has handed back, so every 200 equals collocated serving."""

from __future__ import annotations

import json

import pytest

from pdserve.compare import compare_greedy
from pdserve.launch.two_host import TwoHostPD, metric
from tests.integration.pd_helpers import collocated_reference, prompts

pytestmark = pytest.mark.integration

PROMPTS = prompts(12, seed=4321)
WINDOW = {"transfer_timeout": 4, "defer_timeout": 12, "handshake_timeout": 10, "release_grace": 1}
STALL_S = WINDOW["transfer_timeout"] + WINDOW["release_grace"] + 2  # past D's fence
STALLS = 3


def test_copies_stalled_past_the_fence_across_hosts_never_change_the_output(greedy_reference, tmp_path):
    reference = collocated_reference(greedy_reference, "fence12", PROMPTS)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"rules": [
        {"action": "stall_copy", "role": "P", "seconds": STALL_S, "count": STALLS}], "generation": 1}))
    plan.chmod(0o644)
    tmp_path.chmod(0o755)
    with TwoHostPD(mode="write", connector_extra={**WINDOW, "test_fault_plan": str(plan)}) as pd:
        outcomes = pd.outcomes(PROMPTS, timeout=240)
        p, d = pd.metrics("prefill"), pd.metrics("decode")
        log = (pd.log_dir / "prefill.log").read_text(errors="replace") if (pd.log_dir / "prefill.log").exists() else ""
    served = [(i, row) for i, row in enumerate(outcomes) if row["status"] == 200]
    print(f"fence run: {len(served)}/{len(PROMPTS)} answered 200; statuses {[row['status'] for row in outcomes]}; "
          f"D transfers completed {metric(d, 'pdserve:kv_transfers_completed_total'):.0f} "
          f"failed {metric(d, 'pdserve:kv_transfers_failed_total'):.0f}; "
          f"seconds {[row['seconds'] for row in outcomes]}")
    assert served, "no request was answered"
    result = compare_greedy([reference[i] for i, _ in served], [row["steps"] for _, row in served])
    assert result.ok, result.mismatches()
    assert metric(p, "pdserve:kv_peers_attached_total", transport="nixl") >= 1, "P did not reach D over NIXL"
    assert metric(d, "pdserve:kv_transfers_failed_total") >= 1, "no copy was stalled past D's fence"
    assert metric(d, "pdserve:kv_transfers_completed_total") >= 1, "no transfer moved KV after the stalls"
    if log:
        assert "stall_copy" in log, "the fault plan never stalled a copy"
