"""Fuzz `specx serve` over its own OpenAPI schema (schemathesis): no input gives a 5xx, and every
4xx is in OpenAI's error shape. A small --ctx keeps each generated request short."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402

from tests.serve_util import Server  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    srv = Server.start(
        [
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--budget",
            "4",
            "--max-new-tokens",
            "2",
            "--ctx",
            "40",
            "--max-queue",
            "4",
        ],
        tmp_path_factory.mktemp("fuzz"),
    )
    yield srv
    assert srv.stop() == 0
    assert "Traceback" not in srv.stderr(), srv.stderr()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.base}/openapi.json")
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]  # valid and invalid inputs
    schema.config.generation.update(modes=modes, max_examples=12, deterministic=True)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_errors_in_openai_shape(case, fuzz_server):
    res = case.call(base_url=fuzz_server.base, timeout=60)
    assert res.status_code < 500, (case.as_curl_command(), res.text)
    if res.status_code >= 400:
        err = res.json().get("error")
        assert isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err), res.text
