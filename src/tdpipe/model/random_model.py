"""Random-weight models of real published configs (`--model random:qwen2.5-0.5b`), for throughput benchmarks.

Nothing may download weights at run time, yet tensor vs pipeline parallelism must be measured on a model of
a realistic size and shape (TD-Pipe §4 compares layouts, not answers). Throughput does not depend on the
weights' values, only on their shapes, so the bench generates them: normal(0, 0.02) linears and embeddings,
unit norms, zero biases (finite activations in bf16), from a fixed seed. The folder is a complete Hugging
Face model: config.json, one model.safetensors (bf16), and a self-contained tokenizer covering exactly
the vocabulary (byte-level BPE: any text in, gibberish out). It is built once into
$TDPIPE_CACHE/models/random-<name>-seed<seed> (in a temporary folder, renamed into place with a manifest,
like the GGUF conversions), and reused after.
"""
from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import shutil
import struct
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from tdpipe.model.cache import cache_dir, check_entry, notice, write_manifest

PREFIX = "random:"
FORMAT = 2  # bumped when the folder's contents change (2: byte-level BPE tokenizer): older entries are rebuilt
EOS = "<|endoftext|>"  # the one special token (transformers' Qwen2 tokenizer default)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def known_configs() -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in resources.files("tdpipe.model").joinpath("configs").iterdir()
                  if p.name.endswith(".json"))


def published_config(name: str) -> dict[str, Any]:
    """The shipped shape fields of a published model (src/tdpipe/model/configs/<name>.json)."""
    if name not in known_configs():
        raise ValueError(f"unknown random model {name!r}: known configs are {', '.join(known_configs())} "
                         f"(use --model random:NAME)")
    return json.loads(resources.files("tdpipe.model").joinpath("configs", f"{name}.json").read_text())


def tensor_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every tensor of a checkpoint with this config, in HF names, for each supported
    family (tdpipe/families.py): biases (Qwen2's q/k/v, attention_bias, mlp_bias), q/k norms (Qwen3,
    Gemma 3), Gemma's four norms per layer (initialised to zeros: Gemma scales by 1 + w), Phi-3's fused
    qkv_proj and gate_up_proj."""
    from tdpipe.families import biases, family_of

    arch, fam, cfg = family_of(cfg)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    norm = "zeros" if fam.norm == "gemma" else "ones"
    out = [("model.embed_tokens.weight", (v, h), "normal")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), norm), (p + "post_attention_layernorm.weight", (h,), norm)]
        if fam.sandwich_norms:
            out += [(p + "pre_feedforward_layernorm.weight", (h,), norm),
                    (p + "post_feedforward_layernorm.weight", (h,), norm)]
        if arch == "Phi3ForCausalLM":
            out += [(p + "self_attn.qkv_proj.weight", ((nh + 2 * nkv) * hd, h), "normal")]
        else:
            out += [(p + "self_attn.q_proj.weight", (nh * hd, h), "normal"),
                    (p + "self_attn.k_proj.weight", (nkv * hd, h), "normal"),
                    (p + "self_attn.v_proj.weight", (nkv * hd, h), "normal")]
        if fam.qk_norm:
            out += [(p + "self_attn.q_norm.weight", (hd,), norm), (p + "self_attn.k_norm.weight", (hd,), norm)]
        out.append((p + "self_attn.o_proj.weight", (h, nh * hd), "normal"))
        if arch == "Phi3ForCausalLM":
            out.append((p + "mlp.gate_up_proj.weight", (2 * inter, h), "normal"))
        else:
            out += [(p + "mlp.gate_proj.weight", (inter, h), "normal"), (p + "mlp.up_proj.weight", (inter, h), "normal")]
        out.append((p + "mlp.down_proj.weight", (h, inter), "normal"))
        qkv_bias, o_bias, mlp_bias = biases(fam, cfg)
        if qkv_bias:
            out += [(p + f"self_attn.{k}_proj.bias", (n * hd,), "zeros") for k, n in (("q", nh), ("k", nkv), ("v", nkv))]
        if o_bias:
            out.append((p + "self_attn.o_proj.bias", (h,), "zeros"))
        if mlp_bias:
            out += [(p + f"mlp.{k}_proj.bias", (n,), "zeros") for k, n in (("gate", inter), ("up", inter), ("down", h))]
    out.append(("model.norm.weight", (h,), norm))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, h), "normal"))
    return out


def byte_level_bpe(vocab_size: int, special: dict[int, str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of exactly `vocab_size` ids: the 256 byte symbols, then every 2-symbol
    merge, then 3-symbol ones (a 2-symbol token + a byte) until full; `special` ids are kept for the special
    tokens. Byte-level, because transformers rebuilds the tokenizer of some model types (qwen2) as a
    byte-level BPE from tokenizer.json's vocab and merges, whatever tokenizer.json says its model is."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    n = vocab_size - len(special)
    if n < len(alphabet):
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (at least "
                         f"{len(alphabet) + len(special)})")
    tokens: list[str] = list(alphabet)
    merges: list[tuple[str, str]] = []
    twos = [(x, y) for x in alphabet for y in alphabet]
    threes = ((x + y, z) for x, y in twos for z in alphabet)  # lazily: 16.7M of them, a few hundred k used
    for x, y in itertools.islice(itertools.chain(twos, threes), n - len(alphabet)):
        tokens.append(x + y)
        merges.append((x, y))
    ids = iter(i for i in range(vocab_size) if i not in special)
    vocab = {t: next(ids) for t in tokens}
    vocab.update({t: i for i, t in special.items()})
    return vocab, merges


def write_tokenizer(folder: Path, cfg: dict[str, Any]) -> None:
    """A self-contained tokenizer over exactly the config's vocabulary: text in (any bytes), gibberish out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    v = cfg["vocab_size"]
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    eos = eos if isinstance(eos, int) and 0 <= eos < v else v - 1
    vocab, merges = byte_level_bpe(v, {eos: EOS})
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS, "unk_token": EOS,
        "bos_token": None, "model_max_length": cfg.get("max_position_embeddings", 2048),
        "chat_template": CHAT_TEMPLATE}, indent=1))


def _write_safetensors(path: Path, shapes: list[tuple[str, tuple[int, ...], str]], seed: int, what: str,
                       device: str = "cpu") -> None:
    """Stream a bf16 safetensors file tensor by tensor: the header is known from the shapes alone, so peak
    memory is one tensor (in float32 while drawn), not the model (safetensors' save_file holds it all).
    `device`: where the values are drawn (CPU's generator is one thread: an 8B model takes a minute or more
    there, a second on a GPU; the values then differ, so the cache keeps the two apart)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "tdpipe": f"random weights, seed {seed}"}}
    offset = 0
    for name, shape, _ in shapes:
        n = 2 * torch.Size(shape).numel()
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes
    total = sum(torch.Size(s).numel() for _, s, _ in shapes)
    g = torch.Generator(device).manual_seed(seed)
    done, last = 0, time.perf_counter()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, shape, init in shapes:
            if init == "normal":  # normal(0, 0.02): the HF initializer_range, finite activations in bf16
                t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=g)
                t = t.to(torch.bfloat16).cpu()
            else:
                t = (torch.ones if init == "ones" else torch.zeros)(shape, dtype=torch.bfloat16)
            f.write(t.view(torch.int16).numpy().data)  # no copy; little-endian, as the format requires
            done += t.numel()
            del t
            if time.perf_counter() - last > 5:
                last = time.perf_counter()
                notice(f"{what}: drawing random weights, {100 * done / total:.0f}% of {total / 1e6:.0f}M parameters")


def _generate(folder: Path, cfg: dict[str, Any], seed: int, what: str, device: str = "cpu") -> None:
    _write_safetensors(folder / "model.safetensors", tensor_shapes(cfg), seed, what, device)
    config = {k: v for k, v in cfg.items() if not k.startswith("_")}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(folder, cfg)
    (folder / "README.md").write_text(f"Random weights (seed {seed}) of {cfg.get('_source', 'a custom config')}. "
                                      "For throughput benchmarks only: the outputs are meaningless.\n")


def random_model_folder(spec: str | dict[str, Any], seed: int = 0, root: Path | None = None,
                        device: str = "cpu") -> str:
    """The cache folder of a random-weight model: a shipped config's name (qwen2.5-0.5b, llama-3.2-1b) or a
    config dict (tests); generated on first use, under a lock (one writer per entry across processes).
    `root`: where the models folder lives (default: the tdpipe cache). `device`: where the values are drawn
    (a GPU's generator draws other values than the CPU's, so such a folder has a name of its own)."""
    cfg = published_config(spec) if isinstance(spec, str) else dict(spec)
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    name = spec if isinstance(spec, str) else f"custom-{key}"
    kind = torch.device(device).type  # "cuda:1" draws what "cuda" draws: one entry for both
    drawn = "" if kind == "cpu" else f"-{kind}"
    out = (root or cache_dir()) / "models" / f"random-{name}-seed{seed}{drawn}"
    source = {"random": name, "seed": seed, "config": key, "format": FORMAT} | ({"drawn_on": kind} if drawn else {})
    if check_entry(out, source) is None:
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        why = check_entry(out, source)
        if why is None:
            return str(out)
        what = f"random:{name}"
        notice(f"{what}: generating random weights of {cfg.get('_source', 'a custom config')} under {out} "
               "(once; for throughput benchmarks, the outputs are meaningless)")
        t = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            built = tmp / out.name
            built.mkdir()
            _generate(built, cfg, seed, what, device)
            write_manifest(built, source)
            if out.exists():
                shutil.rmtree(out)
            built.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        notice(f"{what}: done in {time.perf_counter() - t:.1f} s")
    return str(out)


__all__ = ["PREFIX", "known_configs", "published_config", "random_model_folder", "tensor_shapes", "write_tokenizer"]
