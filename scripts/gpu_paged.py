"""The paged KV cache the GPU scripts share: Llama-3.1-8B bf16 as vLLM
lays it out (one int8 allocation of (layers, num_blocks, page) with K and V
packed in each 64 KiB page), registered with a kvhost daemon over CUDA IPC.
"""
import sys
import threading
import time

import kvhost

LAYERS, HEADS, HEAD, TOKENS_PER_BLOCK, DTYPE_SIZE = 32, 8, 128, 16, 2
BLOCK_BYTES = TOKENS_PER_BLOCK * HEADS * HEAD * DTYPE_SIZE  # one plane of one block
PAGE = 2 * BLOCK_BYTES                                      # K and V of one block, one layer


def geometry(tokens_per_key):
    """The model's kvhost.Geometry with tokens_per_key tokens per key."""
    return kvhost.Geometry(model="meta-llama/Llama-3.1-8B", layers=LAYERS, kv_heads=HEADS, head_size=HEAD,
                           dtype_size=DTYPE_SIZE, tokens_per_block=TOKENS_PER_BLOCK, tokens_per_key=tokens_per_key)


def random_cache(num_blocks, seed, device="cuda"):
    """A CUDA int8 tensor of (LAYERS, num_blocks, PAGE), one allocation as
    vLLM makes it, filled with random bytes from seed (the same bytes in
    every process)."""
    import torch
    kv = torch.empty((LAYERS, num_blocks, PAGE), dtype=torch.int8, device=device)
    g = torch.Generator(device=kv.device).manual_seed(seed)
    kv.copy_(torch.randint(-128, 127, kv.shape, generator=g, device=kv.device, dtype=torch.int8))
    torch.cuda.synchronize()
    return kv


def register(c, kv, tokens_per_key):
    """Declares the geometry on client c and registers kv, a CUDA int8
    tensor of (LAYERS, num_blocks, PAGE); returns (namespace, cache)."""
    ns = c.declare(geometry(tokens_per_key))
    assert ns.block_bytes == BLOCK_BYTES, (ns.block_bytes, BLOCK_BYTES)
    num_blocks = kv.shape[1]
    region = c.register_cuda_tensor(kv)
    base = kv.storage_offset() * kv.element_size()
    specs = [kvhost.Layer(region, offset=base + l * num_blocks * PAGE, block_stride=PAGE,
                          plane_stride=BLOCK_BYTES, num_blocks=num_blocks) for l in range(LAYERS)]
    return ns, c.register_cache(ns.id, specs)


def keys_differ(src_kv, dst_kv, src, dst):
    """How many keys' destination blocks (dst[i], in dst_kv) differ from
    their source blocks (src[i], in src_kv); tensors of (LAYERS, blocks,
    PAGE)."""
    import torch  # the scripts that compare have torch; the module does not need it
    return sum(1 for s, d in zip(src, dst) if not torch.equal(src_kv[:, s], dst_kv[:, d]))


def split(xs, n):
    """xs cut into at most n runs of nearly equal length, in order."""
    k = (len(xs) + n - 1) // n
    return [xs[i:i + k] for i in range(0, len(xs), k)]


def run_jobs(c, op, plan, timeout=300):
    """Runs one job per (cache, keys, blocks) of plan, all at once, each
    from its own thread: op is "store" or "load". Returns the seconds from
    the first submission to the last completion and each job's result."""
    results = [None] * len(plan)

    def one(i):
        cache, keys, blocks = plan[i]
        j = (c.store if op == "store" else c.load)(cache, keys, blocks)
        results[i] = j.wait(timeout)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(plan))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0, results


def time_lookups(c, ns, keys, seconds, interval=0.0, spin=False):
    """Looks up keys (all stored) on client c for seconds, paced as
    time_paced paces, and returns each lookup's time in seconds. Exits if a
    lookup misses a key."""
    def one():
        got = c.lookup(ns, keys)
        if got != len(keys):
            sys.exit(f"lookup found {got} of {len(keys)} stored keys")
    return time_paced(one, seconds, interval, spin)


def time_paced(fn, seconds, interval=0.0, spin=False):
    """Calls fn for seconds, once every interval seconds (0: back to back;
    a call that ends late skips the slots it missed), and returns each
    call's time in seconds. Between calls it sleeps, or with spin keeps its
    CPU busy reading the clock (as a scheduler busy with other work between
    its lookups would)."""
    lat, t0 = [], time.perf_counter()
    next_at = t0
    while time.perf_counter() - t0 < seconds:
        s = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - s)
        next_at += interval
        pause = next_at - time.perf_counter()
        if pause > 0:
            if spin:
                while time.perf_counter() < next_at:
                    pass
            else:
                time.sleep(pause)
        else:
            next_at = time.perf_counter()
    return lat
