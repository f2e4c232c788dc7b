"""The partition's stage costs measured once per machine and key (worker/partition_cache.py): later starts
read them, a changed key or a damaged file measures again, `use_cache=False` always measures."""
import json

import pytest
import torch

from tdpipe.config import ModelConfig
from tdpipe.platforms import get_platform
from tdpipe.worker import partition_cache
from tdpipe.worker.partition import PhaseCosts, StageCosts


def _cfg(**kw) -> ModelConfig:
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
    hf.update(kw)
    return ModelConfig.from_hf(hf)


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """StageCosts.measure replaced by a counter that returns distinct costs per call; the cache in tmp_path."""
    monkeypatch.setenv("TDPIPE_CACHE", str(tmp_path))
    calls = []

    def fake(cfg, dtype, threads, batch=64, platform=None, **_):
        calls.append((cfg.hidden_size, threads, batch))
        n = float(len(calls))
        return PhaseCosts(StageCosts(0.1 * n, 1.0, 5.0 + n), StageCosts(0.2, 1.0, 0.5 * n))

    monkeypatch.setattr(StageCosts, "measure", staticmethod(fake))
    return calls


def _costs(cfg, threads=1, batch=64, use_cache=True):
    return partition_cache.measured_costs(cfg, torch.bfloat16, threads, batch, get_platform("cpu"), use_cache)


def test_measured_once_then_read(measured, tmp_path):
    first = _costs(_cfg())
    assert len(measured) == 1
    assert _costs(_cfg()) == first and len(measured) == 1  # read back, equal to the measurement
    files = list((tmp_path / "profiles").glob("partition-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["decode"]["head"] == first.decode.head


def test_another_key_measures_again(measured):
    _costs(_cfg())
    _costs(_cfg(), threads=2)
    _costs(_cfg(), batch=32)
    _costs(_cfg(hidden_size=128))
    assert len(measured) == 4
    _costs(_cfg(num_hidden_layers=30))  # one layer is timed: the depth is not part of the key
    assert len(measured) == 4


def test_no_profile_cache_always_measures(measured):
    a, b = _costs(_cfg(), use_cache=False), _costs(_cfg(), use_cache=False)
    assert len(measured) == 2 and a != b


@pytest.mark.parametrize("damage", ["{not json", '{"key": {}}', "[]", "nan"])
def test_a_damaged_file_is_measured_again_and_overwritten(measured, tmp_path, damage):
    _costs(_cfg())
    (path,) = (tmp_path / "profiles").glob("partition-*.json")
    path.write_text(damage)
    again = _costs(_cfg())
    assert len(measured) == 2 and partition_cache.parse_costs(json.loads(path.read_text()),
                                                              json.loads(path.read_text())["key"]) == again


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), "1", True, None])
def test_parse_costs_refuses_bad_numbers(bad):
    key = {"version": 1}
    good = {"embed": 0.1, "layer": 1.0, "head": 2.0}
    data = {"key": key, "decode": dict(good), "prefill": dict(good, head=bad)}
    with pytest.raises(ValueError, match="prefill.head"):
        partition_cache.parse_costs(data, key)
    assert partition_cache.parse_costs({"key": key, "decode": good, "prefill": good}, key).prefill.head == 2.0
