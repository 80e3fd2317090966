"""``tandem status``'s text from the controller's answer."""

from __future__ import annotations

from tandem.cli import format_status

PREFILL = {"worker_id": "prefill-0", "draining": False, "pid": 4242, "node": "tandem-prefill-abc12", "load": {
    "worker_id": "prefill-0", "queued_prefill_tokens": 300, "running_chunks": 2, "waiting": 1,
    "prefix_cache_queries": 9, "prefix_cache_hits": 4, "sending": 1}}
DECODE = {"worker_id": "decode-0", "draining": False, "load": {
    "worker_id": "decode-0", "free_blocks": 1000, "total_blocks": 1024, "running": 3, "waiting": 0,
    "waiting_for_kv": 1}}


def test_fixed_pools_list_each_worker_with_its_load_and_say_autoscaling_is_off():
    text = format_status({"model": "m", "pools": {"decode": [DECODE], "prefill": [PREFILL]}, "autoscaling": None})
    assert text.splitlines() == [
        "model m",
        "prefill: 1 worker",
        "  prefill-0                300 prompt tokens queued, 2 prefilling, 1 sending  [pid 4242 on tandem-prefill-abc12]",
        "decode: 1 worker",
        "  decode-0                 3 running, 0 waiting, 1 waiting for KV, KV 24/1024 blocks",
        "autoscaling: off (pools of fixed size)",
    ]


def test_autoscaled_pools_show_targets_draining_workers_and_the_latest_decisions():
    draining = {"worker_id": "decode-1", "draining": True, "load": None}
    scaling = {
        "pending": {"prefill": 0, "decode": -1},
        "targets": {"prefill": {"workers": 1, "target": 1, "min": 1, "max": 2},
                    "decode": {"workers": 1, "target": 1, "min": 1, "max": 4}},
        "decisions": [{"at": 0.5, "ago_s": 13.0, "action": "add", "role": "decode", "count": 3,
                       "reason": "ITL 61 ms over the SLO's 50 ms"},
                      {"at": 1.0, "ago_s": 12.5, "action": "remove", "role": "decode", "count": 1,
                       "reason": "idle for 30 s"}],
        "slo": {"ttft_ms": 1000, "itl_ms": 50},
        "router_latency": {"ttft_ms": 812.4, "itl_ms": None, "requests": 7, "tokens": 0},
    }
    text = format_status({"model": "m", "pools": {"prefill": [PREFILL], "decode": [DECODE, draining]},
                          "autoscaling": scaling})
    assert "decode: 1 worker  (target 1, min 1, max 4)" in text
    assert "  decode-1 (draining)      no answer" in text
    assert ("clients saw: TTFT p90 812 ms, ITL p90 - over 7 requests, 0 tokens  (SLO: TTFT 1000 ms, ITL 50 ms)"
            in text)
    assert text.splitlines()[-3:] == ["autoscaling decisions (latest last):",
                                      "     13.0 s ago  add 3 decode: ITL 61 ms over the SLO's 50 ms",
                                      "     12.5 s ago  remove decode: idle for 30 s"]


def test_a_replacement_still_starting_is_shown_and_not_counted():
    starting = {"worker_id": "decode-1", "draining": False, "starting": True, "load": None}
    text = format_status({"model": "m", "pools": {"prefill": [PREFILL], "decode": [starting, DECODE]},
                          "autoscaling": None})
    assert "decode: 1 worker" in text
    assert "  decode-1                 starting (waiting for room, or loading)" in text


def test_request_and_status_talk_to_the_server_with_the_key(monkeypatch, capsys):
    """``tandem request`` and ``tandem status`` against a stand-in server: the key from
    ``$TANDEM_API_KEY`` goes along, a 401 is printed with its body, a missing server named."""
    import http.server
    import json
    import threading

    from tandem.cli import main

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, body: dict) -> None:
            seen.append((self.command, self.path, self.headers.get("authorization")))
            if self.headers.get("authorization") != "Bearer k":
                self.send_response(401)
                self.end_headers()
                self.wfile.write(b'{"error": "bad key"}')
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def do_GET(self):
            self._answer({"model": "m", "pools": {"decode": [DECODE]}, "autoscaling": None})

        def do_POST(self):
            sent = json.loads(self.rfile.read(int(self.headers["content-length"])))
            self._answer({"choices": [{"text": f"echo {sent['prompt']}", "finish_reason": "length"}],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 2}})

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        monkeypatch.setenv("TANDEM_API_KEY", "k")
        assert main(["status", "--url", url]) == 0
        assert "decode-0" in capsys.readouterr().out
        assert main(["request", "hi", "--url", url]) == 0
        assert capsys.readouterr().out.strip() == "echo hi"
        assert main(["status", "--url", url, "--api-key", "wrong"]) == 1
        assert "error 401" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [("GET", "/status", "Bearer k"), ("POST", "/v1/completions", "Bearer k"),
                    ("GET", "/status", "Bearer wrong")]
    assert main(["status", "--url", url, "--timeout", "2"]) == 1
    assert "no server at" in capsys.readouterr().err
