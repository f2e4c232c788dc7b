"""The `tdpipe` command line: help texts, and generate from arguments, JSONL files and stdin."""
import json
import subprocess
import sys

import pytest

from tdpipe.entrypoints.cli import main


@pytest.mark.parametrize("cmd", [[], ["generate"], ["chat"], ["bench"], ["bench", "throughput"], ["predictor"],
                                 ["predictor", "train"], ["predictor", "eval"]])
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main(cmd + ["--help"])
    assert e.value.code == 0
    assert "usage: tdpipe" in capsys.readouterr().out


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
    r = subprocess.run([sys.executable, "-m", "tdpipe.entrypoints.cli", "generate", "--max-tokens", "3",
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
