from tdpipe.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
