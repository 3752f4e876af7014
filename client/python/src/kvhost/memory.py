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
    """Returns (device index, 64-byte IPC handle, offset, size) of a torch
    CUDA tensor's storage, from tensor.untyped_storage()._share_cuda_().

    In torch 2.x _share_cuda_() returns an 8-tuple: (device, handle,
    storage size in bytes, storage offset in bytes, ref-counter handle,
    ref-counter offset, event handle, event sync required). The handle names
    the base of the caching allocator's block (cudaIpcGetMemHandle of it);
    the storage lies at the offset within that block. Sharing marks the
    block as shared: torch keeps it allocated while the tensor lives.
    Expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
    produce a handle that is not a cudaIpcMemHandle_t: they are refused
    here with ValueError."""
    if not getattr(tensor, "is_cuda", False):
        raise ValueError("not a CUDA tensor: register host memory with HostBuffer or register_shared_file")
    info = tensor.untyped_storage()._share_cuda_()
    if len(info) < 4:
        raise ValueError(f"_share_cuda_() returned {len(info)} fields, want at least 4 (torch 2.x)")
    device, handle, size, offset = info[0], info[1], info[2], info[3]
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != 64:
        n = len(handle) if isinstance(handle, (bytes, bytearray)) else type(handle).__name__
        raise ValueError(f"the tensor's IPC handle is {n} bytes, not a 64-byte cudaIpcMemHandle_t "
                         "(expandable segments? set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)")
    if size <= 0:
        raise ValueError("the tensor's storage is empty")
    return int(device), bytes(handle), int(offset), int(size)


def daemon_device(index):
    """The daemon's ordinal of this process's CUDA device index: the index
    translated through CUDA_VISIBLE_DEVICES when that lists integers, else
    the index itself. Devices named by UUID cannot be translated here: pass
    device= to Client.register_cuda_tensor."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() == "":
        return index
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(ids):
        raise ValueError(f"device {index} is not in CUDA_VISIBLE_DEVICES={visible}")
    try:
        return int(ids[index])
    except ValueError:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible} names devices by UUID: "
                         "pass device= (the daemon's ordinal) to register_cuda_tensor") from None
