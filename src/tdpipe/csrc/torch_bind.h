// The slice of torch the kernels use: at::Tensor with its methods, at::empty / at::empty_like,
// at::get_num_threads, TORCH_CHECK and pybind11 with torch's tensor casters. <torch/extension.h> also
// pulls in the C++ frontend (nn, optim, data, autograd) that no kernel here touches: with it gcc spends
// about 25 s on headers per kernel on this machine, with this header about 8 s, and every first start on
// a machine (and every fresh CI run) waits for that build.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
