#!/usr/bin/python3
"""PyTorch DistributedDataParallel baseline for the shardlab benchmark.

Trains torch.nn.parallel.DistributedDataParallel (Gloo backend, CPU) on a Python copy of shardlab's C++ `tiny_gpt`
model (common/course/src/models.cpp) and times every optimizer step, so the shardlab C++ benchmark can print
shardlab/PyTorch step-time ratios for the same model, global batch, world size and bucket sizes.

Run it as N ranks the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the
environment), e.g. with the project's launcher. It needs Debian's python3-torch 1.13, i.e. /usr/bin/python3:

    build/default/bin/shardlab-run -n 2 -- /usr/bin/python3 tools/bench/torch_ddp.py --json out.json

Rank 0 writes the results to --json (FILE.tmp, then renamed onto FILE). `--print-params` prints the parameters in
registration order (a tied weight once, under its first name, as PyTorch lists it) and exits; it needs no launcher, so it can be compared with the C++ model's named_parameters().

What is timed: zero_grad + forward + backward (DDP all-reduces the gradients during it) + optimizer step, with
time.perf_counter() around each step. The step's batch is drawn just before the timer starts.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# The C++ default vocabulary is the number of distinct characters (bytes) of the shipped corpus.
CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "common", "data", "tiny_corpus.txt")
CORPUS_VOCAB_FALLBACK = 67  # its value for the corpus shipped when this was written


def corpus_vocab_size():
    try:
        with open(CORPUS, "rb") as f:
            return len(set(f.read()))
    except OSError:
        return CORPUS_VOCAB_FALLBACK


# ---- the model: same modules, registration order, shapes and forward computation as shardlab::TinyGpt -------------


class GptBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)) (shardlab::GptBlock)."""

    def __init__(self, dim, heads):
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"dim ({dim}) must divide by heads ({heads})")
        self.heads = heads
        # Attribute order = registration order = parameter order, as in the C++ constructor.
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        hd = D // self.heads
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        q, k, v = (t.reshape(B, T, self.heads, hd).transpose(1, 2) for t in (q, k, v))
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = torch.softmax(att.masked_fill(future, float("-inf")), -1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(B, T, D)
        h = x + self.proj(y)
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class TinyGpt(nn.Module):
    """Token + position embeddings, `layers` blocks, final LayerNorm, output tied to wte, also named lm_head.weight
    (shardlab::TinyGpt)."""

    def __init__(self, vocab, block, dim, heads, layers, seed, init=True):
        super().__init__()
        self.block = block
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        for i in range(layers):
            self.add_module(f"block{i}", GptBlock(dim, heads))
        self.blocks = [getattr(self, f"block{i}") for i in range(layers)]  # plain list: registers nothing
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Module()  # wte's second name, as in Hugging Face's GPT-2 (and shardlab's tiny GPT)
        self.lm_head.register_parameter("weight", self.wte.weight)
        if init:  # not on the meta device (torch_fsdp.py --meta initializes after sharding)
            self._init(seed)

    @torch.no_grad()
    def _init(self, seed):
        # The same rule as shardlab::init_parameters (values differ: a different generator); only speed matters here.
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.size(1)), generator=gen)
            elif name.endswith("bias"):
                p.zero_()
            else:  # LayerNorm gain
                p.fill_(1.0)

    def forward(self, tokens, target):
        """Mean next-token cross-entropy over all B*T positions."""
        T = tokens.size(1)
        if T > self.block:
            raise ValueError(f"sequence length {T} exceeds block {self.block}")
        x = self.wte(tokens) + self.wpe(torch.arange(T, dtype=torch.long))
        for b in self.blocks:
            x = b(x)
        logits = torch.matmul(self.ln_f(x), self.wte.weight.t())  # weight tying: wte used twice
        return F.nll_loss(F.log_softmax(logits.reshape(-1, logits.size(-1)), -1), target.reshape(-1))


# ---- command line ---------------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description="PyTorch DDP (gloo, CPU) baseline on shardlab's tiny_gpt model.")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--global-batch", type=int, default=16, help="examples per step over all ranks (default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)")
    p.add_argument("--bucket-cap-kb", type=int, default=25600, help="DDP bucket cap in KiB (default 25600 = 25 MiB)")
    p.add_argument("--first-bucket-kb", type=int, default=1024, help="DDP first bucket cap in KiB (default 1024)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--seed", type=int, default=1, help="model and data seed (default 1)")
    p.add_argument("--timeout", type=float, default=300, help="process group timeout in seconds (default 300)")
    p.add_argument("--json", metavar="FILE", help="rank 0 writes the results here")
    p.add_argument("--print-params", action="store_true", help="print the parameter list and exit")
    g = p.add_argument_group("model shape (defaults: shardlab's tiny_gpt)")
    g.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: distinct corpus characters)")
    g.add_argument("--block", type=int, default=32, help="context length (default 32)")
    g.add_argument("--dim", type=int, default=32, help="embedding width (default 32)")
    g.add_argument("--heads", type=int, default=2, help="attention heads (default 2)")
    g.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4, as shardlab)")
    a = p.parse_args(argv)
    if a.vocab is None:
        a.vocab = corpus_vocab_size()
    for name in ("steps", "global_batch", "bucket_cap_kb", "first_bucket_kb", "threads",
                 "vocab", "block", "dim", "heads", "layers"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(a, name)}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0; got {a.warmup}")
    if a.lr <= 0 or a.timeout <= 0:
        p.error("--lr and --timeout must be > 0")
    if a.dim % a.heads != 0:
        p.error(f"--dim ({a.dim}) must divide by --heads ({a.heads})")
    return a


def env_int(name):
    value = os.environ.get(name)
    if value is None:
        sys.exit(f"torch_ddp.py: {name} is not set; launch it with shardlab-run or torchrun "
                 "(or use --print-params, which needs no launcher)")
    return int(value)


def batch_for(step, args, rank, world):
    """This rank's slice of the global batch of `step`: input [B/W, block] and its shift-by-one target."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    seq = torch.randint(0, args.vocab, (args.global_batch, args.block + 1), generator=gen)
    per_rank = args.global_batch // world
    mine = seq[rank * per_rank:(rank + 1) * per_rank]
    return mine[:, :-1], mine[:, 1:]


def write_json(path, result):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def num_buckets(ddp_model):
    """Number of gradient buckets after DDP's rebuild (it rebuilds once, at the start of the second forward)."""
    # 1.13's logging data holds the bucket sizes in bytes as a string "a, b, c": "bucket_sizes" for the first
    # iteration (one bucket of everything when find_unused_parameters=False), "rebuilt_bucket_sizes" after it.
    try:
        data = ddp_model._get_ddp_logging_data()
    except Exception:  # a private API: leave the field out rather than fail the benchmark
        return None
    sizes = data.get("rebuilt_bucket_sizes") if data.get("has_rebuilt_buckets") else data.get("bucket_sizes")
    return len(str(sizes).split(",")) if sizes else None


def main(argv):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = TinyGpt(args.vocab, args.block, args.dim, args.heads, args.layers, args.seed)
    params = list(model.named_parameters())

    if args.print_params:
        for name, p in params:
            print(f"{name} {list(p.shape)}")
        print(f"total {sum(p.numel() for _, p in params)} parameters in {len(params)} tensors")
        return 0

    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    if args.global_batch % world != 0:
        sys.exit(f"torch_ddp.py: global batch {args.global_batch} does not divide by world size {world}; "
                 "choose a global batch that is a multiple of it")
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))

    # DDP 1.13 reads the first-bucket cap from the module attribute torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
    # when it is constructed (and hands it to the Reducer), so setting the attribute first is enough.
    dist._DEFAULT_FIRST_BUCKET_BYTES = args.first_bucket_kb * 1024
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_kb / 1024)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    step_ms, loss = [], None
    for step in range(args.warmup + args.steps):
        tokens, target = batch_for(step, args, rank, world)
        start = time.perf_counter()
        opt.zero_grad()
        loss = ddp(tokens, target)
        loss.backward()
        opt.step()
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            step_ms.append(elapsed * 1e3)

    # Final loss: the last step's loss averaged over ranks (= the global batch's loss, the slices being equal).
    final = loss.detach().clone()
    dist.all_reduce(final)
    final_loss = final.item() / world

    if rank == 0:
        result = {
            "framework": "pytorch-ddp",
            "torch_version": torch.__version__,
            "world_size": world,
            "steps": args.steps,
            "warmup": args.warmup,
            "global_batch": args.global_batch,
            "bucket_cap_kb": args.bucket_cap_kb,
            "first_bucket_kb": args.first_bucket_kb,
            "threads": args.threads,
            "param_count": sum(p.numel() for _, p in params),
            "param_bytes": sum(p.numel() * p.element_size() for _, p in params),
            "step_ms": step_ms,
            "median_step_ms": statistics.median(step_ms),
            "final_loss": final_loss,
        }
        buckets = num_buckets(ddp)
        if buckets is not None:
            result["num_buckets"] = buckets
        print(f"pytorch-ddp world {world} batch {args.global_batch}: median step {result['median_step_ms']:.3f} ms "
              f"over {args.steps} steps, final loss {final_loss:.4f}, buckets {buckets}")
        if args.json:
            write_json(args.json, result)

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
