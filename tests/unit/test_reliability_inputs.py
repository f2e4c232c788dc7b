"""Ordinary mistakes fail early with one clear line: sampling parameters that would break a batch later,
damaged or incomplete model folders and files, missing inputs and unwritable outputs of the benchmark and
the simulator, and tensor-parallel splits that cannot exist. Damaged models are copies in tmp dirs; the
real cache (~/.cache/tdpipe) is only ever read."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tdpipe.model.weights import (
    MissingModelFile,
    ModelFileError,
    check_safetensors,
    iter_safetensors,
    load_hf_config,
)
from tdpipe.sampling import SamplingParams

# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, field, says",
    [
        ({"seed": 2**64}, "seed", r"\[-2\*\*63, 2\*\*64 - 1\]"),
        ({"seed": -(2**63) - 1}, "seed", "int in"),
        ({"seed": 1.0}, "seed", "int"),
        ({"seed": "7"}, "seed", "int"),
        ({"seed": True}, "seed", "int"),
        ({"temperature": float("inf")}, "temperature", "finite"),
        ({"temperature": float("nan")}, "temperature", ">= 0"),
        ({"top_p": float("nan")}, "top_p", r"\(0, 1\]"),
        ({"top_p": float("inf")}, "top_p", "finite"),
        ({"min_p": float("nan")}, "min_p", r"\[0, 1\]"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty", "finite"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty", "> 0"),
        ({"presence_penalty": float("-inf")}, "presence_penalty", "finite"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty", r"\[-2, 2\]"),
        ({"temperature": "0.7"}, "temperature", ">= 0"),
        ({"ignore_eos": "no"}, "ignore_eos", "bool"),
        ({"ignore_eos": 1}, "ignore_eos", "bool"),
        ({"skip_special_tokens": "False"}, "skip_special_tokens", "bool"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output", "bool"),
        ({"max_tokens": "5"}, "max_tokens", "int >= 1"),
        ({"max_tokens": True}, "max_tokens", "int >= 1"),
        ({"max_tokens": 5.0}, "max_tokens", "int >= 1"),
        ({"min_tokens": "1"}, "min_tokens", "int >= 0"),
        ({"min_tokens": False}, "min_tokens", "int >= 0"),
        ({"top_k": True}, "top_k", "int >= 1"),
        ({"top_k": "5"}, "top_k", "int >= 1"),
        ({"n": True}, "n", "1"),
        ({"stop": 5}, "stop", "str"),
        ({"stop": [b"x"]}, "stop", "str"),
        ({"stop": {"a": 1}}, "stop", "str"),
        ({"stop_token_ids": "12"}, "stop_token_ids", "list of ints"),
        ({"stop_token_ids": 12}, "stop_token_ids", "list of ints"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids", "list of ints"),
        ({"stop_token_ids": [True]}, "stop_token_ids", "list of ints"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids", "list of ints"),
        ({"detokenize": "no"}, "detokenize", "bool"),
        ({"stop": "x", "detokenize": False}, "stop", "detokenize=True"),  # stop strings are found in the text
    ],
)
def test_sampling_params_reject_what_would_fail_later(kwargs, field, says):
    with pytest.raises(ValueError, match=rf"^{field} .*{says}"):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_edges_and_normalise():
    for seed in (0, -1, -(2**63), 2**63, 2**64 - 1, np.int64(5), np.uint64(2**64 - 1)):
        p = SamplingParams(seed=seed)
        assert type(p.seed) is int and p.seed == int(seed)
    p = SamplingParams(max_tokens=np.int32(7), top_k=np.int64(3), stop_token_ids=(np.int64(4), 5),
                       temperature=np.float32(0.5), ignore_eos=True, skip_special_tokens=False)
    assert (type(p.max_tokens), type(p.top_k), p.stop_token_ids) == (int, int, [4, 5])
    assert type(p.temperature) is float and p.ignore_eos is True
    assert SamplingParams(top_k=10**30).top_k == 10**30  # huge but valid: the sampler clamps it to the vocab


def test_extreme_params_sample_without_error():
    """Values at the edges of what SamplingParams accepts must not fail inside a batched step."""
    from tdpipe.sampling.metadata import SamplingMetadata
    from tdpipe.sampling.sampler import Sampler, draw_key

    params = [SamplingParams(seed=2**64 - 1, top_k=10**30), SamplingParams(seed=-(2**63), top_p=0.5),
              SamplingParams(temperature=1e30, seed=0)]
    keys = [draw_key(p.seed, 0) for p in params]
    toks = Sampler()(torch.randn(3, 64), SamplingMetadata(params, [[]] * 3, [[]] * 3, keys))
    assert all(0 <= t < 64 for t in toks)


# ---------------------------------------------------------------- safetensors, config, tokenizer, GGUF


def _save(path: Path, n: int = 4000) -> None:
    save_file({"a": torch.ones(n), "b": torch.zeros(n)}, str(path))


def test_truncated_safetensors_names_the_file_and_sizes(tmp_path):
    f = tmp_path / "model.safetensors"
    _save(f)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelFileError, match=r"model\.safetensors: truncated: header says 32\.0 kB of tensors, "
                                             r"file has \d+\.\d kB"):
        check_safetensors(f)
    f.write_bytes(data[:50])  # cut inside the JSON header
    with pytest.raises(ModelFileError, match="model.safetensors: truncated or not safetensors"):
        check_safetensors(f)
    f.write_bytes(data[:5])
    with pytest.raises(ModelFileError, match="too short to be a safetensors file"):
        check_safetensors(f)
    f.write_bytes(data[:8] + b"x" * (len(data) - 8))  # header bytes scrambled
    with pytest.raises(ModelFileError, match="corrupt safetensors header"):
        check_safetensors(f)


def test_damaged_last_shard_fails_before_any_tensor_is_read(tmp_path):
    _save(tmp_path / "model-00001-of-00002.safetensors")
    _save(tmp_path / "model-00002-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    last = tmp_path / "model-00002-of-00002.safetensors"
    last.write_bytes(last.read_bytes()[:-100])
    got = []
    with pytest.raises(ModelFileError, match="model-00002-of-00002.safetensors: truncated"):
        for name, _ in iter_safetensors(tmp_path):
            got.append(name)
    assert got == []
    last.unlink()
    with pytest.raises(MissingModelFile, match="lists 1 shard.*model-00002-of-00002.safetensors"):
        list(iter_safetensors(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="model.safetensors.index.json: corrupt index"):
        list(iter_safetensors(tmp_path))


def test_missing_weights_and_config_are_named(tmp_path):
    with pytest.raises(MissingModelFile, match="has no weights: no model.safetensors"):
        list(iter_safetensors(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(MissingModelFile, match="weights only as pytorch_model.bin; tdpipe reads safetensors"):
        list(iter_safetensors(tmp_path))
    with pytest.raises(MissingModelFile, match="config.json"):
        load_hf_config(tmp_path)
    with pytest.raises(MissingModelFile, match="does not exist"):
        load_hf_config(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text('{"hidden_size": 5,')
    with pytest.raises(ModelFileError, match=r"config\.json is not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelFileError, match="must hold a JSON object"):
        load_hf_config(tmp_path)
    # both a ValueError (the CLI's one-line error) and, when something is missing, a FileNotFoundError
    err = MissingModelFile("x")
    assert isinstance(err, ValueError) and isinstance(err, FileNotFoundError)


def test_tokenizer_files_missing_or_damaged(tmp_path, bundled_path):
    from tdpipe.model.weights import check_tokenizer_files
    from tdpipe.tokenizer import load_tokenizer

    with pytest.raises(MissingModelFile, match="has no tokenizer files: none of tokenizer.json"):
        check_tokenizer_files(str(tmp_path))
    shutil.copy(Path(bundled_path) / "tokenizer_config.json", tmp_path)
    with pytest.raises(MissingModelFile, match="has no tokenizer files"):  # not "install sentencepiece"
        load_tokenizer(str(tmp_path))
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(MissingModelFile, match="vocab.json but no merges.txt"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "vocab.json").unlink()
    good = (Path(bundled_path) / "tokenizer.json").read_bytes()
    (tmp_path / "tokenizer.json").write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelFileError, match=f"cannot load the tokenizer in {tmp_path}"):
        load_tokenizer(str(tmp_path))


@pytest.mark.slow
def test_damaged_gguf_names_the_file(tmp_path):
    from tdpipe.model.bundled import bundled_gguf_path
    from tdpipe.model.gguf import convert_gguf_to_hf_folder, gguf_to_hf

    src = Path(bundled_gguf_path())
    with src.open("rb") as f:
        head = f.read(4 << 20)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)  # the first 4 MB of a 98 MB file
    with pytest.raises(ModelFileError, match=r"cut\.gguf: truncated"):
        gguf_to_hf(cut)
    with pytest.raises(ModelFileError, match=r"cut\.gguf: truncated"):
        convert_gguf_to_hf_folder(cut, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    other = tmp_path / "notes.gguf"
    other.write_text("hello")
    with pytest.raises(ModelFileError, match=r"notes\.gguf: not a GGUF file"):
        gguf_to_hf(other)
    with pytest.raises(MissingModelFile, match="GGUF file not found"):
        gguf_to_hf(tmp_path / "absent.gguf")


# ---------------------------------------------------------------- CLI: one line, exit 2


def _one_error_line(capsys, rc: int) -> str:
    """The run failed with exit 2 and exactly one 'tdpipe: error:' line, no traceback."""
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("tdpipe: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory, bundled_path) -> Path:
    """One copy of the bundled model folder; each test builds its damaged variant from it."""
    d = tmp_path_factory.mktemp("pristine") / "model"
    shutil.copytree(bundled_path, d)
    return d


def _variant(model_copy: Path, dest: Path) -> Path:
    """Hard links to the pristine copy (never to the cache): removing or rewriting a file in the variant
    replaces the link and leaves the copy whole."""
    dest.mkdir()
    for f in model_copy.iterdir():
        os.link(f, dest / f.name)
    return dest


def _generate(model: Path | str) -> list[str]:
    return ["generate", "--model", str(model), "--max-tokens", "1", "--no-progress", "--threads", "1", "Hi"]


@pytest.mark.slow
def test_cli_truncated_weights(model_copy, tmp_path, capsys):
    from tdpipe.cli import main

    m = _variant(model_copy, tmp_path / "m")
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").unlink()
    (m / "model.safetensors").write_bytes(data[: len(data) // 3])
    line = _one_error_line(capsys, main(_generate(m)))
    assert "model.safetensors: truncated: header says 269.0 MB of tensors, file has 89.7 MB" in line


@pytest.mark.slow
@pytest.mark.parametrize("remove, says", [
    ("tokenizer.json", "has no tokenizer files"),
    ("model.safetensors", "has no weights"),
    ("config.json", "no config.json"),
])
def test_cli_missing_model_parts(model_copy, tmp_path, capsys, remove, says):
    from tdpipe.cli import main

    m = _variant(model_copy, tmp_path / "m")
    (m / remove).unlink()
    line = _one_error_line(capsys, main(_generate(m)))
    assert says in line and str(m) in line


def test_cli_missing_model_path(tmp_path, capsys):
    from tdpipe.cli import main

    gone = tmp_path / "no-such-model"
    assert str(gone) in _one_error_line(capsys, main(_generate(gone)))
    line = _one_error_line(capsys, main(["bench", "throughput", "--model", str(gone), "--num-prompts", "1"]))
    assert f"--model {gone}: no such file or directory" in line


@pytest.mark.slow
def test_cli_truncated_gguf(tmp_path, capsys, monkeypatch):
    from tdpipe.cli import main
    from tdpipe.model.bundled import bundled_gguf_path

    monkeypatch.setenv("TDPIPE_CACHE", str(tmp_path / "cache"))  # a conversion must never touch the real cache
    with open(bundled_gguf_path(), "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(4 << 20))
    line = _one_error_line(capsys, main(_generate(tmp_path / "cut.gguf")))
    assert "cut.gguf: truncated" in line


@pytest.mark.parametrize("args, says", [
    (["--dataset", "{missing}"], "--dataset {missing}: no such file"),
    (["--history", "{missing}"], "--history {missing}: no such file"),
    (["--json", "{nodir}/r.json"], "--json {nodir}/r.json: directory {nodir} does not exist"),
    (["--trace", "{nodir}/t.json"], "--trace {nodir}/t.json: directory {nodir} does not exist"),
])
def test_cli_bench_throughput_checks_paths_before_loading(tmp_path, capsys, monkeypatch, args, says):
    """Fails before any model loads: the engine is never built (LLM would raise here)."""
    import tdpipe
    from tdpipe.cli import main

    monkeypatch.setattr(tdpipe, "LLM", lambda *a, **k: pytest.fail("the model loaded before the check"))
    sub = {"missing": str(tmp_path / "missing.jsonl"), "nodir": str(tmp_path / "nodir")}
    args = [a.format(**sub) for a in args]
    line = _one_error_line(capsys, main(["bench", "throughput", "--num-prompts", "1", *args]))
    assert says.format(**sub) in line


@pytest.mark.parametrize("args", [
    [],
    ["--figure11"],
    ["--compare", "{bench}"],
])
def test_cli_simulate_checks_json_before_simulating(tmp_path, capsys, monkeypatch, args):
    """Every simulate mode checks --json first (a --figure11 grid used to lose hours of results to a
    missing directory at the very end)."""
    from tdpipe.cli import main
    from tdpipe.sim import fidelity, grid, runner

    def never(*a, **k):
        pytest.fail("simulated before the check")

    for mod, name in ((runner, "simulate"), (grid, "run_grid"), (fidelity, "replay")):
        monkeypatch.setattr(mod, name, never)
    bench = tmp_path / "bench.json"
    bench.write_text("{}")
    args = [a.format(bench=bench) for a in args]
    out = tmp_path / "nodir" / "r.json"
    line = _one_error_line(capsys, main(["simulate", "--num-prompts", "5", *args, "--json", str(out)]))
    assert f"--json {out}: directory {out.parent} does not exist" in line
    for flag in ("--markdown", "--trace"):
        line = _one_error_line(capsys, main(["simulate", "--num-prompts", "5", *args, flag, str(out)]))
        assert f"{flag} {out}: directory" in line


def test_cli_simulate_missing_inputs(tmp_path, capsys):
    from tdpipe.cli import main

    missing = tmp_path / "absent.jsonl"
    line = _one_error_line(capsys, main(["simulate", "--dataset", str(missing), "--num-prompts", "5"]))
    assert f"--dataset {missing}: no such file" in line
    line = _one_error_line(capsys, main(["simulate", "--compare", str(missing)]))
    assert f"--compare {missing}: no such file" in line
    line = _one_error_line(capsys, main(["simulate", "--hardware", str(tmp_path / "hw.json"), "--num-prompts", "5"]))
    assert "hw.json: no such file" in line


# ---------------------------------------------------------------- simulator: impossible tensor parallelism


@pytest.mark.parametrize("model, tp, says", [
    ("13b", 3, "40 attention heads and 40 KV heads are not divisible by 3"),
    ("32b", 20, "27648 intermediate_size (MLP columns) and 8 KV heads are not divisible by 20"),
    ("bundled", 2, "9 attention heads and 3 KV heads are not divisible by 2"),
])
def test_cli_simulate_rejects_impossible_tp(capsys, model, tp, says):
    from tdpipe.cli import main

    line = _one_error_line(capsys, main(["simulate", "--hardware", "l20", "--parallel", "tp", "--num-devices",
                                         str(tp), "--model", model, "--num-prompts", "5"]))
    assert f"tensor parallel size {tp} cannot split the model" in line and says in line


def test_cost_model_and_grid_refuse_impossible_tp():
    from tdpipe.config import ModelConfig
    from tdpipe.sim import grid
    from tdpipe.sim.cost import CostModel, check_tensor_parallel
    from tdpipe.sim.hardware import TABLE
    from tdpipe.sim.runner import resolve_sim_model

    mc = ModelConfig.from_hf(load_hf_config(resolve_sim_model("70b")))
    for tp in (1, 2, 4, 8):
        check_tensor_parallel(mc, tp)
    with pytest.raises(ValueError, match="intermediate_size|attention heads"):
        check_tensor_parallel(mc, 3)
    with pytest.raises(ValueError, match="tensor parallel size"):
        CostModel(mc, TABLE["l20"], [(0, mc.num_layers)], tp=24)
    for tp in (16, 32):  # more ranks than KV heads: each keeps one, replicated (as vLLM)
        check_tensor_parallel(mc, tp)
    with pytest.raises(ValueError, match="integer >= 1"):
        check_tensor_parallel(mc, 0)
    cell = {"hardware": "l20", "model": "llama-2-13b", "devices": 3, "method": "TP+SB"}
    r = grid.run_cell(cell, 5, 0, {})
    assert "not divisible by 3" in r["invalid"] and "output_tokens_per_s" not in r
    assert "n/a" in grid.markdown([r | {"hardware": hw, "model": m, "devices": n, "method": name}
                                   for hw, m in grid.PAIRS for n in grid.DEVICES for name in grid.METHODS],
                                  {"num_prompts": 5, "seed": 0})


def test_hardware_file_errors(tmp_path):
    from tdpipe.sim.hardware import TABLE, load_hardware

    f = tmp_path / "hw.json"
    with pytest.raises(ValueError, match="hw.json: no such file"):
        load_hardware(str(f))
    for bad, says in (({"flops": "fast"}, "flops must be a finite number"),
                      ({"mem_bw": float("inf")}, "mem_bw must be a finite number"),
                      ({"measured_engine": "yes"}, "measured_engine must be true or false"),
                      ({"name": 5}, "name must be a string")):
        f.write_text(json.dumps(TABLE["h100"].to_json() | bad))
        with pytest.raises(ValueError, match=says):
            load_hardware(str(f))
    f.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be an object"):
        load_hardware(str(f))


def test_workload_file_errors(tmp_path):
    from tdpipe.bench import workload as wl

    with pytest.raises(ValueError, match="absent.jsonl: no such file"):
        wl.from_jsonl(tmp_path / "absent.jsonl", None)
    b = tmp_path / "bin.jsonl"
    b.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="bin.jsonl: not UTF-8 text"):
        wl.from_jsonl(b, None)
    t = tmp_path / "bools.jsonl"
    t.write_text('{"prompt_token_ids": [true, 5], "output_len": 3}\n')
    with pytest.raises(ValueError, match="list of integers"):
        wl.from_jsonl(t, None)
