"""Loading a checkpoint into the run's dtype: the parameters are allocated in that dtype and the
checkpoint's float32 tensors rounded as they are copied in, with the same result as loading in float32 and
casting the model afterwards (the one rounding either way), without that float32 copy of the model."""
import pytest
import torch

from tdpipe.config import ModelConfig
from tdpipe.model.weights import load_hf_config
from tdpipe.worker.model_runner import ModelRunner


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loading_in_the_run_dtype_equals_casting_a_float32_load(qwen2_tiny, dtype):
    folder, hf = qwen2_tiny  # float32 safetensors, sharded, q/k/v with biases
    cfg = ModelConfig.from_hf(load_hf_config(folder))
    ref = ModelRunner(cfg, folder, torch.float32, num_blocks=2, block_size=16).model
    got = ModelRunner(cfg, folder, dtype, num_blocks=2, block_size=16).model
    ref_state = {k: v for k, v in ref.state_dict().items() if v.dtype.is_floating_point}
    got_state = got.state_dict()
    assert set(ref_state) <= set(got_state)
    for name, p in got.named_parameters():
        assert p.dtype == dtype, name
    for name, t in ref_state.items():
        if name in dict(got.named_parameters()):
            assert torch.equal(got_state[name], t.to(dtype)), name
    assert torch.equal(got_state["embed_tokens.weight"], hf.model.embed_tokens.weight.detach().to(dtype))


def test_materialize_allocates_floating_tensors_in_the_run_dtype_only():
    from tdpipe.worker.model_runner import _materialize

    with torch.device("meta"):
        m = torch.nn.Module()
        m.a, m.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3, bias=False)
        m.a.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
        m.a.register_buffer("table", torch.zeros(5))  # float32 as declared
    m.b.weight = m.a.weight  # tied, as an embedding and its lm_head: stays one tensor
    _materialize(m, torch.device("cpu"), torch.bfloat16)
    assert m.a.weight.dtype == m.a.bias.dtype == m.a.table.dtype == torch.bfloat16
    assert m.a.steps.dtype == torch.int64 and m.a.weight.device.type == "cpu"
    assert m.b.weight is m.a.weight
