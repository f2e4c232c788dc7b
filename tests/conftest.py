"""Shared fixtures: the bundled model (converted once into a session cache) and HF oracles."""
import os
import signal
import sys
import weakref

# pytest rewrites the asserts of every test module, and of every package that ships a pytest plugin
# (hypothesis: about 1.2 s), and caches the result beside the module only when bytecode may be written. This
# project's machines set PYTHONDONTWRITEBYTECODE=1, which made every run (and each xdist worker) parse and
# compile them all again: collection took 14-16 s here, 7 s once the caches exist. Only this process is
# affected (the processes the tests start keep the variable); the caches land in ignored __pycache__ folders.
sys.dont_write_bytecode = False

import pytest  # noqa: E402
import torch  # noqa: E402

# tests/gpu/ assumes a CUDA device: collected only where torch sees one, so the CPU suite neither runs nor skips
# it (`tdpipe gpu-check run` runs it on a GPU machine, docs/gpu.md). Declared
# here, not in a conftest.py of that folder: a second module named conftest would shadow this one's helpers.
collect_ignore_glob = [] if torch.cuda.is_available() else ["gpu/*"]


# The suite runs on one pytest-xdist worker per usable core (pyproject.toml: -n auto), each worker pinned to
# its own core with one torch thread: a test's engine cores, stages and CLI runs inherit the pin, so two
# workers never share a core. Left unpinned, every engine takes all the cores and the workers' OpenMP threads
# spin against each other (four end-to-end files took 3x the time of one process; pinned, 0.74x:
# docs/benchmarks.md, "The test suite's time").
_CORES = sorted(os.sched_getaffinity(0))  # before this process pins itself: every core the suite may use


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core this process may use (xdist's own count ignores the affinity mask)."""
    return len(_CORES)


def xdist_worker(config) -> str | None:
    """"gw0", "gw1", ... in a pytest-xdist worker, else None (from the worker's config, not the environment
    variable xdist also sets: a pytest that a test starts inherits that)."""
    return getattr(config, "workerinput", {}).get("workerid")


def pytest_configure(config):
    worker = xdist_worker(config)
    if worker:
        os.sched_setaffinity(0, {_CORES[int(worker[2:]) % len(_CORES)]})
        torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def lend_all_cores(request):
    """A test file marked `cores(n)` (data-parallel replicas, prefill/decode workers: each process pinned to
    cores of its own) gets every core of the suite while its tests run, its module fixtures' engines included
    (autouse: set up before them); the other worker's tests share those cores meanwhile. On a machine with
    fewer cores the tests run with what there is, as they would without workers."""
    marker = request.node.get_closest_marker("cores")
    own = os.sched_getaffinity(0)
    if marker is None or len(own) >= min(marker.args[0], len(_CORES)):
        yield
        return
    os.sched_setaffinity(0, _CORES)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


@pytest.fixture(autouse=True)
def sigint_raises():
    """Every test runs with Python's own SIGINT handler (KeyboardInterrupt), whatever the runner inherited.
    A runner started with `nohup` or `&` from a script ignores SIGINT: `_thread.interrupt_main()` then does
    nothing, and the processes a test starts inherit the ignored signal, so a test that interrupts a
    generation would run it to the end and report "did not raise"."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if old is not None:  # None: a handler not installed from Python, which cannot be put back
        signal.signal(signal.SIGINT, old)


@pytest.fixture
def anyio_backend() -> str:
    """The async server tests (pytest.mark.anyio) run on asyncio."""
    return "asyncio"


@pytest.fixture(scope="session")
def bundled_path() -> str:
    from tdpipe.model.bundled import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def llm_fp32():
    from tdpipe import LLM

    return LLM(dtype="float32", kv_cache_memory=256 << 20)


@pytest.fixture(scope="session")
def hf_fp32(bundled_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_path, dtype=torch.float32).eval()


_HF_GREEDY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {prompt ids: longest answer}


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Transformers' greedy continuation of one unpadded prompt: the correctness oracle (an EOS argmax is kept,
    as the engine's ignore_eos keeps it: tdpipe.bench.parity.hf_greedy). Remembered per model object for the
    session (several tests ask for the same prompts; a shorter answer is a prefix of a longer one)."""
    from tdpipe.bench.parity import hf_greedy as greedy

    seen = _HF_GREEDY.setdefault(model, {})
    key = tuple(prompt_ids)
    if len(seen.get(key, ())) < n:
        seen[key] = greedy(model, [list(prompt_ids)], n)[0]
    return list(seen[key][:n])


def prompt_lps(llm, ids: list[int]) -> list[float]:
    """The engine's log-probability of each prompt token after the first (prompt_logprobs): the whole forward
    pass compared position by position, where greedy tokens would compare argmaxes only."""
    from tdpipe import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def save_random_qwen2(d, bundled_path: str):
    """A random 3-layer Qwen2 (GQA 4/2, untied, non-zero q/k/v biases so bias loading is exercised), saved
    sharded in `d` (exercises the safetensors index) with the bundled tokenizer and chat template. Returns
    the HF model."""
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, rope_theta=10000.0, initializer_range=0.1,
                      eos_token_id=2, bos_token_id=1)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
    model.save_pretrained(d, max_shard_size="2MB")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the template: for chats
        shutil.copy(f"{bundled_path}/{f}", d / f)
    return model


@pytest.fixture(scope="session")
def qwen2_tiny(tmp_path_factory, bundled_path):
    """(folder, HF model) of save_random_qwen2's model, made once per session (per worker) and only read: for
    parity with transformers on a second family, the pipeline and tensor-parallel runtimes, and the tests
    whose point is the engine's behaviour (interrupts, aborts, shutdown, faults), not the bundled model's
    answers. It loads and steps in a fraction of the bundled model's time."""
    d = tmp_path_factory.mktemp("qwen2_tiny")
    return str(d), save_random_qwen2(d, bundled_path)


@pytest.fixture(scope="session")
def qwen2_tiny_path(qwen2_tiny) -> str:
    """qwen2_tiny's folder alone, for tests that pass the engine a model path."""
    return qwen2_tiny[0]


# tests that load a model or start processes are end-to-end: `-m "not slow and not faults"` skips them. A test
# is one when it is in tests/e2e (some there build their engine inside the test, where no fixture shows it)
# or when it asks for a model fixture.
_MODEL_FIXTURES = {"bundled_path", "llm_fp32", "hf_fp32", "llm_pp2", "smol_folder",
                   "qwen2_tiny", "qwen2_tiny_path"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.parent.name == "e2e" or _MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # the longest tests first (fault injection, then the end-to-end ones; each file's tests stay in order), so
    # that the workers end on short unit tests and finish together instead of one waiting on the other
    items.sort(key=lambda item: 0 if item.get_closest_marker("faults")
               else 1 if item.get_closest_marker("slow") else 2)


def pytest_sessionstart(session):
    """tdpipe's own sources byte-compiled once, before any test starts a process. Where
    PYTHONDONTWRITEBYTECODE is set (this project's machines set it), an editable install's modules are
    otherwise compiled again in every process the suite starts (stages, engine cores, `tdpipe` commands:
    a few hundred), about 0.3 s of a 3.4 s `tdpipe generate`. compileall writes the caches whatever that
    variable says; Python reads them either way."""
    import compileall

    import tdpipe

    compileall.compile_dir(os.path.dirname(tdpipe.__file__), quiet=1)
    if not session.config.option.collectonly:
        _warm_caches()


class _LoggerDict(dict):
    """logging's table of loggers, whose values() is a snapshot: pytest's log capture iterates it at the start
    of the collection and of every test, while _warm_caches' threads import modules that add loggers to it
    ("RuntimeError: dictionary changed size during iteration", a worker lost, the whole run ended: it
    happened here once in some dozens of fresh clones). Copying a dict into a list runs in C under the GIL,
    so the snapshot is whole."""

    def values(self):  # type: ignore[override]
        return list(super().values())


def _warm_caches() -> None:
    """On a fresh $TDPIPE_CACHE (every CI run), the C++ kernels' first build (18 s of gcc here, the two
    side by side) and the bundled model's conversion (4 s) start now and go on while pytest collects
    (10 s), instead of inside the first test that needs them. Both are what the first engine would do
    itself, under the same file locks; where the cache already holds them this loads the kernels (ms) and
    the conversion is a no-op."""
    import logging
    import threading

    manager = logging.Logger.manager
    with logging._lock:  # noqa: SLF001 - the lock logging itself holds while it adds a logger
        if not isinstance(manager.loggerDict, _LoggerDict):
            manager.loggerDict = _LoggerDict(manager.loggerDict)

    from tdpipe.model import cpu_ops, paged_attention
    from tdpipe.model.bundled import bundled_model_path
    from tdpipe.model.jit import in_background

    in_background(cpu_ops.kernel, paged_attention.load_kernel)
    threading.Thread(target=bundled_model_path, name="tdpipe-test-convert").start()


# --suite-times FILE: each test's wall time and CPU seconds (its own process's and those of the processes it
# started and reaped) and its cores' idle seconds as one JSON line, for `python scripts/suite_times.py FILE`
# (where the suite's time goes; idle time on a pinned worker's core is time no test used)

def _idle_seconds(cores: set[int]) -> float:
    """Idle + iowait seconds of `cores` since boot (/proc/stat; 0 where it cannot be read)."""
    try:
        with open("/proc/stat") as f:
            rows = [ln.split() for ln in f if ln.startswith("cpu") and ln[3].isdigit()]
    except OSError:
        return 0.0
    ticks = sum(int(r[4]) + int(r[5]) for r in rows if int(r[0][3:]) in cores)
    return ticks / os.sysconf("SC_CLK_TCK")


def pytest_addoption(parser):
    parser.addoption("--suite-times", metavar="FILE", default=None,
                     help="append each test's wall and CPU seconds (own, children's) and its cores' idle "
                          "seconds to FILE as JSON lines")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("--suite-times")
    if not path:
        yield
        return
    import json
    import time

    cores = set(os.sched_getaffinity(0))  # the worker's own core (all of them inside a cores(n) module)
    t0, c0, i0 = time.perf_counter(), os.times(), _idle_seconds(cores)
    yield
    t1, c1, i1 = time.perf_counter(), os.times(), _idle_seconds(cores)
    rec = {"id": item.nodeid, "worker": xdist_worker(item.config) or "main",
           "start": round(time.time() - (t1 - t0), 3), "wall": round(t1 - t0, 3),
           "cpu": round(c1.user - c0.user + c1.system - c0.system, 3),
           "children_cpu": round(c1.children_user - c0.children_user + c1.children_system - c0.children_system, 3),
           "idle": round((i1 - i0) / len(cores), 3)}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
