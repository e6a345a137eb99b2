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
