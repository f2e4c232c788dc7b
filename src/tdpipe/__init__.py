"""tdpipe: throughput-first LLM inference with bubble-free pipeline parallelism."""
from tdpipe.outputs import CompletionOutput, RequestOutput
from tdpipe.sampling.beam_search import BeamSearchParams
from tdpipe.sampling.params import RequestOutputKind, SamplingParams


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it lazily so `import tdpipe` stays light
    if name == "LLM":
        from tdpipe.entrypoints.llm import LLM

        return LLM
    if name == "__version__":  # read from the installed metadata on first use (tdpipe/version.py)
        from tdpipe.version import package_version

        return package_version()
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "RequestOutputKind", "CompletionOutput"]
