"""A DDP job with a GPT-like model, for the overhead benchmark (benchmarks/run_overhead.py): no
ranktrace in it; it prints its own step times (`step_time_s S`, wall clock, synchronised on GPU)
so that runs with and without `ranktrace run` are measured alike.

    torchrun --nproc-per-node N jobs_gpt.py [--width 2048 --layers 16 --seq 1024 --batch 8]
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        seq = tokens.shape[1]
        mask = torch.triu(torch.full((seq, seq), float("-inf"), device=tokens.device), 1)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.layers, args.heads).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    if dist.get_rank() == 0:
        print(f"params {sum(p.numel() for p in model.parameters())}", flush=True)
    for _ in range(args.steps):
        start = time.perf_counter()
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
        with torch.autocast(device.type if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            logits = ddp(tokens[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.float().flatten(0, 1), tokens[:, 1:].flatten()
            )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if dist.get_rank() == 0:
            print(f"step_time_s {time.perf_counter() - start:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
