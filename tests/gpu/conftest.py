"""GPU tests: collected only where torch sees a CUDA device, so the CPU suite neither runs nor skips them.

`tdpipe gpu-check run` runs this folder on a GPU machine (its tests step); `pytest tests/gpu` does too. A test
here may assume CUDA: it is never collected without it. None of them has run on a GPU yet (docs/gpu.md).
"""
import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
