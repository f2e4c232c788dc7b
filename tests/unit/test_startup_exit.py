"""Start-up and exit of tdpipe's own processes: the tokenizer loaded on a thread while the executor starts
(errors raised where the engine joins it, its stages stopped, setuptools imported before that thread
starts), and the heap frozen before teardown with the garbage collected first (its finalizers still run)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tdpipe.model.weights import MissingModelFile, ModelFileError


def test_background_tokenizer_is_the_one_load_tokenizer_gives(bundled_path):
    from tdpipe.tokenizer import load_tokenizer, load_tokenizer_in_background

    pending = load_tokenizer_in_background(bundled_path)
    tok = pending.result()
    ref = load_tokenizer(bundled_path)
    assert type(tok) is type(ref) and tok.eos_token_id == ref.eos_token_id
    assert tok.encode("The capital of France is") == ref.encode("The capital of France is")
    assert pending.result() is tok  # joining again returns the same object


def test_background_tokenizer_raises_its_error_on_join(tmp_path, bundled_path):
    from tdpipe.tokenizer import load_tokenizer_in_background

    pending = load_tokenizer_in_background(str(tmp_path))  # no tokenizer files at all
    with pytest.raises(MissingModelFile, match="has no tokenizer files"):
        pending.result()
    good = (Path(bundled_path) / "tokenizer.json").read_bytes()
    (tmp_path / "tokenizer.json").write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelFileError, match=f"cannot load the tokenizer in {tmp_path}"):
        load_tokenizer_in_background(str(tmp_path)).result()


def test_setuptools_is_imported_before_the_tokenizer_thread_starts(bundled_path):
    """The kernels' loader imports setuptools, whose first import inserts a finder at the front of
    sys.meta_path and removes it; a thread importing in that instant (the tokenizer's) can skip the path
    finder and fail with "No module named ...". So a CPU engine imports the build tools first: in a fresh
    process, setuptools is already loaded when the tokenizer thread is started."""
    code = f"""
import sys
import tdpipe.core.engine_builder as eb
def spy(path):
    print("setuptools loaded:", "setuptools" in sys.modules, flush=True)
    raise SystemExit(0)
eb.load_tokenizer_in_background = spy
assert "setuptools" not in sys.modules
from tdpipe import LLM
LLM(model={bundled_path!r}, kv_cache_memory=64 << 20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "setuptools loaded: True", out.stdout + out.stderr


@pytest.mark.slow
def test_damaged_tokenizer_at_pp2_fails_once_and_stops_the_stages(tmp_path, bundled_path):
    """The stages start while the tokenizer loads; a tokenizer that then fails to load is the one error
    (ModelFileError naming the folder), and the stages already started are stopped, not left behind."""
    from procs import stage_pids_of

    from tdpipe import LLM

    folder = tmp_path / "model"
    shutil.copytree(bundled_path, folder)
    good = (folder / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").write_bytes(good[: len(good) // 2])  # passes the file check, fails to load
    with pytest.raises(ModelFileError, match="cannot load the tokenizer"):
        LLM(model=str(folder), pipeline_parallel_size=2, kv_cache_memory=64 << 20, layer_partition=[15, 15],
            lm_head_split=0)
    deadline = time.time() + 10
    while stage_pids_of(os.getpid()) and time.time() < deadline:
        time.sleep(0.1)
    assert stage_pids_of(os.getpid()) == []


def test_freeze_heap_runs_pending_finalizers_then_freezes():
    """Garbage in a reference cycle is collected first (its __del__ runs: a buffered file in such a cycle
    is flushed), then the survivors leave the collector's generations."""
    code = """
import gc
from tdpipe.frozen_heap import freeze_heap
gc.disable()
class Node:
    def __del__(self):
        print("finalized", flush=True)
a, b = Node(), Node()
a.other, b.other = b, a
del a, b
keep = [object() for _ in range(10)]
freeze_heap()
print("frozen", gc.get_freeze_count() > 0, flush=True)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["finalized", "finalized", "frozen True"], out.stdout
