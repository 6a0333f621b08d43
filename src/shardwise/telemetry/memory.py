"""Memory per rank: the device's peak over each log window, and the activations of one step.

- GPU: `torch.cuda.max_memory_allocated` / `max_memory_reserved`, reset after every read, so each
  step event reports the peak of its own window (`peak_during`, which measures a checkpoint's
  staging, resets them too and hands the window's peak so far back to the next read).
- CPU: the process's peak resident set since it started (`VmHWM` of /proc/self/status; not
  `getrusage`'s ru_maxrss, which Linux carries over exec from the parent: a worker spawned from a
  500 MB launcher reported 500 MB with 15 MB resident) and the current RSS from /proc/self/statm;
  ru_maxrss only where /proc is missing. The trainer also records the RSS just before the model is
  built (the `memory` event's `rss_before_model_bytes_per_rank`), so the increment a run's model,
  optimizer and activations explain is peak minus that.
- Parameters, gradients and optimizer state come from `parallel.accounting.ModelStateMeter`.
- Activations: `ActivationSampler` counts, on one training step, the bytes autograd keeps for
  backward (`torch.autograd.graph.saved_tensors_hooks`), at their peak: the most bytes saved and
  not yet released at any moment. Each storage counts once (views and repeated saves of a tensor
  share it), and the weights of the module running (a saved Linear weight, FSDP's unsharded
  copy) are not activations and are left out. Inside activation-checkpointed blocks
  `torch.utils.checkpoint` installs its own hooks and keeps only the block inputs — which is
  exactly the memory checkpointing leaves, so that is what is counted.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# Peaks (allocated, reserved) of the current window that `peak_during` reset away to measure a
# part of it, by CUDA device index: `device_memory` folds them back in.
_CARRIED: dict[int, tuple[int, int]] = {}


def device_memory(device: torch.device) -> dict[str, int]:
    """This rank's memory over the window since the last call: `peak_mem_bytes`, plus
    `peak_reserved_bytes` (GPU) or `rss_bytes` (CPU, current)."""
    if device.type == "cuda":
        carried = _CARRIED.pop(_index(device), (0, 0))
        out = {"peak_mem_bytes": max(int(torch.cuda.max_memory_allocated(device)), carried[0]),
               "peak_reserved_bytes": max(int(torch.cuda.max_memory_reserved(device)), carried[1])}
        torch.cuda.reset_peak_memory_stats(device)
        return out
    rss = current_rss_bytes()
    # the kernel updates the high-water mark lazily (the current RSS can be a few pages above it)
    return {"peak_mem_bytes": max(peak_rss_bytes(), rss), "rss_bytes": rss}


@dataclass
class PeakReading:
    """Filled in when a `peak_during` block ends; None off CUDA."""

    bytes: int | None = None


@contextlib.contextmanager
def peak_during(device: torch.device | None) -> Iterator[PeakReading]:
    """The peak of `torch.cuda.max_memory_allocated` on a CUDA `device` during the block (the
    checkpoint event's `device_peak_bytes`). Measuring needs a reset of the device's peak
    counters, so the window's peak so far is first recorded and `device_memory` reports the max
    of it and the counters: the step events' per-window peak is the same as without the reset."""
    reading = PeakReading()
    if device is None or device.type != "cuda":
        yield reading
        return
    index = _index(device)
    held = _CARRIED.get(index, (0, 0))
    _CARRIED[index] = (max(held[0], int(torch.cuda.max_memory_allocated(device))),
                       max(held[1], int(torch.cuda.max_memory_reserved(device))))
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield reading
    finally:
        reading.bytes = int(torch.cuda.max_memory_allocated(device))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def peak_rss_bytes() -> int:
    """Peak resident set of this process: VmHWM (this process's own memory map, so not inherited
    from whatever started it), else ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of the storage behind `t` (a DTensor's local shard)."""
    if isinstance(t, DTensor):
        t = t._local_tensor  # not to_local(): that is an autograd op, and this runs in a pack hook
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return id(t), t.numel() * t.element_size()


_OPEN: ActivationSampler | None = None  # the sampler whose hooks are pushed now, if any


class _Held:
    """What autograd keeps instead of the tensor while sampling; releasing it releases the bytes."""

    __slots__ = ("key", "sampler", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, sampler: ActivationSampler) -> None:
        self.tensor, self.key, self.sampler = tensor, key, sampler

    def __del__(self) -> None:
        self.sampler._release(self.key)


class ActivationSampler:
    """Peak bytes saved for backward during one training step of `parts`.

    Armed once: the first forward with gradients opens the window (pushes the saved-tensor hooks),
    the first optimizer step closes it, so the loss and every micro-batch of the step are inside.
    Afterwards the hooks are gone and `peak_bytes` holds the sample.
    """

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._live: dict[int, tuple[int, int]] = {}  # storage key -> (references, bytes)
        self._live_bytes = 0
        self._peak = 0
        self._weights: Counter[int] = Counter()  # storages of modules now running forward
        self._context: Any = None
        self._module_handles: list[Any] = []
        self._step_handles: list[Any] = []
        self._open = False

    def arm(self, parts: Iterable[nn.Module], optimizers: Iterable[Any]) -> None:
        handles = self._module_handles
        for part in parts:
            handles.append(part.register_forward_pre_hook(self._maybe_open))
            for module in part.modules():
                if next(module.parameters(recurse=False), None) is not None:
                    handles.append(module.register_forward_pre_hook(self._enter_module))
                    handles.append(module.register_forward_hook(self._leave_module,
                                                                always_call=True))
        for o in optimizers:
            self._step_handles.append(
                getattr(o, "optimizer", o).register_step_pre_hook(self._close))

    # --- window ------------------------------------------------------------------------------
    def _maybe_open(self, module: nn.Module, args: Any) -> None:
        global _OPEN
        if self._open or self.peak_bytes is not None or not torch.is_grad_enabled():
            return
        if _OPEN is not None:  # a step that raised left its window open: close it first
            _OPEN._close()
        _OPEN = self
        self._open = True
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()

    def _close(self, *_args: Any) -> None:
        global _OPEN
        if _OPEN is self:
            _OPEN = None
        if self._open:
            self._context.__exit__(None, None, None)
            self._open, self._context = False, None
            self.peak_bytes = self._peak
            self._remove(self._module_handles)
        # The optimizer hooks stay until `disarm`: an optimizer must not lose a hook while it
        # runs them (they are a no-op from now on).

    def disarm(self) -> None:
        """Remove every hook (call outside the optimizer step)."""
        self._remove(self._module_handles)
        self._remove(self._step_handles)

    @staticmethod
    def _remove(handles: list[Any]) -> None:
        for h in handles:
            h.remove()
        handles.clear()

    # --- which storages are weights ------------------------------------------------------------
    def _module_storages(self, module: nn.Module) -> list[int]:
        return [_storage(p)[0] for p in module.parameters(recurse=False)]

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        if self._open:
            self._weights.update(self._module_storages(module))

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._open:
            self._weights.subtract(self._module_storages(module))
            self._weights = +self._weights  # drop zero counts

    # --- saved-tensor hooks --------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        if not self._open:
            return t
        key, nbytes = _storage(t)
        if key in self._weights:
            return t
        refs, _ = self._live.get(key, (0, nbytes))
        if refs == 0:
            self._live_bytes += nbytes
            self._peak = max(self._peak, self._live_bytes)
        self._live[key] = (refs + 1, nbytes)
        return _Held(t, key, self)

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: int) -> None:
        refs, nbytes = self._live.get(key, (0, 0))
        if refs == 1:
            del self._live[key]
            self._live_bytes -= nbytes
        elif refs > 1:
            self._live[key] = (refs - 1, nbytes)
