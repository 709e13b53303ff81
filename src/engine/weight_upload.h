// The weights' way from the checkpoint files into device memory: one device buffer that holds
// every weight, filled by two threads (model_runner.cc plans the slots; this copies them).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "simpler/model/safetensors.h"
#include "simpler/task/tensor.h"
#include "simpler/worker/worker.h"

namespace simpler::llm {

// One weight of the decode program on its way into device memory: its checkpoint view, the
// tensor it becomes and its place in the chip's one weights buffer.
struct WeightSlot {
  task::Tensor* target = nullptr;
  std::vector<int64_t> shape;
  TensorView view;
  bool raw = false;  // kept in the checkpoint dtype: the file's bytes as they are; else f32
  // With raw: the device dtype, the file's or its rows interleaved 16 at a time
  // (task::interleaved_of: kQ4_K_R16, kQ6_K_R16, kQ8_0_R16;
  // prefers_interleaved_weights), copied so.
  task::DataType dtype = task::DataType::kFloat32;
  uint64_t offset = 0;  // in the weights buffer
  uint64_t bytes = 0;   // in device memory
};

// Copies the weights of `slots` into one device buffer of `total` bytes (appended to `buffers`
// as soon as it is allocated, so that its owner frees it also on failure) and points their
// targets at it (as s.dtype: interleaved weights interleaved on the way, whole groups of 16 rows
// at a time): the raw weights in two shares of about equal bytes, the second copied by a
// second thread where the machine has two hardware threads or more (a copy is CPU work on both
// of its sides: the read out of the page cache, and the kernel zeroing the device pages that the
// copy makes present; one thread loaded a Q4_K_M file in twice the time of reading it); a
// widened weight through a host f32 copy. The raw weights are read with read_bytes (pread, not
// through the mapping, so no page of the checkpoint is mapped in and it is resident once, in
// device memory).
// Errors: the first failure of either share, its message prefixed with the tensor's name and
// file ("tensor 'NAME' of FILE: ..."), e.g. DATA_LOSS when the file shrank after it was opened,
// or the Worker's copy error; the other share stops at its next chunk, and the second thread has
// ended when this returns (it is joined on every path). When the second thread cannot be
// started, this thread copies both shares. INVALID_ARGUMENT naming the tensor, before any copy,
// for a raw slot whose dtype is not its view's or the view's interleaved form, or interleaved with
// a shape that is not 2-D rows in whole groups of 16. Call from one thread at a time per Worker.
absl::Status upload_weights(worker::Worker& w, const std::vector<WeightSlot>& slots, uint64_t total,
                            std::vector<worker::DeviceBuffer>* buffers);

}  // namespace simpler::llm
