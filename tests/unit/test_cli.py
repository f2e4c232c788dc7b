"""The `tdpipe` command line: help texts, and generate from arguments, JSONL files and stdin."""
import json
import subprocess
import sys

import pytest

from tdpipe.cli import main


@pytest.mark.parametrize("cmd", [[], ["generate"], ["chat"], ["bench"], ["bench", "throughput"], ["predictor"],
                                 ["predictor", "train"], ["predictor", "eval"]])
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main(cmd + ["--help"])
    assert e.value.code == 0
    assert "usage: tdpipe" in capsys.readouterr().out


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"tdpipe {version('tdpipe')}\n"


@pytest.mark.slow  # starts a Python process that imports torch
def test_the_version_is_read_when_asked_not_at_import():
    """importlib.metadata walks sys.path (40-70 ms here): not in every process's start, each stage's too."""
    import subprocess
    import sys

    code = ("import tdpipe, tdpipe.cli, tdpipe.pipeline.stage\n"
            "from tdpipe.version import package_version\n"
            "assert package_version.cache_info().currsize == 0, 'read at import'\n"
            "from importlib.metadata import version\n"
            "assert tdpipe.__version__ == version('tdpipe') == package_version()\n"
            "from tdpipe.version import __version__\n"
            "assert __version__ == tdpipe.__version__\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_generate_jsonl_file(tmp_path, bundled_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "The capital of France is"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "--input", str(inp), "--output", str(out), "--max-tokens", "5", "--dtype", "float32",
               "--kv-cache-memory", "64MiB", "--no-progress", "--output-token-ids", "--ignore-eos"])
    assert rc == 1  # one request failed
    recs = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["index"])
    assert len(recs) == 2
    assert recs[0]["num_output_tokens"] == 5 and "Paris" in recs[0]["text"] and len(recs[0]["token_ids"]) == 5
    assert recs[1]["finish_reason"] == "error" and "empty" in recs[1]["error"]


def test_generate_samples_and_logprobs(tmp_path, bundled_path):
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "The capital of France is", "--output", str(out), "--max-tokens", "4", "--dtype",
               "float32", "--kv-cache-memory", "64MiB", "--no-progress", "--ignore-eos", "--n", "3",
               "--temperature", "1", "--sampling-seed", "5", "--logprobs", "2", "--prompt-logprobs", "1",
               "--output-token-ids"])
    assert rc == 0
    rec = json.loads(out.read_text())
    assert [s["index"] for s in rec["samples"]] == [0, 1, 2] and rec["num_output_tokens"] == 12
    assert rec["text"] == rec["samples"][0]["text"]
    for s in rec["samples"]:
        assert len(s["logprobs"]) == 4 and all(2 <= len(p) <= 3 for p in s["logprobs"])
        chosen = [p[str(t)]["logprob"] for p, t in zip(s["logprobs"], s["token_ids"])]
        assert abs(sum(chosen) - s["cumulative_logprob"]) < 1e-4
    assert rec["prompt_logprobs"][0] is None and len(rec["prompt_logprobs"]) == rec["num_prompt_tokens"]

def test_generate_bad_best_of_names_the_field(capsys):
    assert main(["generate", "x", "--n", "3", "--best-of", "2"]) == 2  # before any model loads
    assert "best_of must be None or an int >= n (3), got 2" in capsys.readouterr().err


def test_generate_messages_through_the_chat_template_and_record_history(tmp_path, bundled_path):
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a fruit."}]
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"messages": conv}) + "\n")
    out, hist = tmp_path / "out.jsonl", tmp_path / "h.jsonl"
    rc = main(["generate", "--input", str(inp), "--output", str(out), "--max-tokens", "4", "--dtype", "float32",
               "--kv-cache-memory", "64MiB", "--no-progress", "--record-history", str(hist)])
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["prompt"] == "Hi\nHello!\nName a fruit." and rec["num_prompt_tokens"] > 10  # template tokens
    h = json.loads(hist.read_text())
    assert h["prompt"] == rec["prompt"] and h["prompt_tokens"] == rec["num_prompt_tokens"]
    assert h["output_tokens"] == rec["num_output_tokens"]


def test_generate_stdin_subprocess(bundled_path):
    r = subprocess.run([sys.executable, "-m", "tdpipe.cli", "generate", "--max-tokens", "3",
                        "--kv-cache-memory", "64MiB", "--no-progress", "--chat-template"],
                       input="Say hello\nName a fruit\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    recs = sorted((json.loads(line) for line in r.stdout.splitlines()), key=lambda x: x["index"])
    assert [x["prompt"] for x in recs] == ["Say hello", "Name a fruit"]
    assert all(x["num_output_tokens"] <= 3 for x in recs)


def test_bad_flag_value_names_field(capsys):
    rc = main(["generate", "hi", "--temperature", "-1", "--kv-cache-memory", "64MiB"])
    assert rc == 2
    assert "temperature" in capsys.readouterr().err


def test_serve_takes_the_model_as_vllm_serve_does(capsys, bundled_path):
    """`tdpipe serve MODEL`, as `vllm serve MODEL`: the positional is --model; both at once must agree; a
    missing model is one line before the port is taken (exit 2), not the engine core's traceback."""
    from tdpipe.cli import build_parser
    from tdpipe.entrypoints.openai.serve_args import engine_config

    a = build_parser("serve").parse_args(["serve", bundled_path, "--port", "0"])
    assert engine_config(a).model == bundled_path == a.model
    assert main(["serve", "one", "--model", "two", "--port", "0"]) == 2
    assert "the model is given twice, 'one' and --model 'two'" in capsys.readouterr().err
    assert main(["serve", "/nonexistent/model", "--port", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("tdpipe: error: --model /nonexistent/model: no such file"), err


@pytest.mark.slow  # starts the engine-core process
def test_serve_whose_engine_fails_to_start_says_why_in_one_line(tmp_path, capfd):
    assert main(["serve", str(tmp_path), "--port", "0", "--no-access-log"]) == 1
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("tdpipe: ")]
    assert err == [f"tdpipe: error: engine core failed: model folder '{tmp_path}' has no config.json; expected a "
                   "Hugging Face model folder"], err


@pytest.mark.parametrize("suffix,content", [
    (".jsonl", b'{"prompt": "a \xff b"}\r\n{"prompt": "ok"}\n\n{"prompt": "\xc3\xa9"}\n'),
    (".txt", b"plain \xff line\r\nok\n\n\xc3\xa9\n"),
])
def test_input_lines_that_are_not_utf8_fail_alone(tmp_path, suffix, content):
    """One line of --input that is not UTF-8 is that request's error, naming the line; decoding the whole
    file at once failed the run with "'utf-8' codec can't decode byte 0xff", naming neither file nor line."""
    import argparse

    from tdpipe.cli import _read_prompts

    f = tmp_path / f"in{suffix}"
    f.write_bytes(content)
    recs = _read_prompts(argparse.Namespace(prompts=[], input=str(f)))
    assert recs[0] == {"error": "line 1: not valid UTF-8 (byte %d)" % content.index(b"\xff")}
    assert [r.get("prompt") for r in recs[1:]] == ["ok", "é"]  # \r\n ends a line; blank lines skipped
