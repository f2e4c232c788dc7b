"""Trace analysis (bubble ratios, decode window, event kinds), the timeline PNG and `tdpipe plot timeline`."""
import json
import subprocess
import sys

import pytest

from tdpipe.cli import main
from tdpipe.viz import timeline as tl

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def ev(start, end, prefill=0, decode=0, wait=0.0, send=0.0, bid=0):
    return {"batch_id": bid, "start": start, "end": end, "wait": wait, "send": send,
            "prefill_tokens": prefill, "decode_seqs": decode}


def make_trace(stage_events, kv=None, layers=None):
    n = len(stage_events)
    layers = layers or [[i * 10, (i + 1) * 10] for i in range(n)]
    return {"format": "tdpipe-trace/1", "pp": n, "policy": "separate", "machine": "test",
            "stages": [{"stage": i, "layers": layers[i], "threads": 1, "events": evs}
                       for i, evs in enumerate(stage_events)],
            "engine": [], "kv": kv if kv is not None else []}


def two_stage():
    # stage 0 busy 0-1 and 2-3, stage 1 busy 1-2 and 3-4: wall 4, each stage idle 2 -> bubble 0.5
    return make_trace([[ev(0, 1, prefill=100, wait=0.0), ev(2, 3, decode=4, wait=0.5, send=0.1)],
                       [ev(1, 2, prefill=100, wait=0.2, send=0.3), ev(3, 4, decode=4, wait=0.4, send=0.1)]],
                      kv=[[0.0, 0.0], [1.0, 0.25], [2.0, 0.5], [4.0, 0.1]])


def test_bubble_ratios_by_hand():
    assert tl.bubble_ratios(two_stage()) == pytest.approx([0.5, 0.5])


def test_overlapping_intervals_count_once():
    # stage 0: [0,2] and [1,3] overlap -> busy 3 of wall 4; stage 1 nested [0,4] and [1,2] -> busy 4
    t = make_trace([[ev(0, 2, decode=1), ev(1, 3, decode=1)], [ev(0, 4, decode=1), ev(1, 2, decode=1)]])
    assert tl.bubble_ratios(t) == pytest.approx([0.25, 0.0])
    assert tl.summarize(t)["busy_s"] == pytest.approx([3.0, 4.0])


def test_wall_is_global_window_and_empty_stage_is_idle():
    # stage 1 has no events: idle the whole wall -> 1.0; the wall starts at the first start (1), not 0
    t = make_trace([[ev(1, 2, decode=1), ev(3, 5, decode=1)], []])
    assert tl.bubble_ratios(t) == pytest.approx([0.25, 1.0])
    assert tl.summarize(t)["wall_s"] == pytest.approx(4.0)


def test_empty_trace_raises():
    with pytest.raises(ValueError, match="no events"):
        tl.bubble_ratios(make_trace([[], []]))
    with pytest.raises(ValueError, match="no time"):
        tl.bubble_ratios(make_trace([[ev(1, 1)]]))


def test_decode_window():
    t = two_stage()
    # last prefill ends at 2 (stage 1) -> window [2, 4]: stage 0 busy 2-3, stage 1 busy 3-4 -> 0.5 each
    assert tl.decode_window(t) == (2.0, 4.0)
    assert tl.decode_bubble_ratios(t) == pytest.approx([0.5, 0.5])
    # a mixed batch counts as prefill for the window
    t2 = make_trace([[ev(0, 1, prefill=8), ev(1, 3, prefill=8, decode=2), ev(3, 4, decode=2)],
                     [ev(1, 2, prefill=8), ev(3, 3.5, prefill=1, decode=2), ev(4, 6, decode=2)]])
    assert tl.decode_window(t2) == (3.5, 6.0)
    # stage 0: [3.5, 4] busy of 2.5 -> 0.8 idle; stage 1: [4, 6] busy -> 0.2 idle
    assert tl.decode_bubble_ratios(t2) == pytest.approx([0.8, 0.2])


def test_decode_window_without_prefill_is_whole_run():
    t = make_trace([[ev(1, 2, decode=3)], [ev(2, 3, decode=3)]])
    assert tl.decode_window(t) == (1.0, 3.0)
    assert tl.decode_bubble_ratios(t) == tl.bubble_ratios(t) == pytest.approx([0.5, 0.5])


def test_decode_window_none_when_prefill_is_last():
    t = make_trace([[ev(0, 1, decode=2)], [ev(1, 2, prefill=5)]])
    assert tl.decode_window(t) is None and tl.decode_bubble_ratios(t) is None
    s = tl.summarize(t)
    assert s["decode_bubble_ratio"] is None and s["decode_bubble_ratio_per_stage"] is None


def test_event_kinds():
    assert tl.event_kind(ev(0, 1, prefill=10)) == "prefill"
    assert tl.event_kind(ev(0, 1, decode=3)) == "decode"
    assert tl.event_kind(ev(0, 1, prefill=10, decode=3)) == "mixed"
    assert tl.event_kind({"start": 0, "end": 1}) == "other"


def test_summarize():
    s = tl.summarize(two_stage())
    assert s["bubble_ratio"] == pytest.approx(0.5)
    assert s["bubble_ratio_per_stage"] == pytest.approx([0.5, 0.5])
    assert s["decode_bubble_ratio"] == pytest.approx(0.5)
    assert s["wall_s"] == pytest.approx(4.0)
    assert s["num_micro_batches"] == [2, 2]
    assert s["busy_s"] == pytest.approx([2.0, 2.0])
    assert s["mean_wait_s"] == pytest.approx([0.25, 0.3])
    assert s["mean_send_s"] == pytest.approx([0.05, 0.2])


def test_stage_label_inclusive_layers():
    assert tl.stage_label({"stage": 1, "layers": [18, 36]}, 1) == "stage 1 (layers 18-35)"
    assert tl.stage_label({}, 3) == "stage 3"


def test_load_trace_validation(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(two_stage()))
    assert tl.load_trace(p)["pp"] == 2
    bad = two_stage()
    bad["format"] = "other/2"
    p.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="format"):
        tl.load_trace(p)
    bad = two_stage()
    bad["stages"][1]["events"][0]["end"] = 0.5
    p.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"stages\[1\]\.events\[0\]"):
        tl.load_trace(p)
    bad = two_stage()
    del bad["stages"][0]["events"][1]["start"]
    p.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="start"):
        tl.load_trace(p)
    p.write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        tl.load_trace(p)


def test_plot_writes_png(tmp_path):
    out = tmp_path / "tl.png"
    tl.plot_timeline(two_stage(), out, title="two stages")
    data = out.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC


def test_plot_many_events_no_kv(tmp_path):
    # 2 stages x 3000 events, all three kinds, no KV samples: one broken_barh per stage per kind keeps it fast
    evs = [[ev(i * 0.01 + s * 0.005, i * 0.01 + s * 0.005 + 0.004, prefill=(i % 3 != 1) * 7,
               decode=(i % 3 != 0) * 2, wait=0.001) for i in range(3000)] for s in range(2)]
    out = tmp_path / "big.png"
    tl.plot_timeline(make_trace(evs), out)
    assert out.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_cli_plot_timeline_subprocess(tmp_path):
    f = tmp_path / "trace.json"
    f.write_text(json.dumps(two_stage()))
    out = tmp_path / "out.png"
    r = subprocess.run([sys.executable, "-m", "tdpipe.cli", "plot", "timeline", str(f), "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "stage 0 (layers 0-9)" in r.stdout and "stage 1 (layers 10-19)" in r.stdout
    assert "mean bubble ratio 0.500" in r.stdout
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_cli_plot_timeline_bad_file(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"format": "nope"}))
    r = subprocess.run([sys.executable, "-m", "tdpipe.cli", "plot", "timeline", str(f),
                        "-o", str(tmp_path / "x.png")], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "format" in err and "Traceback" not in err


def test_cli_plot_timeline_missing_file(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["plot", "timeline", str(tmp_path / "missing.json"), "-o", str(tmp_path / "x.png")])
    assert "no such trace file" in str(e.value.code)


@pytest.mark.parametrize("cmd", [["plot"], ["plot", "timeline"]])
def test_plot_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main(cmd + ["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "usage: tdpipe" in out
    if cmd[-1] == "timeline":
        assert "idle / wall" in out and "Fig. 2" in out and "Fig. 12" in out
