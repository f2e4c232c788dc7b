"""An AWQ checkpoint folder (AutoAWQ's GEMM format, made here from the bundled model by round-to-nearest
groups of 64) run with its 4-bit weights kept packed (--quantization awq, W4A8 in the block GEMM) against the
same folder dequantised (--quantization none): the dequantised run is transformers on (q - z) d exactly; the
packed run's prompt log-probabilities stay close, pp = 2 computes what pp = 1 does, a tensor-parallel rank
holds its rows or columns of the blocks; `auto` picks awq for such a folder."""
import pytest
import torch

from tdpipe import LLM, SamplingParams
from tdpipe.model import awq
from tdpipe.model.block_linear import BlockLinear

from conftest import hf_greedy, prompt_lps

TEXT = ("The capital of France is Paris. It is known for the Eiffel Tower, the Louvre and its cafes. "
        "Water boils at 100 degrees Celsius at sea level, and freezes at zero.")
KV = 256 << 20
GROUP = 64  # SmolLM2's hidden size 576 is not a multiple of AutoAWQ's usual 128


@pytest.fixture(scope="module")
def awq_folder(tmp_path_factory, bundled_path):
    d = tmp_path_factory.mktemp("smollm2_awq")
    assert awq.write_rtn_checkpoint(bundled_path, str(d), GROUP) == 30 * 7
    return str(d)


def test_dequantised_folder_is_transformers_on_the_dequantised_weights(awq_folder, bundled_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(bundled_path, dtype=torch.float32).eval()
    weights = dict(awq.read_checkpoint(awq_folder))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if awq.LINEAR_WEIGHT.fullmatch(name):
                p.copy_(weights[name])
    with LLM(model=awq_folder, dtype="float32", kv_cache_memory=KV) as llm:  # auto: none in float32
        assert llm.engine.model_config.quantization == "none"
        ids = llm.get_tokenizer().encode(TEXT)[:10]
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    assert list(out) == hf_greedy(hf, ids, 12)


def test_packed_blocks_track_the_dequantised_folder_at_pp1_and_pp2(awq_folder):
    with LLM(model=awq_folder, quantization="none", dtype="bfloat16", kv_cache_memory=KV) as llm:
        ids = llm.get_tokenizer().encode(TEXT)
        ref = prompt_lps(llm, ids)
    with LLM(model=awq_folder, dtype="bfloat16", kv_cache_memory=KV) as llm:  # auto: awq on a bf16 CPU run
        assert llm.engine.model_config.quantization == "awq"
        one = prompt_lps(llm, ids)
        sp = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, logprobs=2, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs
        assert len(outs) == 2 and all(len(c.token_ids) == 6 and len(c.logprobs) == 6 for c in outs)
        assert llm.engine.block_manager.enable_prefix_caching and prompt_lps(llm, ids) == one
    with LLM(model=awq_folder, quantization="awq", pipeline_parallel_size=2, dtype="bfloat16",
             kv_cache_memory=KV) as llm:
        two = prompt_lps(llm, ids)
    # the weights are the folder's exactly; only the int8 activations (one scale per 32 values) differ
    spread = sum(abs(x - y) for x, y in zip(one, ref)) / len(ref)
    cost = sum(y - x for x, y in zip(one, ref)) / len(ref)
    assert spread < 0.15 and abs(cost) < 0.05, (spread, cost)
    assert one != ref  # the packed path really ran
    assert max(abs(x - y) for x, y in zip(one, two)) < 0.02


def test_a_tensor_parallel_rank_holds_its_part_of_the_blocks(awq_folder):
    from tdpipe.config import ModelConfig
    from tdpipe.model.llama import LlamaForCausalLM
    from tdpipe.model.quantization import prepare_linears, resolve_quantization
    from tdpipe.model.tensor_parallel import TPGroup
    from tdpipe.model.weights import load_hf_config

    assert resolve_quantization("auto", awq_folder, "cpu", True) == ("awq", "")
    assert resolve_quantization("auto", awq_folder, "cpu", False) == ("none", "")  # float32: dequantised
    with pytest.raises(ValueError, match="needs an AWQ checkpoint folder"):
        resolve_quantization("awq", None, "cpu", True)
    tp = TPGroup()
    tp.rank, tp.size = 1, 2
    cfg = ModelConfig.from_hf(load_hf_config(awq_folder))
    model = LlamaForCausalLM(cfg, 0, 2, tp)
    model.load_weights(awq.read_checkpoint(awq_folder, names=model.wants, slicer=model.shard_of))
    floats = {n: m.weight.detach().clone() for n, m in model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    assert prepare_linears(model, "awq", "", awq_folder) == 2 * 4
    for name, w in floats.items():
        lin = model.layers.get_submodule(name)
        assert isinstance(lin, BlockLinear) and lin.bits == 4
        assert torch.equal(lin.dequantized(), w), name  # rows (qkv, gate_up) or 32-aligned columns (o, down)
    assert model.layers[0].mlp.down_proj.in_features == cfg.intermediate_size // 2
