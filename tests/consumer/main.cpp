// Trains two ranks (threads, real Gloo) with the installed shardlab and checks they agree.
#include <shardlab/common/data.h>
#include <shardlab/common/reference.h>
#include <shardlab/common/thread_ranks.h>
#include <shardlab/naive_ddp/naive_ddp.h>

#include <iostream>

int main() {
  using namespace shardlab;
  std::vector<std::vector<at::Tensor>> finals(2);
  run_ranks(2, [&](Communicator& comm) {
    auto model = make_model("mlp", 42 + comm.rank());  // different starts: DDP broadcasts rank 0's
    naive_ddp::NaiveDDP ddp(model, comm);
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
