"""`tdpipe bench llama-cpp`: each side in its own process, llama.cpp's JSONL read for B = --num-prompts, the
ratio of the medians written with both sides' runs (a fake llama-batched-bench and a stubbed tdpipe side)."""
import argparse
import json
import stat

import pytest

from tdpipe.bench import llama_cpp


def _args(tmp_path, **kw):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    llama_cpp.add_parser(sub)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    fake = tmp_path / "llama-batched-bench"
    fake.write_text("#!/bin/sh\necho 'main: loading'\necho '{\"pl\": 4, \"speed\": 500.0, \"t\": 2.0, "
                    "\"speed_pp\": 900.0, \"speed_tg\": 300.0}'\necho \"$@\" > " + str(tmp_path / "argv") + "\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    argv = ["llama-cpp", "--model", str(gguf), "--llama-batched-bench", str(fake), "--num-prompts", "4",
            "--input-len", "8", "--output-len", "16", "--threads", "2", "--json", str(tmp_path / "r.json")]
    return p.parse_args(argv + [x for k, v in kw.items() for x in (f"--{k}", str(v))])


def test_ratio_of_medians_and_llama_flags(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp, "tdpipe_side", lambda a: {"total_tokens_per_s": 250.0,
                                                              "output_tokens_per_s": 100.0, "elapsed_s": 1.0})
    a = _args(tmp_path, repeats=2)
    assert a.fn(a) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["ratio_tdpipe_to_llama_cpp"] == pytest.approx(0.5)
    assert [x["repeat"] for x in r["runs"]["llama.cpp"]] == [0, 1]
    assert r["runs"]["llama.cpp"][0]["output_tokens_per_s"] == pytest.approx(4 * 16 / 2.0)
    flags = (tmp_path / "argv").read_text().split()
    assert flags[flags.index("-c") + 1] == str(4 * (8 + 16)) and flags[flags.index("-npl") + 1] == "4"


def test_not_a_gguf_is_one_line(tmp_path):
    a = _args(tmp_path)
    a.model = str(tmp_path / "folder")
    with pytest.raises(ValueError, match="expected a GGUF file"):
        a.fn(a)
