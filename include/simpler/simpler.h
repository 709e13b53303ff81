// The umbrella header of simpler's runtime API: everything a program author
// or a host application needs to register callables, submit runs and read
// their results on a Worker (level 2: one chip). Application layers on top
// (the Qwen3 engine and the CLI: `simpler/kernels`, `simpler/model`, `simpler/tokenizer`,
// `simpler/engine`, `simpler/serve`) have their own headers.
//
// Start with worker/worker.h (Worker: init, malloc/free, submit/run, close),
// worker/run_handle.h (RunHandle: wait, result), task/callable.h
// (ChipCallable: orchestration + kernels) and task/task_args.h (TaskArgs,
// Tensor, ArgDirection). The contracts are in each header; the design and
// its invariants in ARCHITECTURE.md.
#pragma once

#include "simpler/base/clock.h"
#include "simpler/base/ids.h"
#include "simpler/base/status.h"
#include "simpler/base/trace.h"
#include "simpler/task/call_config.h"
#include "simpler/task/callable.h"
#include "simpler/task/data_type.h"
#include "simpler/task/kernel_registry.h"
#include "simpler/task/program_abi.h"
#include "simpler/task/task_args.h"
#include "simpler/task/tensor.h"
#include "simpler/worker/program_library.h"
#include "simpler/worker/run_handle.h"
#include "simpler/worker/worker.h"
