#!/usr/bin/env python3
"""Command-line tests of `shardlab` and `shardlab-run`: bad flags get a clear message and exit code 2.

Usage: test_cli.py SHARDLAB SHARDLAB_RUN SHARDLAB_CLI_BATCH

No check reads a clock: a command that hangs is caught by the test's ctest TIMEOUT, and every command is printed
when it starts (the batch's by the batch itself, on stderr), so the log names the one that hung.

A process of `shardlab` loads libtorch before it parses a flag (about 0.5 s of CPU here; 1 s with CUDA's libtorch),
and about 160 of the 180 commands are shardlab's: as processes they were 45 s of the default line's tests and 85 s
of the CUDA line's. They now run in one process, shardlab_cli_batch (tests/tools/cli_batch.cpp), which calls the
same function main() calls (tools/shardlab/cli.h) once per command line and answers with its exit code and output.
A few stay real processes (process=True), so main()'s exit codes are checked too. The launcher's commands are
processes, as many at a time as this process may use cores (at most 4), beside the batch; verdicts are printed in
the order written."""
import concurrent.futures
import os
import shutil
import subprocess
import tempfile
import sys
import threading

import shardlab_batch

shardlab, launcher, batch = sys.argv[1], sys.argv[2], sys.argv[3]
failures = 0
pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(4, max(2, len(os.sched_getaffinity(0)))))
pending = []  # (command, expected code, needle, future or None: in the batch), in the order written
settled = [0]  # commands checked so far


print_lock = threading.Lock()  # whole lines: the pool's threads print too


def say(*words):
    with print_lock:
        print(*words, flush=True)


def run_one(cmd):
    """One command as a process: (exit code, stdout then stderr)."""
    say("run ", " ".join(cmd[1:]))
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def run_batch(commands):
    """shardlab's command lines `commands` in one shardlab_cli_batch process (shardlab_batch.run_batch)."""
    for args in commands:
        say("run ", " ".join(args), "(batch)")
    return shardlab_batch.run_batch(batch, commands)


def expect(cmd, code, needle, process=False):
    """Checks, at settle(), that `cmd` exits with `code` and prints `needle`. shardlab's commands go to the batch
    unless `process`; the others start in the pool now."""
    batched = cmd[0] == shardlab and not process
    pending.append((cmd, code, needle, None if batched else pool.submit(run_one, cmd)))


def settle():
    """Runs the batch beside the pool's processes, waits for every command so far and prints each verdict in the
    order written."""
    global failures
    batched = [cmd[1:] for cmd, _, _, future in pending if future is None]
    answers = iter(pool.submit(run_batch, batched).result() if batched else [])
    for cmd, code, needle, future in pending:
        got, out = future.result() if future else next(answers)
        ok = got == code and needle in out
        say(("ok  " if ok else "FAIL"), " ".join(cmd[1:]), "->", got, "|",
            out.strip().splitlines()[0] if out.strip() else "")
        if not ok:
            say("     expected exit", code, "and", repr(needle), "in:\n", out)
            failures += 1
    settled[0] += len(pending)
    pending.clear()


expect([shardlab, "train", "--strategy", "nope"], 2, "--strategy: expects one of single|naive_ddp|bucketed_ddp|")
expect([shardlab, "train", "--strategy", "nope"], 2, "--strategy: expects one of", process=True)  # main()'s codes
expect([shardlab, "--help"], 0, "compare", process=True)
expect([shardlab, "train", "--bucket-cap-kb", "0"], 2, "--bucket-cap-kb: expects an integer in [1, ")
expect([shardlab, "train", "--strategy", "fsdp", "--bucket-cap-kb", "auto"], 2,
       "--bucket-cap-kb auto tunes the buckets of bucketed_ddp, hook_allreduce, hook_fp16, hook_bf16 and "
       "overlap_optimizer; got "
       "strategy 'fsdp'")
expect([shardlab, "train", "--strategy", "fsdp_prefetch", "--prefetch-depth", "-1"], 2,
       "--prefetch-depth: expects an integer in [0, 64]; got '-1'")
expect([shardlab, "train", "--strategy", "fsdp_prefetch", "--prefetch-limit", "two"], 2,
       "--prefetch-limit: expects an integer")
expect([shardlab, "train", "--strategy", "fsdp", "--prefetch-depth", "2"], 2,
       "--prefetch-depth sets the prefetch of strategies fsdp_prefetch and hsdp; got strategy 'fsdp'")
# The mesh: its form, its size against --world-size, and only for hsdp; all before any rank starts.
expect([shardlab, "train", "--strategy", "hsdp", "--mesh", "2by2"], 2,
       "--mesh: expects replicas x shards as RxS with R, S >= 1 (e.g. 2x2); got '2by2'")
expect([shardlab, "train", "--strategy", "hsdp", "--mesh", "0x2"], 2, "--mesh: expects replicas x shards")
expect([shardlab, "train", "--strategy", "hsdp", "--mesh", "2x2", "--world-size", "6"], 2,
       "--mesh 2x2 has 4 ranks; got --world-size 6")
expect([shardlab, "train", "--strategy", "fsdp", "--mesh", "2x2"], 2,
       "--mesh applies to strategy hsdp only; got strategy 'fsdp'")
expect([shardlab, "train", "--strategy", "hsdp", "--mesh", "65536x65536"], 2,
       "--mesh: expects at most 64 ranks (R x S), as --world-size; got '65536x65536', 4294967296 ranks")
# hsdp is the library's parallelize: a mesh of shard size 1 would make it DDP.
expect([shardlab, "train", "--strategy", "hsdp", "--mesh", "4x1"], 2,
       "--strategy hsdp shards over S >= 2 ranks per replica; got a 4x1 mesh (a mesh of shard size 1 is DDP: "
       "--strategy bucketed_ddp)")
expect([shardlab, "train", "--strategy", "fsdp", "--world-size", "1"], 2,
       "--strategy fsdp shards over S >= 2 ranks per replica; got a 1x1 mesh (one rank: --strategy single)")
expect([shardlab, "train", "--strategy", "hsdp", "--world-size", "1"], 2,
       "--strategy hsdp shards over S >= 2 ranks per replica; got a 1x1 mesh")
expect([shardlab, "train", "--strategy", "hsdp", "--defer-all-reduce", "yes"], 2,
       "--defer-all-reduce: expects one of true|false; got 'yes'")
expect([shardlab, "bench", "--repeat", "0"], 2, "--repeat: expects an integer in [1, 20]; got '0'")
expect([shardlab, "train", "--world-size", "0"], 2, "--world-size: expects an integer in [1, 64]; got '0'")
expect([shardlab, "train", "--steps", "ten"], 2, "--steps: expects an integer")
expect([shardlab, "train", "--model", "resnet"], 2, "--model: expects one of mlp|tiny_gpt|edge")
expect([shardlab, "train", "--world-size", "3", "--global-batch", "16"], 2, "must divide by world size")
expect([shardlab, "train", "--strategy", "single", "--world-size", "4"], 2, "runs on one rank")
expect([shardlab, "train", "--bogus", "1"], 2, "were not expected: 1 --bogus")  # CLI11's wording
expect([shardlab, "train", "--steps"], 2, "--steps: 1 required")  # CLI11's wording
expect([shardlab, "train", "--device", "gpu"], 2, "unknown device 'gpu'; expected cpu, cuda or cuda:N")
# --json is checked before any rank starts (no training is wasted on a path that cannot be written).
expect([shardlab, "train", "--steps", "1", "--json", "/nonexistent-dir/run.json"], 2,
       "--json: expects a file to write in an existing directory; got '/nonexistent-dir/run.json'")
expect([shardlab, "train", "--steps", "1", "--json", "/tmp"], 2, "--json: expects a file to write; got '/tmp', a directory")
expect([shardlab, "train", "--backend", "mpi"], 2, "--backend: expects one of gloo|nccl; got 'mpi'")
expect([shardlab, "train", "--comm-yield", "maybe"], 2, "--comm-yield: expects one of on|off; got 'maybe'")
expect([shardlab, "train", "--clip-norm", "-1"], 2, "--clip-norm: expects a finite positive number; got '-1'")
expect([shardlab, "train", "--clip-norm", "1", "--clip-norm-type", "1"], 2,
       "--clip-norm-type: expects one of 2|inf; got '1'")
expect([shardlab, "train", "--clip-norm-type", "inf"], 2, "--clip-norm-type chooses the norm --clip-norm bounds")
expect([shardlab, "train", "--strategy", "overlap_optimizer", "--clip-norm", "1"], 2,
       "--clip-norm needs the whole gradient before any parameter steps; strategy overlap_optimizer")
# Checkpoints: the flags' pairs and strategies, a missing or too-late checkpoint, export's arguments; all before any
# rank starts.
expect([shardlab, "train", "--save-every", "2"], 2, "--save-every K saves every K steps into --save DIR; got it without")
expect([shardlab, "train", "--save", "x", "--save-every", "0"], 2, "--save-every: expects an integer in [1, ")
expect([shardlab, "train", "--strategy", "overlap_optimizer", "--save", "x"], 2,
       "strategy overlap_optimizer keeps one optimizer per parameter inside its reducer")
expect([shardlab, "train", "--save", "/etc"], 2,
       "--save expects a new or empty directory, or a checkpoint to replace; got '/etc'")
expect([shardlab, "compare", "--reference", "none"], 2,
       "--reference none trains without one device; compare and bench set every strategy beside one device")
expect([shardlab, "compare", "--save", "x"], 2, "--save, --save-every and --resume are options of shardlab train")
expect([shardlab, "train", "--resume", "/nonexistent/ckpt"], 2, "--resume expects a checkpoint")
# A directory that looks like a checkpoint to the flag checks (it has index.json), so the next check is reached.
fake_checkpoint = tempfile.mkdtemp()
open(os.path.join(fake_checkpoint, "index.json"), "w").close()
expect([shardlab, "export", fake_checkpoint], 2, "FILE is required")  # CLI11's wording
expect([shardlab, "export", "/nonexistent/ckpt", "out.safetensors"], 2,
       "DIR: expects a checkpoint's directory (train --save DIR); got '/nonexistent/ckpt', which does not exist")
expect([shardlab, "export", fake_checkpoint, "/nonexistent-dir/out.safetensors"], 2,
       "FILE: expects a file to write in an existing directory; got '/nonexistent-dir/out.safetensors'")
expect([shardlab, "export", "/tmp", "out.safetensors"], 2, "DIR: expects a checkpoint's directory (train --save DIR); "
       "got '/tmp', a directory without index.json")
# Past the flag checks, a bad checkpoint is a runtime error (exit 1) naming the file.
expect([shardlab, "export", fake_checkpoint, os.path.join(fake_checkpoint, "out.safetensors")], 1,
       "index.json' is not JSON")
expect([shardlab, "export", fake_checkpoint, os.path.join(fake_checkpoint, "out.safetensors")], 1,
       "index.json' is not JSON", process=True)
expect([shardlab, "bench", "--python", "/nonexistent/python3"], 2,
       "--python: expects the python3 with torch; got '/nonexistent/python3', which does not exist")
expect([shardlab, "train", "--backend", "nccl"], 2, "--backend nccl moves CUDA tensors only; it needs --device cuda")
expect([shardlab, "train", "--backend", "nccl", "--device", "cuda:0"], 2, "--backend nccl needs one GPU per rank")
# Checked once by the driver, before any rank starts (this machine may or may not have CUDA).
# "without CUDA" here; "is not a visible GPU" on a machine with fewer than 64 GPUs. Both name the device.
expect([shardlab, "train", "--device", "cuda:63"], 2, "device cuda:63")
expect([shardlab, "train", "--device", "cuda:300"], 2, "GPU index 300 is out of range")
expect([shardlab, "frobnicate"], 2, "unknown command 'frobnicate'; expected one of train, compare, bench, export, worker")
expect([shardlab, "--help"], 0, "compare")
expect([shardlab, "help"], 0, "compare")
expect([shardlab, "train", "--help"], 0, "--write-config")
expect([shardlab, "train", "--help"], 0, "--config FILE")
# Integers are decimal, a leading zero too (CLI11 alone would read 010 as octal 8).
expect([shardlab, "train", "--world-size", "3", "--global-batch", "010"], 2, "--global-batch 10 must divide")
expect([launcher, "-n", "1", "--nnodes", "9", "--node-rank", "010", "--master-port", "29500", "--", "true"], 2,
       "got 10")
# A flag given twice: the last one (as argparse does).
expect([shardlab, "train", "--world-size", "3", "--world-size", "4", "--global-batch", "6"], 2,
       "world size x micro-batches = 4")
expect([launcher, "-n", "1", "sh", "--", "-c", "true"], 2, "expected '--' followed by the program")
expect([launcher, "-n", "1", "-n", "2", "--", "sh", "-c", "echo size $WORLD_SIZE"], 0, "size 2")
expect([shardlab, "bench", "--repeat", "2", "--repeat", "0"], 2, "--repeat: expects an integer in [1, 20]; got '0'")
expect([shardlab, "bench", "--out", "/nonexistent-dir/bench"], 2, "--out: expects a PREFIX to write PREFIX.md and PREFIX.json in an existing directory")
expect([shardlab, "train", "--resume", "/tmp"], 2, "got '/tmp', a directory without index.json")
expect([shardlab, "train", "--save", "/etc/passwd/x"], 2, "--save expects a directory to make")
expect([shardlab, "train", "--save", "/etc/passwd/deeper/x"], 2,
       "--save expects a directory to make; got '/etc/passwd/deeper/x' ('/etc/passwd' is a file, not a directory)")


def every_option_refuses_a_bad_value():
    """Every option of every command's --help, given a value it cannot take: exit 2, and the message names it."""
    paths = {"--save": "/etc/passwd/x", "--resume": "/etc/passwd", "--trace": "/etc/passwd", "--json": "/tmp",
             "--write-config": "", "--config": "", "--python": "/nonexistent/python3",
             "--torch-script": "/nonexistent/x.py", "--out": "/nonexistent/x", "--result-dir": None,
             "--torch-root": None,  # not checked: without the root, the FSDP section says so and runs the rest
             "--master-addr": ""}
    commands = [[shardlab, "train"], [shardlab, "compare"], [shardlab, "bench"], [shardlab, "worker"]]
    helps = [out for _, out in run_batch([cmd[1:] + ["--help"] for cmd in commands])]
    commands.append([launcher])
    helps.append(subprocess.run([launcher, "--help"], capture_output=True, text=True).stdout)
    for cmd, text in zip(commands, helps):
        flags = set()
        for line in text.splitlines():
            words = line.split()
            if words and words[0].startswith("-"):  # "-n,--nproc-per-node", "--steps", "--steps K:INT in [1, 9]"
                flags |= {f.split(":")[0].split("=")[0] for f in words[0].split(",") if f.startswith("--")}
        flags.discard("--help")
        global failures
        say(f"{' '.join(cmd[1:]) or 'shardlab-run'}: {len(flags)} flags, each given a bad value")
        if len(flags) < 5:  # every command has more: the help's layout changed, and this loop would test nothing
            say("FAIL", " ".join(cmd), "--help: expected at least 5 flags, found", sorted(flags), "in:\n", text)
            failures += 1
        for flag in sorted(flags):
            if flag in ("--no-torch",):  # a switch: it takes no value
                continue
            bad = paths.get(flag, "010x")
            if bad is None:
                continue
            args = cmd + [flag, bad] + (["--", "true"] if cmd == [launcher] else [])
            if cmd[-1] == "worker":
                args += ["--result-dir", "/tmp"] if flag != "--result-dir" else []
            expect(args, 2, flag)


every_option_refuses_a_bad_value()
expect([launcher, "-n", "x", "--", "true"], 2, "-n")
expect([launcher, "-n", "2", "true"], 2, "--")
expect([launcher, "-n", "2", "--", "sh", "-c", "exit $RANK"], 1, "rank 1")
expect([launcher, "-n", "2", "--nnodes", "2", "--", "true"], 2, "expected --master-port with --nnodes 2")
expect([launcher, "-n", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "29500", "--", "true"], 2,
       "expected --node-rank in 0..1 (--nnodes 2), got 2")
expect([launcher, "-n", "2", "--master-addr", "", "--", "true"], 2, "--master-addr")
# Node 1 of 2: its ranks are 2 and 3 of 4, local ranks 0 and 1, GROUP_RANK 1; the output names global ranks.
expect([launcher, "-n", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "29500", "--", "sh", "-c",
        "echo env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK; exit $LOCAL_RANK"], 1,
       "rank 3 exited with code 1")
expect([launcher, "-n", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "29500", "--", "sh", "-c",
        "echo env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK"], 0, "[rank 3] env 3 4 1 2 1")


def interrupt_stops_every_rank():
    """Ctrl-C (SIGINT) on the launcher stops the ranks (in their own process groups) and leaves none behind.

    Waits for states, not times: the signal goes only once both ranks have printed "ready" (so the launcher has
    installed its handlers and forked every rank), and the launcher guarantees that when it exits every process
    of every rank's group has been reaped (Note [Reaping a rank's whole group]), so leftovers are looked for at once.
    Each rank's `sh` forks the `sleep`, so a rank leaves a child of its own behind if the launcher only reaps ranks.
    The sleep outlasts the ctest TIMEOUT, so it ends only by being killed; if the launcher never gets both ranks
    running, or never stops them, the test hangs and ctest fails it.
    """
    global failures
    import os, signal
    marker = "sleep 100000.%d" % os.getpid()  # a command line no other process has
    print("run  -n 2 -- sh -c 'echo ready; %s', then SIGINT once both ranks are ready" % marker, flush=True)
    p = subprocess.Popen([launcher, "-n", "2", "--", "sh", "-c", "echo ready; " + marker],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, ready = [], set()
    for line in p.stdout:
        seen.append(line.rstrip("\n"))
        if line.rstrip().endswith("] ready"):
            ready.add(line.split("]")[0])
        if len(ready) == 2:
            break
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate()
    out = "\n".join(seen) + "\n" + out
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    ok = len(ready) == 2 and p.returncode == 130 and "interrupted by signal 2" in out and not left
    print("ok  " if ok else "FAIL", f"SIGINT once {len(ready)} ranks were ready -> exit {p.returncode},",
          f"{len(left)} processes left:", out.strip().splitlines()[-1] if out.strip() else "")
    if not ok:
        print("     output:\n", out)
        subprocess.run(["pkill", "-KILL", "-f", marker])
        failures += 1

settle()  # the SIGINT test below waits for states of its own, with nothing else running beside it


interrupt_stops_every_rank()
shutil.rmtree(fake_checkpoint, ignore_errors=True)
print(f"{settled[0] + 1} commands checked (the SIGINT test included), {failures} failed")
sys.exit(1 if failures else 0)
