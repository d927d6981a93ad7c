"""What one instance can do to a real `rackserve router` over the sockets between them: an answer to
GET /kv_events that is not a rackserve instance's (one started with --api-key the router lacks: 401;
any other server: its 404) leaves that instance out and nothing else, and KV event messages that
are malformed (wrong frame count, undecodable, an event the index cannot hold) each cost one batch
of that instance, never its subscription; an answer without end costs its client a 502, not the
router its memory. The instance here is a small real HTTP server with a real
ZMQ PUB socket, so it can send what no rackserve instance would."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec
import pytest
import zmq

from rackserve.distributed.parallel_state import free_port
from rackserve.engine.kv_events import BlockStored, KVEventBatch
from tests.server_utils import metric_totals, start_command
from tests.tokenizer_utils import save_test_tokenizer

BS = 16
ANSWER_BOUND = 4 << 20
KEY_REFUSED = (401, {"error": {"message": "Incorrect or missing API key", "type": "invalid_request_error",
                               "param": None, "code": "invalid_api_key"}})


class Peer:
    """An HTTP server answering each path from `self.answers` (path -> (status, JSON body))."""

    def __init__(self, answers: dict[str, tuple[int, object]]) -> None:
        self.answers = answers
        peer = self

        class _Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = peer.answers.get(self.path, (404, {"detail": "Not Found"}))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:   # an answer without end (no length: it would end at close)
                self.rfile.read(int(self.headers["content-length"]))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                try:
                    while True:
                        self.wfile.write(b" " * (1 << 20))
                except OSError:
                    pass

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pool(tmp_path):
    """(router URL, router log, the good peer, its PUB socket, the refusing peer)."""
    save_test_tokenizer(str(tmp_path / "tok"), 512)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    info = {"enable_kv_cache_events": True, "tokenizer": str(tmp_path / "tok"), "served_model_name": "tiny",
            "endpoints": [endpoint], "replay_endpoints": [None], "topic": "kv", "block_size": BS,
            "data_parallel_size": 1, "max_model_len": 1024}
    good = Peer({"/health": (200, {}), "/kv_events": (200, info)})
    keyed = Peer({"/health": (200, {}), "/kv_events": KEY_REFUSED})
    log = tmp_path / "router.log"
    router, url = start_command(["router", "--health-interval", "0.2", "--health-timeout", "1",
                                 "--max-answer-bytes", str(ANSWER_BOUND),
                                 "--worker", good.url, "--worker", keyed.url], log, timeout=60)
    try:
        yield url, log, good, pub, keyed
    finally:
        router.terminate()
        router.wait(timeout=30)
        good.close()
        keyed.close()
        pub.close()


def _wait_for(check, what: str, timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_an_instance_that_is_not_a_rackserve_one_is_left_out_alone(pool):
    url, log, good, _, keyed = pool
    assert metric_totals(url)["rackserve_router:healthy_instances"] == 1
    assert "left out: HTTP 401" in log.read_text()
    keyed.answers["/kv_events"] = (404, {"detail": "Not Found"})   # another server altogether
    _wait_for(lambda: "left out: HTTP 404" in log.read_text(), "the router said why")
    # The health checks go on for the others: one that stops answering leaves, and comes back.
    good.answers["/health"] = (503, {})
    _wait_for(lambda: metric_totals(url)["rackserve_router:healthy_instances"] == 0, "the good peer left")
    good.answers["/health"] = (200, {})
    _wait_for(lambda: metric_totals(url)["rackserve_router:healthy_instances"] == 1, "the good peer came back")
    assert log.read_text().count("left out: HTTP 401") == 1   # said once, not at every check


def _batch(block_size: int, group_idx: int | None = None) -> bytes:
    event = BlockStored([12345], None, list(range(block_size)), block_size, None, None, group_idx=group_idx)
    return msgspec.msgpack.encode(KVEventBatch(time.time(), [event], 0))


def test_malformed_kv_events_cost_one_batch_each_never_the_subscription(pool):
    url, _, _, pub, _ = pool

    def counts() -> tuple[float, float]:
        m = metric_totals(url)
        return (m.get("rackserve_router:kv_event_batches_received_total", 0),
                m.get("rackserve_router:kv_event_batches_dropped_total", 0))

    def heard() -> bool:   # a SUB socket hears nothing until its subscription has reached the PUB
        pub.send_multipart([b"kv", (0).to_bytes(8, "big"), _batch(BS)])
        return counts()[0] == 1
    _wait_for(heard, "the router subscribed")
    pub.send_multipart([b"kv", (1).to_bytes(8, "big"), _batch(BS + 1, group_idx=0)])   # not whole engine blocks
    pub.send_multipart([b"kv", (2).to_bytes(8, "big"), b"\xc1not msgpack"])
    pub.send_multipart([b"kv", b"two frames"])
    pub.send_multipart([b"kv", (3).to_bytes(8, "big"), _batch(BS)])
    _wait_for(lambda: counts() == (2, 3), f"batches 0 and 3 applied, three dropped: {counts()}")
    assert metric_totals(url)["rackserve_router:index_blocks"] == 1


def test_an_answer_without_end_costs_its_client_a_502_not_the_router_its_memory(pool):
    url = pool[0]
    answer = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}, timeout=30)
    assert answer.status_code == 502
    assert "--max-answer-bytes" in answer.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200
