// Names of enum values: one constant table that both an enum's name function and its parser read,
// so a value's name and the parse of that name cannot disagree.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <optional>
#include <string_view>

namespace simpler::base {

// One entry of an EnumNames table: a value and its name, a NUL-terminated string that outlives the
// table (a string literal).
template <typename E>
struct EnumName {
  E value;
  const char* name;
};

// The names of some values of enum E, at most kMaxEntries of them, written as a constexpr constant
// beside the functions that read it:
//   constexpr base::EnumNames<Color> kColorNames = {{Color::kRed, "red"}, {Color::kBlue, "blue"}};
// Built at compile time only (a table of more than kMaxEntries entries does not compile);
// immutable, so thread-safe. Lookups scan the entries in order (tables are a handful of entries);
// when two entries share a value or a name, the first one wins.
// Unlike a switch, a table does not make the compiler warn about an enumerator it lacks: the
// enum's own test checks its names.
template <typename E, size_t kMaxEntries = 16>
class EnumNames {
 public:
  consteval EnumNames(std::initializer_list<EnumName<E>> entries) {
    for (const EnumName<E>& entry : entries) entries_[size_++] = entry;
  }

  // The name of `value`, or `fallback` (e.g. "?") when the table has no entry for it.
  constexpr std::string_view name(E value, std::string_view fallback) const {
    const EnumName<E>* entry = find(value);
    return entry != nullptr ? std::string_view(entry->name) : fallback;
  }

  // name() as a C string, for functions that return const char*.
  constexpr const char* c_name(E value, const char* fallback) const {
    const EnumName<E>* entry = find(value);
    return entry != nullptr ? entry->name : fallback;
  }

  // The value named `text` (exact, case-sensitive match), or nullopt when no entry has that name.
  constexpr std::optional<E> parse(std::string_view text) const {
    for (size_t i = 0; i < size_; ++i) {
      if (std::string_view(entries_[i].name) == text) return entries_[i].value;
    }
    return std::nullopt;
  }

 private:
  constexpr const EnumName<E>* find(E value) const {
    for (size_t i = 0; i < size_; ++i) {
      if (entries_[i].value == value) return &entries_[i];
    }
    return nullptr;
  }

  EnumName<E> entries_[kMaxEntries]{};
  size_t size_ = 0;
};

}  // namespace simpler::base
