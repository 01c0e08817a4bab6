#!/usr/bin/python3
"""PyTorch FSDP2 (`fully_shard`) on CPU with Gloo: the peer of shardlab's stage 04 in `shardlab bench`.

Trains shardlab's tiny_gpt shape (the Python copy in torch_ddp.py, beside this file) with FSDP2: every block is
sharded on its own (`fully_shard(block)`), then the root (embeddings, final norm, tied output), as torchtitan does;
reshard_after_forward as asked for the blocks, the root keeps its parameters (FSDP2's default). SGD with momentum,
as shardlab's benchmark. Every optimizer step is timed, and the bytes FSDP2 hands to Gloo are counted.

It needs torch >= 2.6 (FSDP2 on CPU): Debian trixie's python3-torch, run inside a trixie root (`shardlab bench`
does that; see tools/bench/make-torch-root). Run it as N ranks with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); rank 0 writes --json.

torch 2.6 on CPU needs four things FSDP2 does not do by itself (facts from ../shared/peers/README.md, checked there
on this machine kind; written here anew):
 1. Debian's 2.6 is built without libuv, while its TCPStore asks for it by default: USE_LIBUV=0.
 2. FSDP2 records and waits for events on the current stream; torch.cpu.Stream gains those methods only in 2.7:
    no-ops here, which is what 2.7 added.
 3. With reshard_after_forward the backward's all-gather copies into the very tensors forward saved, and on CPU that
    bumps their version counters: backward then fails ("modified by an inplace operation"). The values written are
    the ones saved, so the counters are put back after each copy-out.
 4. FSDP2 averages fp32/bf16 gradients with ReduceOp.AVG, which Gloo 2.6's reduce_scatter_tensor silently treats as
    SUM (gradients N times too large; PyTorch issue #162338). For Gloo groups FSDP2's own pre-divide + SUM +
    post-divide path is used instead (the same factors as shardlab's hooks).
"""

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

os.environ.setdefault("USE_LIBUV", "0")  # 1.

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_ddp  # noqa: E402  (TinyGpt and the batches: the same model shape and data as the DDP baseline)


def make_fsdp2_work_on_cpu():
    """Applies fixes 2-4 of the module docstring; each only where the running torch needs it."""
    stream = torch.cpu.Stream
    if not hasattr(stream, "record_event"):  # 2.
        stream.record_event = lambda self, event=None: torch.cpu.Event()
        stream.wait_event = lambda self, event: None

    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    copy_out = param_group.foreach_all_gather_copy_out  # 3.

    def copy_out_keeping_versions(result, fsdp_params, group):
        before = []
        for p in fsdp_params:
            for t in getattr(p, "all_gather_outputs", []):
                if t.device.type == "cpu":
                    before.append((t, t._version))
        copy_out(result, fsdp_params, group)
        for t, version in before:  # torch 2.6's signature (one tensor, one version); 2.7 takes tuples
            torch._C._autograd._unsafe_set_version_counter(t, version)

    param_group.foreach_all_gather_copy_out = copy_out_keeping_versions

    factors = collectives._get_gradient_divide_factors  # 4.

    def divide_factors(reduce_scatter_group, all_reduce_group, *args, **kwargs):
        if dist.get_backend(reduce_scatter_group) != "gloo":
            return factors(reduce_scatter_group, all_reduce_group, *args, **kwargs)
        world = reduce_scatter_group.size() * (all_reduce_group.size() if all_reduce_group is not None else 1)
        pre = 1
        while world % pre == 0 and world / pre > pre:
            pre *= 2
        return float(pre), world / pre

    collectives._get_gradient_divide_factors = divide_factors


class ByteCounter:
    """Counts what FSDP2's collectives hand to the backend: the payload (the caller's input tensor) and what a ring
    algorithm sends for it, with the size of the group each ran on (HSDP: the shard group for the all-gathers and
    reduce-scatters, the replicate group for the all-reduces). Gloo's reduce_scatter_tensor is an all-reduce of the
    whole input inside (PyTorch PR #118911), so it is counted as one."""

    def __init__(self, world):
        self.world, self.payload, self.sent, self.calls = world, 0, 0.0, {}

    def wrap(self, name, input_of, group_at, sent_factor):
        original = getattr(dist, name)

        def counted(*args, **kwargs):
            tensor = input_of(args, kwargs)
            group = kwargs.get("group", args[group_at] if len(args) > group_at else None)
            n = dist.get_world_size(group) if group is not None else self.world
            nbytes = tensor.numel() * tensor.element_size()
            self.payload += nbytes
            self.sent += sent_factor(n) * nbytes
            self.calls[name] = self.calls.get(name, 0) + 1
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    def install(self):
        self.wrap("all_gather_into_tensor", lambda a, k: k.get("input_tensor", a[1] if len(a) > 1 else None), 2,
                  lambda n: n - 1)
        self.wrap("reduce_scatter_tensor", lambda a, k: k.get("input", a[1] if len(a) > 1 else None), 3,
                  lambda n: 2 * (n - 1) / n)
        self.wrap("all_reduce", lambda a, k: k.get("tensor", a[0] if a else None), 2, lambda n: 2 * (n - 1) / n)

    def reset(self):
        self.payload, self.sent, self.calls = 0, 0.0, {}


def status_mib(field):
    """A /proc/self/status figure (kB) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def rss_mib():
    return status_mib("VmRSS")


def peak_mib():
    return status_mib("VmHWM")


def reset_peak():
    """VmHWM from now on (clear_refs' 5, as shardlab's worker does)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


@torch.no_grad()
def init_sharded(model, seed):
    """init_parameters' rule on the shards (values differ from the unsharded model's: only speed and memory matter)."""
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, 1.0 / p.size(1) ** 0.5)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)


def parse_args(argv):
    p = argparse.ArgumentParser(description="PyTorch FSDP2 (gloo, CPU) on shardlab's tiny_gpt shape.")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--reshard-after-forward", choices=["true", "false"], default="true")
    p.add_argument("--vocab", type=int, required=True, help="vocabulary size (shardlab's corpus_vocab())")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--mesh", metavar="RxS", help="HSDP on a 2-D mesh of R replicas x S shards (default: FSDP)")
    p.add_argument("--meta", action="store_true",
                   help="build the model on the meta device, shard it, then to_empty and initialize the shards")
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def main(argv):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from torch.distributed.fsdp import fully_shard

    make_fsdp2_work_on_cpu()
    counter = ByteCounter(world)
    counter.install()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    base = rss_mib()
    if args.meta:  # as FSDP2's users build a large model: no storage until each rank's shards exist
        with torch.device("meta"):
            model = torch_ddp.TinyGpt(args.vocab, args.block, args.dim, args.heads, args.layers, args.seed, init=False)
    else:
        model = torch_ddp.TinyGpt(args.vocab, args.block, args.dim, args.heads, args.layers, args.seed)
    param_count = sum(p.numel() for p in model.parameters())
    raf = args.reshard_after_forward == "true"
    kw = {}
    if args.mesh:  # HSDP: dim 0 replicates, dim 1 shards (rank = row * S + column, as shardlab's Mesh)
        from torch.distributed.device_mesh import init_device_mesh
        replicas, shards = (int(x) for x in args.mesh.split("x"))
        kw["mesh"] = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=raf, **kw)
    fully_shard(model, **kw)  # the root: FSDP2 does not reshard the root after forward (used again first in backward)
    if args.meta:
        model.to_empty(device="cpu")  # each rank's shards only
        init_sharded(model, args.seed)
    built = peak_mib()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    step_ms, payload, sent, loss = [], [], [], None
    for step in range(args.warmup + args.steps):
        tokens, target = torch_ddp.batch_for(step, args, rank, world)
        counter.reset()
        start = time.perf_counter()
        opt.zero_grad()
        loss = model(tokens, target)
        loss.backward()
        opt.step()
        elapsed = time.perf_counter() - start
        if step + 1 == args.warmup:
            run_peak = peak_mib()
            reset_peak()  # the steady peak: over the timed steps
        if step >= args.warmup:
            step_ms.append(elapsed * 1e3)
            payload.append(counter.payload)
            sent.append(counter.sent)
    calls = dict(counter.calls)

    steady = peak_mib()
    if args.warmup == 0:
        run_peak = steady
    memory = [None] * world
    dist.all_gather_object(memory, {"base": base, "construction": built, "run_peak": max(run_peak, steady),
                                    "steady_peak": steady})
    final = loss.detach().clone()
    dist.all_reduce(final)
    if rank == 0:
        result = {
            "framework": "pytorch-fsdp2",
            "torch_version": torch.__version__,
            "world_size": world,
            "reshard_after_forward": raf,
            "mesh": args.mesh or "",
            "steps": args.steps,
            "global_batch": args.global_batch,
            "threads": args.threads,
            "param_count": param_count,
            "median_step_ms": statistics.median(step_ms),
            "step_ms": step_ms,
            "payload_bytes_per_step": statistics.median(payload),
            "sent_bytes_per_step": statistics.median(sent),
            "collectives_per_step": calls,
            "final_loss": final.item() / world,
            "built_on_meta": args.meta,
            # Per rank, MiB of resident memory (VmHWM): the process before the model, its peak by the end of
            # construction, over the whole run, and over the timed steps (reset after warm-up).
            "base_rss_mib": [m["base"] for m in memory],
            "construction_rss_mib": [m["construction"] for m in memory],
            "run_peak_rss_mib": [m["run_peak"] for m in memory],
            "peak_rss_mib": [m["steady_peak"] for m in memory],
        }
        print(f"pytorch-fsdp2 world {world} raf {raf}: median step {result['median_step_ms']:.2f} ms, "
              f"payload {result['payload_bytes_per_step']} B/step, collectives {calls}")
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f, indent=2)
            os.replace(tmp, args.json)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
