// gmlake on torch 1.13 (included by ../version_compat.h).
//
// torch 1.13 has no allocator class: c10::cuda::CUDACachingAllocator is a namespace of free
// functions. gmlake takes them over inside a patched libc10_cuda (patches/pytorch-1.13.1.patch
// and torch_1_13.cpp); there is no run-time install (gmlake_torch.cpp is not built for 1.13).
// This header gives gmlake_impl.cpp the GPU trace hooks (compat/gpu_trace.h: 1.13 has no device
// type argument).
#pragma once

#include "compat/gpu_trace.h"
