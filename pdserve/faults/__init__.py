"""Fault injection for tests: off unless a plan file is configured (`test_fault_plan` in
kv_connector_extra_config, or PDSERVE_FAULT_PLAN). Nothing here runs in a normal deployment."""

from pdserve.faults.plan import FaultPlan, FaultRule

__all__ = ["FaultPlan", "FaultRule"]
