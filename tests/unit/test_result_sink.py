"""What `tdpipe generate -o` relies on before and after the engine, without a model: the result sink writes
each answer as one whole line the moment it is done (in input order on request), resumes after a cut line
and refuses a changed input; the preflight checks name the flag; a conversation is checked message by
message; the CLI checks its output paths before loading anything."""
import errno
import json
import os

import pytest

from tdpipe.cli import main
from tdpipe.entrypoints.conversation import check_conversation
from tdpipe.entrypoints.preflight import PreflightError, check_readable, check_writable
from tdpipe.entrypoints.results import ResultSink


def lines(path) -> list[dict]:
    return [json.loads(x) for x in open(path).read().splitlines()]


def test_preflight_names_the_flag(tmp_path):
    with pytest.raises(PreflightError, match=r"--json .*directory .* does not exist"):
        check_writable(str(tmp_path / "missing" / "r.json"), "--json")
    with pytest.raises(PreflightError, match="--output .*is a directory"):
        check_writable(str(tmp_path), "--output")
    with pytest.raises(PreflightError, match="--input .*no such file"):
        check_readable(str(tmp_path / "nope.txt"), "--input")
    check_writable(str(tmp_path / "new.jsonl"), "-o")
    assert not (tmp_path / "new.jsonl").exists()  # checking creates nothing


def test_sink_writes_a_refused_prompt_with_an_unpaired_surrogate(tmp_path):
    """A prompt holding a lone \\ud800 is refused and echoed in its error line; UTF-8 cannot hold it, and the
    write raised, ending `tdpipe generate` with every later answer lost. It is written as its JSON escape."""
    out = tmp_path / "o.jsonl"
    with ResultSink(str(out)) as s:
        s.write(0, {"index": 0, "prompt": "bad \ud800 é", "error": "refused"})
        s.write(1, {"index": 1, "prompt": "ok"})
    assert out.read_bytes().startswith('{"index": 0, "prompt": "bad \\ud800 é"'.encode())
    assert [r["prompt"] for r in lines(out)] == ["bad \ud800 é", "ok"]


def test_sink_writes_each_line_at_once_and_orders_on_request(tmp_path):
    out = tmp_path / "o.jsonl"
    with ResultSink(str(out), ordered=True) as s:
        s.write(2, {"index": 2})
        assert not out.exists() or out.read_text() == ""  # held back: 0 and 1 are not done
        s.write(0, {"index": 0})
        assert [r["index"] for r in lines(out)] == [0]  # on disk before the call ends
        s.write(1, {"index": 1})
        assert [r["index"] for r in lines(out)] == [0, 1, 2]
        assert s.finish(3) == 0


def test_sink_stopped_writes_what_it_held_back(tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    with ResultSink(str(out), ordered=True) as s:
        s.write(3, {"index": 3})
        s.write(1, {"index": 1})
        assert s.stopped(5, "interrupted", 130) == 130
    assert sorted(r["index"] for r in lines(out)) == [1, 3]
    err = capsys.readouterr().err
    assert "interrupted: 2 of 5 prompts answered" in err and "--resume" in err


def test_sink_resume_drops_a_cut_line_and_checks_the_input(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps({"index": 1, "prompt": "b"}) + "\n" + '{"index": 0, "pro')
    s = ResultSink(str(out), resume=True)
    assert s.done == {1}
    assert out.read_text().count("\n") == 1 and out.read_text().endswith("\n")
    s.check_resumed([{"prompt": "a"}, {"prompt": "b"}])
    with pytest.raises(PreflightError, match="different input"):
        s.check_resumed([{"prompt": "a"}, {"prompt": "changed"}])
    with pytest.raises(PreflightError, match="different input"):
        s.check_resumed([{"prompt": "a"}])
    with s:
        s.write(0, {"index": 0, "prompt": "a"})
    assert [r["index"] for r in lines(out)] == [1, 0]


def test_sink_failed_write_leaves_whole_lines(tmp_path, monkeypatch):
    out = tmp_path / "o.jsonl"
    sink = ResultSink(str(out))
    sink.write(0, {"index": 0, "text": "x" * 100})
    real = os.write

    def half_then_full(fd, data):  # the disk fills in the middle of a line
        real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError):
        sink.write(1, {"index": 1, "text": "y" * 100})
    monkeypatch.setattr(os, "write", real)
    assert sink.write_failed
    assert [r["index"] for r in lines(out)] == [0]


def test_conversation_check_names_the_message():
    check_conversation([{"role": "user", "content": "hi"}])
    for bad, msg in [([], "non-empty"), ("hi", "non-empty list"), ([{"role": "user"}], "message 0: missing 'content'"),
                     ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
                      "message 1: unknown role 'robot'"),
                     ([{"role": "user", "content": 3}], "'content' must be a string"),
                     ([{"role": "user", "content": "ok \ud83d"}], "'content': character 3 is an unpaired UTF-16")]:
        with pytest.raises(ValueError, match=msg):
            check_conversation(bad)


def test_cli_checks_outputs_before_loading(tmp_path, capsys):
    for flag in ("-o", "--trace", "--record-history"):
        rc = main(["generate", "hi", flag, str(tmp_path / "no" / "f.json")])
        assert rc == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "does not exist" in err
    assert main(["generate", "hi", "--resume"]) == 2
    assert "--resume needs --output" in capsys.readouterr().err
    assert main(["generate", "-i", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
