"""The families beside Llama and Qwen2 (Qwen3, Mistral, Gemma 1/2/3, Phi-3, Granite): config.json parsing per
family (windows per layer, rope per layer kind, refusals) and one forward of tdpipe's decoder against
transformers on tiny random configs, prefill and decode, float32 (the same numbers, not merely close)."""
import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig,
                          GemmaForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from tdpipe.config import ModelConfig
from tdpipe.model import random_model as rm
from tdpipe.model.layers import RotaryEmbedding
from tdpipe.model.llama import LlamaForCausalLM as TdLlama
from tdpipe.model.tensor_parallel import TPGroup
from tdpipe.step_input import StepInput
from tdpipe.worker.model_runner import prepare_input

BS = 16
SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
PHI3_ROPE = {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 4.0, 5.0]}


def hf_configs() -> dict:
    """A tiny config per family, each with what sets it apart switched on."""
    return {
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SIZES, head_dim=32, tie_word_embeddings=False)),
        "mistral": (MistralForCausalLM, MistralConfig(**SIZES, sliding_window=20)),
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(
            **SIZES, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1e6, rope_local_base_freq=1e4)),
        "phi3": (Phi3ForCausalLM, Phi3Config(**SIZES, partial_rotary_factor=0.5, original_max_position_embeddings=64,
                                             rope_scaling=dict(PHI3_ROPE), pad_token_id=0, eos_token_id=1,
                                             bos_token_id=2)),
        "gemma": (GemmaForCausalLM, GemmaConfig(**SIZES, head_dim=32)),
        # caps low enough that these random weights' scores and logits bend under them
        "gemma2": (Gemma2ForCausalLM, Gemma2Config(**SIZES, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                                                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
        # Llama's optional biases: q/k/v/o (attention_bias) and gate/up/down (mlp_bias)
        "llama_bias": (LlamaForCausalLM, LlamaConfig(**SIZES, attention_bias=True, mlp_bias=True)),
        # Granite's four multipliers, none of them 1
        "granite": (GraniteForCausalLM, GraniteConfig(**SIZES, embedding_multiplier=3.0, attention_multiplier=0.2,
                                                      residual_multiplier=0.3, logits_scaling=4.0)),
    }


def hf_model(family: str):
    cls, cfg = hf_configs()[family]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # every weight away from its init (Gemma's norms start at 0, Llama's at 1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def hf_dict(model) -> dict:
    d = model.config.to_dict()
    d["architectures"] = [type(model).__name__]
    return d


def tdpipe_model(model, tp: TPGroup | None = None) -> TdLlama:
    cfg = ModelConfig.from_hf(hf_dict(model))
    ours = TdLlama(cfg, tp=tp) if tp is not None else TdLlama(cfg)
    sd = model.state_dict()
    ours.load_weights((n, sd[n][slice(None)] if ours.shard_of(n) is None else _cut(sd[n], ours.shard_of(n)))
                      for n in sd if ours.wants(n))
    ours.init_rotary("cpu")
    return ours.eval()


def _cut(t: torch.Tensor, part: tuple[int, int, int]) -> torch.Tensor:
    dim, a, b = part
    return t[a:b] if dim == 0 else t[:, a:b]


def run_steps(model: TdLlama, prompts: list[list[int]], decode: list[list[int]]) -> list[torch.Tensor]:
    """Prefill the prompts in one step, then one decode step per entry of `decode` (a token per sequence);
    the sampled rows' logits of each step."""
    cfg = model.cfg
    total = [len(p) + len(decode) for p in prompts]
    tables, nxt = [], 1
    for n in total:
        k = -(-n // BS)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    cache = torch.zeros((cfg.num_layers, 2, nxt, cfg.num_kv_heads, BS, cfg.head_dim))
    lens = [len(p) for p in prompts]
    steps = [StepInput(0, [t for p in prompts for t in p], lens, lens, tables, True)]
    for toks in decode:
        lens = [n + 1 for n in lens]
        steps.append(StepInput(0, toks, [1] * len(toks), lens, tables, False))
    out = []
    for s in steps:
        inp = prepare_input(s, BS, torch.device("cpu"))
        out.append(model.compute_logits(model(inp.input_ids, inp.meta, cache)[inp.sample_idx]))
    return out


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "llama_bias", "granite"])
def test_logits_match_transformers(family):
    """Two prompts longer than the windows (Mistral 20, Gemma 3's local layers 8), prefilled together, then
    three decode steps through the paged cache: every step's logits equal transformers' on the whole text."""
    hf = hf_model(family)
    ours = tdpipe_model(hf)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (37, 23)]
    decode = [torch.randint(0, 300, (2,), generator=g).tolist() for _ in range(3)]
    got = run_steps(ours, prompts, decode)
    for s, p in enumerate(prompts):
        ids = p + [d[s] for d in decode]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        for k in range(len(decode) + 1):
            torch.testing.assert_close(got[k][s], ref[len(p) - 1 + k], atol=2e-5, rtol=1e-5)


def test_windows_are_honoured_not_ignored():
    """A Mistral with a 20-token window on a 40-token text: the last logits differ from the same weights
    attending globally (the bug this guards against: the window read, then ignored)."""
    hf = hf_model("mistral")
    windowed = tdpipe_model(hf)
    d = hf_dict(hf)
    d["sliding_window"] = None
    glob = TdLlama(ModelConfig.from_hf(d)).eval()
    glob.load_weights(hf.state_dict().items())
    glob.init_rotary("cpu")
    ids = [list(range(5, 45))]
    a, b = run_steps(windowed, ids, [[7]]), run_steps(glob, ids, [[7]])
    assert (a[1] - b[1]).abs().max() > 1e-3
    short = [list(range(5, 19))]  # within the window: the same
    torch.testing.assert_close(run_steps(windowed, short, [])[0], run_steps(glob, short, [])[0])


def test_bf16_embedding_scale_rounds_as_transformers():
    """Gemma multiplies embeddings by sqrt(hidden) cast to their dtype (bf16: 55.5 for hidden 3072)."""
    hf = hf_model("gemma3").to(torch.bfloat16)
    ours = tdpipe_model(hf).to(torch.bfloat16)
    ours.init_rotary("cpu")
    ids = torch.arange(10, 30)
    with torch.no_grad():
        ref = hf.model.embed_tokens(ids[None])[0]
        got = ours.embed_tokens(ids) * ours._embed_scale(torch.bfloat16)
    assert torch.equal(got, ref)
    with torch.device("meta"):  # Gemma 3 270M: sqrt(640) = 25.298 is 25.25 in bf16, 25.2982 in float32
        g270 = TdLlama(ModelConfig.from_hf(rm.published_config("gemma-3-270m")), end_layer=1)
    assert g270._embed_scale(torch.bfloat16) == 25.25 and abs(g270._embed_scale(torch.float32) - 640 ** 0.5) < 1e-5


# ----------------------------------------------------------------------------------- config parsing

def test_model_config_windows_default_and_properties():
    c = ModelConfig.from_hf(hf_dict(hf_model("qwen3")))
    assert c.layer_windows == [None] * 4 and c.sliding_window is None and not c.has_local_layers
    assert c.qk_norm and c.head_dim == 32 and not c.qkv_bias
    g = ModelConfig.from_hf(hf_dict(hf_model("gemma3")))
    assert g.layer_windows == [8, 8, None, 8] and g.sliding_window == 8 and g.has_local_layers
    from dataclasses import replace

    with pytest.raises(ValueError, match="layer_windows has 3 entries; the model has 4 layers"):
        replace(g, layer_windows=[8, None, 8])


def test_mistral_window_as_transformers_defaults_it():
    base = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    assert ModelConfig.from_hf({**base, "sliding_window": 20}).layer_windows == [20, 20]
    assert ModelConfig.from_hf({**base, "sliding_window": None}).layer_windows == [None, None]
    assert ModelConfig.from_hf(base).layer_windows == [4096, 4096]  # MistralConfig's default


def test_qwen_windows_need_use_sliding_window():
    base = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100,
            "sliding_window": 32}
    assert ModelConfig.from_hf(base).layer_windows == [None] * 3
    on = {**base, "use_sliding_window": True, "max_window_layers": 1}
    assert ModelConfig.from_hf(on).layer_windows == [None, 32, 32]
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):  # transformers' own reading agrees
        cfg = (Qwen3Config if arch.startswith("Qwen3") else __import__("transformers").Qwen2Config)(
            **{k: v for k, v in on.items() if k != "architectures"})
        want = [32 if t == "sliding_attention" else None for t in cfg.layer_types]
        assert ModelConfig.from_hf({**cfg.to_dict(), "architectures": [arch]}).layer_windows == want


def test_gemma3_rope_per_layer_kind_both_config_formats():
    """transformers 4's rope_theta / rope_local_base_freq / rope_scaling and sliding_window_pattern (what
    published config.json files hold), and transformers 5's nested rope_parameters and layer_types."""
    old = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
           "vocab_size": 262144, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 512,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256}
    c = ModelConfig.from_hf(old)
    assert c.layer_windows == [512] * 5 + [None, 512]  # sliding_window_pattern 6
    assert (c.rope_theta, c.rope_scaling["rope_type"], c.rope_scaling["factor"], c.local_rope_theta) == \
        (1e6, "linear", 8.0, 1e4)
    assert c.norm == "gemma" and c.sandwich_norms and c.hidden_act == "gelu_pytorch_tanh"
    assert c.embed_scale == 64 ** 0.5 and c.attn_scale == 256 ** -0.5 and c.tie_word_embeddings
    new = Gemma3TextConfig(**{k: v for k, v in old.items() if k not in ("architectures",)}, sliding_window_pattern=6)
    c5 = ModelConfig.from_hf({**new.to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    assert "rope_parameters" in new.to_dict()
    assert (c5.layer_windows, c5.rope_theta, c5.rope_scaling["factor"], c5.local_rope_theta) == \
        (c.layer_windows, 1e6, 8.0, 1e4)
    # the multimodal checkpoint's text_config, its missing keys at Gemma3TextConfig's defaults
    mm = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
          "text_config": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
                          "num_attention_heads": 4, "sliding_window": 16}}
    cm = ModelConfig.from_hf(mm)
    assert (cm.vocab_size, cm.head_dim, cm.num_kv_heads, cm.eos_token_ids) == (262208, 256, 4, [1, 106])
    assert cm.layer_windows == [16] * 5 + [None] and cm.local_rope_theta == 1e4 and cm.rope_theta == 1e6


def test_phi3_longrope_and_partial_rotary():
    hf = hf_model("phi3")
    c = ModelConfig.from_hf(hf_dict(hf))
    s = c.rope_scaling
    assert s["rope_type"] == "longrope" and s["original_max_position_embeddings"] == 64 and s["factor"] == 4.0
    assert c.rotary_dim == 8 and c.layer_windows == [None] * 4
    old = {**hf_dict(hf), "rope_scaling": {**PHI3_ROPE, "type": "su"}, "partial_rotary_factor": 0.5}
    del old["rope_parameters"]
    assert ModelConfig.from_hf(old).rope_scaling["rope_type"] == "longrope"  # Phi-3's first name for it
    # positions below the pretraining length turn with the short factors, the others with the long ones,
    # each as transformers computes them for a sequence of that length
    rot = RotaryEmbedding(c.head_dim, 256, c.rope_theta, s, c.rotary_dim)
    emb = hf.model.rotary_emb
    x = torch.zeros(1, 1, 16)
    for seq_len in (10, 200):
        pos = torch.arange(seq_len)[None]
        cos, sin = emb(x, pos)
        p = seq_len - 1
        h = c.rotary_dim // 2
        torch.testing.assert_close(rot.cos_sin[p], torch.cat([cos[0, p, :h], sin[0, p, :h]]), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(cos[0, p, :h], cos[0, p, h:])  # the halves the table no longer repeats


def test_refusals_name_the_problem():
    base = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    with pytest.raises(ValueError, match="attn_logit_softcapping must be a positive number or null, got -1.0"):
        ModelConfig.from_hf({**base, "attn_logit_softcapping": -1.0})
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: Gemma2ForCausalLM, "
                                         "Gemma3ForCausalLM, .*"
                                         "MistralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        ModelConfig.from_hf({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        ModelConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"],
                             "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden activation 'relu' is not supported"):
        ModelConfig.from_hf({**base, "hidden_activation": "relu"})


# ----------------------------------------------------------------------------------- loading

@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "llama_bias", "granite"])
def test_random_checkpoints_have_transformers_names_and_shapes(family):
    """random:NAME folders (model/random_model.py) hold exactly the tensors transformers' model of that
    config has, so both load them."""
    hf = hf_model(family)
    want = {n: tuple(t.shape) for n, t in hf.state_dict().items() if "rotary" not in n}
    if hf.config.tie_word_embeddings:
        want.pop("lm_head.weight")
    assert {n: s for n, s, _ in rm.tensor_shapes(hf_dict(hf))} == want
    assert ModelConfig.from_hf(hf_dict(hf)).num_params() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("cls, cfg_cls, extra", [
    (LlamaForCausalLM, LlamaConfig, {}), (Qwen2ForCausalLM, Qwen2Config, {}), (Qwen3ForCausalLM, Qwen3Config, {}),
    (MistralForCausalLM, MistralConfig, {}), (Phi3ForCausalLM, Phi3Config, {"pad_token_id": 0}),
    (Gemma3ForCausalLM, Gemma3TextConfig, {"head_dim": 16}), (GemmaForCausalLM, GemmaConfig, {"head_dim": 16}),
    (Gemma2ForCausalLM, Gemma2Config, {"head_dim": 16}), (GraniteForCausalLM, GraniteConfig, {})])
@pytest.mark.parametrize("attention_bias, mlp_bias", [(True, True), (False, False), (True, False)])
def test_biases_follow_transformers_per_family(cls, cfg_cls, extra, attention_bias, mlp_bias):
    """Which linears carry a bias, for each family and each setting of the attention_bias / mlp_bias keys
    (some families read them, some fix their biases): exactly the bias tensors transformers' model has."""
    sizes = {**SIZES, "num_hidden_layers": 1}
    hf = cls(cfg_cls(**sizes, attention_bias=attention_bias, mlp_bias=mlp_bias, **extra))
    want = sorted(n.split(".")[-2] for n, _ in hf.named_parameters() if n.endswith(".bias"))
    d = hf_dict(hf)
    d.update(attention_bias=attention_bias, mlp_bias=mlp_bias)  # as a config.json with the keys would say
    ours = TdLlama(ModelConfig.from_hf(d))
    got = sorted(n.split(".")[-2] for n, _ in ours.named_parameters() if n.endswith(".bias"))
    split = {"qkv_proj": ["k_proj", "q_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    if cls is not Phi3ForCausalLM:
        got = sorted(p for g in got for p in split.get(g, [g]))
    assert got == want
    assert ModelConfig.from_hf(d).num_params() == sum(p.numel() for p in hf.parameters())


def test_gemma_reads_the_legacy_gelu_as_transformers_does():
    """Gemma 1's released configs say hidden_act "gelu"; transformers' GemmaConfig runs the tanh GELU then."""
    d = hf_dict(hf_model("gemma"))
    d.pop("hidden_activation", None)
    assert ModelConfig.from_hf({**d, "hidden_act": "gelu"}).hidden_act == "gelu_pytorch_tanh"
    assert GemmaConfig(**{**SIZES, "hidden_act": "gelu"}).hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="'gelu' is not supported"):  # elsewhere it would be exact GELU
        ModelConfig.from_hf({**hf_dict(hf_model("mistral")), "hidden_act": "gelu"})


def test_shipped_configs_of_the_new_families():
    g = ModelConfig.from_hf(rm.published_config("gemma-3-270m"))
    assert (g.hidden_size, g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim, g.vocab_size) == \
        (640, 18, 4, 1, 256, 262144)
    assert g.layer_windows == ([512] * 5 + [None]) * 3 and abs(g.num_params() - 268e6) < 1e6
    g2 = ModelConfig.from_hf(rm.published_config("gemma-2-2b"))  # 2.61B parameters, as published
    assert g2.layer_windows == [4096, None] * 13 and (g2.attn_softcap, g2.final_logit_softcap) == (50.0, 30.0)
    assert abs(g2.num_params() - 2.614e9) < 1e6 and g2.local_rope_theta is None
    q = ModelConfig.from_hf(rm.published_config("qwen3-0.6b"))
    assert q.qk_norm and q.head_dim == 128 and abs(q.num_params() - 596e6) < 1e6


class _Rank(TPGroup):
    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.rank, self.size = rank, size


def test_phi3_fused_tensors_shard_like_separate_ones():
    """A tensor-parallel rank of Phi-3 (qkv_proj and gate_up_proj stored fused) holds the same rows as a
    rank loading the same weights stored split (q/k/v, gate/up: the Llama layout's sharding)."""
    hf = hf_model("phi3")
    sd = hf.state_dict()
    split = {}
    h, kv = 64, 2 * 16
    for n, t in sd.items():
        if n.endswith("qkv_proj.weight"):
            for name, part in zip(("q_proj", "k_proj", "v_proj"), t.split([h, kv, kv])):
                split[n.replace("qkv_proj", name)] = part
        elif n.endswith("gate_up_proj.weight"):
            for name, part in zip(("gate_proj", "up_proj"), t.chunk(2)):
                split[n.replace("gate_up_proj", name)] = part
        else:
            split[n] = t
    cfg = ModelConfig.from_hf(hf_dict(hf))
    for r in range(2):
        fused, ref = TdLlama(cfg, tp=_Rank(r, 2)), TdLlama(cfg, tp=_Rank(r, 2))
        for m, src in ((fused, sd), (ref, split)):
            m.load_weights((n, src[n] if m.shard_of(n) is None else _cut(src[n], m.shard_of(n))) for n in src)
        for (n, a), (_, b) in zip(fused.state_dict().items(), ref.state_dict().items()):
            assert torch.equal(a, b), n


def test_multimodal_checkpoint_names_map_to_the_decoder():
    from tdpipe.model.weights import canonical_name

    assert canonical_name("language_model.model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"
    assert canonical_name("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert canonical_name("model.vision_tower.vision_model.post_layernorm.weight") is None
    assert canonical_name("multi_modal_projector.mm_soft_emb_norm.weight") is None
    assert canonical_name("model.layers.0.self_attn.qkv_proj.weight") == "model.layers.0.self_attn.qkv_proj.weight"


def test_multimodal_gemma3_folder_runs_its_text_decoder(tmp_path):
    """A Gemma3ForConditionalGeneration folder as transformers saves it (text_config; the decoder under
    language_model., a vision tower beside it): tdpipe loads the decoder alone, transformers' text logits."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from tdpipe.model.weights import iter_safetensors, load_hf_config

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, sliding_window=8, max_position_embeddings=256)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                     image_token_index=299, boi_token_index=297,
                                                     eoi_token_index=298)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    ours = TdLlama(ModelConfig.from_hf(load_hf_config(tmp_path))).eval()
    ours.load_weights(iter_safetensors(tmp_path, names=ours.wants))
    ours.init_rotary("cpu")
    ids = list(range(5, 30))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(run_steps(ours, [ids], [])[0][0], ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3", "granite"])  # Mistral's bf16 is Llama's
def test_bf16_error_like_transformers_own(family):
    """bf16 (the fused CPU kernels where the family uses them, torch ops for Gemma's norms and GeGLU): tdpipe's
    distance to the float32 logits stays near transformers' own bf16 distance."""
    from tdpipe.model.packed_linear import pack_linears

    hf = hf_model(family)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (37, 23)]
    decode = [torch.randint(0, 300, (2,), generator=g).tolist() for _ in range(2)]
    ref = torch.stack(run_steps(tdpipe_model(hf), prompts, decode))
    hf = hf.to(torch.bfloat16)
    ours = tdpipe_model(hf).to(torch.bfloat16)
    ours.init_rotary("cpu")
    pack_linears(ours)
    err = (torch.stack(run_steps(ours, prompts, decode)).float() - ref).abs().max().item()
    hf_err = 0.0
    for s, p in enumerate(prompts):
        with torch.no_grad():
            out = hf(torch.tensor([p + [d[s] for d in decode]])).logits[0].float()
        hf_err = max(hf_err, (out[len(p) - 1:] - ref[:, s]).abs().max().item())
    assert err <= 1.5 * hf_err + 0.02, (err, hf_err)
