"""Randomised parity sweep against transformers: tiny checkpoints of every family with odd shapes (head dims
16-80, heads 1-9, GQA 1-3, intermediate sizes not a multiple of 32, 1-5 layers, tied or not, Llama's optional
biases and llama3 rope, Gemma 2's soft-caps, Gemma 3's layer kinds, Phi-3's partial rotary, Granite's
multipliers), saved by transformers itself, run through tdpipe in float32 under a random layout and scheduler
setting, compared token for token.

    .venv/bin/python scripts/fuzz_parity.py --seed 1 --count 16              # greedy, pp 1-3, tp 1-2 (P x T)
    .venv/bin/python scripts/fuzz_parity.py --mode quant --seed 3 --count 20 # W8A8 / int8 KV / bf16
    .venv/bin/python scripts/fuzz_parity.py --mode gguf --seed 5 --count 16  # exported to GGUF and back

`greedy`: tdpipe's tokens must equal transformers' (prefix caching, chunked prefill, block sizes, the
policies and n = 1 or 2 greedy samples drawn too). `quant`: the prompt's log-probabilities must stay near the
float model's (mean gap below 0.15 nats, or three times bf16's gap where that is larger) and n = 2 sampling
with logprobs must run. `gguf`: the checkpoint goes through tdpipe's GGUF export and loader first. Exit
status 1 on any difference or error. Bugs it found are fixed and tested (tests/e2e/test_families_engine.py:
Llama's attention_bias and mlp_bias; tests/unit/test_gguf_export.py: biased q/k rows;
tests/e2e/test_sliding_window.py: forked samples on a stage without sliding layers). Configurations
transformers itself refuses are skipped.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import transformers as hf

from tdpipe import LLM, SamplingParams
from tdpipe.bench.parity import hf_greedy
from tdpipe.model.random_model import write_tokenizer

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "granite")
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "tie_word_embeddings", "sliding_window", "layer_types",
              "attn_logit_softcapping", "final_logit_softcapping")  # printed with each result
N_OUT = 12


def draw_config(rng: random.Random, families: tuple[str, ...]) -> tuple[str, type, type, dict]:
    """(family, transformers model class, its config class, config keywords) with odd shapes."""
    fam = rng.choice(families)
    kv = rng.choice([1, 2, 3])
    heads, hd = kv * rng.choice([1, 2, 3]), rng.choice([16, 32, 48, 64, 80])
    kw = dict(hidden_size=rng.choice([48, 64, 96, 120, 160]), intermediate_size=rng.choice([37, 64, 100, 200]),
              num_hidden_layers=rng.choice([1, 2, 3, 5]), num_attention_heads=heads, num_key_value_heads=kv,
              max_position_embeddings=512, eos_token_id=1, bos_token_id=2, pad_token_id=0,
              vocab_size=rng.choice([300, 517, 1000]), tie_word_embeddings=rng.choice([True, False]))
    if fam in ("qwen2", "phi3"):  # head_dim = hidden / heads in these
        kw["hidden_size"] = heads * hd
    else:
        kw["head_dim"] = hd
    if fam == "llama":
        kw.update(attention_bias=rng.choice([True, False]), mlp_bias=rng.choice([True, False]),
                  rope_scaling=rng.choice([None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}]))
    elif fam == "mistral":
        kw["sliding_window"] = rng.choice([None, 12, 30])
    elif fam == "gemma2":
        kw.update(query_pre_attn_scalar=rng.choice([hd, 24]), sliding_window=rng.choice([8, 16]),
                  attn_logit_softcapping=rng.choice([None, 1.5, 50.0]), final_logit_softcapping=rng.choice([None, 2.0]))
    elif fam == "gemma3":
        kw.update(query_pre_attn_scalar=rng.choice([hd, 24]), sliding_window=rng.choice([8, 16]),
                  layer_types=[rng.choice(["sliding_attention", "full_attention"])
                               for _ in range(kw["num_hidden_layers"])])
    elif fam == "granite":
        kw.update(embedding_multiplier=rng.choice([1.0, 3.0, 12.0]), attention_multiplier=rng.choice([0.05, 0.2]),
                  residual_multiplier=rng.choice([0.22, 1.0]), logits_scaling=rng.choice([1.0, 8.0]),
                  attention_bias=rng.choice([True, False]), mlp_bias=rng.choice([True, False]))
    elif fam == "phi3":
        kw["partial_rotary_factor"] = rng.choice([1.0, 0.5])
    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma": "Gemma",
             "gemma2": "Gemma2", "gemma3": "Gemma3", "phi3": "Phi3", "granite": "Granite"}
    cfg_cls = getattr(hf, "Gemma3TextConfig" if fam == "gemma3" else f"{names[fam]}Config")
    return fam, getattr(hf, f"{names[fam]}ForCausalLM"), cfg_cls, kw


def save(i: int, model_cls: type, cfg_cls: type, cfg: dict) -> tuple[str, torch.nn.Module]:
    """The model, every weight moved off its init (no near-ties), saved with a tokenizer covering the vocab."""
    torch.manual_seed(i)
    model = model_cls(cfg_cls(**cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    d = tempfile.mkdtemp(prefix=f"fuzz{i}_")
    model.save_pretrained(d)
    write_tokenizer(Path(d), {"vocab_size": model.config.vocab_size, "eos_token_id": 1, "max_position_embeddings": 512})
    return d, model


def prompt_lps(llm: LLM, ids: list[int]) -> list[float]:
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])]


def run_one(mode: str, rng: random.Random, folder: str, model: torch.nn.Module, layers: int, kv: int,
            heads: int) -> tuple[bool, str]:
    """(passed, what ran) for one checkpoint; a crash is re-raised naming the settings it ran under."""
    drawn: dict = {}
    try:
        return _run_one(mode, rng, folder, model, layers, kv, heads, drawn)
    except Exception as e:
        raise RuntimeError(f"under {drawn}") from e


def _run_one(mode: str, rng: random.Random, folder: str, model: torch.nn.Module, layers: int, kv: int,
             heads: int, drawn: dict) -> tuple[bool, str]:
    """run_one's body; `drawn` receives the settings as soon as they are drawn."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    prompts = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in (rng.randint(1, 60), rng.randint(1, 40), 3)]
    prompts.append(prompts[0][:rng.randint(1, len(prompts[0]))] + [5, 6])  # a shared prefix
    pp = rng.choice([p for p in (1, 2, 3) if p <= layers])
    if mode == "quant":
        kw = dict(pipeline_parallel_size=pp, quantization=rng.choice(["w8a8", "w8a8", "none"]),
                  kv_cache_dtype=rng.choice(["auto", "int8"]), dtype=rng.choice(["float32", "bfloat16"]))
        drawn.update(kw, prompt_len=len(prompts[0]) + len(prompts[1]) + 3)
        ids = prompts[0] + prompts[1] + [5, 6, 7]
        with LLM(model=folder, dtype="float32", kv_cache_memory=32 << 20) as llm:
            ref = prompt_lps(llm, ids)
        with LLM(model=folder, kv_cache_memory=32 << 20, **kw) as llm:
            got = prompt_lps(llm, ids)
            sp = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, logprobs=2, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs
        gap = sum(abs(a - b) for a, b in zip(got, ref)) / len(ref)
        bound = 0.15
        if gap >= bound:  # a model whose logits are large (random weights): 8 bits may lose more than 0.15
            with LLM(model=folder, kv_cache_memory=32 << 20, dtype="bfloat16") as llm:  # nats; bf16 then does too
                bf16 = prompt_lps(llm, ids)
            bound = max(bound, 3 * sum(abs(a - b) for a, b in zip(bf16, ref)) / len(ref))
        ok = gap < bound and len(outs) == 2 and all(len(c.logprobs) == 6 for c in outs)
        return ok, f"{kw} mean gap {gap:.4f} (bound {bound:.4f})"
    ref = [hf_greedy(model, [p], N_OUT)[0] for p in prompts]
    if mode == "gguf":
        from tdpipe.model.gguf_export import write_gguf

        folder = str(write_gguf(folder, Path(folder) / "m.gguf", dtype="f32"))
        kw = dict(pipeline_parallel_size=min(pp, 2))
        drawn.update(kw)
    else:
        # T = 2 where the heads split (a single KV head is copied to both ranks), up to P x T = 2 x 2
        tp = rng.choice([1, 2]) if heads % 2 == 0 and (kv % 2 == 0 or kv == 1) and pp <= 2 else 1
        policies = ["separate", "hybrid", "throttle", "td-pipe"] if pp > 1 else ["separate", "hybrid"]
        kw = dict(pipeline_parallel_size=pp, tensor_parallel_size=tp, scheduler=rng.choice(policies),
                  block_size=rng.choice([8, 16, 32]), enable_prefix_caching=rng.choice([True, False]),
                  max_num_seqs=rng.choice([1, 2, 256]))
        budget = rng.choice([None, 16, 64])
        if budget is not None:
            kw["max_num_batched_tokens"] = budget
        drawn.update(kw)
    # n = 2: forked blocks, copy-on-write in every pool (a request's samples run together: max_num_seqs >= n)
    samples = 1 if mode == "gguf" or kw.get("max_num_seqs") == 1 else rng.choice([1, 2])
    drawn["n"] = samples
    with LLM(model=folder, dtype="float32", kv_cache_memory=32 << 20, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(n=samples, temperature=0, max_tokens=N_OUT, ignore_eos=True),
                            use_tqdm=False)
    got = [[c.token_ids for c in o.outputs] for o in outs]
    want = [[r] * samples for r in ref]
    return got == want, f"{drawn}" + ("" if got == want else f"\n  got {got}\n  ref {want}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=("greedy", "quant", "gguf"), default="greedy")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--count", type=int, default=16)
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    # GGUF export writes llama, mistral, qwen2, qwen3, phi3, gemma, gemma2 and granite (unscaled rope only)
    families = (("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "granite") if a.mode == "gguf"
                else FAMILIES)
    failed = 0
    for i in range(a.count):
        fam, model_cls, cfg_cls, cfg = draw_config(rng, families)
        if a.mode == "gguf":
            cfg["rope_scaling"] = None
            if cfg["hidden_size"] % cfg["num_attention_heads"]:  # transformers' GGUF tokenizer reader (which
                print(f"skip {i} {fam}: hidden size not a multiple of the heads")  # the loader uses) refuses
                continue
        try:
            folder, model = save(i, model_cls, cfg_cls, cfg)
        except Exception as e:  # noqa: BLE001 - transformers refuses the shape (hidden not a multiple of heads)
            print(f"skip {i} {fam}: {str(e).splitlines()[-1].strip()}")
            continue
        shape = {k: cfg[k] for k in SHAPE_KEYS if k in cfg}
        try:
            ok, what = run_one(a.mode, rng, folder, model, cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                               cfg["num_attention_heads"])
        except Exception:  # noqa: BLE001 - a crash is a finding: report it and go on
            ok, what = False, traceback.format_exc()
        failed += not ok
        print(f"{'OK  ' if ok else 'FAIL'} {i} {fam} {json.dumps(shape)} {what}", flush=True)
    print(f"{a.count} drawn, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
