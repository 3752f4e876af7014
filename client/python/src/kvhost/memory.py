"""Host memory the daemon can map: memfd-backed buffers, and torch tensors
over them when torch is importable. No numpy needed."""

import mmap
import os
import uuid as _uuid
import warnings


def seal_shrink(fd):
    """Adds F_SEAL_SHRINK to a memfd (the daemon requires it). A descriptor
    that cannot be sealed raises ValueError saying what to use instead."""
    import errno
    import fcntl
    F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
    F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
    F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 2)
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as e:
        if e.errno == errno.EINVAL:  # a file system without seals
            raise ValueError(f"descriptor {fd} is not a memfd and cannot be sealed against shrinking: "
                             "register_memfd takes a memfd (HostBuffer makes one), register_shared_file "
                             "a file on a memory file system such as /dev/shm") from None
        raise OSError(e.errno, f"{e.strerror}: descriptor {fd}") from None
    if seals & F_SEAL_SHRINK:
        return
    try:
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)
    except PermissionError:
        raise ValueError(f"descriptor {fd} cannot be sealed against shrinking (a memfd made without "
                         "MFD_ALLOW_SEALING, or a file on a memory file system): make the memfd with "
                         "MFD_ALLOW_SEALING (HostBuffer does), or register it unsealed with "
                         "register_shared_file") from None


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
            self.fd = -1  # not closed again (__del__): the number may be another file's by then
            raise
        self.size = size
        self.view = memoryview(self.mmap)

    def close(self):
        """Unmaps and closes the memfd (after the daemon is done with it).
        While something else holds the mapping (a slice of .view, a tensor
        or memoryview over .mmap, an array over .view) it raises BufferError
        and the buffer stays open, .view a new memoryview of it: close it
        again once that is released or gone."""
        if self.fd < 0:
            return
        released = False
        try:
            # Whether another export of the mapping is left shows only once
            # .view is released: the mmap refuses to close then.
            self.view.release()
            released = True
            self.mmap.close()
        except BufferError:
            if released:
                self.view = memoryview(self.mmap)
            raise BufferError("HostBuffer.close: something still holds the mapping (a slice of .view, a "
                              "tensor or memoryview over .mmap, an array over .view): release or drop it, "
                              "then close again; the buffer stays open meanwhile") from None
        os.close(self.fd)
        self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Dropped unclosed: the memfd is closed, with a ResourceWarning as
        # for a file; the mapping goes with its own last reference (a
        # tensor over it keeps working). The daemon's registration holds
        # a descriptor of its own.
        fd = getattr(self, "fd", -1)
        if fd >= 0:
            self.fd = -1
            warnings.warn(f"unclosed kvhost.HostBuffer (memfd {fd})", ResourceWarning, source=self)
            os.close(fd)


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
    block as shared: torch keeps it allocated while the tensor lives (and,
    since the daemon never releases torch's IPC reference counter, until
    the process exits).

    The handle is either the bare 64-byte cudaIpcMemHandle_t (older torch)
    or torch's versioned form (torch 2.11 writes it, 66 bytes): a version
    byte (2 or 3; both carry the same payload for plain blocks), a type byte
    ('c': a cudaMalloc block, followed by the 64-byte cudaIpcMemHandle_t;
    'e': an expandable segment), then the payload. Expandable segments
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) have no
    cudaIpcMemHandle_t and are refused with ValueError, as are versions
    this client does not know."""
    if not getattr(tensor, "is_cuda", False):
        raise ValueError("not a CUDA tensor: register host memory with HostBuffer or register_shared_file")
    info = tensor.untyped_storage()._share_cuda_()
    if len(info) < 4:
        raise ValueError(f"_share_cuda_() returned {len(info)} fields, want at least 4 (torch 2.x)")
    device, handle, size, offset = info[0], info[1], info[2], info[3]
    if size <= 0:
        raise ValueError("the tensor's storage is empty")
    return int(device), ipc_mem_handle(handle), int(offset), int(size)


IPC_HANDLE_SIZE = 64
_KNOWN_HANDLE_VERSIONS = (2, 3)


def ipc_mem_handle(handle):
    """The 64-byte cudaIpcMemHandle_t inside a torch storage handle (see
    cuda_ipc_handle); ValueError for what has none."""
    if not isinstance(handle, (bytes, bytearray)):
        raise ValueError(f"the tensor's IPC handle is a {type(handle).__name__}, not bytes")
    handle = bytes(handle)
    if len(handle) == IPC_HANDLE_SIZE:
        return handle
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise ValueError("the tensor lives in an expandable segment, which has no cudaIpcMemHandle_t: "
                         "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False in the process that allocates it")
    if len(handle) != IPC_HANDLE_SIZE + 2 or handle[1:2] != b"c":
        raise ValueError(f"unknown torch IPC handle of {len(handle)} bytes (type byte {handle[1:2]!r})")
    if handle[0] not in _KNOWN_HANDLE_VERSIONS:
        raise ValueError(f"torch IPC handle version {handle[0]}: this client knows versions "
                         f"{', '.join(map(str, _KNOWN_HANDLE_VERSIONS))}")
    return handle[2:]


def device_uuid(tensor):
    """The 16-byte UUID of the GPU a torch CUDA tensor lives on (what
    nvidia-smi prints as GPU-<uuid>), or None where torch cannot say. It
    names the same GPU in every process, whatever CUDA_VISIBLE_DEVICES does
    to its index."""
    try:
        import torch
        return _uuid.UUID(str(torch.cuda.get_device_properties(tensor.device).uuid)).bytes
    except Exception:  # no torch, no CUDA, or a torch without uuid
        return None


def uuid_text(b):
    """A 16-byte GPU UUID as nvidia-smi prints it."""
    return "GPU-" + str(_uuid.UUID(bytes=bytes(b)))


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
