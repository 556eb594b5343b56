"""Reusable host buffers for KV hand-offs.

Memory a process has not touched yet costs a page fault per 4 KiB page on its first write, and glibc
maps every allocation over 32 MiB afresh and unmaps it on free.  A KV frame of a long prompt (100 MB
for 4,096 tokens of llama-80m in float32, far more for real models) so pays ~0.3-0.6 ms per MB on a
VM for every new tensor, more than copying the bytes.  The workers keep the tensors of past hand-offs
here and hand them out again.
"""

from __future__ import annotations

import threading

import torch


class HostBuffers:
    """A bounded cache of CPU byte buffers; thread-safe.

    :meth:`take` returns a uint8 tensor of exactly ``nbytes``: a view of the smallest cached buffer
    that is large enough (removed from the cache), else a new one.  :meth:`give` puts a tensor's whole
    storage back; only give what nobody reads or writes any more.  At most ``max_buffers`` buffers
    and ``max_bytes`` bytes stay cached (the largest are dropped first); requests under
    ``min_bytes`` bypass the cache, the allocator reuses such small blocks well by itself.
    """

    def __init__(self, max_bytes: int = 1 << 30, max_buffers: int = 4, min_bytes: int = 1 << 20) -> None:
        self.max_bytes, self.max_buffers, self.min_bytes = max_bytes, max_buffers, min_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.reused = 0  # takes served from the cache

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes >= self.min_bytes:
            with self._lock:
                for i, buf in enumerate(self._free):  # sorted by size: the first that fits is the smallest
                    if buf.numel() >= nbytes:
                        del self._free[i]
                        self.reused += 1
                        return buf[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if tensor.device.type != "cpu" or storage.nbytes() < self.min_bytes or storage.nbytes() > self.max_bytes:
            return
        buf = torch.empty(0, dtype=torch.uint8).set_(storage)
        with self._lock:
            if any(b.untyped_storage().data_ptr() == storage.data_ptr() for b in self._free):
                return  # already cached
            self._free.append(buf)
            self._free.sort(key=torch.Tensor.numel)
            while len(self._free) > self.max_buffers or sum(b.numel() for b in self._free) > self.max_bytes:
                self._free.pop()
