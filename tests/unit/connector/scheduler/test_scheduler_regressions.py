from pdserve.config import TransferMode
from tests.unit.connector.scheduler.scheduler_fakes import (
    ROUTER_ID,
    FakeBlocks,
    FakeRequest,
    SchedulerOutput,
    consumer_params,
    make_scheduler,
)


def test_no_async_promise_after_the_transfer_was_cancelled():
    """After a zero-external allocation cancelled the transfer (P was told to let go), a later
    scheduling of the same request (preemption resets num_computed_tokens) must not be promised a
    remote load: update_state_after_alloc would emit no RecvSpec and the request would wait in
    WAITING_FOR_REMOTE_KVS forever."""
    s = make_scheduler("kv_consumer", TransferMode.WRITE)
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    s.scheduler.get_num_new_matched_tokens(request, 0)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), 0)  # e.g. skip_reading_prefix_cache
    s.scheduler.build_connector_meta(SchedulerOutput({}))
    count, is_async = s.scheduler.get_num_new_matched_tokens(request, 0)
    if is_async:
        s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), count)
        assert s.scheduler.build_connector_meta(SchedulerOutput({})).recvs, "promised a load nobody will do"
