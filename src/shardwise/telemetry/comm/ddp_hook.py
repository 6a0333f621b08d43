"""DDP's gradient all-reduce, issued where the comm tap sees it.

DDP's reducer calls the process group from C++, past the tap's wrappers of `torch.distributed`, so
DDP is given a comm hook (`ddp_comm_hook`) that issues its bucket all-reduce through the wrapped
`all_reduce` (a sum: shardwise normalises the loss by the global token count, so nothing is
divided by the ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def ddp_comm_hook(group: dist.ProcessGroup | None) -> Callable:
    """DDP's all-reduce of each gradient bucket as a plain sum (shardwise divides the loss by the
    step's global token count, so no rank count is divided out), issued through
    `torch.distributed.all_reduce` so the tap sees the bytes DDP's C++ reducer sends."""

    def hook(state: Any, bucket: Any) -> torch.futures.Future:
        buffer = bucket.buffer()
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    # DDP checks the annotations as objects; `from __future__ import annotations` made strings.
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    return hook
