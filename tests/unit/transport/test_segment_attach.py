"""SharedSegment.attach maps only pdserve segments; create allocates its pages up front."""

import os
import tempfile

import pytest

from pdserve.errors import TransferError
from pdserve.transport import RegionDescriptor, SharedSegment, ShmTransport, segment_name
from pdserve.transport.shared_segment import SHM_DIR

SIZE = 8192


@pytest.fixture
def foreign_fd():
    """An open descriptor of an ordinary same-user file, big enough to pass a size check."""
    with tempfile.TemporaryFile(dir="/tmp") as f:
        f.write(b"secret" * (SIZE // 6 + 1))
        f.flush()
        yield f.fileno()


def test_a_proc_fd_of_an_ordinary_file_is_refused(foreign_fd):
    path = f"/proc/{os.getpid()}/fd/{foreign_fd}"
    with pytest.raises(TransferError, match=f"{path} points at '/tmp/.*', not at a pdserve segment of process {os.getpid()}"):
        SharedSegment.attach(path, SIZE)


def test_a_proc_fd_of_a_device_is_refused_without_opening_it():
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        with pytest.raises(TransferError, match="points at '/dev/null'"):
            SharedSegment.attach(f"/proc/{os.getpid()}/fd/{fd}", SIZE)
    finally:
        os.close(fd)


def test_a_segment_whose_name_names_another_pid_is_refused():
    segment = SharedSegment.create("pdserve-999999999-attach-forged", SIZE)
    try:
        path = segment.unlink_name()
        with pytest.raises(TransferError, match="not at a pdserve segment of process"):
            SharedSegment.attach(path, SIZE)
    finally:
        segment.close()


def test_an_unlinked_pdserve_segment_attaches_through_proc():
    segment = SharedSegment.create(segment_name("attach", "ok"), SIZE)
    try:
        path = segment.unlink_name()
        assert os.readlink(path).endswith(" (deleted)")
        peer = SharedSegment.attach(path, SIZE)
        peer.close(unlink=False)
    finally:
        segment.close()


def test_a_symlink_in_dev_shm_is_refused(foreign_fd):
    with tempfile.NamedTemporaryFile(dir="/tmp") as target:
        target.write(b"\0" * SIZE)
        target.flush()
        name = segment_name("attach", "link")
        link = os.path.join(SHM_DIR, name)
        os.symlink(target.name, link)
        try:
            with pytest.raises(TransferError, match="symbolic link"):
                SharedSegment.attach(name, SIZE)
        finally:
            os.unlink(link)


def test_a_fifo_in_dev_shm_is_refused():
    name = segment_name("attach", "fifo")
    os.mkfifo(os.path.join(SHM_DIR, name))
    try:
        with pytest.raises(TransferError, match="not a regular file"):
            SharedSegment.attach(name, SIZE)
    finally:
        os.unlink(os.path.join(SHM_DIR, name))


@pytest.mark.parametrize("name", ["passwd", "../pdserve-1-x", "pdserve-x-y", "", "a/b"])
def test_names_that_are_no_pdserve_segment_are_refused(name):
    with pytest.raises(TransferError):
        SharedSegment.attach(name, SIZE)


def test_attach_peer_names_the_region_whose_segment_is_foreign(foreign_fd):
    with ShmTransport(name="attachtest") as transport:
        with pytest.raises(TransferError, match="region 3: .*not at a pdserve segment"):
            transport.attach_peer("peer", [RegionDescriptor(3, SIZE, f"/proc/{os.getpid()}/fd/{foreign_fd}", None)])


def test_duplicate_region_ids_are_refused_by_attach_peer():
    segment = SharedSegment.create(segment_name("attach", "dup"), SIZE)
    try:
        with ShmTransport(name="duptest") as transport:
            with pytest.raises(TransferError, match="region 0 is described more than once"):
                transport.attach_peer("peer", [RegionDescriptor(0, SIZE, segment.name, None)] * 2)
    finally:
        segment.close()


def test_create_allocates_every_page():
    segment = SharedSegment.create(segment_name("alloc", "full"), 1 << 20)
    try:
        st = os.stat(os.path.join(SHM_DIR, segment.name))
        assert st.st_blocks * 512 >= 1 << 20, "a sparse segment would SIGBUS when /dev/shm fills up"
    finally:
        segment.close()


def test_create_beyond_dev_shm_is_a_transfer_error_with_the_numbers():
    usage = os.statvfs(SHM_DIR)
    total = usage.f_blocks * usage.f_frsize
    if total == 0:
        pytest.fail(f"{SHM_DIR} reports no size limit; this test needs a bounded tmpfs")
    name = segment_name("alloc", "huge")
    need = total + (1 << 30)
    with pytest.raises(TransferError) as info:
        SharedSegment.create(name, need)
    message = str(info.value)
    assert f"not enough space in {SHM_DIR} for {name}: need {need} bytes, free " in message
    assert not os.path.exists(os.path.join(SHM_DIR, name)), "the failed segment is removed"
