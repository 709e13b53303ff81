// The task layer's names that the kernels' own files (kernels.cc, sampling.cc and their tests)
// use unqualified. Private to src/kernels/: include it from those .cc files only.
#pragma once

#include "simpler/task/callable.h"
#include "simpler/task/data_type.h"
#include "simpler/task/task_args.h"
#include "simpler/task/tensor.h"

namespace simpler::llm {

using task::ArgDirection;
using task::DataType;
using task::KernelContext;
using task::TaskArgs;
using task::Tensor;

}  // namespace simpler::llm
