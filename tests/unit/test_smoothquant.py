"""SmoothQuant (model/smoothquant.py) on tiny random transformers models of every family it folds: the smoothed
model computes the same logits in float32, its linears' inputs are the old ones divided by s, and
`tdpipe smoothquant` writes a folder in the source's dtype that transformers loads; refusals name the problem."""
import json

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig,
                          GemmaForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM,
                          Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from tdpipe.model import smoothquant as sq

SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def tiny(family: str):
    cls, cfg = {
        "llama": (LlamaForCausalLM, LlamaConfig(**SIZES)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SIZES)),  # q/k/v biases: v's is divided with its rows
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(**SIZES, head_dim=16, query_pre_attn_scalar=16,
                                                       sliding_window=8)),
        "phi3": (Phi3ForCausalLM, Phi3Config(**SIZES, pad_token_id=0, eos_token_id=1, bos_token_id=2)),
        "gemma": (GemmaForCausalLM, GemmaConfig(**SIZES, head_dim=16)),
        "granite": (GraniteForCausalLM, GraniteConfig(**SIZES, embedding_multiplier=3.0, attention_multiplier=0.2,
                                                      residual_multiplier=0.3, logits_scaling=4.0)),
        "gemma2": (Gemma2ForCausalLM, Gemma2Config(**SIZES, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                                   attn_logit_softcapping=5.0, final_logit_softcapping=10.0)),
        # biases on every linear: v's and up's are divided with their rows, the others stay
        "llama_bias": (LlamaForCausalLM, LlamaConfig(**SIZES, attention_bias=True, mlp_bias=True)),
    }[family]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for layer in model.model.layers:  # outlier channels, as trained models have them
            norm = layer.input_layernorm.weight
            norm[:3] = norm[:3] * 20 + (19 if family.startswith("gemma") else 0)
    return model


def windows() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (40,), generator=g).tolist() for _ in range(3)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gemma2", "gemma3", "phi3", "llama_bias", "granite"])
def test_smoothing_keeps_the_function_and_divides_the_inputs(family):
    model = tiny(family)
    ids = torch.tensor([windows()[0]])
    with torch.no_grad():
        before = model(ids).logits
    maxima = sq.activation_maxima(model, iter(windows()))
    names = sq.layer_names(model)
    layers = model.model.layers
    # s per checked input, from the maxima and the weights before the fold (Eq. 4)
    checked = {"layers.0." + names.qkv[0]: (0, names.qkv), "layers.1." + names.gate_up[0]: (1, names.gate_up),
               "layers.1." + names.down: (1, (names.down,))}
    s = {k: sq.smoothing_scales(maxima[k], [layers[i].get_submodule(n).weight for n in group])
         for k, (i, group) in checked.items()}
    q0 = layers[0].get_submodule(names.qkv[0])
    w_before = q0.weight.detach().clone()
    assert sq.fold(model, maxima) == 2
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=2e-4, rtol=2e-4)
    q_rows = slice(0, 64)  # q's rows (Phi-3's fused qkv: v's rows also carry o's smoothing)
    torch.testing.assert_close(q0.weight[q_rows], w_before[q_rows] * s["layers.0." + names.qkv[0]])
    assert float(s["layers.0." + names.qkv[0]].max() / s["layers.0." + names.qkv[0]].min()) > 3  # outliers moved
    new = sq.activation_maxima(model, iter(windows()))
    for key in checked:
        torch.testing.assert_close(new[key], maxima[key] / s[key], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_smooth_checkpoint_writes_a_folder_in_the_source_dtype(tmp_path, family):
    model = tiny(family)
    ids = torch.tensor([windows()[0]])
    with torch.no_grad():
        exact = model(ids).logits
    src = tmp_path / "src"
    model.to(torch.bfloat16).save_pretrained(src)
    (src / "tokenizer_config.json").write_text("{}")
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    text = " ".join(f"w{(i * 37) % 300}" for i in range(700))
    report = sq.smooth_checkpoint(str(src), str(tmp_path / "out"), text, tokens=600)
    assert report["dtype"] == "bfloat16" and report["layers"] == 2 and report["calibration_tokens"] == 600
    assert report["alpha"] == sq.DEFAULT_ALPHA == "auto"  # the per-layer search: its choices written beside
    chosen = json.loads((tmp_path / "out" / "smoothquant.json").read_text())["alphas"]
    assert len(chosen) == 8 and set(chosen.values()) <= set(sq.ALPHA_GRID)
    cls = type(model)
    out = cls.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert (tmp_path / "out" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    ref = cls.from_pretrained(src, dtype=torch.float32).eval()
    from safetensors import safe_open
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    norms = [k for k in dtypes if k.endswith(("input_layernorm.weight", "pre_feedforward_layernorm.weight"))]
    # Gemma's folded (1 + w) / s - 1 is written in float32; every other tensor in the source's bf16
    assert {dtypes[k] for k in norms} == {"F32" if family == "gemma3" else "BF16"}
    assert {v for k, v in dtypes.items() if k not in norms} == {"BF16"}
    with torch.no_grad():
        a, b = out(ids).logits, ref(ids).logits
    assert not torch.equal(out.model.layers[0].self_attn.q_proj.weight, ref.model.layers[0].self_attn.q_proj.weight)
    # the same function up to bf16 rounding: the smoothed copy is as far from the source as the source's
    # own bf16 rounding is from its float32 original
    assert (a - b).abs().max() <= 2 * (b - exact).abs().max()


def test_fake_quant_is_the_engines_int8_round_trip():
    from tdpipe.model.int8_linear import Int8Linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g)
    x[:, :2] *= 40  # outlier channels
    lin = torch.nn.Linear(64, 24, bias=False)
    w8 = Int8Linear(lin)
    # W8A8's output is the fake-quantised activations times the fake-quantised weight, up to float32 sums
    expect = sq.fake_quant_rows(x) @ sq.fake_quant_rows(lin.weight.detach()).T
    torch.testing.assert_close(w8(x), expect, atol=1e-4, rtol=1e-4)
    # so the search's error at s = 1 is exactly the engine's squared error
    ones = torch.ones(64)
    err = float((w8(x) - x @ lin.weight.detach().T).square().sum())
    assert sq.w8a8_error(x, [lin.weight.detach()], ones) == pytest.approx(err, rel=1e-3)


def test_search_alpha_takes_the_grid_argmin_and_it_matters():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    x[:, :3] *= 60  # a few channels far larger than the rest, as after a trained model's norms
    ws = [torch.randn(32, 64, generator=g) * 0.05, torch.randn(16, 64, generator=g) * 0.05]
    x_max = x.abs().amax(0)
    errors = {a: sq.w8a8_error(x, ws, sq.smoothing_scales(x_max, ws, a)) for a in sq.ALPHA_GRID}
    best = sq.search_alpha(x, ws, x_max)
    assert errors[best] == min(errors.values())
    assert 0 < best < 1 and errors[best] < 0.5 * min(errors[0.0], errors[1.0])  # an interior optimum
    # GQA: the scales the search scores are the ones the fold applies (one per kv head and dim)
    o = [torch.randn(8, 64, generator=g)]
    a = sq.search_alpha(x, o, x_max, gqa=(2, 16))
    s = sq._group_scales(sq.smoothing_scales(x_max, o, a), (2, 16)).view(2, 2, 16)
    torch.testing.assert_close(s[:, 0], s[:, 1])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "phi3"])
def test_fold_takes_one_alpha_per_input(family):
    model = tiny(family)
    ids = torch.tensor([windows()[0]])
    with torch.no_grad():
        before = model(ids).logits
    maxima, samples = sq.calibrate(model, iter(windows()), stride=2)
    names = sq.layer_names(model)
    assert set(samples) == {f"layers.{i}.{n}" for i in range(2)
                            for n in (names.qkv[0], names.gate_up[0], names.down, names.o)}
    assert samples["layers.0." + names.down].shape == (60, 96)  # every 2nd of 3 x 40 rows
    alphas = sq.choose_alphas(model, maxima, samples)
    assert set(alphas) == set(samples) and set(alphas.values()) <= set(sq.ALPHA_GRID)
    alphas["layers.0." + names.qkv[0]] = 0.3
    q0 = model.model.layers[0].get_submodule(names.qkv[0])
    expect = q0.weight.detach() * sq.smoothing_scales(
        maxima["layers.0." + names.qkv[0]], [model.model.layers[0].get_submodule(n).weight for n in names.qkv], 0.3)
    sq.fold(model, maxima, alphas)
    q_rows = slice(0, 64)  # q's rows (Phi-3's fused qkv: v's rows also carry o's smoothing)
    torch.testing.assert_close(q0.weight[q_rows], expect[q_rows])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, atol=2e-4, rtol=2e-4)


def test_refusals_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="alpha"):
        sq.smooth_checkpoint(str(tmp_path), str(tmp_path / "o"), alpha=1.5)
    with pytest.raises(ValueError, match="source folder"):
        sq.smooth_checkpoint(str(tmp_path), str(tmp_path))

    class Other(torch.nn.Module):
        config = type("C", (), {"model_type": "gpt2", "intermediate_size": 8, "num_key_value_heads": 1,
                                "hidden_size": 8, "num_attention_heads": 1})()
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        sq.layer_names(Other())


def test_cli_checks_before_loading(tmp_path, capsys):
    from tdpipe.cli import main

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["smoothquant", "--output", str(tmp_path / "full")]) == 2
    assert "--output" in capsys.readouterr().err
    assert main(["smoothquant", "--output", str(tmp_path / "o"), "--alpha", "2"]) == 2
    assert "--alpha" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["smoothquant", "--output", str(tmp_path / "o"), "--alpha", "most"])
    assert "--alpha: must be a number in [0, 1] or 'auto', got 'most'" in capsys.readouterr().err


def test_gemma_norm_weights_stay_float32_through_a_cast():
    from tdpipe.model.layers import GemmaRMSNorm, RMSNorm

    g, r = GemmaRMSNorm(8, 1e-6), RMSNorm(8, 1e-6)
    with torch.no_grad():
        g.weight.copy_(torch.full((8,), -0.99 + 1e-4))  # not a bf16 value
        r.weight.fill_(0.5)
    g.to(torch.bfloat16)
    r.to(torch.bfloat16)
    assert g.weight.dtype == torch.float32
    assert float(g.weight[0].detach()) == pytest.approx(-0.99 + 1e-4, abs=1e-7)
    assert r.weight.dtype == torch.bfloat16
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert g(x).dtype == torch.bfloat16
