// Trains two ranks (threads, real Gloo) with the installed shardlab — bucketed DDP with the fp16 hook, the most
// capable wrapper so far — and checks the ranks agree.
#include <shardlab/bucketed_ddp/bucketed_ddp.h>
#include <shardlab/comm_hooks/comm_hook.h>
#include <shardlab/common/data.h>
#include <shardlab/common/reference.h>
#include <shardlab/common/thread_ranks.h>

#include <iostream>

int main() {
  using namespace shardlab;
  std::vector<std::vector<at::Tensor>> finals(2);
  run_ranks(2, [&](Communicator& comm) {
    auto model = make_model("mlp", 42 + comm.rank());  // different starts: DDP broadcasts rank 0's
    bucketed_ddp::Options options;
    options.caps = {1024, 8192};  // a few buckets
    options.reducer = comm_hooks::as_bucket_reducer(comm_hooks::make_hook("fp16", comm));
    bucketed_ddp::BucketedDDP ddp(model, comm, options);
    auto data = make_dataset("mlp", 42);
    auto opt = make_optimizer("sgd", trainable_parameters(*model), 0.05);
    for (int step = 0; step < 3; ++step) {
      opt->zero_grad();
      ddp.loss(rank_slice(data->global_batch(step, 8), comm.rank(), comm.size())).backward();
      opt->step();
    }
    finals[comm.rank()] = model->parameters();
  });
  const double diff = max_abs_diff(finals[0], finals[1]);
  std::cout << "consumer: 2 ranks trained, max parameter difference between ranks " << diff << "\n";
  return diff == 0.0 ? 0 : 1;
}
