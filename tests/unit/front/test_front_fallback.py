"""A request survives the death of the instance serving it: the front, in front of a fake router and
two fake instances (decode, prefill) on real sockets, resends once to a live instance what failed
before its first byte, routes around an instance its probes find down, never resends what may still
run upstream, and counts all of it on its /metrics."""

import json
import socket
import time

import pytest
import requests

from pdserve.bench.samples import parse_samples
from pdserve.front.body import RequestBody
from pdserve.front.config import Upstream
from pdserve.front.instances import InstancePool
from pdserve.front.metrics import FrontMetrics
from pdserve.front.routes import Routes
from tests.unit.front.fake_upstream import running, serve_raw
from tests.unit.front.test_front import openai_error

BASE = 27400  # 27400-27454: a test's front on BASE + 5k, its fakes on the 4 ports after it
BODY = {"model": "m", "prompt": "hi", "max_tokens": 4}
HEAD_ONLY = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"


def instances(port: int) -> tuple[tuple[str, int], ...]:
    """The fallback sources of a front on `port` (its router fake is on port + 1), decode first."""
    return ("decode", port + 2), ("prefill", port + 3)


def front_metrics(run) -> dict[str, float]:
    response = requests.get(f"{run.url}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse_samples(response.text)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def instance_up(run, name: str) -> float:
    return front_metrics(run)[f'pdserve:instance_up{{instance="{name}"}}']


def answered_by(run) -> str:
    """Which fake answered a completion sent to the front (the request as the client sent it)."""
    response = requests.post(f"{run.url}/v1/completions", json=BODY, timeout=10)
    assert response.status_code == 200, response.text
    assert json.loads(response.json()["body"]) == BODY
    return response.json()["upstream"]


def served_by_instances(run) -> list[str]:
    return [each for fake in run.instances.values() for each in fake.served]


@pytest.mark.parametrize("status", [500, 502, 503])
def test_a_router_5xx_is_resent_once_to_a_live_instance(status):
    with running(BASE, instances=instances(BASE)) as run:
        run.upstream.status = status
        assert answered_by(run) in ("decode", "prefill")
        assert run.upstream.served == ["POST /v1/completions"] and len(served_by_instances(run)) == 1
        assert front_metrics(run)['pdserve:requests_retried_total{reason="upstream_5xx"}'] == 1


def test_a_router_gateway_timeout_is_not_resent():  # its instance may still be computing the request
    with running(BASE + 45, instances=instances(BASE + 45)) as run:
        run.upstream.status = 504
        response = requests.post(f"{run.url}/v1/completions", json=BODY, timeout=10)
        assert response.status_code == 504 and served_by_instances(run) == []


@pytest.mark.parametrize("reply, reason", [(None, "connect"), (b"", "disconnected"),
                                           (HEAD_ONLY, "broke_before_first_byte")])
def test_a_router_connection_failing_before_the_first_byte_is_resent(reply, reason):
    router_port = BASE + 9  # nothing listens there unless `reply` is given
    with running(BASE + 5, upstream_port=router_port, instances=instances(BASE + 5)) as run:
        server = run.call(serve_raw(router_port, reply)) if reply is not None else None
        try:
            assert answered_by(run) in ("decode", "prefill")
            assert front_metrics(run)[f'pdserve:requests_retried_total{{reason="{reason}"}}'] == 1
        finally:
            if server is not None:
                server.close()


def test_client_errors_and_a_silent_upstream_are_not_resent():
    silent_port = BASE + 14
    with running(BASE + 10, instances=instances(BASE + 10), idle_timeout=0.5) as run:
        error = openai_error(requests.get(f"{run.url}/router-400", timeout=10), 400)
        assert error["message"].startswith("Failed to parse the request body as JSON")
        error = openai_error(requests.get(f"{run.url}/slow?s=3", timeout=10), 504)  # silent before its head
        assert error["message"].startswith("the router sent no answer")
        assert served_by_instances(run) == []
    with running(BASE + 10, upstream_port=silent_port, instances=instances(BASE + 10), idle_timeout=0.5) as run:
        server = run.call(serve_raw(silent_port, HEAD_ONLY, hold_s=2))  # silent after its head
        try:
            openai_error(requests.post(f"{run.url}/v1/completions", json=BODY, timeout=10), 504)
        finally:
            server.close()
        assert served_by_instances(run) == []
        assert not [key for key in front_metrics(run) if key.startswith("pdserve:requests_retried_total")]


def test_while_an_instance_is_down_requests_go_around_the_router_until_it_is_back():
    with running(BASE + 15, instances=instances(BASE + 15)) as run:
        decode = run.instances["decode"]
        run.stop(decode)
        wait_for(lambda: instance_up(run, "decode") == 0)
        assert [answered_by(run) for _ in range(3)] == ["prefill"] * 3
        assert run.upstream.served == []  # the router would have sent some to the dead decode
        run.start(decode)
        wait_for(lambda: instance_up(run, "decode") == 1)
        assert answered_by(run) == "upstream"  # through the router again
        samples = front_metrics(run)
        assert samples["pdserve:requests_routed_around_total"] == 3
        assert not [key for key in samples if key.startswith("pdserve:requests_retried_total")]


def test_with_every_instance_dead_the_answer_is_a_503_naming_them():
    with running(BASE + 20, instances=instances(BASE + 20)) as run:
        for fake in run.instances.values():
            run.stop(fake)
        wait_for(lambda: instance_up(run, "decode") == instance_up(run, "prefill") == 0)
        error = openai_error(requests.post(f"{run.url}/v1/completions", json=BODY, timeout=10), 503)
        assert error["message"] == "no live instance to serve the request: the decode is down; the prefill is down"
        assert run.upstream.served == []
        assert front_metrics(run)["pdserve:requests_failed_no_instance_total"] == 1


def test_a_resend_that_fails_too_is_a_503_naming_both_failures():
    with running(BASE + 25, instances=instances(BASE + 25)) as run:
        run.stop(run.instances["prefill"])
        wait_for(lambda: instance_up(run, "prefill") == 0)
        run.instances["decode"].status = 503  # healthy, yet failing every request
        error = openai_error(requests.post(f"{run.url}/v1/completions", json=BODY, timeout=10), 503)
        assert error["message"] == ("no live instance to serve the request: the decode answered 503: Decode server "
                                    "error: 503; the prefill is down")  # no internal address: they are logged
        samples = front_metrics(run)
        assert samples["pdserve:requests_routed_around_total"] == 1
        assert samples["pdserve:requests_failed_no_instance_total"] == 1


def test_a_client_leaving_during_the_resend_cancels_it():
    with running(BASE + 30, instances=instances(BASE + 30)) as run:
        run.upstream.status = 502
        with socket.create_connection(("127.0.0.1", BASE + 30), timeout=10) as client:
            client.sendall(b"GET /slow?s=30 HTTP/1.1\r\nHost: x\r\n\r\n")
            wait_for(lambda: "GET /slow?s=30" in served_by_instances(run))
        wait_for(lambda: sum(fake.num_slow_cancelled for fake in run.instances.values()) == 1)
        wait_for(lambda: run.front.num_in_flight == 0)
        assert run.upstream.served == ["GET /slow?s=30"]


def test_the_metrics_page_counts_in_prometheus_text_format():
    with running(BASE + 35, instances=instances(BASE + 35)) as run:
        text = requests.get(f"{run.url}/metrics", timeout=10).text
        assert text.splitlines() == [
            "# TYPE pdserve:instance_up gauge",
            'pdserve:instance_up{instance="decode"} 1',
            'pdserve:instance_up{instance="prefill"} 1',
            "# TYPE pdserve:requests_continued_total counter",
            "pdserve:requests_continued_total 0",
            "# TYPE pdserve:requests_failed_no_instance_total counter",
            "pdserve:requests_failed_no_instance_total 0",
            "# TYPE pdserve:requests_routed_around_total counter",
            "pdserve:requests_routed_around_total 0"]
        run.upstream.status = 502
        for _ in range(2):
            answered_by(run)
        text = requests.get(f"{run.url}/metrics", timeout=10).text
        assert ("# TYPE pdserve:requests_retried_total counter\n"
                'pdserve:requests_retried_total{reason="upstream_5xx"} 2\n') in text
        assert run.upstream.served == ["POST /v1/completions"] * 2  # /metrics is the front's own


def test_without_instances_to_fall_back_on_nothing_is_resent():
    router_port = BASE + 44
    with running(BASE + 40) as run:
        run.upstream.status = 502
        error = openai_error(requests.post(f"{run.url}/v1/completions", json=BODY, timeout=10), 502)
        assert error["message"] == "Decode server error: 502"
        assert requests.get(f"{run.url}/metrics", timeout=10).status_code == 502  # the upstream's /metrics
        assert run.upstream.served == ["POST /v1/completions", "GET /metrics"]
    with running(BASE + 40, upstream_port=router_port) as run:
        server = run.call(serve_raw(router_port, HEAD_ONLY))
        try:
            error = openai_error(requests.post(f"{run.url}/v1/completions", json=BODY, timeout=10), 502)
        finally:
            server.close()
        assert error["message"].startswith("the router broke off its answer before its body")


def test_routes_go_around_a_down_instance_for_echo_with_logprobs_too():
    router, decode, prefill = (Upstream(name, "127.0.0.1", port) for name, port in
                               (("router", 1), ("decode", 2), ("prefill", 3)))
    metrics = FrontMetrics()
    pool = InstancePool((decode, prefill), metrics)
    routes = Routes(router, (decode,), pool, metrics)
    echo = RequestBody.parse(json.dumps({"model": "m", "prompt": "hi", "echo": True, "logprobs": 1}).encode())
    plain = RequestBody.parse(json.dumps(BODY).encode())
    assert routes.pick("POST", "/v1/completions", echo) == decode
    assert routes.pick("POST", "/v1/completions", plain) == router
    pool.mark_down(decode, "connection refused")
    assert [routes.pick("POST", "/v1/completions", body) for body in (echo, plain)] == [prefill, prefill]
    pool.mark_down(prefill, "connection refused")
    assert routes.pick("POST", "/v1/completions", plain) is None
    assert 'pdserve:instance_up{instance="decode"} 0' in metrics.render()
    assert "pdserve:requests_routed_around_total 2" in metrics.render()


def test_an_instance_answering_its_probes_late_is_down_only_after_several(monkeypatch):
    from pdserve.front import instances as pool_module

    monkeypatch.setattr(pool_module, "PROBE_TIMEOUT_S", 0.2)
    with running(BASE + 50, instances=instances(BASE + 50)) as run:
        prefill = run.instances["prefill"]
        probes = len(prefill.requests)
        prefill.health_delay = 1.0  # loaded, not dead
        wait_for(lambda: len(prefill.requests) >= probes + 2)  # one probe timed out, the next is out
        assert instance_up(run, "prefill") == 1
        assert answered_by(run) == "upstream"  # still through the router
        wait_for(lambda: instance_up(run, "prefill") == 0)  # the third in a row
        prefill.health_delay = 0.0
        wait_for(lambda: instance_up(run, "prefill") == 1)
