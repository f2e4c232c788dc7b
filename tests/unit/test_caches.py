"""The caches under $TDPIPE_CACHE: keyed by what changes them, checked on load, rebuilt when damaged.

Every test points TDPIPE_CACHE at a temporary folder (copies or links of the shared cache where a test
needs a model or kernels), so the shared ~/.cache/tdpipe is never written.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tdpipe.core import step_profile as sp
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.scheduler.registry import scheduler_config
from tdpipe.core.scheduler.td_pipe import StepCostModel
from tdpipe.model import bundled, jit
from tdpipe.model import cache as model_cache


_SHARED = Path(os.environ["TDPIPE_CACHE"]).expanduser() if os.environ.get("TDPIPE_CACHE") else \
    Path.home() / ".cache" / "tdpipe"  # read at import, before any test redirects TDPIPE_CACHE


def shared_cache() -> Path:
    """The cache the other tests use (read only here)."""
    return _SHARED


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv("TDPIPE_CACHE", str(root))
    return root


def linked_cache(root: Path) -> None:
    """Models and kernels of the shared cache linked into `root` (profiles stay in root)."""
    models = root / "models"
    models.mkdir()
    entry = f"{bundled.BUNDLED_MODEL}-bf16"
    shared = shared_cache()
    if not (shared / "models" / entry / "config.json").is_file():
        pytest.skip("the shared model cache is not built")
    (models / entry).symlink_to(shared / "models" / entry)
    if (shared / "kernels").is_dir():
        (root / "kernels").symlink_to(shared / "kernels")


# -- TDPIPE_CACHE itself ---------------------------------------------------------------------------------
def test_cache_that_is_a_file_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    monkeypatch.setenv("TDPIPE_CACHE", str(f))
    with pytest.raises(ValueError, match=rf"TDPIPE_CACHE={f}: {f} is not a directory") as e:
        model_cache.cache_dir()
    assert isinstance(e.value, model_cache.CacheDirError) and "\n" not in str(e.value)
    monkeypatch.setenv("TDPIPE_CACHE", str(f / "below"))
    with pytest.raises(model_cache.CacheDirError, match=rf"TDPIPE_CACHE={f}/below: cannot create"):
        model_cache.cache_dir()


def test_cli_reports_a_bad_cache_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    from tdpipe.cli import main

    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.setenv("TDPIPE_CACHE", str(f))
    assert main(["generate", "--max-tokens", "2", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tdpipe: error: TDPIPE_CACHE=") and str(f) in err[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_cache_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    monkeypatch.setenv("TDPIPE_CACHE", str(ro))
    with pytest.raises(model_cache.CacheDirError, match="is not writable"):
        model_cache.cache_dir()


def test_cache_is_created_when_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDPIPE_CACHE", str(tmp_path / "a" / "b"))
    assert model_cache.cache_dir() == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()


def test_cache_created_by_another_process_meanwhile_is_no_error(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes on a first run (in CI: the kernel-build thread and the engine) both find no cache; one
    creates it between the other's looks. That is a directory like any other, not "not a directory"."""
    root = tmp_path / "c"
    monkeypatch.setenv("TDPIPE_CACHE", str(root))
    real_is_dir = Path.is_dir

    def is_dir(self: Path) -> bool:
        if self == root and not root.exists():
            root.mkdir()  # the other process, just after this look
            return False
        return real_is_dir(self)

    real_mkdir = os.mkdir

    def mkdir(path, mode=0o777):  # or the other process wins the race inside mkdir itself
        if Path(path) == root:
            real_mkdir(path, mode)
            raise FileExistsError(17, "File exists", str(path))
        real_mkdir(path, mode)

    monkeypatch.setattr(Path, "is_dir", is_dir)
    monkeypatch.setattr(os, "mkdir", mkdir)
    assert model_cache.cache_dir() == root and real_is_dir(root)


def test_dangling_link_cache_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    monkeypatch.setenv("TDPIPE_CACHE", str(link))
    with pytest.raises(model_cache.CacheDirError, match="is a dangling link"):
        model_cache.cache_dir()


def test_two_threads_writing_one_json_never_fail(tmp_path: Path) -> None:
    """The kernel-build threads and the engine share a process: a temporary name per process only would
    let one thread's rename take the other's file away (FileNotFoundError)."""
    import threading

    path, errors = tmp_path / "p.json", []

    def writer(k: int) -> None:
        try:
            for i in range(300):
                model_cache.write_json(path, {"k": k, "i": i})
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and json.loads(path.read_text())["i"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


# -- the step profile (td-pipe, core/step_profile.py) ----------------------------------------------------
def fake_engine(model: Path, num_blocks: int, max_num_seqs: int = 256, budget: int | None = None,
                pp: int = 1) -> SimpleNamespace:
    """What profile_key / load_or_measure read from an engine's parts (sp.ProfileTarget); measuring is faked
    (`fake_measure`)."""
    return SimpleNamespace(
        model_path=str(model), dtype="torch.float32", pp=pp, partition=[(0, 30)], stage_threads=[2] * pp,
        block_manager=BlockManager(num_blocks, 16),
        scheduler_config=scheduler_config(policy="td-pipe", max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=budget),
        executor=SimpleNamespace(num_stages=pp), model_config=SimpleNamespace(vocab_size=100),
        new_seq_id=itertools.count().__next__)


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[sp.Plan]:
    """Replace the executor run by a deterministic profile of the plan; lists the plans measured."""
    plans: list[sp.Plan] = []

    def fake_measure(engine, plan: sp.Plan) -> StepCostModel:
        plans.append(plan)
        decode = [(b, 0.01 + 0.001 * b) for b in plan.decode] + ([(0, 0.0)] if len(plan.decode) < 2 else [])
        prefill = [(k * plan.context, 0.002 * k * plan.context) for k in plan.prefill]
        prefill += [(0, 0.0)] if len(prefill) < 2 else []
        return StepCostModel.fit(decode, prefill, peak_batch=plan.requests)

    monkeypatch.setattr(sp, "measure_plan", fake_measure)
    return plans


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def test_small_kv_run_does_not_change_a_normal_runs_profile(cache, model_dir, measured, tmp_path,
                                                            monkeypatch):
    """The bar: the profile a normal-KV engine loads is the same whether or not a small-KV run came first."""
    normal = lambda: fake_engine(model_dir, num_blocks=5000)  # noqa: E731
    small = lambda: fake_engine(model_dir, num_blocks=12)  # noqa: E731 (one profiling request fits)
    tiny = lambda: fake_engine(model_dir, num_blocks=2)  # noqa: E731 (not even a ROOM-token request)
    s = sp.load_or_measure(small())
    t = sp.load_or_measure(tiny())
    assert s.peak_batch == 1 and t.peak_batch == 1 and measured[-1].context == 2 * 16 - sp.REPEATS
    after = sp.load_or_measure(normal())
    assert measured[-1] == sp.standard_plan(normal())  # measured, not taken from the small runs
    assert len(measured) == 3 and after.peak_batch == sp.MAX_BATCH
    loaded = sp.load_or_measure(normal())
    monkeypatch.setenv("TDPIPE_CACHE", str(tmp_path / "fresh"))
    alone = sp.load_or_measure(normal())
    assert after == alone  # measured the same way, under the same key
    assert dataclasses.replace(loaded, source="profile") == alone
    assert Path(loaded.source).name == sp._path(sp.profile_key(normal())).name
    assert len(list((cache / "profiles").glob("step-*.json"))) == 3  # small, tiny, normal: three keys


def test_profile_is_shared_across_capacity_and_max_num_seqs_and_limited_on_use(cache, model_dir, measured):
    first = sp.load_or_measure(fake_engine(model_dir, num_blocks=5000))
    assert len(measured) == 1
    few = sp.load_or_measure(fake_engine(model_dir, num_blocks=3000, max_num_seqs=8, pp=1))
    small = sp.load_or_measure(fake_engine(model_dir, num_blocks=30))
    assert len(measured) == 1  # the standard profile serves them all (its points do not depend on them)
    assert few.source == small.source == str(sp._path(sp.profile_key(fake_engine(model_dir, 5000))))
    assert first.source == "profile"
    assert few.peak_batch == 8 and small.peak_batch == sp.kv_batch(BlockManager(30, 16)) == 3
    assert (few.d0, few.d1, few.points) == (first.d0, first.d1, first.points)
    # what does change the measured points changes the key: the token budget shapes the prefill batches
    sp.load_or_measure(fake_engine(model_dir, num_blocks=5000, budget=256))
    assert len(measured) == 2 and measured[-1].prefill != measured[0].prefill
    key = sp.profile_key(fake_engine(model_dir, num_blocks=5000))
    assert key == sp.profile_key(fake_engine(model_dir, num_blocks=99999, max_num_seqs=7))
    for other in (fake_engine(model_dir, num_blocks=5000, pp=2), fake_engine(model_dir, num_blocks=20)):
        assert sp.profile_key(other) != key
    (model_dir / "model.safetensors").write_bytes(b"x")  # another model (new weights): another key
    assert sp.profile_key(fake_engine(model_dir, num_blocks=5000)) != key


@pytest.mark.parametrize("damage", [
    "{not json", "[]", '{"d0": 1}', "wrong-key", "bad-field", "negative", "bad-points", ""])
def test_damaged_profile_is_measured_again_and_overwritten(cache, model_dir, measured, caplog, damage):
    engine = fake_engine(model_dir, num_blocks=5000)
    good = sp.load_or_measure(engine)
    path = sp._path(sp.profile_key(engine))
    data = json.loads(path.read_text())
    text = {"wrong-key": json.dumps(data | {"key": data["key"] | {"dtype": "torch.bfloat16"}}),
            "bad-field": json.dumps(data | {"d1": "fast"}),
            "negative": json.dumps(data | {"peak_batch": 0}),
            "bad-points": json.dumps(data | {"points": {"decode": [[1, "x"]], "prefill": []}}),
            }.get(damage, damage)
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="tdpipe"):
        again = sp.load_or_measure(engine)
    assert len(measured) == 2 and again.d1 == good.d1
    assert any("damaged" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text()) == data  # overwritten with a good profile
    assert sp.load_or_measure(engine).source == str(path) and len(measured) == 2


def test_no_profile_when_not_even_one_request_fits(cache, model_dir, measured):
    engine = fake_engine(model_dir, num_blocks=1)
    engine.block_manager = BlockManager(1, 2)  # 2 tokens: less than a prompt token and REPEATS decodes
    c = sp.load_or_measure(engine)
    assert c.source == "default" and c.peak_batch == 1 and not measured


# -- the model cache (model/cache.py) --------------------------------------------------------------------
def small_entry(folder: Path) -> Path:
    """A complete-looking HF folder with a real (tiny) safetensors file."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(64, 64)}, str(folder / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text('{"x": 1}')
    return folder


def test_model_entry_checks(tmp_path: Path) -> None:
    src = {"gguf": "m.gguf", "size": 1}
    e = small_entry(tmp_path / "e")
    assert model_cache.check_entry(e, src) is None and (e / model_cache.MANIFEST).is_file()  # adopted
    assert model_cache.check_entry(e, src) is None
    assert "converted from" in model_cache.check_entry(e, {"gguf": "m.gguf", "size": 2})
    w = e / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-10])
    assert model_cache.check_entry(e, src) == f"model.safetensors has {w.stat().st_size} bytes, expected " \
                                          f"{w.stat().st_size + 10} (truncated)"
    (e / model_cache.MANIFEST).unlink()  # without a manifest the header finds it
    assert "model.safetensors has" in model_cache._structure(e) and model_cache.check_entry(e, src)
    e2 = small_entry(tmp_path / "e2")
    (e2 / "tokenizer.json").unlink()
    assert model_cache.check_entry(e2, src) == "tokenizer.json is missing"
    e3 = small_entry(tmp_path / "e3")
    model_cache.write_manifest(e3, src)
    (e3 / "config.json").unlink()
    assert model_cache.check_entry(e3, src) == "config.json is missing"
    (e3 / model_cache.MANIFEST).write_text("{garbage")
    assert "manifest is unreadable" in model_cache.check_entry(e3, src)
    assert model_cache.check_entry(tmp_path / "nothing", src) == "missing"


def test_model_check_on_load_is_cheap(cache: Path) -> None:
    """Every start pays check_entry; it must stay far below 50 ms (measured: about 0.1 ms)."""
    import time

    e = small_entry(cache / "models" / "x")
    src = {"gguf": "x.gguf", "size": 1}
    model_cache.check_entry(e, src)
    t = time.perf_counter()
    for _ in range(100):
        assert model_cache.check_entry(e, src) is None
    assert (time.perf_counter() - t) / 100 < 0.005


@pytest.mark.slow
def test_damaged_model_cache_is_converted_again(cache: Path, capfd: pytest.CaptureFixture) -> None:
    entry = f"{bundled.BUNDLED_MODEL}-bf16"
    shared = shared_cache() / "models" / entry
    if not (shared / "model.safetensors").is_file():
        pytest.skip("the shared model cache is not built")
    out = cache / "models" / entry
    shutil.copytree(shared, out)  # a copy: the shared cache is never touched
    (out / model_cache.MANIFEST).unlink(missing_ok=True)
    assert bundled.bundled_model_path() == str(out)  # a complete old entry: adopted, not converted
    assert (out / model_cache.MANIFEST).is_file() and "converting" not in capfd.readouterr().err
    w = out / "model.safetensors"
    size = w.stat().st_size
    with open(w, "r+b") as f:
        f.truncate(size // 2)
    stale = cache / "models" / f".{entry}.tmp-killed"  # what a killed conversion leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    assert bundled.bundled_model_path() == str(out)
    err = capfd.readouterr().err
    assert f"tdpipe: the cached model {out} is damaged (model.safetensors has {size // 2} bytes, expected " \
           f"{size} (truncated)); converting it again" in err
    assert f"converting the bundled {bundled.BUNDLED_MODEL} GGUF to a Hugging Face folder" in err
    assert "done in" in err
    assert w.stat().st_size == size and model_cache.check_entry(out, None) is None
    assert sorted(p.name for p in (cache / "models").iterdir()) == [f".{entry}.lock", entry]  # no leftovers
    assert bundled.bundled_model_path() == str(out) and capfd.readouterr().err == ""


# -- the kernel cache (model/jit.py) ---------------------------------------------------------------------
def test_elf_check_finds_truncated_and_garbage_objects(tmp_path: Path) -> None:
    so = Path(sys.executable).resolve()  # any ELF file will do
    if so.read_bytes()[:4] != b"\x7fELF":
        pytest.skip("not an ELF platform")
    assert jit.elf_damage(so) is None
    data = so.read_bytes()
    for cut in (len(data) // 2, len(data) - 100, 100):
        (tmp_path / "t.so").write_bytes(data[:cut])
        assert "truncated" in jit.elf_damage(tmp_path / "t.so")
    (tmp_path / "g.so").write_bytes(b"garbage" * 100)
    assert jit.elf_damage(tmp_path / "g.so") == "not an ELF file"


def test_kernel_entry_damage_without_building(tmp_path: Path) -> None:
    d = tmp_path / "k"
    d.mkdir()
    assert jit.entry_damage(d, "m") is None  # not built yet: nothing damaged
    (d / "lock").touch()
    assert jit.entry_damage(d, "m") == "a build lock left by a killed build"
    (d / "lock").unlink()
    (d / "m.so").write_bytes(b"\x7fELF" + b"\0" * 10)
    assert "m.so is" in jit.entry_damage(d, "m")


@pytest.mark.slow
def test_damaged_kernel_is_built_again(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                       capfd: pytest.CaptureFixture) -> None:
    """A garbage .so and a stale torch lock in a copy of the kernel cache: detected, cleared, built again,
    recorded. Where the shared cache holds a good build (the suite built it for real earlier), the compiler
    step hands back a copy of it instead of compiling again (18 s here); alone in a cold cache it compiles."""
    from torch.utils import cpp_extension

    monkeypatch.delenv("TDPIPE_NO_KERNEL", raising=False)
    monkeypatch.setattr(jit, "_built", {})
    src = jit.CSRC / "ops.cpp"
    flags = jit.CFLAGS + ["-ffast-math"]
    name = f"tdpipe_ops-{jit.cpu_tag(src, flags)}"
    shared = shared_cache() / "kernels" / name
    d = cache / "kernels" / name
    if shared.is_dir():
        shutil.copytree(shared, d)
        good = (shared / "tdpipe_ops.so").read_bytes()
        compiled: list[str] = []

        def compile_from_the_shared_build(name: str, build_directory: str, **kw) -> object:
            assert not (Path(build_directory) / "tdpipe_ops.so").exists()  # the damaged entry was cleared
            (Path(build_directory) / f"{name}.so").write_bytes(good)
            compiled.append(name)
            return jit._import_built(name, Path(build_directory) / f"{name}.so")

        monkeypatch.setattr(cpp_extension, "load", compile_from_the_shared_build)
    else:
        d.mkdir(parents=True)
    (d / "tdpipe_ops.so").write_bytes(b"garbage")
    (d / "lock").touch()  # torch would wait on it forever
    mod = jit.build("tdpipe_ops", "ops.cpp", ["-ffast-math"])
    err = capfd.readouterr().err
    assert mod is not None and hasattr(mod, "add_rms_norm")
    assert f"tdpipe: the cached tdpipe_ops kernel in {d} is damaged" in err and "built tdpipe_ops in" in err
    assert not (d / "lock").exists() and jit.entry_damage(d, "tdpipe_ops") is None
    assert json.loads((d / jit.MANIFEST).read_text())["size"] == (d / "tdpipe_ops.so").stat().st_size
    if shared.is_dir():
        assert compiled == ["tdpipe_ops"]


# -- td-pipe with a small KV cache (start-up profile) ------------------------------------------------------
# (on the tiny random model: profiling it at every start-up takes a fraction of the bundled model's time)
@pytest.mark.slow
def test_td_pipe_with_tiny_kv_runs_to_completion(qwen2_tiny, cache: Path) -> None:
    from tdpipe import LLM, SamplingParams

    linked_cache(cache)
    block = 3 * 2 * 16 * 2 * 4 * 16  # float32: layers x kv heads x head dim x (k, v) x 4 B x 16 tokens
    for blocks in (1, 11):  # 16 tokens: a shorter profiling prompt; 176: one standard profiling request
        with LLM(model=qwen2_tiny[0], scheduler="td-pipe", kv_cache_memory=blocks * block,
                 dtype="float32") as llm:
            assert llm.engine.block_manager.num_blocks == blocks
            outs = llm.generate(["hello", "The sea"], SamplingParams(temperature=0, max_tokens=6),
                                use_tqdm=False)
            assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 2
            assert llm.engine.scheduler.costs.peak_batch == 1
            llm.engine.block_manager.check_no_leaks()


@pytest.mark.slow
def test_small_kv_engine_leaves_the_normal_profile_alone(qwen2_tiny, cache: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar on real engines (a short standard plan keeps it quick): a normal engine after a small one
    measures the standard plan under the standard key; the small run cached only under its own key."""
    from tdpipe import LLM

    monkeypatch.setattr(sp, "MAX_BATCH", 8)
    linked_cache(cache)
    model = qwen2_tiny[0]
    with LLM(model=model, scheduler="td-pipe", num_kv_blocks=3, dtype="float32") as llm:
        small = llm.engine.scheduler.costs
        small_key = sp.profile_key(sp.ProfileTarget.of(llm.engine))
        assert small.peak_batch == 1 and max(b for b, _ in small.points["decode"]) == 1
    with LLM(model=model, scheduler="td-pipe", kv_cache_memory=64 << 20, dtype="float32") as llm:
        normal = llm.engine.scheduler.costs
        target = sp.ProfileTarget.of(llm.engine)
        key = sp.profile_key(target)
        assert key == sp.profile_key(target, sp.standard_plan(target)) != small_key
        assert normal.source == "profile" and normal.peak_batch == 8  # measured now, not the small run's
        assert [b for b, _ in normal.points["decode"]] == list(sp.standard_plan(target).decode)
    assert sorted(p.name for p in (cache / "profiles").iterdir()) == sorted([sp._path(key).name,
                                                                             sp._path(small_key).name])
    with LLM(model=model, scheduler="td-pipe", num_kv_blocks=3, dtype="float32") as llm:  # the standard one
        costs = llm.engine.scheduler.costs
        assert costs.source == str(sp._path(key)) and costs.peak_batch == 1


# -- the simulator's CPU calibration (sim/calibrate.py) ----------------------------------------------------
def test_calibration_cache_is_validated_and_rewritten(cache, model_dir, monkeypatch, caplog):
    from tdpipe.sim import calibrate
    from tdpipe.sim.hardware import TABLE

    runs: list[list[int]] = []

    def fake_calibrate(counts, model):
        runs.append(counts)
        return {"version": calibrate.CALIBRATION_VERSION, "devices": {str(n): TABLE["l20"].to_json()
                                                                      for n in counts}}

    monkeypatch.setattr(calibrate, "calibrate", fake_calibrate)
    monkeypatch.setattr(calibrate, "default_thread_counts", lambda: [1, 2])
    first = calibrate.cpu_hardware(model=str(model_dir))
    assert calibrate.cpu_hardware(model=str(model_dir)) == first and len(runs) == 1
    path = calibrate.cache_path(str(model_dir), [1, 2])
    for damage in ("{half", json.dumps({"devices": {"2": {"name": 1}}}), "[]"):
        path.write_text(damage)
        with caplog.at_level(logging.WARNING, logger="tdpipe"):
            assert calibrate.cpu_hardware(model=str(model_dir)) == first
        assert "damaged" in caplog.records[-1].getMessage()
    assert len(runs) == 4 and json.loads(path.read_text())["key"]["threads"] == [1, 2]
    monkeypatch.setenv("TDPIPE_NO_KERNEL", "1")  # other timings: another key
    assert calibrate.cache_path(str(model_dir), [1, 2]) != path


@pytest.mark.slow  # starts a Python process that imports torch
def test_kernel_threads_start_after_setuptools_changed_the_import_path() -> None:
    """in_background imports torch's cpp_extension (and so setuptools, whose distutils shim goes into and out
    of sys.meta_path) on the caller's thread before any builder starts: a builder thread doing it while the
    caller imports could make Python's walk of sys.meta_path skip the path finder ("No module named ..." for
    an installed module). A fresh interpreter, since this one may have imported setuptools already."""
    import subprocess

    code = ("import sys, threading\n"
            "from tdpipe.model.jit import in_background\n"
            "seen = []\n"
            "in_background(lambda: seen.append('setuptools' in sys.modules))\n"
            "[t.join() for t in threading.enumerate() if t.name == 'tdpipe-kernel-build']\n"
            "print(seen)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[True]"
