#pragma once
/// @file facets.h
/// What a data-parallel wrapper offers beyond ParallelModel, asked for by type (Note [Facets, not downcasts]).
///
/// Vocabulary:
///  - *facet*: one capability a wrapper may or may not have, named by a type (a class with virtual methods): its
///    measured memory, its buckets, a switch for the all-reduce across replicas, a step after the optimizer. The
///    core names the facets every wrapper may share (standard_facets.h); a stage names its own (stage 02: its
///    buckets).
///  - *part*: the object that implements a facet: the wrapper itself, or an object the wrapper (or an extension
///    attached from outside) keeps alive.

#include <map>
#include <memory>
#include <typeindex>
#include <utility>

namespace shardlab {

/// A wrapper's facets, at most one of each type. Registration and lookup are by the same static type F, so a part
/// is only ever handed out as the type it was registered as. Not thread-safe: filled at construction (or by an
/// extension before training), then read.
class Facets {
 public:
  /// An empty set.
  Facets() = default;
  /// Not copyable: a copy that outlived its wrapper would hand out parts that point into the dead wrapper (adopt()
  /// is how a facade shares them, while it holds the wrapper).
  Facets(const Facets&) = delete;
  /// Not copyable (see the copy constructor).
  Facets& operator=(const Facets&) = delete;
  /// Movable, with the wrapper that holds it.
  Facets(Facets&&) = default;
  /// Movable, with the wrapper that holds it.
  Facets& operator=(Facets&&) = default;
  ~Facets() = default;

  /// Registers `part` as facet F, replacing an earlier F. `keep` (optional) is owned by the set, for a part that
  /// lives outside the wrapper.
  template <class F>
  void add(F* part, std::shared_ptr<void> keep = nullptr) {
    entries_[std::type_index(typeid(F))] = Entry{static_cast<void*>(part), std::move(keep)};
  }
  /// The part registered as facet F, or null.
  template <class F>
  F* get() const {
    const auto it = entries_.find(std::type_index(typeid(F)));
    return it == entries_.end() ? nullptr : static_cast<F*>(it->second.part);
  }
  /// Adds every facet of `other` that this set lacks (a facade offering what it wraps), sharing their keep-alives. A
  /// copy of what `other` holds now: a facet added to `other` later is not seen here.
  void adopt(const Facets& other) {
    for (const auto& [type, entry] : other.entries_) entries_.emplace(type, entry);
  }
  /// How many facets the set holds.
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    void* part = nullptr;
    std::shared_ptr<void> keep;
  };
  std::map<std::type_index, Entry> entries_;
};

}  // namespace shardlab
