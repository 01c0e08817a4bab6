#include "shardlab/core/model/no_sync.h"

namespace shardlab {

NoSync::NoSync(bool& sync_enabled) : sync_enabled_(sync_enabled), previous_(sync_enabled) { sync_enabled_ = false; }

NoSync::~NoSync() { sync_enabled_ = previous_; }

}  // namespace shardlab
