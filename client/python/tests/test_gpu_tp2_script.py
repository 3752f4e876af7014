"""scripts/gpu-tp2.py (issue 87's two-GPU check and benchmark) on CPU: two
rank processes with a tiny shard each (2 layers, 2 KV heads of 16 per
rank) against a real daemon on a temporary directory, through the kvhost
client, KvhostConnector's worker half and llm-d's engine (the stand-in
test_peer_llmd_script writes, real files), alone and together. The script
must say ok True with 0 differing bytes where every load put back its
sources' bytes, and ok False, with exit status 1, where a stored file was
corrupted: never a silent pass."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

from daemon import REPO, kvhost_binary
from test_peer_llmd_script import STAND_IN

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

LINE = re.compile(r"tp2 path (\w+) mode (\w+) op (\w+) ranks (\d+) gbps_rank ([\d.,]+) gbps_total (\d+\.\d\d) "
                  r"ok (True|False) differ (\d+) pipeline (\w+)")
RATIO = re.compile(r"tp2 ratio path (\w+) op (\w+) (\d+\.\d\d) pipeline (\w+)")
VERSUS = re.compile(r"tp2 vs_llmd path (\w+) mode (\w+) op (\w+) rank ([\d.,]+) total (\d+\.\d\d) pipeline (\w+)")
TINY = ["--device", "cpu", "--ranks", "2", "--layers", "2", "--kv-heads", "4", "--head-dim", "16",
        "--tokens-per-key", "32", "--keys", "8", "--jobs", "2", "--requests", "2", "--pause", "0",
        "--capacity", "0.002"]  # 2 MiB: the fill before the runs is 17 rounds of 128 KiB
OPS = ("store", "load")


@unittest.skipUnless(HAVE_TORCH, "needs torch (python3-torch)")
class TestGpuTp2Script(unittest.TestCase):
    def tp2(self, *args):
        """Runs the script on a fresh directory; returns its result, its
        summary lines by (path, mode, op), its ratio lines by (path, op),
        its llm-d comparisons by (path, mode, op), and its JSON report."""
        tmp = tempfile.mkdtemp(prefix="kvhost-tp2-test-")
        self.addCleanup(shutil.rmtree, tmp, True)
        report = os.path.join(tmp, "report.json")
        mod = os.path.join(tmp, "llmd")
        os.makedirs(mod)
        with open(os.path.join(mod, "storage_offload.py"), "w") as f:
            f.write(STAND_IN)  # llm-d's engine as test_peer_llmd_script stands it in: real files
        env = dict(os.environ, KVHOST_BIN=kvhost_binary())
        out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu-tp2.py"), "--dir",
                              os.path.join(tmp, "cache"), "--json", report, "--llmd", mod, "--llmd-threads", "2",
                              *TINY, *args], capture_output=True, text=True, timeout=300, env=env)
        lines, ratios, versus = {}, {}, {}
        for line in out.stdout.splitlines():
            for rx, into, key in ((LINE, lines, (1, 2, 3)), (RATIO, ratios, (1, 2)), (VERSUS, versus, (1, 2, 3))):
                m = rx.fullmatch(line)
                if m:
                    into[tuple(m.group(i) for i in key)] = m
        data = None
        if os.path.exists(report):
            with open(report) as f:
                data = json.load(f)
        left = [d for d in os.listdir(tmp) if "llmd-rank" in d]
        return out, lines, ratios, versus, data, left

    def test_every_path_alone_and_together_loads_every_byte_and_reports_its_rates(self):
        out, lines, ratios, versus, data, left = self.tp2("--reps", "2")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        want = [(p, m, op) for p in ("client", "connector", "llmd") for m in ("alone", "together") for op in OPS]
        self.assertEqual(sorted(lines), sorted(want), out.stdout)
        for (path, mode, op), m in lines.items():
            with self.subTest(path=path, mode=mode, op=op):
                ranks = 1 if mode == "alone" else 2
                self.assertEqual((m.group(4), m.group(7), m.group(8), m.group(9)),
                                 (str(ranks), "True", "0", "registered"), out.stdout)
                self.assertEqual(len(m.group(5).split(",")), ranks, out.stdout)  # the figures: in the JSON
        self.assertEqual(sorted(ratios), sorted((p, op) for p in ("client", "connector", "llmd") for op in OPS))
        self.assertTrue(all(r > 0 for ops in data["ratios_together_over_alone"].values() for r in ops.values()))
        self.assertEqual(sorted(versus), sorted((p, m, op) for p in ("client", "connector")
                                                for m in ("alone", "together") for op in OPS))
        self.assertEqual(len(versus[("client", "together", "load")].group(4).split(",")), 2)
        self.assertEqual(left, [], "llm-d's files were left behind")
        fill = re.search(r"detail: filled the cache with ([\d.]+) MiB of keys \((\d+) rounds\) before the runs", out.stdout)
        self.assertIsNotNone(fill, out.stdout)
        self.assertGreaterEqual(float(fill.group(1)), 2.0)  # the capacity, in 128 KiB rounds

        self.assertTrue(data["ok"])
        self.assertEqual(data["pipeline"], "registered")
        self.assertEqual(len(data["runs"]), 3 * 2 * 3)  # paths x modes x (reps and the warm-up)
        self.assertEqual(sorted({r["rep"] for r in data["runs"] if r["warmup"]}), [-1])
        for run in data["runs"]:
            for op in OPS:
                with self.subTest(path=run["path"], mode=run["mode"], rep=run["rep"], op=op):
                    got = run[op]
                    self.assertEqual([x["rank"] for x in got["per_rank"]], [0] if run["mode"] == "alone" else [0, 1])
                    self.assertTrue(got["ok"])
                    self.assertEqual(got["differ"], 0)
                    self.assertEqual(got["bytes"], len(got["per_rank"]) * 8 * 8192)  # keys x key bytes per rank
                    self.assertGreater(got["gbps_total"], 0)
                    for x in got["per_rank"]:
                        self.assertEqual(x["errors"], [])
                        self.assertGreater(x["gbps"], 0)
                        self.assertLessEqual(x["seconds"], got["seconds"] + 1e-9, "a rank outlasted the span")
        self.assertEqual(data["summary"]["connector"]["together"]["load"]["ranks"], 2)
        self.assertEqual(data["summary"]["client"]["alone"]["store"]["reps"], 2)
        m = data["machine"]
        self.assertEqual(m["device"], "cpu")
        self.assertEqual(len({r["pid"] for r in m["ranks"]}), 2, "the ranks are not two processes")
        self.assertTrue(all(r["connector_layer_loads"] for r in m["ranks"]), "the connector loaded no layer range")
        self.assertIn("fs_type", m["mount"])

    def test_a_corrupted_stored_file_fails_the_run_instead_of_passing(self):
        out, lines, _, _, data, _ = self.tp2("--corrupt-stored", "--pinned", "--paths", "client,connector",
                                             "--reps", "1", "--warmup", "0")
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertEqual(out.stdout.count("detail: corrupted "), 4, out.stdout)  # each kvhost store phase
        for path in ("client", "connector"):
            for mode in ("alone", "together"):
                with self.subTest(path=path, mode=mode):
                    self.assertEqual(lines[(path, mode, "store")].group(7), "True", out.stdout)
                    load = lines[(path, mode, "load")]
                    self.assertEqual((load.group(7), load.group(9)), ("False", "pinned"), out.stdout)
        self.assertFalse(data["ok"])
        self.assertIn("register_files = 0", data["daemon_config"])
        failed = [x for r in data["runs"] for x in r["load"]["per_rank"] if not x["ok"]]
        self.assertEqual(len(failed), 4, data["runs"])
        self.assertTrue(all(x["errors"] for x in failed))


if __name__ == "__main__":
    unittest.main()
