"""The Responses API in process, around the session's engine and a gate that keeps what it is given: each
response, whole or streamed, is admitted and billed exactly once, under its x-request-id; a refused one is neither.
The app has no batch dir here, so its responses are stored in memory. And /openapi.json documents the routes."""

import openai
import pytest
from live_server import ServedApp

from carpool.server.app import create_app
from carpool.server.open_gate import RecordingGate


def test_each_response_is_billed_once_under_its_id(engine):
    gate = RecordingGate()
    with ServedApp(create_app(engine, gate, model_name="tiny")) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", max_retries=0)
        whole = client.responses.create(input="Hi", max_output_tokens=4, temperature=0)
        streamed = list(client.responses.create(input="Hi", max_output_tokens=4, temperature=0, stream=True))
        with pytest.raises(openai.BadRequestError):
            client.responses.create(input="Hi", reasoning={"effort": "low"})
        with pytest.raises(openai.NotFoundError):
            client.responses.create(input="Hi", previous_response_id="resp_unknown")
        final = streamed[-1].response
        assert client.responses.retrieve(final.id).output_text == final.output_text
    # Billed under the x-request-id each client was answered with (the ledger's request id), once each.
    assert gate.admitted == [record.request_id for record in gate.records]
    assert gate.records[0].request_id == whole._request_id and len({r.request_id for r in gate.records}) == 2
    for record, response in zip(gate.records, (whole, final), strict=True):
        assert record.prompt_tokens == response.usage.input_tokens
        assert record.output_tokens == response.usage.output_tokens
        assert record.cached_tokens == response.usage.input_tokens_details.cached_tokens


def test_openapi_documents_the_routes_and_their_errors(engine):
    with ServedApp(create_app(engine, RecordingGate(), model_name="tiny")) as http:
        schema = http.get("/openapi.json").json()
    paths = schema["paths"]
    assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}
    create = paths["/v1/responses"]["post"]
    assert {"400", "404"} <= set(create["responses"]) and "422" not in create["responses"]
    assert "ResponsesRequest" in schema["components"]["schemas"]
    for operation in paths["/v1/responses/{response_id}"].values():
        assert operation["responses"]["404"]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")
