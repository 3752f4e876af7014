"""A reload storm on a memory + disk `tiered` daemon under load.

Starts bin/kvhost with two mounts (a small tmpfs hot mount in front of a
disk directory, the built-in `tiered` policy, metrics on), then, at once:
a writer stores 2 MiB keys from host memory as fast as it can; a
re-declarer connects, declares the writer's namespace and a second one,
looks up and disconnects in a loop (as reconnecting vLLM workers do); and
RELOADS reloads (`kvhost reload`), each time with the policy's shard count
changed, so that every reload builds new plugin instances. Afterwards every
key the writer was told was stored is loaded back and compared, and the
daemon's metrics give the demotions, evictions and policy fallbacks.

Prints one line of counts and exits 1 if a store failed during the storm,
an acknowledged key did not load with its bytes (the disk mount is large
enough that nothing is evicted from it), the daemon fell back to a native
policy, or no demotion happened.

usage: python3 scripts/reload-storm.py [RELOADS]   (after make build; $KVHOST_BIN picks another binary)
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "client", "python", "src"))
import kvhost  # noqa: E402

GEOMETRY = kvhost.Geometry(model="storm/model", layers=8, kv_heads=8, head_size=128, dtype_size=2,
                           tokens_per_block=16, tokens_per_key=64)
OTHER = kvhost.Geometry(model="storm/other", layers=2, kv_heads=2, head_size=64, dtype_size=2,
                        tokens_per_block=16, tokens_per_key=16)


def config(tmp, hot, cold, sock, shards):
    return (f'[server]\nsocket = "{sock}"\n\n[log]\nlevel = "warn"\nformat = "json"\n\n'
            f'[metrics]\nlisten = "127.0.0.1:{METRICS_PORT}"\n\n'
            f'[policy]\nname = "tiered"\nshards = {shards}\ncache_dir = "{tmp}/wasm-cache"\n\n'
            f'[policy.params]\nhot = 0\ncold = 1\n\n'
            f'[[mount]]\npath = "{hot}"\ncapacity = "256MiB"\ndevice_class = "memory"\n\n'
            f'[[mount]]\npath = "{cold}"\ncapacity = "8GiB"\ndevice_class = "ssd"\n')


def one_key_cache(c):
    """Declares GEOMETRY on client c and registers a cache of one key's
    blocks in host memory; returns (buffer, cache id, blocks per key)."""
    ns = c.declare(GEOMETRY)
    n = ns.blocks_per_key
    page = 2 * GEOMETRY.block_bytes
    buf = kvhost.HostBuffer(GEOMETRY.layers * n * page)
    region = c.register_buffer(buf)
    layers = [kvhost.Layer(region, offset=l * n * page, block_stride=page,
                           plane_stride=GEOMETRY.block_bytes, num_blocks=n) for l in range(GEOMETRY.layers)]
    return buf, c.register_cache(ns.id, layers), n


METRICS_PORT = 9417
BIN = os.environ.get("KVHOST_BIN", os.path.join(REPO, "bin", "kvhost"))


def metrics():
    body = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
    out = {}
    for name in ("kvhost_demotions_total", "kvhost_evictions_total", "kvhost_policy_fallback",
                 "kvhost_reloads_total", "kvhost_policy_replacements_total"):
        vals = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", body, re.M)]
        out[name] = sum(vals) if vals else None
    return out


def main():
    reloads = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    tmp = tempfile.mkdtemp(prefix="kvhost-storm-")
    hot = tempfile.mkdtemp(prefix="kvhost-storm-hot-", dir="/dev/shm")
    cold, sock, conf = f"{tmp}/cold", f"{tmp}/kvhost.sock", f"{tmp}/kvhost.toml"
    os.makedirs(cold)
    with open(conf, "w") as f:
        f.write(config(tmp, hot, cold, sock, 2))
    log = open(f"{tmp}/kvhost.log", "w+")
    daemon = subprocess.Popen([BIN, "--config", conf], stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        if not daemon.stdout.readline().startswith("kvhost: listening"):
            sys.exit("the daemon did not start: " + open(f"{tmp}/kvhost.log").read())
        stop = threading.Event()
        stored, failed, declared = {}, [], [0]

        def writer():
            with kvhost.Client(sock, name="storm-writer") as c:
                buf, cache, n = one_key_cache(c)
                i = 0
                while not stop.is_set():
                    data = os.urandom(64) * (len(buf.view) // 64)
                    buf.view[:] = data
                    key = f"storm-{i}".encode()
                    try:
                        out = c.store(cache, [key], [list(range(n))]).wait(60).outcomes()
                    except Exception as e:  # counted; the storm goes on
                        failed.append(f"{key!r}: {e}")
                        out = []
                    if out == ["stored"]:
                        stored[key] = data[:64]
                    elif out:
                        failed.append(f"{key!r}: {out}")
                    i += 1

        def redeclarer():
            while not stop.is_set():
                with kvhost.Client(sock, name="storm-redeclare") as c:
                    a, b = c.declare(GEOMETRY), c.declare(OTHER)
                    c.lookup(a, [b"storm-0"])
                    c.lookup(b, [b"nothing"])
                    declared[0] += 1

        threads = [threading.Thread(target=writer), threading.Thread(target=redeclarer)]
        for t in threads:
            t.start()
        reload_failed = 0
        t0 = time.time()
        for r in range(reloads):
            with open(conf, "w") as f:
                f.write(config(tmp, hot, cold, sock, 2 + r % 3))
            if subprocess.run([BIN, "reload", "--socket", sock], capture_output=True).returncode != 0:
                reload_failed += 1
        storm = time.time() - t0
        time.sleep(1)  # let the writer store past the last reload
        stop.set()
        for t in threads:
            t.join()
        wrong = lost = 0
        with kvhost.Client(sock, name="storm-check") as c:
            buf, cache, n = one_key_cache(c)
            for key, head in stored.items():
                out = c.load(cache, [key], [list(range(n))]).wait(60).outcomes()
                if out != ["loaded"]:
                    lost += 1
                elif bytes(buf.view[:64]) != head:
                    wrong += 1
        m = metrics()
        print(f"reloads {reloads} ({reload_failed} failed) in {storm:.1f} s; namespaces re-declared {declared[0]} times; "
              f"stores acknowledged {len(stored)}, failed {len(failed)}; loads lost {lost}, wrong {wrong}; "
              f"demotions {m['kvhost_demotions_total']}, evictions {m['kvhost_evictions_total']}, "
              f"fallback active {m['kvhost_policy_fallback']}")
        if failed:
            print("first store failures:", failed[:3])
        bad = failed or lost or wrong or reload_failed or not m["kvhost_demotions_total"] or m["kvhost_policy_fallback"]
        sys.exit(1 if bad else 0)
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(hot, ignore_errors=True)


if __name__ == "__main__":
    main()
