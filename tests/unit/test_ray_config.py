"""tdpipe.ray's ProcessorConfig refuses what would kill every replica at start, naming the field (no Ray
needed: the module imports Ray only when a processor is built)."""
import pytest

from tdpipe.ray import ProcessorConfig


def test_model_inside_engine_kwargs_is_refused_with_the_field_named():
    with pytest.raises(ValueError, match=r"engine_kwargs must not hold 'model'.*ProcessorConfig\.model"):
        ProcessorConfig(engine_kwargs={"model": "/some/folder"})
    assert ProcessorConfig(model="/some/folder", engine_kwargs={"dtype": "float32"}).model == "/some/folder"


@pytest.mark.parametrize("name", ["concurrency", "batch_size", "num_cpus_per_replica"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_counts_must_be_positive_integers(name, value):
    with pytest.raises(ValueError, match=f"ProcessorConfig.{name} must be an integer >= 1"):
        ProcessorConfig(**{name: value})
