"""End-to-end check on the GPU test machine: a Python worker with vLLM-shaped
torch KV-cache tensors in host memory (memfd, kvhost.torch_host_tensor)
stores blocks through a running kvhost daemon, loads them into other blocks,
and compares; then copies loaded blocks to the GPU and back. Prints
throughput of whole store/load jobs as the Python client sees them.

usage: python3 scripts/device-torch-check.py SOCKET [KEYS]
"""
import sys
import time

import torch

sys.path.insert(0, "client/python/src")
import kvhost  # noqa: E402

sock = sys.argv[1]
keys_per_job = int(sys.argv[2]) if len(sys.argv) > 2 else 32
layers, heads, head, tpb, tpk = 32, 8, 128, 16, 256  # Llama-3.1-8B bf16
bpk = tpk // tpb
num_blocks = 2 * keys_per_job * bpk

# One tensor per layer, vLLM's FlashAttention layout [2, num_blocks, 16, 8, 128].
tensors, bufs = [], []
for _ in range(layers):
    t, b = kvhost.torch_host_tensor((2, num_blocks, tpb, heads, head), torch.bfloat16)
    tensors.append(t)
    bufs.append(b)

with kvhost.Client(sock, name="torch-check") as c:
    ns = c.declare(kvhost.Geometry(model="meta-llama/Llama-3.1-8B", layers=layers, kv_heads=heads,
                                   head_size=head, dtype_size=2, tokens_per_block=tpb, tokens_per_key=tpk))
    bb = ns.block_bytes
    layer_specs = []
    for b in bufs:
        region = c.register_buffer(b)
        layer_specs.append(kvhost.Layer(region, offset=0, block_stride=bb, plane_stride=num_blocks * bb,
                                        num_blocks=num_blocks))
    cache = c.register_cache(ns.id, layer_specs)

    g = torch.Generator().manual_seed(1)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(torch.bfloat16))
    perm = torch.randperm(num_blocks // 2, generator=g).tolist()
    src = [perm[i * bpk:(i + 1) * bpk] for i in range(keys_per_job)]
    dst = [[num_blocks // 2 + b for b in blocks] for blocks in src]
    keys = [f"torch-check-{i}".encode() for i in range(keys_per_job)]
    nbytes = keys_per_job * ns.key_bytes

    t0 = time.perf_counter()
    res = c.store(cache, keys, src).wait(120)
    store_s = time.perf_counter() - t0
    assert res.count(1) + res.count(2) == keys_per_job, res.outcomes()
    assert c.lookup(ns.id, keys) == keys_per_job

    t0 = time.perf_counter()
    res = c.load(cache, keys, dst).wait(120)
    load_s = time.perf_counter() - t0
    assert res.count(4) == keys_per_job, res.outcomes()

    for t in tensors:
        for s, d in zip(src, dst):
            assert torch.equal(t[:, s], t[:, d]), "loaded blocks differ from stored ones"
    # The loaded blocks reach the GPU and come back intact.
    if torch.cuda.is_available():
        gpu = tensors[0][:, dst[0]].to("cuda", non_blocking=False)
        assert torch.equal(gpu.cpu(), tensors[0][:, src[0]])
    print(f"torch check OK: {keys_per_job} keys of {ns.key_bytes >> 20} MiB; "
          f"store {nbytes / store_s / 1e9:.2f} GB/s, load {nbytes / load_s / 1e9:.2f} GB/s "
          f"(one Python client, one job each, daemon on the mount given)")
