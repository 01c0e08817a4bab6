// The `shardlab` command line as a function: main() is one call of it, and tests/tools/cli_batch.cpp calls it once
// per command line in one process (libtorch loads once, not once per refused flag).
#pragma once

namespace shardlab::cli {

/// Parses `argv` (CLI11: the commands train, compare, bench, export, worker and their options), runs the command and
/// returns the process's exit code: 0 done (or --help), 1 a runtime error, 2 a usage error. Every message goes to
/// std::cout or std::cerr; a refusal is one line on std::cerr starting "shardlab: ". A refused command line changes
/// nothing outside the call; a command that runs may (train and compare print with the streams' precision changed; a
/// worker sets process-wide state: thread counts, the CPU allocator, its memory limit), so a process runs one of those.
int shardlab_main(int argc, char** argv);

}  // namespace shardlab::cli
