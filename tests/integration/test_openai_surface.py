"""The shared read deployment (pool.py: P, D, vllm-router and the front, as `pdserve up --mode read`)
as an OpenAI endpoint: /v1/models through the endpoint (vllm-router's PD discovery mode alone
answers 503), the official client's streaming, errors in OpenAI's shape.
Write mode gets the same checks in test_drain.py, on the deployment that test then stops."""

import pytest
import requests

from pdserve.model.build import resolve_model
from tests.integration.openai_checks import check_error_shapes, check_openai_client
from tests.integration.pool import shared

pytestmark = pytest.mark.integration

cluster = shared("pd-read")


def test_models_answer_through_the_endpoint_not_the_router_alone(cluster):
    model = str(resolve_model("tiny"))
    assert requests.get(f"{cluster.endpoint}/v1/models", timeout=30).json()["data"][0]["id"] == model
    router = requests.get(f"{cluster.deployment.router.url}/v1/models", timeout=30)
    assert router.status_code == 503 and router.text == "No prefill servers available"  # why the front exists


def test_openai_client_lists_the_model_and_streams_max_tokens(cluster):
    check_openai_client(cluster.endpoint, str(resolve_model("tiny")))


def test_errors_are_openai_shaped_and_name_the_cause(cluster):
    check_error_shapes(cluster.endpoint, str(resolve_model("tiny")))
