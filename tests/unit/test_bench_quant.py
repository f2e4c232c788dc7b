"""`tdpipe bench gemm` and `tdpipe bench perplexity`: their shapes, text handling and errors, without a model."""
import json

import pytest

from tdpipe.bench import gemm, perplexity
from tdpipe.cli import main


def test_model_shapes_are_the_configs_linears():
    shapes = dict((name, (n, k)) for name, n, k in gemm.model_shapes("smollm2-135m"))
    assert shapes == {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                      "lm_head": (49152, 576)}
    assert dict((name, (n, k)) for name, n, k in gemm.model_shapes("qwen2.5-0.5b"))["qkv"] == (1152, 896)


def test_every_path_times_a_tiny_shape():
    secs = gemm.time_shape(4, 32, 64, iters=1)
    """Every path this CPU can run (bf16-packed needs avx512_bf16), the others named with why."""
    assert set(secs) == set(gemm.PATHS) - set(gemm.skipped_paths()) and all(s > 0 for s in secs.values())
    assert "bf16" in secs and "w8a8" in secs and "w4a8-block" in secs  # run everywhere
    assert all(p in gemm.PATHS and why for p, why in gemm.skipped_paths().items())


def test_the_table_gives_ratios_only_where_both_paths_ran():
    """A subset of --paths: a ratio to bf16-packed appears where both ran, never a "nan"."""
    row = {"model": "m", "linear": "qkv", "m": 8, "n": 960, "k": 576}
    alone = gemm.table({"results": [{**row, "gops": {"bf16-packed": 100.0}}]})
    assert "nan" not in alone and "/ bf16-packed" not in alone and "| 100 |" in alone
    both = gemm.table({"results": [{**row, "gops": {"bf16-packed": 100.0, "w8a8": 150.0}}]})
    assert "w8a8 / bf16-packed" in both and "| 1.50x |" in both
    lines = both.splitlines()
    assert len({line.count("|") for line in lines}) == 1  # header, rule and rows have the same columns


def test_gemm_rejects_an_unknown_path(capsys):
    with pytest.raises(SystemExit, match="unknown"):
        main(["bench", "gemm", "--paths", "bf16,int4"])


def test_read_text_takes_text_prompt_or_messages(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in ({"text": "a"}, {"prompt": "b"},
                                                   {"messages": [{"role": "user", "content": "c"}]})) + "\n")
    assert perplexity.read_text(f) == "a\n\nb\n\nc"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1"):
        perplexity.read_text(bad)
    raw = tmp_path / "raw.txt"
    raw.write_text("plain text")
    assert perplexity.read_text(raw) == "plain text"


def test_windows_cut_the_text_and_drop_an_unscorable_tail():
    assert perplexity.windows(list(range(10)), 4, 100) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert perplexity.windows(list(range(9)), 4, 100) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # [8] scores nothing
    assert perplexity.windows(list(range(10)), 4, 6) == [[0, 1, 2, 3], [4, 5]]


def test_the_default_dataset_is_committed_text():
    assert perplexity.DEFAULT_DATASET.is_file()
    assert len(perplexity.read_text(perplexity.DEFAULT_DATASET)) > 100_000


@pytest.mark.parametrize("args, msg", [(["--quantization", "int4"], "must be one of"),
                                       (["--window", "1"], "at least 2"),
                                       (["--dataset", "/no/such/file"], "no file")])
def test_perplexity_rejects_bad_arguments(args, msg):
    with pytest.raises(SystemExit, match=msg):
        main(["bench", "perplexity", *args])
