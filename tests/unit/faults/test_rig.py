"""The fault rig attaches through pdserve/rigs.py only: to a worker whose config asks for faults,
on real shared-memory transports; product code never names the fault package."""

from __future__ import annotations

import ast
import json
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pytest

from pdserve.config import parse_connector_config
from pdserve.errors import ConfigError
from pdserve.faults.corrupt import CorruptingTransport
from pdserve.faults.rig import RIG_NAME, FaultRig, register
from pdserve.rigs import Rig, attach_rig, register_rig, unregister_rig
from pdserve.transport import CopyOp, Direction, RegionDescriptor, RegionOps, SharedSegment, ShmTransport, segment_name
from pdserve.transport.base import TransferStatus

PACKAGE = Path(__file__).resolve().parents[3] / "pdserve"
SIZE = 4096


class Tagged:
    TAG = "write_done"


def config(role: str = "kv_producer", **extra):
    return parse_connector_config(role, extra, env={"PDSERVE_SECRET_FILE": "/nonexistent/secret"})


@pytest.fixture(autouse=True)
def fault_rig_registered():
    register()
    yield
    unregister_rig(RIG_NAME)


@pytest.fixture
def pair():
    """A ShmTransport wrapped by `wrap` whose peer is another segment of this process."""
    segments = [SharedSegment.create(segment_name("rigtest", side), SIZE) for side in ("local", "remote")]
    transports = []

    def make(wrap):
        transport = wrap(ShmTransport())
        transport.register_region(0, segments[0].address, SIZE, segments[0].name)
        transport.attach_peer("peer", [RegionDescriptor(0, SIZE, segments[1].name, None)])
        transports.append(transport)
        return transport, [np.frombuffer(s.mmap, dtype=np.uint8) for s in segments]

    yield make
    for transport in transports:
        transport.close()
    for segment in segments:
        segment.close()


def write(transport) -> TransferStatus:
    handle = transport.submit("peer", Direction.WRITE, [RegionOps(0, (CopyOp(0, 0, 64),))])
    return transport.wait(handle, 10)


def test_the_plugin_entry_point_registers_the_fault_rig():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("pdserve-faults") == "pdserve.faults.rig:register"


def test_a_worker_that_asks_for_no_faults_gets_a_rig_that_changes_nothing(pair):
    rig = attach_rig(config())
    assert type(rig) is Rig
    transport, (local, remote) = pair(rig.wrap_transport)
    local[:64] = 7
    assert type(transport) is ShmTransport and write(transport) is TransferStatus.DONE
    assert (remote[:64] == 7).all()
    sent = []
    assert rig.outgoing(Tagged(), lambda m: sent.append(m) or True) and len(sent) == 1


def test_corruption_flips_every_second_byte_of_what_lands(pair):
    rig = attach_rig(config(test_corrupt_transfers=True))
    assert isinstance(rig, FaultRig)
    transport, (local, remote) = pair(rig.wrap_transport)
    local[:64] = 0x01
    assert isinstance(transport, CorruptingTransport) and write(transport) is TransferStatus.DONE
    assert (remote[0:64:2] == 0x01).all() and (remote[1:64:2] == 0x81).all()


def test_a_fault_plan_corrupts_what_lands_while_its_rule_is_in_force(pair, tmp_path):
    plan = tmp_path / "faults.json"
    plan.write_text(json.dumps({"rules": [{"action": "corrupt_copy"}]}))
    rig = attach_rig(config(test_fault_plan=str(plan)))
    transport, (local, remote) = pair(rig.wrap_transport)
    local[:64] = 0x01
    assert write(transport) is TransferStatus.DONE
    assert (remote[0:64:2] == 0x01).all() and (remote[1:64:2] == 0x81).all()
    plan.write_text(json.dumps({"rules": [], "generation": 2}))  # a new size: re-read at once
    rig._plan._next_check = 0.0
    remote[:64] = 0
    assert write(transport) is TransferStatus.DONE and (remote[:64] == 0x01).all()


def test_a_fault_plan_drops_messages_and_fails_copies_of_its_role(pair, tmp_path):
    plan = tmp_path / "faults.json"
    plan.write_text(json.dumps({"rules": [{"action": "drop", "message": "write_done", "role": "P"},
                                          {"action": "fail_copy", "role": "P"}]}))
    p_rig = attach_rig(config("kv_producer", test_fault_plan=str(plan)))
    sent = []
    assert p_rig.outgoing(Tagged(), lambda m: sent.append(m) or True) and sent == []
    transport, _ = pair(p_rig.wrap_transport)
    handle = transport.submit("peer", Direction.WRITE, [RegionOps(0, (CopyOp(0, 0, 64),))])
    assert transport.wait(handle, 10) is TransferStatus.FAILED and "injected copy failure" in handle.error
    d_rig = attach_rig(config("kv_consumer", test_fault_plan=str(plan)))
    assert d_rig.outgoing(Tagged(), lambda m: sent.append(m) or True) and len(sent) == 1


def test_the_plan_file_can_come_from_the_environment(tmp_path):
    plan = tmp_path / "faults.json"
    plan.write_text(json.dumps({"rules": [{"action": "drop", "message": "write_done"}]}))
    env = {"PDSERVE_SECRET_FILE": "/nonexistent/secret", "PDSERVE_FAULT_PLAN": str(plan)}
    rig = attach_rig(parse_connector_config("kv_consumer", {}, env=env))
    assert rig.outgoing(Tagged(), lambda m: pytest.fail("a dropped message was sent"))


def test_two_rigs_for_one_worker_are_refused():
    register_rig("other", lambda config: Rig())
    try:
        with pytest.raises(ConfigError, match="faults, other"):
            attach_rig(config(test_corrupt_transfers=True))
    finally:
        unregister_rig("other")


def test_product_code_never_names_the_fault_package():
    """Only pdserve/faults itself imports pdserve.faults or reads its settings; the worker gets it
    as a rig, through the vLLM plugin."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "faults" or path.name == "config.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute) and node.attr in ("test_fault_plan", "test_corrupt_transfers"):
                names = [node.attr]
            offenders += [f"{path.relative_to(PACKAGE)}: {n}" for n in names
                          if n.startswith("pdserve.faults") or n.startswith("test_") or n.endswith(".corrupt")]
    assert not offenders
