// The public L3Worker: options, host buffers, registration, and the calls it forwards to its
// Impl (hierarchy/l3_worker_impl.h).
#include "simpler/hierarchy/l3_worker.h"

#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "hierarchy/l3_worker_impl.h"
#include "simpler/base/enum_names.h"
#include "simpler/base/status.h"

namespace simpler::hierarchy {

namespace {

constexpr base::EnumNames<ChildMode> kChildModeNames = {{ChildMode::kThread, "thread"},
                                                        {ChildMode::kProcess, "process"}};

}  // namespace

std::string_view name_of(ChildMode mode) { return kChildModeNames.name(mode, "process"); }

absl::StatusOr<ChildMode> parse_child_mode(std::string_view text) {
  if (std::optional<ChildMode> mode = kChildModeNames.parse(text)) return *mode;
  return absl::InvalidArgumentError(
      absl::StrCat("child mode '", std::string(text), "': expected thread or process"));
}

absl::Status L3Options::validate() const {
  if (device_ids.empty()) return absl::InvalidArgumentError("L3Options.device_ids is empty");
  std::set<int32_t> seen;
  for (int32_t id : device_ids) {
    if (id < 0) {
      return absl::InvalidArgumentError(absl::StrCat("L3Options.device_ids: negative id ", id));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("L3Options.device_ids: id ", id, " repeats"));
    }
  }
  if (sub_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("L3Options.sub_threads ", sub_threads, " is below 1"));
  }
  if (host_heap_bytes == 0) return absl::InvalidArgumentError("L3Options.host_heap_bytes is 0");
  if (launch_depth < 1 || launch_depth > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("L3Options.launch_depth ", launch_depth, " is outside [1, 16]"));
  }
  if (child.level != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("L3Options.child.level ", child.level, ": children are level-2 workers"));
  }
  return base::annotate(child.validate(), "L3Options.child: ");
}

absl::StatusOr<task::Tensor> HostBuffer::tensor(std::initializer_list<int64_t> shape,
                                                task::DataType dtype, uint64_t offset) const {
  return task::Tensor::in_buffer(address, bytes, offset, shape.begin(),
                                 static_cast<int32_t>(shape.size()), dtype,
                                 task::MemoryKind::kHost);
}

L3Worker::L3Worker(L3Options options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>(options_)) {}

L3Worker::~L3Worker() { (void)close(); }

absl::StatusOr<ChildCallable> L3Worker::register_callable(task::ChipCallable callable) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_registration("register_callable"));
  SIMPLER_RETURN_IF_ERROR(callable.validate());
  for (const auto& c : impl_->callables) {
    if (c.name == callable.name) {
      return absl::InvalidArgumentError(
          absl::StrCat("a callable named '", callable.name, "' is already registered"));
    }
  }
  impl_->callables.push_back(std::move(callable));
  return ChildCallable{static_cast<uint32_t>(impl_->callables.size() - 1)};
}

absl::StatusOr<SubHandle> L3Worker::register_sub(std::string name, SubFn fn) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_registration("register_sub"));
  if (name.empty() || !fn) {
    return absl::InvalidArgumentError("register_sub: a sub needs a name and a function");
  }
  impl_->subs.emplace_back(std::move(name), std::move(fn));
  return SubHandle{static_cast<uint32_t>(impl_->subs.size() - 1)};
}

absl::StatusOr<ProgramHandle> L3Worker::register_program(L3Program program) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_registration("register_program"));
  if (program.name.empty() || !program.orchestration) {
    return absl::InvalidArgumentError(
        "register_program: an L3 program needs a name and an orchestration");
  }
  impl_->programs.push_back(std::move(program));
  return ProgramHandle{static_cast<uint32_t>(impl_->programs.size() - 1)};
}

absl::Status L3Worker::register_child_setup(
    std::function<absl::Status(int32_t child, worker::Worker& worker)> setup) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_registration("register_child_setup"));
  if (!setup) return absl::InvalidArgumentError("register_child_setup: an empty function");
  impl_->setups.push_back(std::move(setup));
  return absl::OkStatus();
}

absl::Status L3Worker::init() { return impl_->init(); }

absl::StatusOr<HostBuffer> L3Worker::create_buffer(uint64_t bytes) {
  return impl_->create_buffer(bytes);
}

absl::Status L3Worker::free_buffer(const HostBuffer& buffer) { return impl_->free_buffer(buffer); }

absl::StatusOr<worker::RunHandle> L3Worker::submit(ProgramHandle program,
                                                   const task::TaskArgs& args) {
  return impl_->submit(program, args);
}

absl::Status L3Worker::run(ProgramHandle program, const task::TaskArgs& args) {
  SIMPLER_ASSIGN_OR_RETURN(worker::RunHandle h, submit(program, args));
  return h.wait();
}

absl::Status L3Worker::close() { return impl_->close(); }

absl::StatusOr<worker::DeviceBuffer> L3Worker::child_malloc(int32_t child, uint64_t bytes) {
  return impl_->child_malloc(child, bytes);
}

absl::Status L3Worker::child_free(int32_t child, const worker::DeviceBuffer& buffer) {
  return impl_->child_free(child, buffer);
}

absl::Status L3Worker::copy_to_child(int32_t child, const worker::DeviceBuffer& dst,
                                     const HostBuffer& src, uint64_t bytes, uint64_t offset) {
  return impl_->copy_child(true, child, dst, src, bytes, offset);
}

absl::Status L3Worker::copy_from_child(int32_t child, const HostBuffer& dst,
                                       const worker::DeviceBuffer& src, uint64_t bytes,
                                       uint64_t offset) {
  return impl_->copy_child(false, child, src, dst, bytes, offset);
}

uint64_t L3Worker::next_level_dispatched() const { return impl_->next_level_dispatched(); }

std::vector<std::string> L3Worker::describe_children() const { return impl_->describe_children(); }

}  // namespace simpler::hierarchy
