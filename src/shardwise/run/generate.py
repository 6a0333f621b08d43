"""Sample text from the trained model so a person can see what it learned.

Every rank runs the same forward passes (sharded weights need every rank); one rank that holds the
final logits draws each token, and an all-reduce hands it to all, so all extend the same sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.parallel.parallelize import ParallelModel


@torch.no_grad()
def generate(pm: ParallelModel, prompt_ids: list[int], *, new_tokens: int, seq_len: int,
             temperature: float, top_k: int, seed: int) -> list[int]:
    pm.eval()
    ctx = pm.ctx
    # (cp ranks each run the whole window: the model's own attention outside training)
    drawer = pm.holds_last_stage and pm.tp_rank == 0 and ctx.dp_rank == 0 and pm.cp_rank == 0
    gen = torch.Generator(device="cpu").manual_seed(seed)
    prompt = prompt_ids or [0]
    ids = torch.tensor([prompt], dtype=torch.long, device=ctx.device)
    # Sequence parallel splits the sequence evenly over tp ranks: pad the window on the right to
    # a multiple of tp. Causal attention keeps the real positions blind to the padding.
    multiple = pm.ctx.dims.tp if pm.ctx.mesh is not None and pm.sequence_parallel else 1
    for _ in range(new_tokens):
        window = ids[:, -seq_len:]
        n = window.shape[1]
        if n % multiple:
            pad = torch.zeros(1, multiple - n % multiple, dtype=torch.long, device=ctx.device)
            window = torch.cat([window, pad], dim=1)
        logits = pm.logits(window)
        token = torch.zeros(1, dtype=torch.long, device=ctx.device)
        if drawer:
            last = logits[0, n - 1].float().cpu() / temperature
            if top_k:
                kth = torch.topk(last, min(top_k, last.numel())).values[-1]
                last = last.masked_fill(last < kth, float("-inf"))
            # drawn on the CPU with a CPU generator: the same token on every device type
            token = torch.multinomial(torch.softmax(last, -1), 1, generator=gen).to(ctx.device)
        if ctx.distributed:
            dist.all_reduce(token)  # only the drawer's value is non-zero
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
    pm.train()
    return ids[0, len(prompt):].tolist()
