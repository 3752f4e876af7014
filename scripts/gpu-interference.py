"""How much kvhost's GPU transfers slow the inference process's own kernels,
and the daemon's control path.

A torch process plays an inference server: it registers a vLLM-shaped
paged KV cache (Llama-3.1-8B bf16, 32 MiB keys) with a running kvhost
daemon over CUDA IPC and stores KEYS keys once. Then it times bf16 matrix
multiplications (8192 x 8192, its own stream) for SECONDS alone, and again
for SECONDS while JOBS threads keep loading those keys through the daemon,
and prints the matmul throughput of both phases and the loads' GB/s. Run
it once against a daemon with gpu.copy = "kernel" and once with "batch" to
see what the copy kernel, which runs on the SMs in the daemon's own CUDA
context, costs the inference kernels next to DMA copies, which run on the
copy engines.

During both phases a second process (this script with --probe) times
lookups of 16 stored keys on a connection of its own, back to back, and
the script prints their median and 99th percentile: what the transfers
cost the daemon's control path (a scheduler's lookup), which shares the
daemon's processors with the jobs (their copies' waits poll for up to
gpu.poll).

usage: python3 scripts/gpu-interference.py SOCKET [SECONDS] [KEYS] [JOBS]
"""
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, "client/python/src")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvhost  # noqa: E402
import gpu_paged  # noqa: E402

TPK = 256


def key(i):
    return f"interference-{i}".encode()


def probe(sock, seconds, nkeys):
    """Times lookups of 16 stored keys for seconds; prints 'p50 p99' in µs."""
    with kvhost.Client(sock, name="gpu-interference-probe") as c:
        ns = c.declare(gpu_paged.geometry(TPK))
        keys = [key(i) for i in range(min(16, nkeys))]
        lat = gpu_paged.time_lookups(c, ns, keys, seconds)
    lat.sort()
    print(f"{lat[len(lat) // 2] * 1e6:.0f} {lat[int(len(lat) * 0.99)] * 1e6:.0f} {len(lat)}")


def main():
    import torch

    sock = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 10
    nkeys = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    jobs = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    layers, page, tpb = gpu_paged.LAYERS, gpu_paged.PAGE, gpu_paged.TOKENS_PER_BLOCK
    bpk = TPK // tpb
    num_blocks = nkeys * bpk

    dev = torch.device("cuda", 0)
    kv = torch.randint(-128, 127, (layers, num_blocks, page), dtype=torch.int8, device=dev)
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=dev)
    torch.cuda.synchronize()

    def matmuls(secs):
        """Runs matmuls for secs; returns TFLOP/s."""
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < secs:
            for _ in range(20):
                torch.matmul(a, b, out=out)
            torch.cuda.synchronize()
            done += 20
        return done * 2 * n ** 3 / (time.perf_counter() - t0) / 1e12

    def probing(secs):
        """Starts the lookup probe for secs; returns a function giving its
        (p50, p99) in µs once it ended."""
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--probe", sock, str(secs), str(nkeys)],
                             stdout=subprocess.PIPE, text=True)

        def result():
            line, _ = p.communicate(timeout=secs + 60)
            if p.returncode != 0:
                sys.exit(f"lookup probe failed (exit {p.returncode})")
            p50, p99, _ = line.split()
            return int(p50), int(p99)
        return result

    with kvhost.Client(sock, name="gpu-interference") as c:
        ns, cache = gpu_paged.register(c, kv, TPK)
        keys = [key(i) for i in range(nkeys)]
        blocks = [list(range(i * bpk, (i + 1) * bpk)) for i in range(nkeys)]
        res = c.store(cache, keys, blocks).wait(300)
        assert res.count(1) + res.count(2) == nkeys, res.outcomes()

        quiet = probing(seconds)
        alone = matmuls(seconds)
        quiet = quiet()

        stop = threading.Event()
        moved = [0] * jobs
        failed = []

        def loader(j):
            ks, bs = keys[j::jobs], blocks[j::jobs]
            while not stop.is_set():
                r = c.load(cache, ks, bs).wait(300)
                if r.count(4) != len(ks):
                    failed.append(r.outcomes())
                    return
                moved[j] += len(ks) * ns.key_bytes

        ts = [threading.Thread(target=loader, args=(j,)) for j in range(jobs)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        loaded = probing(seconds)
        busy = matmuls(seconds)
        loaded = loaded()
        stop.set()
        for t in ts:
            t.join()
        secs = time.perf_counter() - t0
        if failed:
            sys.exit(f"loads failed: {failed[0]}")
        print(f"matmul alone: {alone:.0f} TFLOP/s; beside kvhost loads: {busy:.0f} TFLOP/s ({busy / alone:.2f}); "
              f"loads meanwhile: {sum(moved) / secs / 1e9:.2f} GB/s")
        print(f"lookups of 16 keys: alone p50 {quiet[0]} µs, p99 {quiet[1]} µs; "
              f"beside the loads p50 {loaded[0]} µs, p99 {loaded[1]} µs")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        probe(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
