"""tdpipe: throughput-first LLM inference with bubble-free pipeline parallelism."""
from tdpipe.outputs import CompletionOutput, RequestOutput
from tdpipe.sampling.params import SamplingParams
from tdpipe.version import __version__


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it lazily so `import tdpipe` stays light
    if name == "LLM":
        from tdpipe.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
