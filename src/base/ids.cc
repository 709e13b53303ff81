#include "simpler/base/ids.h"

#include "absl/strings/str_cat.h"

namespace simpler::base {

std::string to_string(RunId id) { return absl::StrCat("run ", id.value); }

}  // namespace simpler::base
