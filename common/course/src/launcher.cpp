/// @file launcher.cpp
/// POSIX implementation of launch(): fork/exec one process per rank, one pipe per rank, a poll() loop.
///
/// Note [Rank process groups]
/// Each rank runs in its own process group (pgid == its pid), so a signal sent to -pid also reaches whatever the
/// rank started (`sh -c '... sleep 30'`). When a rank exits we look at it with waitid(WNOWAIT), which leaves it a
/// zombie: while the zombie exists its pid cannot be reused, so SIGKILL to its group can only hit its own leftovers.
/// Then we reap it. Being a background group, a rank that read the terminal would stop (SIGTTIN), so stdin is
/// /dev/null. On Linux each rank also gets PR_SET_PDEATHSIG, so if the launcher itself dies (Ctrl-C reaches only
/// the launcher's group) the ranks die too; what they started themselves may then outlive them, as nothing is left
/// to signal their groups.
///
/// Note [Reaping a rank's whole group]
/// Killing a group is asynchronous: SIGKILL is only *pending* in each member until the kernel schedules it, and a
/// rank's own children (`sh -c 'sleep 30'` forks the sleep) are not ours to wait for. So reaping the rank alone
/// could return while its children still run, and on a loaded machine a caller that looks for them right after
/// launch() returns finds them (the old flake of tool_cli_errors). On Linux the launcher therefore makes itself a
/// child subreaper for the duration of launch(): whatever a rank leaves behind when it dies is re-parented to the
/// launcher rather than to init, and after reaping the rank we wait (waitid(P_PGID)) for every process of its group.
/// The group id stays allocated while any member lives, so that wait cannot hit another program's group. When
/// launch() returns, nothing a rank started in its own group is alive. (A process that left the group with
/// setsid/setpgid is out of reach, as for torchrun.)
///
/// Note [Environment after fork]
/// The launcher may be multi-threaded (libtorch), and after fork() the child may only call async-signal-safe
/// functions: no setenv, no malloc. So every rank's environment is built in the parent and the child only points
/// `environ` at it before execvp.

#include "shardlab/course/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <system_error>

extern char** environ;

namespace shardlab {
namespace {

using Clock = std::chrono::steady_clock;
// Set by SIGINT/SIGTERM while launch() runs: the launcher then stops its ranks (which live in their own process
// groups and so do not get the terminal's signal) instead of dying and leaving them behind.
volatile sig_atomic_t g_interrupted = 0;
extern "C" void on_interrupt(int sig) { g_interrupted = sig; }

// Installs on_interrupt for SIGINT and SIGTERM for the lifetime of the object, then restores the old handlers.
class InterruptGuard {
 public:
  InterruptGuard() {
    g_interrupted = 0;
    struct sigaction sa {};
    sa.sa_handler = on_interrupt;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~InterruptGuard() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;

 private:
  struct sigaction old_int_ {
  }, old_term_{};
};

constexpr auto kGracePeriod = std::chrono::seconds(3);      // SIGTERM -> SIGKILL
constexpr auto kPollSlice = std::chrono::milliseconds(50);  // how often exits are checked while pipes are quiet

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

/// Waits for every process of group `pgid` that is our child (the rank's leftovers, re-parented to us) after the
/// group was sent SIGKILL. Returns at once where there are none, and after kGracePeriod at the latest: a process
/// that SIGKILL does not end (stuck in the kernel) must not hang the launcher. See Note [Reaping a rank's whole
/// group].
void reap_group(pid_t pgid) {
  const auto give_up = Clock::now() + kGracePeriod;
  for (;;) {
    siginfo_t info{};
    if (waitid(P_PGID, static_cast<id_t>(pgid), &info, WEXITED | WNOHANG) != 0) {
      if (errno == EINTR) continue;
      return;  // ECHILD: none left
    }
    if (info.si_pid != 0) continue;  // reaped one; there may be more
    if (Clock::now() >= give_up) return;
    poll(nullptr, 0, 1);  // 1 ms: SIGKILLed processes take moments to end
  }
}

/// Makes the launcher a child subreaper while it lives (Linux), then restores the caller's setting.
/// See Note [Reaping a rank's whole group].
class SubreaperGuard {
 public:
  SubreaperGuard() {
#ifdef __linux__
    prctl(PR_GET_CHILD_SUBREAPER, &old_);
    prctl(PR_SET_CHILD_SUBREAPER, 1);
#endif
  }
  ~SubreaperGuard() {
#ifdef __linux__
    prctl(PR_SET_CHILD_SUBREAPER, old_);
#endif
  }
  SubreaperGuard(const SubreaperGuard&) = delete;
  SubreaperGuard& operator=(const SubreaperGuard&) = delete;

 private:
  int old_ = 0;
};

/// One rank's process and the read end of its output pipe.
struct RankProc {
  pid_t pid = -1;
  int fd = -1;           // read end, non-blocking; -1 once at EOF
  bool running = false;  // forked and not yet reaped
  std::string pending;   // bytes after the last newline
};

/// The environment of one rank: the launcher's own, with our variables replacing any of the same name.
std::vector<std::string> rank_env(const std::vector<std::pair<std::string, std::string>>& vars) {
  std::set<std::string> names;
  for (const auto& kv : vars) names.insert(kv.first);
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (names.count(entry.substr(0, entry.find('='))) == 0) env.push_back(entry);
  }
  for (const auto& kv : vars) env.push_back(kv.first + "=" + kv.second);
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

/// All ranks of one launch. The destructor SIGKILLs and reaps whatever still runs, so an exception (from fork or
/// from the sink) leaves no orphans. See Note [Rank process groups].
class Job {
 public:
  explicit Job(int nproc) : ranks_(nproc) {}
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  ~Job() {
    signal_running(SIGKILL);
    for (auto& r : ranks_) {
      if (r.running) {
        waitpid(r.pid, nullptr, 0);
        reap_group(r.pid);
      }
      if (r.fd >= 0) close(r.fd);
    }
  }

  bool any_running() const { return !running_ranks().empty(); }
  void signal_running(int sig) {
    for (const auto& r : ranks_) {
      if (r.running) kill(-r.pid, sig);  // the whole group: see Note [Rank process groups]
    }
  }

  /// Forks rank `rank` running argv with envp. See Note [Environment after fork].
  void start(int rank, char* const* argv, char** envp, const std::string& exec_error_prefix) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) throw_errno("launch: pipe");
    fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
    const int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    const pid_t launcher = getpid();
    const pid_t pid = fork();
    if (pid == 0) {
      setpgid(0, 0);
#ifdef __linux__
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher) _exit(127);  // the launcher died before prctl
#endif
      if (devnull >= 0) dup2(devnull, STDIN_FILENO);
      dup2(fds[1], STDOUT_FILENO);
      dup2(fds[1], STDERR_FILENO);
      environ = envp;
      execvp(argv[0], argv);
      const char* reason = strerror(errno);
      (void)!write(STDERR_FILENO, exec_error_prefix.data(), exec_error_prefix.size());
      (void)!write(STDERR_FILENO, reason, strlen(reason));
      (void)!write(STDERR_FILENO, "\n", 1);
      _exit(127);
    }
    const int fork_errno = errno;
    close(fds[1]);
    if (devnull >= 0) close(devnull);
    if (pid < 0) {
      close(fds[0]);
      errno = fork_errno;
      throw_errno("launch: fork for rank " + std::to_string(rank));
    }
    setpgid(pid, pid);  // also here, so kill(-pid) works before the child has run
    ranks_[rank] = RankProc{pid, fds[0], true, {}};
  }

  /// Waits up to `wait` for output and forwards every complete line to the sink.
  void pump(std::chrono::milliseconds wait, const LineSink& sink) {
    std::vector<pollfd> fds;
    std::vector<int> owner;
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
      if (ranks_[r].fd >= 0) {
        fds.push_back({ranks_[r].fd, POLLIN, 0});
        owner.push_back(r);
      }
    }
    if (fds.empty()) {
      poll(nullptr, 0, static_cast<int>(wait.count()));
      return;
    }
    if (poll(fds.data(), fds.size(), static_cast<int>(wait.count())) <= 0) return;  // timeout or EINTR
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents != 0) read_some(owner[i], sink);
    }
  }

  /// Reads what is already in every pipe, flushes partial last lines and closes the pipes.
  void drain(const LineSink& sink) {
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
      while (ranks_[r].fd >= 0 && read_some(r, sink)) continue;
      if (ranks_[r].fd >= 0) close_pipe(r, sink);
    }
  }

  std::vector<int> running_ranks() const {
    std::vector<int> out;
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
      if (ranks_[r].running) out.push_back(r);
    }
    return out;
  }

  /// If rank r has exited, kills its leftovers, reaps it and returns its wait status; else (or if it was already
  /// reaped) returns -1.
  int try_reap(int r) {
    siginfo_t info{};
    if (!ranks_[r].running) return -1;
    if (waitid(P_PID, ranks_[r].pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0) return -1;
    kill(-ranks_[r].pid, SIGKILL);
    int status = 0;
    waitpid(ranks_[r].pid, &status, 0);
    reap_group(ranks_[r].pid);
    ranks_[r].running = false;
    return status;
  }

 private:
  /// One read(); returns true if bytes came (more may follow), false at EOF, EAGAIN or error.
  bool read_some(int r, const LineSink& sink) {
    char buf[65536];
    const ssize_t n = read(ranks_[r].fd, buf, sizeof buf);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return false;
    if (n <= 0) {
      close_pipe(r, sink);
      return false;
    }
    std::string& pending = ranks_[r].pending;
    pending.append(buf, static_cast<size_t>(n));
    size_t start = 0;
    for (size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1) {
      sink(r, pending.substr(start, nl - start));
    }
    pending.erase(0, start);
    return true;
  }

  void close_pipe(int r, const LineSink& sink) {
    close(ranks_[r].fd);
    ranks_[r].fd = -1;
    if (!ranks_[r].pending.empty()) sink(r, ranks_[r].pending);
    ranks_[r].pending.clear();
  }

  std::vector<RankProc> ranks_;
};

/// How long one poll() may wait: until `t`, but at least 1 ms (no spinning) and at most kPollSlice.
std::chrono::milliseconds poll_wait(Clock::time_point t) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now());
  return std::clamp<std::chrono::milliseconds>(left, std::chrono::milliseconds(1), kPollSlice);
}

/// "rank 2 exited with code 1" (exit code 1) or "rank 1 killed by signal 9" (exit code 128 + 9).
LaunchResult exit_result(int rank, int status) {
  const std::string who = "rank " + std::to_string(rank);
  if (WIFSIGNALED(status)) {
    return {128 + WTERMSIG(status), rank, who + " killed by signal " + std::to_string(WTERMSIG(status))};
  }
  return {WEXITSTATUS(status), rank, who + " exited with code " + std::to_string(WEXITSTATUS(status))};
}

/// "timeout after 0.5 s: ranks 0, 3 still running", naming the lowest of `hung` as the failed rank.
LaunchResult timeout_result(std::chrono::milliseconds timeout, const std::vector<int>& hung) {
  std::ostringstream msg;
  msg << "timeout after " << static_cast<double>(timeout.count()) / 1000.0
      << " s: " << (hung.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < hung.size(); ++i) msg << (i > 0 ? ", " : "") << hung[i];
  msg << " still running";
  return {124, hung.front(), msg.str()};
}

}  // namespace

void print_prefixed(int rank, const std::string& line) { std::cout << "[rank " << rank << "] " << line << std::endl; }

int pick_free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw_errno("pick_free_port: socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    close(fd);
    errno = err;
    throw_errno("pick_free_port: bind 127.0.0.1:0");
  }
  close(fd);
  return ntohs(addr.sin_port);
}

LaunchResult launch(const LaunchOptions& options, const std::vector<std::string>& argv, const LineSink& sink) {
  if (options.nproc < 1) {
    throw std::invalid_argument("launch: expected nproc >= 1, got " + std::to_string(options.nproc));
  }
  if (argv.empty() || argv[0].empty()) throw std::invalid_argument("launch: expected a program in argv, got none");
  if (options.master_port < 0 || options.master_port > 65535) {
    throw std::invalid_argument("launch: expected master_port in 0..65535, got " + std::to_string(options.master_port));
  }
  if (options.timeout.count() <= 0) {
    throw std::invalid_argument("launch: expected a positive timeout, got " + std::to_string(options.timeout.count()) +
                                " ms");
  }
  if (options.nnodes < 1 || options.node_rank < 0 || options.node_rank >= options.nnodes) {
    throw std::invalid_argument("launch: expected nnodes >= 1 and 0 <= node_rank < nnodes, got nnodes " +
                                std::to_string(options.nnodes) + ", node_rank " + std::to_string(options.node_rank));
  }
  if (options.nnodes > 1 && options.master_port == 0) {
    throw std::invalid_argument("launch: " + std::to_string(options.nnodes) +
                                " nodes need a master_port every node knows (a port picked here is unknown to the "
                                "others), got 0");
  }
  const int port = options.master_port != 0 ? options.master_port : pick_free_port();
  // This node's ranks are [base, base + nproc) of nnodes * nproc (torchrun's static rendezvous, node by node).
  const int base = options.node_rank * options.nproc;
  const std::string n = std::to_string(options.nproc);
  const std::string world = std::to_string(options.nnodes * options.nproc);
  const std::string exec_error_prefix = "shardlab-run: cannot execute " + argv[0] + ": ";
  std::vector<std::string> args = argv;
  std::vector<char*> c_args = c_strings(args);

  InterruptGuard interrupt_guard;
  SubreaperGuard subreaper_guard;  // declared before the Job: its destructor reaps groups while we are subreaper
  Job job(options.nproc);
  for (int r = 0; r < options.nproc; ++r) {
    std::vector<std::pair<std::string, std::string>> vars = {{"RANK", std::to_string(base + r)},
                                                             {"WORLD_SIZE", world},
                                                             {"LOCAL_RANK", std::to_string(r)},
                                                             {"LOCAL_WORLD_SIZE", n},
                                                             {"GROUP_RANK", std::to_string(options.node_rank)},
                                                             {"MASTER_ADDR", options.master_addr},
                                                             {"MASTER_PORT", std::to_string(port)}};
    // See Note [BLAS threads per rank]: as torchrun does, one compute thread per rank unless the user said.
    if (std::getenv("OMP_NUM_THREADS") == nullptr &&
        std::none_of(options.extra_env.begin(), options.extra_env.end(),
                     [](const auto& kv) { return kv.first == "OMP_NUM_THREADS"; }))
      vars.emplace_back("OMP_NUM_THREADS", "1");
    vars.insert(vars.end(), options.extra_env.begin(), options.extra_env.end());
    std::vector<std::string> env = rank_env(vars);
    std::vector<char*> c_env = c_strings(env);
    job.start(r, c_args.data(), c_env.data(), exec_error_prefix);
  }

  const auto deadline = Clock::now() + options.timeout;
  LaunchResult result;
  bool stopping = false;
  Clock::time_point kill_at;
  const auto stop = [&] {
    stopping = true;
    job.signal_running(SIGTERM);
    kill_at = Clock::now() + kGracePeriod;
  };
  // The sink and the result name global ranks.
  const LineSink global_sink = [&](int r, const std::string& line) { sink(base + r, line); };
  while (job.any_running()) {
    job.pump(poll_wait(stopping ? kill_at : deadline), global_sink);
    for (int r = 0; r < options.nproc; ++r) {
      const int status = job.try_reap(r);
      if (status > 0 && !stopping) {  // once stopping, later exits are casualties of stop(), not failures
        result = exit_result(base + r, status);
        stop();
      }
    }
    if (!stopping && g_interrupted != 0) {
      const int sig = g_interrupted;
      result = {128 + sig, -1, "interrupted by signal " + std::to_string(sig) + ": stopped every rank"};
      stop();
    }
    if (!stopping && job.any_running() && Clock::now() >= deadline) {
      std::vector<int> hung = job.running_ranks();
      for (int& r : hung) r += base;
      result = timeout_result(options.timeout, hung);
      stop();
    }
    if (stopping && Clock::now() >= kill_at) job.signal_running(SIGKILL);
  }
  job.drain(global_sink);
  return result;
}

}  // namespace shardlab
