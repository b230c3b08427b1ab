"""Data-parallel replicas across processes (CAF middleman over loopback): a front `troupe serve
--replica HOST:PORT` routes generations to another `troupe serve --publish-port PORT` process
besides its own executor.

The reference is the same request served by one process alone: routing must be invisible
(greedy and seeded outputs, logprobs, stop strings equal). Failure paths use real processes
killed with SIGKILL: a replica dying mid-generation, coming back on its port, a front dying while
the replica runs its generations, a replica of another model.
"""
import contextlib
import http.client
import json
import re
import signal
import subprocess
import threading
import time

import pytest

from serve_util import MODEL, free_port, running_server, health_ok, metrics, request, stop, TROUPE

pytestmark = pytest.mark.skipif(not MODEL.exists(), reason="default model not installed (scripts/setup.sh)")


def replica_series(port, name, replica):
    return metrics(port).get(f'{name}{{model="default",replica="{replica}"}}')


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    pytest.fail(f"{what} within {timeout} s")


def start_replica(port, http_port, *args):
    """A `troupe serve --publish-port PORT` process (not a context manager: tests kill it)."""
    proc = subprocess.Popen([TROUPE, "serve", "--host", "127.0.0.1", "--port", str(http_port), "-t", "1",
                             "--publish-port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: health_ok(http_port) or proc.poll() is not None, 60, "the replica did not start")
    assert proc.poll() is None, "the replica exited at start"
    return proc


def sse(port, body, on_token=None):
    """Streams a completion; returns (text, n_tokens, error_or_None)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    text, n, err = "", 0, None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            err = ev["error"]
            continue
        text += ev["choices"][0]["text"]
        if ev["choices"][0]["text"] or ev["choices"][0].get("finish_reason") is None:
            n += 1
            if on_token:
                on_token(n)
    conn.close()
    return text, n, err


def two_streams(front, body):
    """Starts two SSE streams of `body` through the front (fewest in flight: one runs on each side)
    and waits until both have tokens. Returns (threads, out): out[i] = sse()'s result once done."""
    progress, out = [0, 0], [None, None]

    def run(i):
        out[i] = sse(front, body, on_token=lambda n: progress.__setitem__(i, n))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    wait_for(lambda: min(progress) >= 3, 60, "both streams did not start")
    return threads, out


def expect_routed_again(front, remote):
    """The front (re)connects `remote` and sends it some of four concurrent requests."""
    wait_for(lambda: replica_series(front, "troupe_replica_up", remote) == 1, 20, "the front did not reconnect")
    before = replica_series(front, "troupe_replica_routed_total", remote)
    threads = [threading.Thread(target=request, args=(front, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 8}))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert replica_series(front, "troupe_replica_routed_total", remote) > before


PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "In 1492, Columbus", "Water boils at", "A color, as JSON:"]
# The last prompt's generation is held to a JSON schema: its grammar crosses the wire too.
COLOR = {"type": "json_schema", "json_schema": {"name": "c", "schema": {
    "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "shade": {"type": "integer"},
                                     "code": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
    "required": ["color", "shade", "code"]}}}


def bodies():
    out = []
    for i, p in enumerate(PROMPTS):
        b = {"prompt": p, "max_tokens": 24}
        if i % 3 == 0:
            b.update(temperature=0)
        elif i % 3 == 1:
            b.update(temperature=0.9, top_p=0.95, seed=1000 + i, logprobs=2, frequency_penalty=0.3)
        else:
            b.update(temperature=0, stop=["\n\n"], presence_penalty=0.5)
        if p == PROMPTS[-1]:
            b = {"prompt": p, "max_tokens": 40, "temperature": 0.9, "seed": 7, "response_format": COLOR}
        out.append(b)
    return out


@contextlib.contextmanager
def replica_and_front_with(*args):
    """A replica and a front routing to it (both with `args`); yields (front, rhttp, rport, replica)."""
    rport, rhttp = free_port(), free_port()
    replica = start_replica(rport, rhttp, *args)
    try:
        with running_server("--replica", f"127.0.0.1:{rport}", "--replica-retry-s", "0.3", *args) as (front, _):
            wait_for(lambda: replica_series(front, "troupe_replica_up", f"127.0.0.1:{rport}") == 1, 20,
                     "the front did not connect to the replica")
            yield front, rhttp, rport, replica
    finally:
        if replica.poll() is None:
            stop(replica)


@pytest.fixture
def replica_and_front():
    with replica_and_front_with() as r:
        yield r


def test_generations_spread_over_replicas_equal_one_process(replica_and_front):
    front, rhttp, rport, _ = replica_and_front
    remote = f"127.0.0.1:{rport}"
    # The reference: each request served by the replica process alone, one at a time.
    ref = []
    for b in bodies():
        st, r = request(rhttp, "POST", "/v1/completions", b)
        assert st == 200, r
        ref.append(r["choices"][0])
    made = json.loads(ref[-1]["text"])
    assert made["color"] in ("red", "green", "blue") and re.fullmatch("#[0-9a-f]{6}", made["code"])
    steps_before = metrics(rhttp)['troupe_scheduler_steps_total{model="default"}']
    routed_before = replica_series(front, "troupe_replica_routed_total", remote)

    results = [None] * len(ref)

    def run(i, b):
        results[i] = request(front, "POST", "/v1/completions", b)

    for _ in range(2):  # all at once, twice: the least loaded replica takes each
        threads = [threading.Thread(target=run, args=(i, b)) for i, b in enumerate(bodies())]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for i, (st, r) in enumerate(results):
            assert st == 200, r
            got = r["choices"][0]
            assert got["text"] == ref[i]["text"], (PROMPTS[i], got["text"], ref[i]["text"])
            assert got["finish_reason"] == ref[i]["finish_reason"]
            if ref[i]["logprobs"]:
                assert got["logprobs"]["tokens"] == ref[i]["logprobs"]["tokens"]
                assert got["logprobs"]["token_logprobs"] == pytest.approx(ref[i]["logprobs"]["token_logprobs"], abs=1e-4)

    routed = replica_series(front, "troupe_replica_routed_total", remote) - routed_before
    assert 2 <= routed <= 10, routed  # both places got work
    assert replica_series(front, "troupe_replica_in_flight", remote) == 0
    assert replica_series(front, "troupe_replica_lost_total", remote) == 0
    # The routed generations ran on the replica's engine (its HTTP side saw none of them).
    assert metrics(rhttp)['troupe_scheduler_steps_total{model="default"}'] > steps_before
    # A stream through the front equals the replica's own stream.
    b = {"prompt": "List three animals:", "max_tokens": 20, "temperature": 0}
    assert sse(front, b)[:2] == sse(rhttp, b)[:2]


def test_replica_killed_mid_generation_then_back(replica_and_front):
    front, rhttp, rport, replica = replica_and_front
    remote = f"127.0.0.1:{rport}"
    body = {"prompt": "Write a long story about a dragon.", "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    st, ref = request(rhttp, "POST", "/v1/completions", body)
    assert st == 200
    ref_text = ref["choices"][0]["text"]
    threads, out = two_streams(front, body)  # one runs on each side
    assert replica_series(front, "troupe_replica_in_flight", remote) == 1
    replica.send_signal(signal.SIGKILL)
    replica.wait()
    for t in threads:
        t.join(timeout=300)
    failed = [o for o in out if o[2] is not None]
    ok = [o for o in out if o[2] is None]
    assert len(failed) == 1 and len(ok) == 1, out
    assert ok[0][0] == ref_text
    err = failed[0][2]
    assert err["type"] == "unavailable" or "unavailable" in json.dumps(err), err
    assert remote in err["message"] and "lost" in err["message"], err
    assert 3 <= failed[0][1] < 160

    # The front keeps serving alone; its /ready says where the replica is.
    wait_for(lambda: replica_series(front, "troupe_replica_up", remote) == 0, 10, "the replica was not marked down")
    assert replica_series(front, "troupe_replica_lost_total", remote) == 1
    st, ready = request(front, "GET", "/ready")
    assert st == 200 and ready["status"] == "ready"
    assert [r["up"] for r in ready["replicas"]] == [True, False]
    for _ in range(3):
        st, r = request(front, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
        assert st == 200, r

    # Back on the same port: the front reconnects and routes to it again.
    replica = start_replica(rport, rhttp)
    try:
        expect_routed_again(front, remote)
    finally:
        stop(replica)


def test_generation_queued_on_a_lost_replica_moves_to_another():
    """A replica that runs one sequence at a time holds a second one queued (no token yet): when
    the replica dies, the running one fails and the queued one finishes on the front, with the
    output it would have had."""
    rport, rhttp = free_port(), free_port()
    replica = start_replica(rport, rhttp, "--max-num-seqs", "1")
    remote = f"127.0.0.1:{rport}"
    try:
        with running_server("--replica", remote, "--replica-retry-s", "5") as (front, _):
            wait_for(lambda: replica_series(front, "troupe_replica_up", remote) == 1, 20, "no connection")
            bodies_ = [{"prompt": p, "max_tokens": 120, "temperature": 0, "ignore_eos": True} for p in PROMPTS[:4]]
            refs = []
            for b in bodies_:
                st, r = request(rhttp, "POST", "/v1/completions", b)
                assert st == 200
                refs.append(r["choices"][0]["text"])
            progress = [0] * 4
            out = [None] * 4

            def run(i):
                out[i] = sse(front, bodies_[i], on_token=lambda n: progress.__setitem__(i, n))

            threads = []
            for i in range(4):  # in turn: local, remote, local, remote (fewest in flight)
                threads.append(threading.Thread(target=run, args=(i,)))
                threads[-1].start()
                wait_for(lambda: replica_series(front, "troupe_replica_in_flight", "local")
                         + replica_series(front, "troupe_replica_in_flight", remote) == i + 1, 10, "not routed")
            assert replica_series(front, "troupe_replica_in_flight", remote) == 2
            wait_for(lambda: sorted(progress)[1] >= 3, 60, "three streams did not start")  # 2 local + 1 remote
            assert sorted(progress)[0] == 0  # the one queued at the replica
            replica.send_signal(signal.SIGKILL)
            replica.wait()
            for t in threads:
                t.join(timeout=400)
            failed = [i for i in range(4) if out[i][2] is not None]
            assert len(failed) == 1, out
            assert "lost" in out[failed[0]][2]["message"]
            for i in range(4):
                if i not in failed:
                    assert out[i][0] == refs[i], i
            assert replica_series(front, "troupe_replica_lost_total", remote) == 2  # the running and the queued one
    finally:
        stop(replica)


def test_front_killed_replica_frees_what_it_ran():
    rport, rhttp = free_port(), free_port()
    replica = start_replica(rport, rhttp)
    try:
        fport = free_port()
        front = subprocess.Popen([TROUPE, "serve", "--host", "127.0.0.1", "--port", str(fport), "-t", "1",
                                  "--replica", f"127.0.0.1:{rport}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: health_ok(fport) and replica_series(fport, "troupe_replica_up", f"127.0.0.1:{rport}") == 1,
                     60, "the front did not connect")
            body = {"prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True}
            def client():
                try:
                    sse(fport, body)
                except OSError:  # the front is killed under it
                    pass
            for _ in range(4):
                threading.Thread(target=client, daemon=True).start()
            wait_for(lambda: metrics(rhttp)['troupe_num_requests_running{model="default"}'] >= 1, 30,
                     "nothing ran on the replica")
            assert metrics(rhttp)['troupe_kv_blocks_used{model="default"}'] > 0
        finally:
            front.send_signal(signal.SIGKILL)
            front.wait()
        # The replica sees its client actors go (the connection closed) and frees their sequences.
        wait_for(lambda: metrics(rhttp)['troupe_num_requests_running{model="default"}'] == 0
                 and metrics(rhttp)['troupe_num_requests_waiting{model="default"}'] == 0
                 and metrics(rhttp)['troupe_kv_blocks_used{model="default"}'] == 0, 15,
                 "the replica did not free the dead front's sequences")
        st, r = request(rhttp, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
        assert st == 200, r
    finally:
        stop(replica)


def test_replica_of_another_model_is_not_used(tiny_dir):
    rport, rhttp = free_port(), free_port()
    replica = start_replica(rport, rhttp, "--model", str(tiny_dir / "llama_f32_gqa2.gguf"))
    remote = f"127.0.0.1:{rport}"
    try:
        with running_server("--replica", remote, "--replica-retry-s", "0.3") as (front, _):
            def refused():
                st, ready = request(front, "GET", "/ready")
                return st == 200 and "another model" in ready["replicas"][1]["status"] and not ready["replicas"][1]["up"]
            wait_for(refused, 20, "the mismatched replica was not reported")
            for _ in range(4):
                st, r = request(front, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
                assert st == 200, r
            assert replica_series(front, "troupe_replica_routed_total", remote) == 0
    finally:
        stop(replica)


def test_bad_replica_options_are_refused():
    for args, needle in [(["--replica", "nohost"], "HOST:PORT"), (["--replica", "h:70000"], "HOST:PORT"),
                         (["--publish-port", "70000"], "publish_port"), (["--replica-retry-s", "0"], "retry_s")]:
        r = subprocess.run([TROUPE, "serve", "--port", "0", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and needle in r.stderr, (args, r.stderr)
    # A port already taken: a clear error, not a hang.
    busy = free_port()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", busy))
        s.listen()
        r = subprocess.run([TROUPE, "serve", "--port", "0", "--publish-port", str(busy)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "cannot publish" in r.stderr, r.stderr


SYSTEMS = [
    "You are a careful assistant for a shipping company. Answer questions about parcels, customs forms, "
    "delivery windows and lost items. Be brief, name the form to use, and never invent tracking numbers. "
    "Greet the customer by name when they give it.",
    "You are a tutor for high school chemistry. Explain each step of a calculation, state the units at "
    "every step, and end with one practice question of the same kind for the student to try alone.",
    "You translate short English notes into plain French for a hotel front desk. Keep the tone polite, "
    "keep names and numbers unchanged, and put the translation alone on the first line of the answer.",
]
QUESTIONS = ["What should I do first?", "How long does it take?", "Can you give an example?", "What is the most common mistake?"]


def hit_tokens(port):
    return metrics(port)['troupe_prefix_cache_hits_total{model="default"}']


@pytest.mark.parametrize("routing", ["prefix", "least_loaded"])
def test_prefix_routing_keeps_a_shared_prefix_on_one_replica(routing):
    """Requests sharing a system prompt, one at a time, interleaved across three prompts: prefix
    routing sends each prompt's followers where its first request went (9 of 12 by prefix, its
    blocks served from that replica's cache); least-loaded routing alternates, so the cache of the
    replica a prompt went to first is hit less often."""
    rport, rhttp = free_port(), free_port()
    replica = start_replica(rport, rhttp)
    remote = f"127.0.0.1:{rport}"
    try:
        with running_server("--replica", remote, "--replica-routing", routing) as (front, _):
            wait_for(lambda: replica_series(front, "troupe_replica_up", remote) == 1, 20, "no connection")
            hits0 = hit_tokens(front) + hit_tokens(rhttp)
            sent = {}
            for q in QUESTIONS:
                for s in SYSTEMS:
                    st, r = request(front, "POST", "/v1/completions",
                                    {"prompt": s + "\n\nQuestion: " + q, "max_tokens": 4, "temperature": 0})
                    assert st == 200, r
            hits = hit_tokens(front) + hit_tokens(rhttp) - hits0
            by_prefix = sum(replica_series(front, "troupe_replica_prefix_routed_total", r) for r in ("local", remote))
            routed = {r: replica_series(front, "troupe_replica_routed_total", r) for r in ("local", remote)}
            print(f"{routing}: prefix cache hit tokens {hits}, routed {routed}, by prefix {by_prefix}")
            if routing == "prefix":
                assert by_prefix == 9, (by_prefix, routed)
                # Each system prompt is > 2 blocks of 16 tokens: 9 followers hit >= 2 blocks each.
                assert hits >= 9 * 32, hits
                assert min(routed.values()) >= 1  # the three prompts did not all land on one side
                test_prefix_routing_keeps_a_shared_prefix_on_one_replica.prefix_hits = hits
            else:
                assert by_prefix == 0
                assert abs(routed["local"] - routed[remote]) <= 2  # alternating (+ the warm-up on local)
                prefix_hits = getattr(test_prefix_routing_keeps_a_shared_prefix_on_one_replica, "prefix_hits", None)
                if prefix_hits is not None:
                    assert hits < prefix_hits, (hits, prefix_hits)
    finally:
        stop(replica)


def test_a_hung_replica_is_dropped_after_dead_after_s_and_rejoins():
    """SIGSTOP: the replica's sockets stay open but it answers nothing (a hung process, or a machine
    gone without closing its connections). The front drops it after --replica-dead-after-s without
    heartbeats: its stream ends with an error, the front serves alone; after SIGCONT the replica
    frees that generation and the front connects it again."""
    beat = ("--replica-heartbeat-s", "0.2", "--replica-dead-after-s", "1.5")
    rport, rhttp = free_port(), free_port()
    replica = start_replica(rport, rhttp, *beat)
    remote = f"127.0.0.1:{rport}"
    try:
        with running_server("--replica", remote, "--replica-retry-s", "0.5", *beat) as (front, _):
            wait_for(lambda: replica_series(front, "troupe_replica_up", remote) == 1, 20, "no connection")
            body = {"prompt": "Tell me about rivers.", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
            threads, out = two_streams(front, body)
            replica.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                wait_for(lambda: any(o is not None and o[2] is not None for o in out), 15, "the hung replica's stream did not end")
                assert time.monotonic() - t0 < 10
                assert replica_series(front, "troupe_replica_up", remote) == 0
                for t in threads:
                    t.join(timeout=300)
                failed = [o for o in out if o[2] is not None]
                assert len(failed) == 1 and "lost" in failed[0][2]["message"], out
                st, r = request(front, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
                assert st == 200, r
            finally:
                replica.send_signal(signal.SIGCONT)
            # Resumed: it sees the front's side closed, frees the generation, and is connected again.
            wait_for(lambda: metrics(rhttp)['troupe_num_requests_running{model="default"}'] == 0
                     and metrics(rhttp)['troupe_kv_blocks_used{model="default"}'] == 0, 15, "the replica kept the generation")
            wait_for(lambda: replica_series(front, "troupe_replica_up", remote) == 1, 20, "no reconnection")
    finally:
        stop(replica)


def test_reloading_a_published_replica_fails_nothing(replica_and_front):
    """POST /admin/reload on a replica while a front streams from it: the generation running on the
    old version finishes there (the old version is unloaded only once idle), new ones go to the
    front or, once it reconnects, to the new version; nothing fails, nothing is lost."""
    reload_while_streaming(*replica_and_front[:3])


def test_reloading_a_tls_replica_fails_nothing(tls_dir):
    """The same over TLS: the new version takes over the TLS listener."""
    with replica_and_front_with(*tls_args(tls_dir, "replica")) as r:
        reload_while_streaming(*r[:3])


def reload_while_streaming(front, rhttp, rport):
    remote = f"127.0.0.1:{rport}"
    body = {"prompt": "Describe a long walk through a city at night.", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    st, ref = request(rhttp, "POST", "/v1/completions", body)
    assert st == 200
    threads, out = two_streams(front, body)
    assert replica_series(front, "troupe_replica_in_flight", remote) == 1
    st, r = request(rhttp, "POST", "/admin/reload")
    assert st == 200 and r["version"] == 2, r
    for _ in range(4):  # meanwhile: new generations succeed (moved off the retired version if sent there)
        st, r = request(front, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
        assert st == 200, r
    for t in threads:
        t.join(timeout=300)
    for o in out:
        assert o[2] is None, o
        assert o[0] == ref["choices"][0]["text"]
    # The old version, idle, is unloaded; the front reconnects to the new one and routes to it.
    wait_for(lambda: request(rhttp, "GET", "/ready")[1]["draining_versions"] == 0, 30, "the old version was not unloaded")
    expect_routed_again(front, remote)
    assert replica_series(front, "troupe_replica_lost_total", remote) == 0


def test_a_router_without_an_executor_spreads_over_replicas_and_fails_clearly_without_them():
    """--local-replica false: the front only routes. Its outputs equal a replica's own; with one
    replica gone the other serves everything; with none, /ready is 503 and requests get a clear
    503; a replica back on its port serves again."""
    ports = [(free_port(), free_port()) for _ in range(2)]
    replicas = [start_replica(rp, hp) for rp, hp in ports]
    names = [f"127.0.0.1:{rp}" for rp, _ in ports]
    try:
        args = ["--local-replica", "false", "--replica-retry-s", "0.3", "--replica-routing", "least_loaded"]
        for n in names:
            args += ["--replica", n]
        with running_server(*args) as (front, _):
            wait_for(lambda: all(replica_series(front, "troupe_replica_up", n) == 1 for n in names), 20, "no connection")
            st, ready = request(front, "GET", "/ready")
            assert st == 200 and ready["replicas"][0]["up"] is False and "router" in ready["replicas"][0]["status"]
            body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
            st, ref = request(ports[0][1], "POST", "/v1/completions", body)
            assert st == 200
            results = [None] * 6

            def run(i):
                results[i] = request(front, "POST", "/v1/completions", body)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            for st, r in results:
                assert st == 200, r
                assert r["choices"][0]["text"] == ref["choices"][0]["text"]
            assert replica_series(front, "troupe_replica_routed_total", "local") == 0
            assert all(replica_series(front, "troupe_replica_routed_total", n) >= 2 for n in names)

            replicas[0].send_signal(signal.SIGKILL)
            replicas[0].wait()
            wait_for(lambda: replica_series(front, "troupe_replica_up", names[0]) == 0, 10, "not marked down")
            for _ in range(3):
                st, r = request(front, "POST", "/v1/completions", body)
                assert st == 200, r
            replicas[1].send_signal(signal.SIGKILL)
            replicas[1].wait()
            wait_for(lambda: replica_series(front, "troupe_replica_up", names[1]) == 0, 10, "not marked down")
            st, ready = request(front, "GET", "/ready")
            assert st == 503 and ready["status"] == "unavailable"
            st, r = request(front, "POST", "/v1/completions", body)
            assert st == 503 and "no replica" in r["error"]["message"], r

            replicas[1] = start_replica(*ports[1])
            wait_for(lambda: replica_series(front, "troupe_replica_up", names[1]) == 1, 20, "no reconnection")
            st, r = request(front, "POST", "/v1/completions", body)
            assert st == 200 and r["choices"][0]["text"] == ref["choices"][0]["text"], r
    finally:
        for p in replicas:
            if p.poll() is None:
                stop(p)


def test_a_front_reload_reconnects_its_replicas(replica_and_front):
    """POST /admin/reload on the front: its new version connects the replicas itself (each version
    has its own engine and keeper) and routes to them; nothing in flight fails."""
    front, rhttp, rport, _ = replica_and_front
    remote = f"127.0.0.1:{rport}"
    body = {"prompt": "Describe a harbour at dawn.", "max_tokens": 80, "temperature": 0, "ignore_eos": True}
    st, ref = request(rhttp, "POST", "/v1/completions", body)
    assert st == 200
    threads, out = two_streams(front, body)
    st, r = request(front, "POST", "/admin/reload")
    assert st == 200 and r["version"] == 2, r
    for t in threads:
        t.join(timeout=300)
    for o in out:
        assert o[2] is None and o[0] == ref["choices"][0]["text"], o
    assert request(front, "GET", "/ready")[1]["model_version"] == 2
    expect_routed_again(front, remote)  # the metrics are the new version's: its own keeper connected


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory):
    """A CA, certificates it signs for a replica and a front, and a rogue certificate signed by
    another CA (openssl's command line; RSA 2048, valid for two days)."""
    import shutil
    if not shutil.which("openssl"):
        pytest.skip("no openssl command (scripts/setup.sh installs it)")
    d = tmp_path_factory.mktemp("tls")

    def ssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=120)

    for ca in ("ca", "other_ca"):
        ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
            "-subj", f"/CN=troupe test {ca}")
    for name, ca in [("replica", "ca"), ("front", "ca"), ("rogue", "other_ca")]:
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2")
    return d


def tls_args(d, cert, ca="ca"):
    return ["--replica-tls-cert", str(d / f"{cert}.pem"), "--replica-tls-key", str(d / f"{cert}.key"),
            "--replica-tls-ca", str(d / f"{ca}.pem")]


def test_tls_between_replicas_admits_only_certificates_of_the_ca(tls_dir):
    """--replica-tls-*: a front with a certificate of the replica's CA is served (a router only: every
    generation crosses TLS, with the same greedy text as the replica's own). A plain-TCP front, a
    front whose certificate another CA signed, and a front that trusts another CA are refused at
    the handshake, say so in /ready and serve locally; raw bytes on the port do not disturb the
    replica; a TLS front refuses a plain replica."""
    import socket
    rport, rhttp = free_port(), free_port()
    replica = start_replica(rport, rhttp, *tls_args(tls_dir, "replica"))
    remote = f"127.0.0.1:{rport}"
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    try:
        st, ref = request(rhttp, "POST", "/v1/completions", body)
        assert st == 200, ref
        # The port speaks TLS, with the replica's certificate (openssl's own client checks it).
        hello = subprocess.run(["openssl", "s_client", "-connect", remote, "-CAfile", str(tls_dir / "ca.pem"), "-brief",
                                "-cert", str(tls_dir / "front.pem"), "-key", str(tls_dir / "front.key")],
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=30)  # stdout: the replica's binary bytes
        said = hello.stderr.decode(errors="replace")
        assert "Peer certificate: CN = replica" in said and "Verification: OK" in said, said
        for args in [[], tls_args(tls_dir, "rogue"), tls_args(tls_dir, "front", ca="other_ca")]:
            with running_server("--replica", remote, "--replica-retry-s", "0.3", *args) as (front, _):
                def refused():
                    st, ready = request(front, "GET", "/ready")
                    return st == 200 and "handshake failed" in ready["replicas"][1]["status"] and not ready["replicas"][1]["up"]
                wait_for(refused, 20, f"the front {args} was not refused at the handshake")
                for _ in range(2):
                    st, r = request(front, "POST", "/v1/completions", body)
                    assert st == 200 and r["choices"][0]["text"] == ref["choices"][0]["text"], r
                assert replica_series(front, "troupe_replica_routed_total", remote) == 0  # all served locally
        with socket.create_connection(("127.0.0.1", rport), timeout=5) as s:  # not TLS, not BASP
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)) * 8)
        with running_server("--replica", remote, "--local-replica", "false", "--replica-retry-s", "0.3",
                            *tls_args(tls_dir, "front")) as (front, _):
            wait_for(lambda: replica_series(front, "troupe_replica_up", remote) == 1, 20, "no TLS connection")
            before = replica_series(front, "troupe_replica_routed_total", remote)
            for _ in range(2):
                st, r = request(front, "POST", "/v1/completions", body)
                assert st == 200 and r["choices"][0]["text"] == ref["choices"][0]["text"], r
            assert replica_series(front, "troupe_replica_routed_total", remote) == before + 2
    finally:
        stop(replica)
    # The other way round: a plain replica, a TLS front.
    rport, rhttp = free_port(), free_port()
    replica = start_replica(rport, rhttp)
    try:
        with running_server("--replica", f"127.0.0.1:{rport}", "--replica-retry-s", "0.3", *tls_args(tls_dir, "front")) as (front, _):
            def refused_plain():
                st, ready = request(front, "GET", "/ready")
                return st == 200 and "unreachable" in ready["replicas"][1]["status"]
            wait_for(refused_plain, 20, "the plain replica was not refused")
            for _ in range(10):  # and it stays refused
                st, ready = request(front, "GET", "/ready")
                assert st == 200 and not ready["replicas"][1]["up"], ready
                time.sleep(0.2)
    finally:
        stop(replica)


def test_bad_tls_options_are_refused(tls_dir):
    d = tls_dir
    for args, needle in [(["--replica-tls-cert", str(d / "front.pem")], "all three"),
                         (tls_args(d, "front")[:2] + ["--replica-tls-key", str(d / "replica.key"), "--replica-tls-ca", str(d / "ca.pem")],
                          "is not the key of"),
                         (tls_args(d, "front")[:4] + ["--replica-tls-ca", str(d / "missing.pem")], "CA file"),
                         (["--replica-tls-cert", str(d / "front.key"), *tls_args(d, "front")[2:]], "certificate")]:
        r = subprocess.run([TROUPE, "serve", "--port", "0", "--publish-port", "0", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and needle in r.stderr, (args, r.stderr)
