"""The LLM proposer against a local stub of an OpenAI-compatible server (loopback only)."""

import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from kernelmill.agents.space import Space
from kernelmill.agents.strategies.llm import LlmProposer
from kernelmill.kernels.ops import get_op

ANSWERS: list = []  # what the stub answers next, one per request
PROMPTS: list = []  # the prompts it was sent, for the tests to check (an assert in the handler was a 500)


@pytest.fixture(autouse=True)
def _fresh_exchange():
    ANSWERS.clear()
    PROMPTS.clear()
    yield
    assert not ANSWERS, f"answers never asked for: {ANSWERS}"


def _asked_about_softmax() -> None:
    assert PROMPTS and all(p["op"] == "softmax" and "block_row" in p["families"] for p in PROMPTS), PROMPTS


def _stub() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        PROMPTS.append(json.loads(body["messages"][1]["content"]))
        answer = ANSWERS.pop(0)
        if isinstance(answer, Response):  # sent as it is: a body that is not the usual JSON
            return answer
        if answer == "500":
            from fastapi.responses import PlainTextResponse

            return PlainTextResponse("overloaded", status_code=500)
        return {"choices": [{"message": {"role": "assistant", "content": answer}}]}

    return app


@pytest.fixture(scope="module")
def stub_url():
    # The socket is handed to uvicorn bound (a port freed and bound again could be taken meanwhile), and the wait
    # for it has a deadline (it waited for ever where uvicorn could not start).
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_stub(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the stub LLM server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(5)
    sock.close()


@pytest.fixture
def space():
    return Space(get_op("softmax"), "float16")


def test_valid_answers_are_used_with_reasons_and_invalid_dropped(stub_url, space):
    good = {"vec": 8, "unroll": 4, "threads": 512, "fast_exp": True}
    answer = {
        "candidates": [
            {"family": "block_row", "params": good, "reason": "wider rows"},
            {"family": "block_row", "params": {**good, "vec": 3}, "reason": "not an allowed value"},
            {"family": "block_row", "params": {**good, "vec": 8, "unroll": 16}, "reason": "breaks a constraint"},
            {"family": "no_such", "params": good},
            "garbage",
        ]
    }
    ANSWERS.append("Sure!\n```json\n" + json.dumps(answer) + "\n```")
    batch = LlmProposer(url=stub_url).propose(space, [], 3)
    assert len(batch) == 3
    assert batch[0].family == "block_row" and batch[0].params == good and batch[0].note == "llm: wider rows"
    assert all(c in space for c in batch)
    assert all("guided" in c.note for c in batch[1:])  # the rest came from the fallback
    _asked_about_softmax()


def _choice(content) -> Response:
    return Response(json.dumps({"choices": [{"message": {"content": content}}]}), media_type="application/json")


@pytest.mark.parametrize(
    "bad",
    ["500", "no json here", json.dumps({"candidates": "nope"}), _choice(None), _choice({"candidates": []})],
    ids=["500", "no-json", "not-a-list", "null-content", "object-content"],
)
def test_bad_answers_fall_back_to_guided(stub_url, space, bad):
    ANSWERS.append(bad)
    batch = LlmProposer(url=stub_url).propose(space, [], 4)
    assert len(batch) == 4 and all("unusable" in c.note and "guided" in c.note for c in batch)
    _asked_about_softmax()  # a 500 is the stub's answer, not a prompt it refused


def test_no_endpoint_means_guided(space, monkeypatch):
    monkeypatch.delenv("KERNELMILL_LLM_URL", raising=False)
    batch = LlmProposer().propose(space, [], 2)
    assert len(batch) == 2 and all("no LLM endpoint" in c.note for c in batch)


@pytest.mark.parametrize("where", ["content", "body"])
def test_json_nested_too_deep_falls_back_to_guided(stub_url, space, where):
    """json.loads raises RecursionError past ~1000 levels, which the proposer let through: the job failed."""
    nested = "[" * 100_000 + "]" * 100_000
    if where == "content":
        ANSWERS.append('{"candidates": ' + nested + "}")
    else:
        ANSWERS.append(Response(nested, media_type="application/json"))
    batch = LlmProposer(url=stub_url).propose(space, [], 3)
    assert len(batch) == 3 and all("unusable" in c.note and "guided" in c.note for c in batch)


def test_a_long_answer_of_unclosed_braces_is_refused_in_linear_time():
    """The search for a JSON object backtracked from every '{': 100000 of them took ~5 s, a megabyte ~10 min."""
    from kernelmill.agents.strategies.llm import parse_answer

    started = time.monotonic()
    with pytest.raises(ValueError, match="no JSON object"):
        parse_answer("{" * 100_000)
    assert time.monotonic() - started < 1.0
    assert parse_answer('Sure!\n```json\n{"candidates": [{"family": "x"}]}\n```') == [{"family": "x"}]


def _streamed(pieces: int, piece: bytes, pause_s: float) -> StreamingResponse:
    """``pieces`` of ``piece`` (JSON's whitespace), ``pause_s`` apart, then a valid answer of one candidate."""
    good = {"vec": 8, "unroll": 4, "threads": 512, "fast_exp": True}
    answer = json.dumps({"candidates": [{"family": "block_row", "params": good}]})

    async def body():
        import asyncio

        for _ in range(pieces):
            yield piece
            await asyncio.sleep(pause_s)
        yield json.dumps({"choices": [{"message": {"content": answer}}]}).encode()

    return StreamingResponse(body(), media_type="application/json")


@pytest.mark.parametrize(
    ("pieces", "piece", "pause_s", "said"),
    [
        (60, b" ", 0.05, "ReadTimeout: no whole answer within 0.5 s"),  # a byte at a time: 3 s in all
        (80, b" " * 65536, 0.0, "over 1048576 bytes"),  # 5 MiB: read whole into memory
    ],
    ids=["trickled", "huge"],
)
def test_an_answer_slower_than_the_timeout_or_too_large_falls_back_unread(
    stub_url, space, pieces, piece, pause_s, said
):
    """httpx's timeout bounds each read, not the answer: a server that sent a byte within each kept the job
    waiting as long as it liked, and any size was read into memory."""
    ANSWERS.append(_streamed(pieces, piece, pause_s))
    proposer = LlmProposer(url=stub_url)
    proposer.timeout_s = 0.5
    started = time.monotonic()
    batch = proposer.propose(space, [], 2)
    assert time.monotonic() - started < 2.0
    assert len(batch) == 2 and all(said in c.note and "guided" in c.note for c in batch), batch[0].note


def test_an_item_whose_family_is_not_a_name_is_dropped_alone(stub_url, space):
    """A family given as a list or an object raised TypeError in the lookup, and the valid items beside it were
    dropped with it."""
    good = {"vec": 8, "unroll": 4, "threads": 512, "fast_exp": True}
    items = [{"family": ["block_row"], "params": good}, {"family": {}}, {"family": "block_row", "params": good}]
    ANSWERS.append(json.dumps({"candidates": items}))
    batch = LlmProposer(url=stub_url).propose(space, [], 1)
    assert [(c.family, c.params, c.note) for c in batch] == [("block_row", good, "llm: ")]


def test_an_endpoint_that_timed_out_is_not_asked_again_in_that_search(stub_url, space):
    """Each batch waited out the timeout again (30 s by default): a search of 64 batches spent half an hour of
    its time budget on a server that did not answer."""
    ANSWERS.append(_streamed(40, b" ", 0.05))  # 2 s, against a timeout of 0.3 s
    proposer = LlmProposer(url=stub_url)
    proposer.timeout_s = 0.3
    first = proposer.propose(space, [], 2)
    started = time.monotonic()
    second = proposer.propose(space, [], 2)
    assert time.monotonic() - started < 0.25 and len(PROMPTS) == 1
    assert all("ReadTimeout" in c.note for c in first)
    assert len(second) == 2 and all(c.note.startswith("the LLM timed out earlier in this search") for c in second)


def test_an_endpoint_url_httpx_cannot_parse_falls_back_naming_the_setting(space):
    """httpx.InvalidURL is not an httpx.HTTPError: a typo in KERNELMILL_LLM_URL failed every llm job."""
    proposer = LlmProposer(url="http://[::1/v1")  # the "]" missing
    for _ in range(2):  # the second batch says the same, asking nothing
        batch = proposer.propose(space, [], 2)
        assert len(batch) == 2 and all(c.note.startswith("KERNELMILL_LLM_URL 'http://[::1/v1' ") for c in batch)
