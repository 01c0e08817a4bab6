#pragma once
// What the files of stage 02's suite share: caps that cut the mlp into a chosen number of buckets.
#include "shardlab/bucketed_ddp/bucket_plan.h"

namespace shardlab::test_support {

/// Caps that cut the mlp into `buckets` (1, 2 or 3) buckets. Its trainable parameters in reverse registration order
/// (bytes): fc2.bias 16, fc2.weight 1024, fc1.bias 256, fc1.weight 16384, fc0.bias 256, fc0.weight 4096.
inline bucketed_ddp::BucketCaps mlp_caps(int buckets) {
  if (buckets == 1) return {};               // 1 MiB first bucket holds everything
  if (buckets == 2) return {1000, 1 << 20};  // [fc2.*] [the rest]
  return {1000, 16000};                      // [fc2.*] [fc1.*] [fc0.*]
}

}  // namespace shardlab::test_support
