"""Fault injection for tests, attached to a worker as a rig (pdserve/rigs.py) only when its config
names a fault plan (`test_fault_plan` in kv_connector_extra_config, or PDSERVE_FAULT_PLAN) or asks
for corrupted transfers (`test_corrupt_transfers`). Nothing here runs in a normal deployment."""

from pdserve.faults.plan import FaultPlan, FaultRule

__all__ = ["FaultPlan", "FaultRule"]
