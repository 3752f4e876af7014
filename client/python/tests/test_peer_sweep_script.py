"""scripts/peer-sweep.sh (docs/performance.md's comparison with llm-d) run
on CPU, scaled down: this checkout's kvhost binary and the stand-in of
llm-d's storage_offload module from test_peer_llmd_script, 128 MiB a
part, 2 jobs. It checks that the memory-mount and disk parts run in the
order the summary's manifests name, that each run writes what
docs/performance.md's summary reads (the sweep file's sections, both
engines' lines, a kvhost report per run), and that a run cut at LIMIT
fails the sweep (in the 16 GiB part, which runs the same functions).
The sweep runs with the knobs that add runs (FRESH_PAIRS, DISK_BUFFERED),
so their order and their reports are checked too."""

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import unittest

from daemon import REPO, kvhost_binary
from test_peer_llmd_script import HAVE_TORCH, ROUND, STAND_IN

SWEEP = REPO / "scripts" / "peer-sweep.sh"

# The runs of the SHM and DISK parts with FRESH_PAIRS=1 and DISK_BUFFERED=1,
# in order: (engine, name).
ORDER = [("llmd", "shm32-1"), ("kvhost-cur", "shm32-1"), ("kvhost-cur", "restart-nogap-1"),
         ("kvhost-cur", "foreign-1"), ("kvhost-cur", "fresh-1"), ("kvhost-cur", "nogap-1"),
         ("llmd", "shm32-2"), ("kvhost-cur", "fresh-2"), ("llmd", "shm32-3"),
         ("llmd", "disk-1"), ("kvhost-cur", "disk-1"), ("kvhost-cur", "disk-buffered-1"),
         ("llmd", "disk-2"), ("kvhost-cur", "disk-buffered-2"), ("kvhost-cur", "disk-2")]
KEYS = 4  # every run's keys: 128 MiB (GIB and BIG_GIB 0.125) of 32 MiB
# What each kvhost run's load row says it loaded.
LOAD_KIND = {"restart-nogap-1": "load (restart)", "foreign-1": "load (foreign)"}
SECTION = re.compile(r"== (llmd|kvhost-cur) ([\w-]+): (.*)")
KV_ROW = re.compile(r"  auto +\S+ +\S+ +on +32MiB +2 +(store|load(?: \(\w+\))?) +(\d+)/(\d+) +(\d+\.\d\d) ")


@unittest.skipUnless(HAVE_TORCH, "needs torch (python3-torch)")
class TestPeerSweepScript(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.kvhost = kvhost_binary()

    def sweep(self, tmp, **extra):
        """Runs the sweep scaled down in tmp; returns (its result, OUT)."""
        tmp = pathlib.Path(tmp)
        for d in ("mod", "bin", "shm", "disk"):
            (tmp / d).mkdir()
        (tmp / "mod" / "storage_offload.py").write_text(STAND_IN)
        (tmp / "bin" / "kvhost").symlink_to(self.kvhost)
        # The sweep runs python3 from PATH: this one, which has torch.
        (tmp / "bin" / "python3").symlink_to(sys.executable)
        env = dict(os.environ, LLMD=str(tmp / "mod"), GIB="0.125", BIG_GIB="0.125",
                   DISK_GIB="0.125", JOBS="2", WARM_GIB="0", DISK_WARM_GIB="0", DEVICE="cpu",
                   SHM_DIR=str(tmp / "shm"), DISK_DIR=str(tmp / "disk"), LIMIT="120",
                   PATH=f"{tmp / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}")
        env.update(extra)
        out = tmp / "out"
        r = subprocess.run(["bash", str(SWEEP), str(tmp / "bin"), str(out)],
                           capture_output=True, text=True, timeout=900, env=env)
        return r, out

    def sections(self, text):
        """The sweep file's runs: [(engine, name, args, [lines])]."""
        runs = []
        for line in text.splitlines():
            m = SECTION.fullmatch(line.rstrip())
            if m:
                runs.append((m.group(1), m.group(2), m.group(3), []))
            elif runs and not line.startswith("-- "):
                runs[-1][3].append(line)
        return runs

    def test_a_sweep_writes_every_run_the_summary_reads(self):
        with tempfile.TemporaryDirectory() as tmp:
            r, out = self.sweep(tmp, BIG="0", FRESH_PAIRS="1", DISK_BUFFERED="1")
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            text = (out / "peer.txt").read_text()
            first = text.splitlines()[0]
            version = subprocess.run([self.kvhost, "version"], capture_output=True, text=True).stdout.split()
            self.assertEqual(first, f"# kvhost beside llm-d, written by scripts/peer-sweep.sh; commit {version[1]}")
            self.assertRegex(text.splitlines()[-1], r"^-- done .* after \d+ s$")
            runs = self.sections(text)
            self.assertEqual([(e, n) for e, n, _, _ in runs], ORDER, text)
            for engine, name, args, lines in runs:
                with self.subTest(f"{engine} {name}"):
                    if engine == "llmd":
                        self.check_llmd(name, args, lines)
                    else:
                        self.check_kvhost(name, args, lines, out / f"kv-cur-{name}.json")
            self.assertEqual(os.listdir(pathlib.Path(tmp) / "shm"), [], "the sweep left files on SHM_DIR")
            self.assertEqual(os.listdir(pathlib.Path(tmp) / "disk"), [], "the sweep left files on DISK_DIR")

    def check_llmd(self, name, args, lines):
        disk = name.startswith("disk")
        self.assertEqual(args.split()[1:], ["0.125", "2", "2"] + (["--cold", "--sync"] if disk else []))
        rounds = [ROUND.fullmatch(line.replace("store+sync", "store").replace("cold load", "load"))
                  for line in lines if line.startswith("llmd ")]
        self.assertEqual(len(rounds), 4, lines)
        for m, kind in zip(rounds, ["store", "load"] * 2):
            self.assertIsNotNone(m, lines)
            self.assertEqual((m.group(1), m.group(3), m.group(5)), (kind, str(KEYS), "True"))
        if disk:
            self.assertTrue(any("store+sync" in line for line in lines) and any("cold load" in line for line in lines), lines)

    def check_kvhost(self, name, args, lines, report):
        self.assertIn(f"--jobs 2 --rounds 2 --mix write,read --total {KEYS * 32}MiB", args)
        rows = [KV_ROW.match(line) for line in lines if line.startswith("  auto ")]
        self.assertEqual([m.group(1) if m else None for m in rows], ["store", LOAD_KIND.get(name, "load")], lines)
        for m in rows:
            self.assertEqual((m.group(2), m.group(3)), (str(KEYS), str(KEYS)), lines)
            self.assertGreater(float(m.group(4)), 0, lines)
        self.assertTrue(any(line.startswith("fraction:") for line in lines), lines)
        rep = json.loads(report.read_text())
        self.assertEqual(rep["schema"], "kvhost-bench/2")
        self.assertEqual([x["direction"] for x in rep["runs"]], ["store", "load"])
        load = rep["runs"][1]
        self.assertEqual((load["hits"], load["verified_bytes"]), (KEYS, load["bytes"]), "a load not verified whole")
        if name.startswith("disk-buffered"):
            self.assertEqual([x["io"] for x in rep["runs"]], ["buffered", "buffered"], "a buffered disk run read or wrote around the page cache")
            self.assertIn("--config", args)
        elif "--preallocate 0" in args:
            self.assertEqual(rep["runs"][0].get("preallocate", 0), 0, "a fresh run made spare files")

    def test_a_run_cut_at_the_limit_fails_the_sweep(self):
        with tempfile.TemporaryDirectory() as tmp:
            r, out = self.sweep(tmp, KVH_FAKE="never-finish", LIMIT="3", SHM="0", DISK="0")
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            runs = self.sections((out / "peer.txt").read_text())
            self.assertEqual([(e, n) for e, n, _, _ in runs], [("llmd", "shm16g-1"), ("kvhost-cur", "shm16g-1")])
            self.assertIn("   llmd FAILED or cut at 3s", runs[0][3])
            self.assertEqual(os.listdir(pathlib.Path(tmp) / "shm"), [], "a cut run left its files")


if __name__ == "__main__":
    unittest.main()
