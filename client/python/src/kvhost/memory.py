"""Host memory the daemon can map: memfd-backed buffers, and torch tensors
over them when torch is importable. No numpy needed."""

import mmap
import os

from .client import seal_shrink


class HostBuffer:
    """size bytes of shared memory: a sealed memfd, mapped here. Register it
    with Client.register_buffer; read and write it through .view (a
    memoryview) or .mmap."""

    def __init__(self, size, name="kvhost"):
        if size <= 0:
            raise ValueError(f"size {size}: want > 0")
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        self.fd = os.memfd_create(name, flags)
        try:
            os.ftruncate(self.fd, size)
            seal_shrink(self.fd)
            self.mmap = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.view = memoryview(self.mmap)

    def close(self):
        """Unmaps and closes the memfd (after the daemon is done with it)."""
        if self.fd < 0:
            return
        self.view.release()
        self.mmap.close()
        os.close(self.fd)
        self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def torch_host_tensor(shape, dtype, name="kvhost"):
    """Returns (tensor, HostBuffer): a CPU torch tensor of shape and dtype
    whose storage is a memfd the daemon can map. Requires torch."""
    import torch  # imported lazily: torch is optional

    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = HostBuffer(max(1, numel * itemsize), name)
    t = torch.frombuffer(buf.mmap, dtype=dtype, count=numel).view(*shape)
    return t, buf


def cuda_ipc_handle(tensor):
    """Reserved: CUDA tensors are registered by IPC handle once the daemon
    supports GPU memory (Client.register_cuda raises UnsupportedError on a
    daemon without it)."""
    raise NotImplementedError("CUDA IPC registration is not wired up yet; use torch_host_tensor")
