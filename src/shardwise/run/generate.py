"""Sample text from the trained model so a person can see what it learned.

Every rank runs the same forward passes (a sharded model needs all ranks to gather its weights);
rank 0 draws each token and broadcasts it, so all ranks extend the same sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.parallel.distributed import DistContext
from shardwise.run.step import autocast


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: list[int], *, new_tokens: int, seq_len: int,
             temperature: float, top_k: int, seed: int, precision: str,
             ctx: DistContext) -> list[int]:
    model.eval()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.tensor([prompt_ids or [0]], dtype=torch.long, device=ctx.device)
    for _ in range(new_tokens):
        with autocast(precision, ctx.device):
            logits = model(ids[:, -seq_len:])[0, -1].float().cpu()
        logits = logits / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        token = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).to(ctx.device)
        if ctx.distributed:
            dist.broadcast(token, src=0)
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
    model.train()
    return ids[0, len(prompt_ids or [0]):].tolist()
