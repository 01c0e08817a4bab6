#pragma once
// Deprecated path (shardlab 0.1). The course's parts left the library in 0.2: this header is shardlab::course's
// <shardlab/course/launcher.h> now, on the include path of that target only. This forwarder goes in 0.3.
#if __has_include(<shardlab/course/launcher.h>)
#warning "<shardlab/common/launcher.h> is deprecated: include <shardlab/course/launcher.h>"
#include <shardlab/course/launcher.h>
#else
#error "<shardlab/common/launcher.h> is the course's: link shardlab::course and include <shardlab/course/launcher.h>"
#endif
