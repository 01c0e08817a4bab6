#pragma once
// Deprecated path (shardlab 0.1). The course's parts left the library in 0.2: this header is shardlab::course's
// <shardlab/course/reference.h> now, on the include path of that target only. This forwarder goes in 0.3.
#if __has_include(<shardlab/course/reference.h>)
#warning "<shardlab/common/reference.h> is deprecated: include <shardlab/course/reference.h>"
#include <shardlab/course/reference.h>
#else
#error "<shardlab/common/reference.h> is the course's: link shardlab::course and include <shardlab/course/reference.h>"
#endif
