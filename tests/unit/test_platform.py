"""The device platforms (tdpipe/platforms), --device / --gpu-memory-utilization, and the distributed groups'
backend choice and host staging (pipeline/wire/groups.py, staging.py).

No GPU here: the CUDA platform's arithmetic runs with injected probes, NCCL only as a choice (never built),
host staging over gloo with CPU tensors standing in for device ones.
"""
import os
import threading

import pytest
import torch

from tdpipe.cli import main
from tdpipe.config import CacheConfig, ModelConfig, ParallelConfig
from tdpipe.engine_args import EngineArgs
from tdpipe.model.random_model import tensor_shapes
from tdpipe.pipeline.wire.groups import GLOO, NCCL, GroupBackends, choose_backends
from tdpipe.pipeline.wire.layout import Layout
from tdpipe.pipeline.wire.transport import Rendezvous, Transport
from tdpipe.platforms import DeviceUnavailable, get_platform, resolve_device
from tdpipe.platforms import cpu as cpu_platform
from tdpipe.platforms.cuda import ALLOC_CONF, CudaPlatform, cuda_kv_bytes

GiB = 1 << 30


# ----------------------------------------------------------------------------------------- resolve_device

def test_resolve_device():
    assert resolve_device("auto", cuda_available=False) == "cpu"
    assert resolve_device("auto", cuda_available=True) == "cuda"
    assert resolve_device("cpu", cuda_available=True) == "cpu"
    assert resolve_device("cuda", cuda_available=True) == "cuda"
    with pytest.raises(DeviceUnavailable) as e:
        resolve_device("cuda", cuda_available=False)
    assert "\n" not in str(e.value) and "--device cpu" in str(e.value)
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, got 'tpu'"):
        resolve_device("tpu")


def test_auto_without_cuda_is_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert EngineArgs().create_engine_config().parallel.device == "auto"  # the builder resolves it


# ----------------------------------------------------------------------------------------- the CPU platform

def test_cpu_platform(monkeypatch):
    p = get_platform("cpu")
    assert (p.name, p.dist_backend, p.attention_backend, p.supports_cuda_graphs, p.host_memory) == \
        ("cpu", "gloo", "cpu", False, True)
    assert p.torch_device(3) == p.set_device(1) == torch.device("cpu")
    monkeypatch.setattr(cpu_platform, "cpu_supports_bf16", lambda: True)
    assert p.default_dtype() == torch.bfloat16
    monkeypatch.setattr(cpu_platform, "cpu_supports_bf16", lambda: False)
    assert p.default_dtype() == torch.float32


def test_cpu_configure_process_sets_threads_and_pins_malloc(monkeypatch):
    pinned = []
    monkeypatch.setattr(cpu_platform, "pin_mmap_threshold", lambda: pinned.append(1) or True)
    own = torch.get_num_threads()
    try:
        get_platform("cpu").configure_process(1)
        assert torch.get_num_threads() == 1 and pinned == [1]
        get_platform("cpu").configure_process(None)  # threads left as they are
        assert torch.get_num_threads() == 1 and pinned == [1, 1]
    finally:
        torch.set_num_threads(own)


def test_cpu_kv_cache_is_a_zeroed_mapping():
    """The CPU KV cache: one contiguous tensor of the asked shape and dtype, zeros, writable (an anonymous
    mapping whose pages the kernel zeroes on first write)."""
    plat = get_platform("cpu")
    kv = plat.kv_zeros((8, 2, 64, 4, 16, 64), torch.bfloat16, torch.device("cpu"))
    assert kv.shape == (8, 2, 64, 4, 16, 64) and kv.dtype == torch.bfloat16 and kv.is_contiguous()
    kv[3, 1, 7] = 1.5
    assert kv[3, 1, 7].eq(1.5).all() and kv[3, 1, 6].eq(0).all() and kv[7].eq(0).all()
    assert kv.sum().item() == 1.5 * 4 * 16 * 64
    assert plat.kv_zeros((0, 3), torch.int8, torch.device("cpu")).shape == (0, 3)
    q = plat.kv_zeros((5, 68), torch.int8, torch.device("cpu"))
    assert q.dtype == torch.int8 and q.eq(0).all()


def _resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_cpu_kv_cache_is_resident_only_where_written():
    """A 1 GiB CPU KV cache costs nothing until blocks are written, then only those blocks' pages."""
    before = _resident_kib()
    kv = get_platform("cpu").kv_zeros((8, 2, 1024, 4, 16, 256), torch.bfloat16, torch.device("cpu"))
    assert _resident_kib() - before < 64 << 10  # KiB
    kv[3, 1, 7:9] = 1.0  # two blocks: 64 KiB
    assert _resident_kib() - before < 64 << 10
    assert kv[3, 1, 7:9].eq(1).all()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_cpu_kv_cache_is_not_shared_with_a_forked_child():
    """Private memory: a forked child's writes never reach the parent's cache (Python's mmap shares by default)."""
    import ctypes

    kv = get_platform("cpu").kv_zeros((4, 1024), torch.float32, torch.device("cpu"))
    pid = os.fork()
    if pid == 0:  # the child writes through the raw pointer (no torch threads after fork)
        ctypes.memset(kv.data_ptr(), 0x7F, kv.numel() * 4)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert kv.eq(0).all()


def test_cpu_kv_budget(monkeypatch):
    assert cpu_platform.kv_budget(None, 20 * GiB) == 4 * GiB  # min(4 GiB, 40%)
    assert cpu_platform.kv_budget(None, 5 * GiB) == 2 * GiB
    assert cpu_platform.kv_budget(0.25, 8 * GiB) == 2 * GiB
    assert cpu_platform.kv_budget(123456, 8 * GiB) == 123456
    monkeypatch.setattr(cpu_platform, "available_memory", lambda: 10 * GiB)
    # the weights and gpu_memory_utilization do not apply on CPU
    assert get_platform("cpu").kv_cache_bytes(0.5, 0.1, 9 * GiB) == 5 * GiB


# ----------------------------------------------------------------------------------------- the CUDA platform

def _fake_cuda(free: int, total: int, count: int = 1) -> CudaPlatform:
    return CudaPlatform(mem_get_info=lambda i: (free, total), device_count=lambda: count)


def test_cuda_platform_without_a_gpu():
    p = get_platform("cuda:1")
    assert (p.name, p.dist_backend, p.attention_backend, p.supports_cuda_graphs, p.host_memory) == \
        ("cuda", "nccl", "triton", True, False)
    assert p.default_dtype() == torch.bfloat16


def test_cuda_kv_is_vllms_gpu_memory_utilization():
    # 80 GiB device, 2 GiB used by others, 16 GiB of weights: 0.9 x 80 - 2 - 16 = 54 GiB
    p = _fake_cuda(free=78 * GiB, total=80 * GiB)
    assert p.kv_cache_bytes(None, 0.9, 16 * GiB) == 54 * GiB
    assert p.kv_cache_bytes(None, 0.5, 16 * GiB) == 22 * GiB
    assert p.kv_cache_bytes(3 * GiB, 0.9, 16 * GiB) == 3 * GiB  # bytes as given
    assert p.kv_cache_bytes(0.5, 0.9, 16 * GiB) == 31 * GiB  # a fraction of what the weights leave free
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache.*raise --gpu-memory-utilization"):
        cuda_kv_bytes(None, 0.2, 16 * GiB, free=78 * GiB, total=80 * GiB)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        cuda_kv_bytes(None, 1.5, 0, free=1, total=2)


def test_cuda_devices_per_worker():
    one, two = _fake_cuda(1, 1, count=1), _fake_cuda(1, 1, count=2)
    assert [one.torch_device(i) for i in range(2)] == [torch.device("cuda", 0)] * 2  # pp = 2 on one GPU
    assert [two.torch_device(i) for i in range(3)] == [torch.device("cuda", i) for i in (0, 1, 0)]
    with pytest.raises(RuntimeError, match="no devices"):
        _fake_cuda(1, 1, count=0).torch_device(0)


def test_cuda_allocator_setting(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    own = torch.get_num_threads()
    try:
        _fake_cuda(1, 1).configure_process(None)
    finally:
        torch.set_num_threads(own)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOC_CONF
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    _fake_cuda(1, 1).configure_process(None)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"  # the user's own stays


def test_num_params_counts_every_checkpoint_tensor():
    for hf in ({"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 24, "intermediate_size": 40,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "tie_word_embeddings": False},
               {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 97, "hidden_size": 24, "intermediate_size": 40,
                "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
                "tie_word_embeddings": True}):
        total = 0
        for _, shape, _ in tensor_shapes(hf):
            total += torch.Size(shape).numel()
        assert ModelConfig.from_hf(hf).num_params() == total


# ----------------------------------------------------------------------------------------- backend choice

def test_choose_backends():
    cpu = torch.device("cpu")
    assert choose_backends("gloo", [cpu] * 4, Layout(2, 2)) == GroupBackends(GLOO, (GLOO, GLOO))
    # pp = 2 on two GPUs: NCCL between the stages; on one GPU (NCCL refuses a GPU twice): gloo, host staging
    assert choose_backends("nccl", ["cuda:0", "cuda:1"], Layout(2, 1)) == GroupBackends(NCCL, (GLOO, GLOO))
    assert choose_backends("nccl", ["cuda:0", "cuda:0"], Layout(2, 1)) == GroupBackends(GLOO, (GLOO, GLOO))
    # 2 x 2 on two GPUs: each stage's two ranks on distinct GPUs (NCCL all-reduce), the stages share them
    two = [f"cuda:{i % 2}" for i in range(4)]
    assert choose_backends("nccl", two, Layout(2, 2)) == GroupBackends(GLOO, (NCCL, NCCL))
    assert choose_backends("nccl", [f"cuda:{i}" for i in range(4)], Layout(2, 2)) == GroupBackends(NCCL, (NCCL, NCCL))
    assert choose_backends("nccl", ["cuda:0", "cuda:0"], Layout(1, 2)) == GroupBackends(GLOO, (GLOO,))
    assert choose_backends("nccl", ["cuda:0"], Layout(1, 1)) == GroupBackends(GLOO, (GLOO,))  # no traffic
    with pytest.raises(ValueError, match="3 devices for the 4 workers"):
        choose_backends("nccl", two[:3], Layout(2, 2))


def test_pipeline_picks_devices_and_backends_through_the_platform():
    """What PipelineExecutor sends each stage: its device by worker index, the groups' backends."""
    p = _fake_cuda(1, 1, count=1)
    lay = Layout(2, 1)
    devices = [p.torch_device(r - 1) for r in lay.worker_ranks()]
    assert [str(d) for d in devices] == ["cuda:0", "cuda:0"]
    assert choose_backends(p.dist_backend, devices, lay).stages == GLOO


# ----------------------------------------------------------------------------------------- host staging

def _transports(world: int) -> list[Transport]:
    import torch.distributed as dist

    store = dist.HashStore()
    out: list = [None] * world

    def make(r: int) -> None:
        out[r] = Transport(Rendezvous(r, world, store, loopback=True))

    ts = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert all(out)
    return out


def test_host_staging_over_gloo():
    """Workers whose tensors are device memory send through host copies (stage -> stage, last -> engine);
    the receive lands in a host buffer and reaches the destination tensor on wait. CPU tensors stand in."""
    engine, a, b = _transports(3)
    for t in (a, b):
        t.use_backends(GroupBackends(GLOO, (GLOO,)), host_memory=False, num_workers=2)
    assert a._staged and a.stages is None and not engine._staged
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    dst = torch.zeros(3, 4)
    send = a.isend(x, 2, 16)
    recv = b.irecv(dst, 1, 16)
    assert type(send).__name__ == "StagedSend" and type(recv).__name__ == "StagedRecv"
    a.wait(send)
    b.wait(recv)
    assert torch.equal(dst, x)
    res = torch.zeros(3, 4)
    w = engine.irecv(res, 2, 17)  # the engine receives plainly
    b.wait(b.isend(dst * 2, 0, 17))
    engine.wait(w)
    assert torch.equal(res, x * 2)


# ----------------------------------------------------------------------------------------- flags and CLI

def test_flags_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "--device {auto,cpu,cuda}" in out and "--gpu-memory-utilization" in out
    assert "has not yet run on a GPU" in " ".join(out.split())


def test_flag_values():
    cfg = EngineArgs(gpu_memory_utilization=0.5, device="cpu").create_engine_config()
    assert cfg.cache.gpu_memory_utilization == 0.5 and cfg.parallel.device == "cpu"
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction in"):
            CacheConfig(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        ParallelConfig(device="tpu")


@pytest.mark.parametrize("cmd", [["generate", "--device", "cuda", "hello"], ["serve", "--device", "cuda"]])
def test_device_cuda_without_cuda_is_one_line_exit_2(cmd, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(cmd) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tdpipe: error: device cuda is not available"), cap.err


def test_llm_device_cuda_without_cuda_raises(monkeypatch):
    from tdpipe import LLM

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailable, match="device cuda is not available"):
        LLM(device="cuda")


def test_new_group_refuses_what_it_cannot_build(monkeypatch):
    import datetime

    import torch.distributed as dist

    from tdpipe.pipeline.wire.groups import new_group

    timeout = datetime.timedelta(seconds=5)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(RuntimeError, match="NCCL backend is not available"):
        new_group(NCCL, dist.HashStore(), 0, 1, timeout, timeout)
    with pytest.raises(ValueError, match="unknown distributed backend 'mpi'"):
        new_group("mpi", dist.HashStore(), 0, 1, timeout, timeout)


def test_the_real_memory_probe_hands_back_cached_blocks_first(monkeypatch):
    """A second LLM in one process must see the memory the first one freed: torch's allocator keeps freed
    blocks cached and mem_get_info counts them as used, so the probe empties the cache before reading."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: calls.append(f"mem_get_info({i})") or (5, 10))
    assert CudaPlatform(device_count=lambda: 1).mem_get_info(0) == (5, 10)
    assert calls == ["empty_cache", "mem_get_info(0)"]
