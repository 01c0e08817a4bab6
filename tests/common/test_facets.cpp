// Facets (Note [Facets, not downcasts]): a wrapper offers its parts by type, an extension attaches one from outside,
// and a facade adopts what it wraps. The wrappers' own facets are checked where they are built (stage 06's kind_of,
// the tool's runs).
#include "shardlab/core/parallel/facets.h"
#include "shardlab/core/parallel/parallel_model.h"
#include "shardlab/core/parallel/standard_facets.h"

#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>

namespace shardlab {
namespace {

// A wrapper that offers two facets of its own and trains nothing (every ParallelModel call but facets is refused).
class Toy : public ParallelModel, public ReplicaSync, public MemoryFacet {
 public:
  Toy() {
    facets_.add<ReplicaSync>(this);
    facets_.add<MemoryFacet>(this);
  }
  at::Tensor loss(const Batch&) override { throw std::logic_error("toy"); }
  NoSync no_sync() override { throw std::logic_error("toy"); }
  std::vector<at::Tensor> parameters() const override { return {}; }
  void visit_full_parameters(const std::function<void(size_t, const at::Tensor&)>&) override {}
  std::vector<at::Tensor> full_parameters() override { return {}; }
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override { return {}; }
  double clip_grad_norm(double, double) override { return 0; }
  void save_checkpoint(const std::string&, torch::optim::Optimizer*,
                       const std::map<std::string, std::string>&) override {}
  std::map<std::string, std::string> load_checkpoint(const std::string&, torch::optim::Optimizer*, bool,
                                                     const SavedNames&) override {
    return {};
  }
  // ReplicaSync
  void set_requires_all_reduce(bool on) override { requires_all_reduce = on; }
  // MemoryFacet
  void reset_memory_peaks() override {}
  MemoryFigures memory_figures(int micro_batches, bool) const override { return {micro_batches, 0, 0, 0}; }
  void record_memory_samples(bool) override {}
  std::vector<MemorySample> memory_samples() const override { return {}; }

  bool requires_all_reduce = true;
};

// A facade over another wrapper, as parallelize's DataParallel is.
class Facade : public Toy {
 public:
  explicit Facade(const ParallelModel& inner) { facets_.adopt(inner.facets()); }
};

struct CountingSeam : StepSeam {
  void after_optimizer_step() override { ++calls; }
  int calls = 0;
};

TEST(Facets, AWrapperOffersItsPartsByTypeAndNothingElse) {
  Toy toy;
  EXPECT_EQ(toy.facets().size(), 2u);
  ASSERT_NE(toy.facet<ReplicaSync>(), nullptr);
  toy.facet<ReplicaSync>()->set_requires_all_reduce(false);
  EXPECT_FALSE(toy.requires_all_reduce) << "the part handed out is the wrapper's own";
  ASSERT_NE(toy.facet<MemoryFacet>(), nullptr);
  EXPECT_EQ(toy.facet<MemoryFacet>()->memory_figures(3, false).peak_param_bytes, 3);
  EXPECT_EQ(toy.facet<StepSeam>(), nullptr) << "a facet the wrapper does not offer is null";
  EXPECT_EQ(&toy.required_facet<ReplicaSync>("a switch"), toy.facet<ReplicaSync>());
  try {
    toy.required_facet<StepSeam>("a step after the optimizer");
    ADD_FAILURE() << "required_facet returned a facet the wrapper does not offer";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expected a wrapper that offers a step after the optimizer"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(toy.facet<Toy>(), nullptr) << "a facet is found by the type it was offered as, not by the class";
}

TEST(Facets, AnAttachedPartLivesWithTheWrapperAndReplacesAnEarlierOneOfItsType) {
  std::weak_ptr<CountingSeam> watched;
  {
    Toy toy;
    auto seam = std::make_shared<CountingSeam>();
    watched = seam;
    toy.attach<StepSeam>(seam);
    seam.reset();
    ASSERT_FALSE(watched.expired()) << "the wrapper keeps an attached part alive";
    toy.facet<StepSeam>()->after_optimizer_step();
    EXPECT_EQ(watched.lock()->calls, 1);
    auto other = std::make_shared<CountingSeam>();
    toy.attach<StepSeam>(other);
    EXPECT_EQ(toy.facet<StepSeam>(), other.get()) << "a second part of one type replaces the first";
    EXPECT_TRUE(watched.expired()) << "and the first is released";
  }
}

TEST(Facets, AFacadeOffersWhatItWrapsAndKeepsItsOwn) {
  Toy inner;
  auto seam = std::make_shared<CountingSeam>();
  inner.attach<StepSeam>(seam);
  Facade facade(inner);
  EXPECT_EQ(facade.facet<StepSeam>(), seam.get()) << "adopted from the wrapped one";
  EXPECT_NE(facade.facet<ReplicaSync>(), inner.facet<ReplicaSync>()) << "a facet the facade has itself stays its own";
  facade.facet<ReplicaSync>()->set_requires_all_reduce(false);
  EXPECT_TRUE(inner.requires_all_reduce);
  EXPECT_FALSE(facade.requires_all_reduce);
}

}  // namespace
}  // namespace shardlab
