"""The server under load, through the real openai client: 1,000 requests from 64 concurrent clients with no
error, none lost, none duplicated, and the server's processes' memory flat after warm-up."""
import asyncio
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from procs import alive, descendants

pytestmark = pytest.mark.slow

N_REQUESTS, CLIENTS, WARMUP = 1000, 64, 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("srv") / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tdpipe.cli", "serve", "--port", str(port),
                             "--dtype", "auto", "--kv-cache-memory", str(128 << 20), "--max-num-seqs", "64"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.2)
        assert proc.poll() is None, open(log.name).read()
    yield proc, url
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    log.seek(0)
    print(log.read()[-3000:])


def test_1000_requests_64_clients_nothing_lost_memory_flat(server):
    from openai import AsyncOpenAI

    import json

    proc, url = server
    pids = [proc.pid, *(p for p in descendants(proc.pid) if alive(p))]
    assert len(pids) >= 2  # the frontend and the engine core
    with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
        model = json.loads(r.read())["data"][0]["id"]

    async def run(ids: list[int], client) -> dict[int, str]:
        queue: asyncio.Queue = asyncio.Queue()
        for i in ids:
            queue.put_nowait(i)
        got: dict[int, str] = {}
        errors: list[str] = []

        async def worker(w: int) -> None:
            while not queue.empty():
                i = queue.get_nowait()
                try:
                    if i % 3 == 0:
                        stream = await client.completions.create(
                            model=model, prompt=f"Request {i}: count to three.", max_tokens=3, temperature=0,
                            stream=True, extra_body={"ignore_eos": True})
                        text = "".join([c.choices[0].text async for c in stream if c.choices])
                    elif i % 3 == 1:
                        r = await client.chat.completions.create(
                            model=model, messages=[{"role": "user", "content": f"Say {i}."}], max_tokens=3,
                            temperature=0, extra_body={"ignore_eos": True})
                        assert r.usage.completion_tokens == 3
                        text = r.choices[0].message.content
                    else:
                        r = await client.completions.create(model=model, prompt=f"{i} + {i} =", max_tokens=3,
                                                            temperature=0, extra_body={"ignore_eos": True})
                        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
                        text = r.choices[0].text
                    assert i not in got, f"request {i} answered twice"
                    got[i] = text
                except Exception as e:  # noqa: BLE001 - counted, the test fails on any
                    errors.append(f"{i}: {type(e).__name__}: {e}")

        await asyncio.gather(*[worker(w) for w in range(CLIENTS)])
        assert not errors, errors[:5]
        return got

    async def main():
        import httpx

        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                               http_client=httpx.AsyncClient(limits=limits, timeout=600)) as client:
            first = await run(list(range(WARMUP)), client)
            rss_warm = rss_mib(pids)
            rest = await run(list(range(WARMUP, N_REQUESTS)), client)
            await asyncio.sleep(1.5)
            return first | rest, rss_warm, rss_mib(pids)

    got, rss_warm, rss_end = asyncio.run(main())
    assert sorted(got) == list(range(N_REQUESTS))  # none lost, none twice
    print(f"RSS of the server's processes: {rss_warm:.0f} MiB after {WARMUP} requests, {rss_end:.0f} MiB after "
          f"{N_REQUESTS}")
    assert rss_end - rss_warm < max(32.0, 0.05 * rss_warm), (rss_warm, rss_end)
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    free = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
            if ln.startswith("tdpipe:num_requests_running") or ln.startswith("tdpipe:kv_cache_usage_perc")}
    assert free["tdpipe:num_requests_running"] == 0 and free["tdpipe:kv_cache_usage_perc"] == 0


def test_sigterm_stops_everything(server):
    proc, url = server
    pids = [proc.pid, *(p for p in descendants(proc.pid) if alive(p))]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    deadline = time.time() + 10
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]
