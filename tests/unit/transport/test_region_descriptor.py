"""RegionDescriptor.from_wire: a peer's descriptor is checked field by field, with ProtocolError."""

import pytest

from pdserve.errors import ProtocolError
from pdserve.transport import RegionDescriptor

GOOD = {"region_id": 0, "size": 4096, "shm_name": "pdserve-12-ab12-kv0", "address": 0x7F0000}


@pytest.mark.parametrize("name", ["pdserve-12-ab12-kv0", "/proc/12/fd/7", None])
def test_valid_descriptors_parse(name):
    desc = RegionDescriptor.from_wire({**GOOD, "shm_name": name})
    assert desc == RegionDescriptor(0, 4096, name, 0x7F0000)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("shm_name", "a/b", ["shm segment name 'a/b'"]),
        ("shm_name", "", ["non-empty"]),
        ("shm_name", "pdserve-1-x\0y", ["shm segment name"]),
        ("shm_name", "../../etc/passwd", ["shm segment name"]),
        ("shm_name", "/proc/1/fd/3/../../environ", ["shm segment name"]),
        ("shm_name", "/proc/self/fd/3", ["shm segment name"]),
        ("shm_name", "/home/user/.ssh/id_rsa", ["shm segment name"]),
        ("shm_name", "pdserve-1-" + "x" * 300, ["characters long"]),
        ("shm_name", 7, ["non-empty string"]),
        ("region_id", -1, ["region_id -1 is outside"]),
        ("region_id", True, ["region_id must be an integer, got bool"]),
        ("region_id", 1 << 40, ["region_id", "outside"]),
        ("size", 0, ["size 0 is outside"]),
        ("size", -4096, ["size -4096"]),
        ("size", False, ["size must be an integer, got bool"]),
        ("size", 1 << 60, ["size", "outside"]),
        ("address", -1, ["address -1"]),
        ("address", 1 << 64, ["address"]),
        ("address", 1.5, ["address must be an integer, got float"]),
    ],
)
def test_out_of_range_fields_raise_protocol_error_naming_them(field, value, words):
    with pytest.raises(ProtocolError) as info:
        RegionDescriptor.from_wire({**GOOD, field: value})
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("data", [None, [], "x", {"region_id": 0}, {**GOOD, "extra": 1}])
def test_wrong_shapes_raise_protocol_error(data):
    with pytest.raises(ProtocolError, match="exactly the keys"):
        RegionDescriptor.from_wire(data)


# ---- device regions ---------------------------------------------------------------------------

IPC = ["cuda", 4242, 987654, [0, b"\x01" * 64, 1 << 20, 0, b"/torch_4242_1", 0, b"\x02" * 64, True]]


def test_host_regions_travel_in_the_old_four_keys_and_old_descriptors_still_parse():
    desc = RegionDescriptor.from_wire(GOOD)
    assert desc.device.is_cpu and desc.ipc is None
    assert set(desc.to_wire()) == set(GOOD)


def test_device_regions_round_trip_with_device_and_ipc_handle():
    from pdserve.transport.device import MemoryDevice
    from pdserve.transport.ipc_handle import IpcHandle

    wire = {**GOOD, "shm_name": None, "device": "cuda:1", "ipc": IPC}
    desc = RegionDescriptor.from_wire(wire)
    assert desc.device == MemoryDevice("cuda", 1) and desc.ipc == IpcHandle.from_wire(IPC)
    assert RegionDescriptor.from_wire(desc.to_wire()) == desc
    assert desc.to_wire()["device"] == "cuda:1" and desc.to_wire()["ipc"][3][1] == b"\x01" * 64


@pytest.mark.parametrize("field, value, words", [
    ("device", "gpu:0", ["device must be 'cpu' or 'cuda:<n>'"]),
    ("device", "cuda:99999", ["device must be"]),
    ("device", "cpu:1", ["no index but 0"]),
    ("device", 0, ["device must be"]),
    ("ipc", ["cuda", 1, 2], ["ipc handle must be"]),
    ("ipc", ["nvlink", 1, 2, []], ["kind"]),
    ("ipc", ["cuda", 0, 2, []], ["owner_pid"]),
    ("ipc", ["cuda", 1, True, []], ["owner_start"]),
    ("ipc", ["cuda", 1, 2, [1.5]], ["float"]),
    ("ipc", ["cuda", 1, 2, [b"x" * 5000]], ["5000 bytes"]),
    ("ipc", ["cuda", 1, 2, list(range(17))], ["at most 16"]),
])
def test_bad_device_fields_raise_protocol_error_naming_them(field, value, words):
    with pytest.raises(ProtocolError) as info:
        RegionDescriptor.from_wire({**GOOD, field: value})
    for word in [*words, "region descriptor 0"]:
        assert word in str(info.value)
