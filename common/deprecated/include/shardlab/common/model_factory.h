#pragma once
// Deprecated path (shardlab 0.1). The course's parts left the library in 0.2: this header is shardlab::course's
// <shardlab/course/model_factory.h> now, on the include path of that target only. This forwarder goes in 0.3.
#if __has_include(<shardlab/course/model_factory.h>)
#warning "<shardlab/common/model_factory.h> is deprecated: include <shardlab/course/model_factory.h>"
#include <shardlab/course/model_factory.h>
#else
#error \
    "<shardlab/common/model_factory.h> is the course's: link shardlab::course and include <shardlab/course/model_factory.h>"
#endif
