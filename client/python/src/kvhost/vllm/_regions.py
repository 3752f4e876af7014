"""A worker's KV-cache memory registered with the daemon, shared by the
spec's workers and the connector's: a CUDA tensor by CUDA IPC, host
memory by the shared-memory file behind its mapping (a memfd or a
/dev/shm file), each storage once per connection (region_of).

Importing this module imports nothing of vLLM (nor torch).
"""

import os

from ._common import mapping_of as _mapping_of, open_mapped as _open_mapped


def region_of(client, regions, t):
    """(region id, offset of t's storage in it) of tensor t's storage on
    client, registered once: regions maps a storage's address to it."""
    st = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    addr = st.data_ptr()
    if addr in regions:
        return regions[addr]
    if getattr(t, "is_cuda", False):
        reg = (client.register_cuda_tensor(t), 0)
    else:
        reg = register_host(client, addr, st.nbytes())
    regions[addr] = reg
    return reg


def host_mapping(addr, size):
    """The shared-memory file mapping (mapping_of) that holds host
    memory [addr, addr+size); ValueError where it is none."""
    m = _mapping_of(addr, size)
    if m is None:
        raise ValueError("kvhost.vllm: a host KV-cache tensor is not one file mapping: allocate it in "
                         "shared memory (kvhost.torch_host_tensor) to use it with the daemon")
    path = m[3]
    if not path.startswith("/"):
        raise ValueError(f"kvhost.vllm: a host KV-cache tensor lies in private memory ({path or 'anonymous'}): "
                         "allocate it in shared memory (kvhost.torch_host_tensor, a memfd or a /dev/shm "
                         "file) to use it with the daemon")
    return m


def register_host(client, addr, size):
    """Host memory: the shared-memory file behind the mapping (a memfd or a
    /dev/shm file), registered unsealed."""
    lo, hi, off, path = host_mapping(addr, size)
    fd = _open_mapped(lo, hi, path)
    try:
        file_off = off + (addr - lo)
        region = client.register_shared_file(fd, file_off + size)
    finally:
        os.close(fd)
    return region, file_off
