#!/usr/bin/env python3
"""Two `shardlab-run` launchers on this machine as two nodes of 2 ranks each (torchrun's --nnodes/--node-rank):
the 4 processes meet over one TCPStore and run a 2x2 mesh, the shard groups inside a node and the replicate groups
across the nodes, as HSDP is deployed. The rank program is test_common's own MeshOfProcesses test.

Usage: test_nodes.py SHARDLAB_RUN TEST_COMMON. No check reads a clock: a hang is caught by the launchers' --timeout
and the test's ctest TIMEOUT."""
import os
import socket
import subprocess
import sys

launcher, program = sys.argv[1], sys.argv[2]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
env = dict(os.environ, SHARDLAB_TEST_WORLD_RANK="1")
nodes = []
for node in (0, 1):
    cmd = [launcher, "-n", "2", "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
           "--master-port", str(port), "--timeout", "120", "--", program,
           "--gtest_filter=MeshOfProcesses.TwoByTwoOverOneTcpStore"]
    print("run ", " ".join(cmd[1:]), flush=True)
    nodes.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
failures = 0
for node, p in enumerate(nodes):
    out, _ = p.communicate()
    print(f"--- node {node}: exit {p.returncode}\n{out}")
    mine = (2 * node, 2 * node + 1)
    for rank in mine:
        said = f"[rank {rank}] mesh ok (node {node}, local rank {rank - 2 * node})"
        if said not in out:
            print(f"FAIL node {node}: expected {said!r}")
            failures += 1
    if p.returncode != 0:
        print(f"FAIL node {node}: exit {p.returncode}")
        failures += 1
print("test_nodes:", "FAIL" if failures else "ok")
sys.exit(1 if failures else 0)
