"""The attention micro-benchmark (`python -m tdpipe.bench.attention`) on tiny shapes: its JSON carries the
kernel, the decode timings and the reference's distance, with and without Gemma 2's soft-cap."""
import json

import pytest

from tdpipe.bench import attention


@pytest.mark.parametrize("softcap", [0.0, 50.0])
def test_json_figures_and_reference_agreement(tmp_path, softcap, capsys):
    out = tmp_path / "a.json"
    attention.main(["--batch", "3", "--context", "40", "--layers", "2", "--iters", "2", "--head-dim", "32",
                    "--softcap", str(softcap), "--json", str(out)])
    d = json.loads(out.read_text())
    assert d["args"]["softcap"] == softcap and d["kernel"]
    assert d["decode"]["per_layer_ms"] > 0 and d["decode"]["kv_bytes_per_layer"] == 3 * 40 * 3 * 32 * 2 * 2
    assert d["reference"]["max_abs_diff"] < 2e-2  # bf16 output, the same scores capped on both sides
    assert "wrote" in capsys.readouterr().out


def test_negative_softcap_is_refused():
    with pytest.raises(SystemExit):
        attention.main(["--softcap", "-1"])
