"""scripts/ttft-bench.py (issue 84's time-to-first-token benchmark) on CPU:
a tiny model of the same shape rules (2 layers, hidden 64) against a real
daemon on a temporary directory, every mode that needs neither CUDA nor
llm-d. The script must say ok True where each load put back the
recomputation's bytes, and ok False, with exit status 1, where a stored
file was corrupted: never a silent pass."""

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import types
import unittest

from daemon import REPO, kvhost_binary
from test_peer_llmd_script import STAND_IN

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

LINE = re.compile(r"ttft P (\d+) S (\d+) mode (\w+) ms (\d+\.\d) best (\d+\.\d) ok (True|False)")
TINY = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--mlp", "128", "--vocab", "128", "--sizes", "64", "--suffix", "16",
        "--tokens-per-key", "32", "--reps", "2", "--layers-per-load", "1"]
CPU_MODES = ["recompute", "suffix", "half", "bound", "whole", "layerwise", "split"]


@unittest.skipUnless(HAVE_TORCH, "needs torch (python3-torch)")
class TestTtftBenchScript(unittest.TestCase):
    def bench(self, *args, cache=None):
        """Runs the script on a fresh directory (or on cache, the cache
        directory of an earlier run); returns its result, its mode lines by
        mode, and its JSON report (None if it wrote none)."""
        tmp = tempfile.mkdtemp(prefix="kvhost-ttft-test-")
        self.addCleanup(shutil.rmtree, tmp, True)
        report = os.path.join(tmp, "report.json")
        env = dict(os.environ, KVHOST_BIN=kvhost_binary())
        out = subprocess.run([sys.executable, str(REPO / "scripts" / "ttft-bench.py"), "--dir",
                              cache or os.path.join(tmp, "cache"), "--json", report, *TINY, *args],
                             capture_output=True, text=True, timeout=300, env=env)
        lines = {}
        for line in out.stdout.splitlines():
            m = LINE.fullmatch(line)
            if m:
                lines[m.group(3)] = m
        data = None
        if os.path.exists(report):
            with open(report) as f:
                data = json.load(f)
        return out, lines, data

    def test_every_cpu_mode_reports_its_ttft_and_matches_the_recomputation(self):
        out, lines, data = self.bench()
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertEqual(sorted(lines), sorted(CPU_MODES), out.stdout)
        for mode, m in lines.items():
            with self.subTest(mode):
                self.assertEqual((m.group(1), m.group(2), m.group(6)), ("64", "16", "True"), out.stdout)
                self.assertGreater(float(m.group(4)), 0, out.stdout)
                self.assertLessEqual(float(m.group(5)), float(m.group(4)), "best above the median")
        size = data["sizes"]["64"]
        self.assertEqual(sorted(size["modes"]), sorted(CPU_MODES + ["disk"]))
        # disk: the store's files read whole in every shape, the best the
        # ceiling the whole load's rate is reported against.
        disk = size["modes"].pop("disk")
        self.assertEqual(disk["files"], 2)  # 64 tokens of 32 per key
        self.assertEqual([c["errors"] for c in disk["configs"]], [[]] * len(disk["configs"]))
        # Every shape read once per repetition, in turns; a shape's rate
        # the median of its reads, the fastest shape's the ceiling (as
        # each mode's figure is a median); best_gbps the fastest read.
        for c in disk["configs"]:
            self.assertEqual(len(c["reps_gbps"]), 2, c)
            self.assertEqual(c["gbps"], statistics.median(c["reps_gbps"]), c)
        self.assertEqual(disk["ceiling_gbps"], max(c["gbps"] for c in disk["configs"]))
        best = next(c for c in disk["configs"] if c["name"] == disk["best"])
        self.assertEqual((disk["ceiling_gbps"], disk["ceiling_reps_gbps"]), (best["gbps"], best["reps_gbps"]))
        self.assertEqual(disk["best_gbps"], max(g for c in disk["configs"] for g in c["reps_gbps"]))
        self.assertGreater(disk["ceiling_gbps"], 0)
        # A disk mount's load readers, as its tuning left them after each
        # load mode: one mount, at least one reader, buffered or not (a
        # memory mount has none).
        readers = size["modes"]["whole"]["load_readers_after"]
        fs = subprocess.run(["stat", "-f", "-c", "%T", tempfile.gettempdir()], capture_output=True, text=True)
        if fs.stdout.strip() == "tmpfs":
            self.assertEqual(readers, {})
        else:
            self.assertEqual(len(readers), 1, readers)
            n, buffered, changes, gbps, arms = next(iter(readers.values()))
            self.assertGreaterEqual(n, 1)
            self.assertIn(buffered, (0, 1))
            self.assertGreaterEqual(changes, 0)
            self.assertGreaterEqual(gbps, 0)
            # Every arm tuning measured, none on loads this small (under
            # one window of 256 MiB).
            self.assertEqual(arms, [])
            # and a line of the output says it after the mode's line.
            self.assertRegex(out.stdout, rf"readers P 64 mode whole mount \S+ readers {n} buffered {bool(buffered)} "
                                         rf"changes {changes} measured {gbps} GB/s arms \[\]\n")
        # The whole load's rate is its bytes over its time beyond the
        # suffix's: none where the tiny model's noise put it under.
        if size["modes"]["whole"]["median_ms"] > size["modes"]["suffix"]["median_ms"]:
            self.assertGreater(size["ratios"]["whole_gbps/disk"], 0)
        else:
            self.assertNotIn("whole_gbps/disk", size["ratios"])
        self.assertRegex(out.stdout, r"disk P 64 files 2 bytes \d+ best_gbps [\d.]+ .* ceiling_gbps [\d.]+ \([\w-]+, reps [\d.]+-[\d.]+\)")
        for mode, m in size["modes"].items():
            self.assertEqual(len(m["reps_ms"]), 2, mode)
            self.assertEqual(m["errors"], [], mode)
        self.assertEqual(size["modes"]["whole"]["loaded_tokens"], 64)
        self.assertEqual(size["modes"]["layerwise"]["loaded_tokens"], 64)
        self.assertTrue(data["layer_loads"], "the connector loaded no layer range")
        self.assertEqual(len(size["modes"]["layerwise"]["layer_ready_ms"]), 2)  # one wait per layer
        # Its load jobs, one per layer here, timed: sent, the daemon's time,
        # waited for, in that order; its completion received after the
        # step's first submission (sent_ms is stamped once the group's jobs
        # are all sent, which a small job's completion can precede) and
        # before its wait returned, which began before it returned.
        jobs = size["modes"]["layerwise"]["load_jobs"]
        self.assertEqual([j["layers"] for j in jobs], [[0, 1], [1, 1]])
        # The first repetition's step too (the warm-up here), as timed.
        first = size["modes"]["layerwise"]["first_rep"]
        self.assertEqual(first["ms"], size["modes"]["layerwise"]["warmup_ms"][0])
        self.assertEqual([j["layers"] for j in first["load_jobs"]], [[0, 1], [1, 1]])
        # Each timed repetition's CPU figures: the bench's main thread's
        # time on a CPU and waiting for one, the daemon's CPU time, and
        # for the connector's modes the forward pass's pace per layer.
        for mode in ("whole", "layerwise"):
            cpu = size["modes"][mode]["cpu_reps"]
            self.assertEqual(len(cpu), 2, mode)
            for x in cpu:
                self.assertGreater(x["main_cpu_ms"], 0, mode)
                self.assertGreaterEqual(x["main_runnable_ms"], 0, mode)
                self.assertGreaterEqual(x["main_preempted"], 0, mode)
                self.assertGreater(x["daemon_cpu_ms"], 0, mode)  # it served the load
            self.assertEqual("ms_per_layer" in cpu[0], mode == "layerwise", mode)
            self.assertRegex(out.stdout, rf"cpu P 64 mode {mode} main_cpu_ms [\d.]+-[\d.]+ main_runnable_ms ")
        for j in jobs:
            self.assertGreater(j["daemon_ms"], 0)
            self.assertLessEqual(j["sent_ms"], j["waited_ms"])
            self.assertLessEqual(j["daemon_ms"], j["waited_ms"] - j["sent_ms"] + 1.0)  # the clocks' skew, at most
            self.assertLessEqual(j["daemon_ms"], j["received_ms"] + 1.0)  # the skew again, from the first submission
            self.assertLessEqual(j["called_ms"], j["waited_ms"])
            self.assertLessEqual(j["received_ms"], j["waited_ms"])
        self.assertIn(size["modes"]["split"]["loaded_tokens"], (0, 32, 64))
        self.assertIn("split/recompute", size["ratios"])
        self.assertEqual(size["modes"]["half"]["cached_tokens"], 32)
        self.assertEqual(sorted(size["split_costs"]), ["load_gbps", "load_latency_ms", "prefill_fixed_ms",
                                                       "prefill_ns_per_token2", "prefill_us_per_token"])
        self.assertTrue(all(v >= 0 for v in size["split_costs"].values()), size["split_costs"])
        look = size["lookups"]  # the connector's lookups of the prompt, idle and beside the loads
        self.assertEqual(look["claimed_tokens"], 64)
        self.assertEqual(look["process"], "own")  # apart from the loads' process, as vLLM's scheduler is
        self.assertEqual(look["idle"]["n"], 2000)
        self.assertGreaterEqual(look["beside_loads"]["n"], 2000)  # more requests run until there are as many
        self.assertEqual(look["idle_spaced"]["n"], 2000)  # 200 us apart
        self.assertLessEqual(look["idle"]["p50_us"], look["idle"]["p99_us"])
        self.assertRegex(out.stdout, r"lookup P 64 tokens 64 idle p50_us [\d.]+ p99_us [\d.]+ n 2000 beside_loads ")
        self.assertEqual(data["machine"]["device"], "cpu")
        self.assertIn("fs_type", data["machine"]["mount"])
        self.assertRegex(out.stdout, r"ratio P 64 S 16 split/recompute \d+\.\d\d split_tokens \d+ "
                                     r"modelled_optimum/recompute \d+\.\d\d at_tokens (0|32|64) "
                                     r"split/modelled_at_split_tokens \d+\.\d\d split/modelled_optimum \d+\.\d\d "
                                     r"rate_margin 0\.15 split/optimum_at_rate \d+\.\d\d at_rate_tokens (0|32|64)\n")
        model = size["split_model"]  # the split's own model at this run's rates
        self.assertIn(model["optimum_tokens"], (0, 32, 64))
        self.assertGreater(model["optimum_ms"], 0)
        # The rate and latency the connector learns of its layer-wise
        # jobs: the step's seconds the daemon's (first submission to the
        # end of the longest job, at most to the last wait); the rate the
        # second job's bytes over the time after the first, the latency
        # the first job's time past its bytes at that rate, where the
        # first ended early enough to separate them (load_measure), else
        # the step's rate and none.
        step = min(max(j["waited_ms"] for j in jobs), max(j["sent_ms"] for j in jobs) + max(j["daemon_ms"] for j in jobs))
        self.assertEqual(jobs[0]["bytes"], jobs[1]["bytes"])  # a layer each
        b, first = jobs[1]["bytes"], jobs[0]["daemon_ms"]
        costs = size["split_costs"]
        if step - first >= step / 4:
            self.assertAlmostEqual(costs["load_gbps"], b / (step - first) / 1e6, places=6)
            self.assertAlmostEqual(costs["load_latency_ms"], max(0.0, first - (step - first)), places=6)
        else:
            self.assertAlmostEqual(costs["load_gbps"], 2 * b / step / 1e6, places=6)
            self.assertEqual(costs["load_latency_ms"], 0.0)
        # The optimum is the connector's own model's: its pipeline of two
        # layers, one per job, at these costs (not the max of load and
        # compute that a one-layer model would price).
        from kvhost.vllm._conn_common import cost_model, options
        opts = options({"load_split": "auto", "layers_per_load": 1, **size["split_costs"]})
        cm = cost_model(opts, size["prefix_kv_bytes"] / 64, 2)
        self.assertAlmostEqual(model["optimum_ms"], cm.ttft_s(80, 0, model["optimum_tokens"]) * 1e3, places=6)
        self.assertEqual(model["chosen_tokens"], cm.split(80, 0, 64, 32))
        split = size["modes"]["split"]
        at = sorted(ms / model["modelled_ms"][str(k)] for ms, k in zip(split["reps_ms"], split["loaded_tokens_reps"]))
        self.assertAlmostEqual(size["ratios"]["split/modelled_at_split_tokens"], (at[0] + at[-1]) / 2, places=6)
        self.assertAlmostEqual(size["ratios"]["split/modelled_optimum"], split["median_ms"] / model["optimum_ms"],
                               places=6)
        # Priced as the split prices (the rate less its margin), and
        # beside it the optimum at the rate itself.
        self.assertEqual(model["rate_margin"], 0.15)
        cm.rate_margin = 0.0
        self.assertAlmostEqual(model["at_rate_optimum_ms"], min(cm.ttft_s(80, 0, k) for k in (0, 32, 64)) * 1e3, places=6)
        self.assertLessEqual(model["at_rate_optimum_ms"], model["optimum_ms"] + 1e-9)
        self.assertAlmostEqual(size["ratios"]["split/optimum_at_rate"], split["median_ms"] / model["at_rate_optimum_ms"],
                               places=6)
        # The bound mode: the prefix's K/V copied in per layer, no daemon,
        # every block equal to the recomputation's; each load mode is
        # reported against it, repetition by repetition.
        self.assertEqual(size["modes"]["bound"]["loaded_tokens"], 64)
        for mode in ("whole", "layerwise", "split"):
            self.assertIn(f"{mode}/bound", size["ratios"])
            self.assertEqual(len(size["ratios"][f"{mode}/bound_reps"]), 2)
        self.assertRegex(out.stdout, r"bound P 64 S 16 layerwise/bound \d+\.\d\d \(reps [\d.]+-[\d.]+\) bound_ms ")
        self.assertEqual(data["machine"]["rope"], "bf16 (cos and sin cast to bf16)")
        self.assertIn("gc.freeze", data["machine"]["gc"])  # as vLLM's worker, the setup's heap frozen
        # After the store and after the connector's save, the daemon's
        # metrics were asked until it settled (no spares on this disk).
        self.assertEqual(len(size["settle_s"]), 2)
        self.assertTrue(all(w is not None and 0.3 <= w < 60 for w in size["settle_s"]), size["settle_s"])
        self.assertIn("rms_norm", data["machine"])

    def test_a_sliding_window_hybrid_loads_only_the_window_of_its_window_layers(self):
        # --window 24: layer 0 a sliding window of 24 tokens (one of the two
        # 32-token keys), layer 1 full attention, in two KV-cache groups.
        out, lines, data = self.bench("--window", "24", "--modes", "recompute,suffix,bound,whole,layerwise")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertEqual(sorted(lines), ["bound", "layerwise", "recompute", "suffix", "whole"], out.stdout)
        for mode, m in lines.items():
            self.assertEqual(m.group(6), "True", (mode, out.stdout))
        modes = data["sizes"]["64"]["modes"]
        self.assertEqual(modes["layerwise"]["loaded_tokens"], 64)
        # Full attention loads both keys' blocks, the window layer the
        # second key's only: 3 of 4 layer-keys, as the bound copies.
        whole, layerwise = modes["whole"]["loaded_bytes_reps"][-1], modes["layerwise"]["loaded_bytes_reps"][-1]
        self.assertEqual(layerwise * 4, whole * 3, (layerwise, whole))
        self.assertEqual(modes["bound"]["loaded_bytes_reps"][-1], layerwise)
        self.assertRegex(out.stdout, r"bytes P 64 S 16 layerwise \d+ whole \d+ layerwise/whole 0\.750")

    def test_a_first_load_timed_without_warm_up_still_measures_a_warm_bound(self):
        # --warmup 0 times a first load; the bound is the hardware's, so it
        # still runs once untimed first (and says so), the load does not.
        out, lines, data = self.bench("--warmup", "0", "--reps", "1", "--modes", "recompute,bound,layerwise")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertEqual(sorted(lines), ["bound", "layerwise", "recompute"], out.stdout)
        modes = data["sizes"]["64"]["modes"]
        self.assertEqual(modes["bound"].get("untimed_runs"), 1, modes["bound"])
        self.assertNotIn("untimed_runs", modes["layerwise"])
        self.assertEqual((modes["bound"]["warmup_ms"], len(modes["bound"]["reps_ms"])), ([], 1))

    def test_a_restarted_daemon_loads_the_prefix_an_earlier_run_kept_stored(self):
        # --keep-stored leaves the prefix's files; a second run on the same
        # directory starts its own daemon on them (a restart), finds every
        # key stored and loads them, each load checked against its own
        # recomputation.
        cache = tempfile.mkdtemp(prefix="kvhost-ttft-restart-")
        self.addCleanup(shutil.rmtree, cache, True)
        modes = ["--modes", "recompute,whole,layerwise"]
        first, _, data = self.bench("--keep-stored", *modes, cache=cache)
        self.assertEqual(first.returncode, 0, first.stdout + first.stderr)
        self.assertEqual(data["sizes"]["64"]["keys_present"], 0)
        out, lines, data = self.bench("--warmup", "0", "--reps", "1", *modes, cache=cache)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        size = data["sizes"]["64"]
        self.assertEqual(size["keys_present"], size["keys"], size)
        # The daemon's registered files sampled from its start to the first
        # load mode: none at any sample here.
        self.assertEqual([n for _, n in data["registrations"]], [0], data["registrations"])
        for mode in ("whole", "layerwise"):
            with self.subTest(mode):
                self.assertEqual(lines[mode].group(6), "True", out.stdout)
                self.assertEqual(size["modes"][mode]["loaded_tokens"], 64)
                # No GPU here: the daemon registers no file with CUDA.
                self.assertEqual(size["modes"][mode]["registered_files_at_start"], 0)
        # Without --keep-stored, the second run removed them when it ended.
        out, _, data = self.bench("--modes", "recompute,whole", cache=cache)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertEqual(data["sizes"]["64"]["keys_present"], 0)

    def test_layer_jobs_mode_waits_for_every_layer_before_the_forward_pass(self):
        out, lines, data = self.bench("--modes", "recompute,bound,layerwise,layerjobs", "--lookups", "0")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertEqual(lines["layerjobs"].group(6), "True", out.stdout)
        modes = data["sizes"]["64"]["modes"]
        mode = modes["layerjobs"]
        self.assertEqual(mode["loaded_tokens"], 64)
        # Every layer's wait returned before the forward pass began (the
        # loads_waited phase, which layerwise, waiting inside it, lacks);
        # each job's wait began only after the one before returned.
        self.assertEqual(len(mode["layer_ready_ms"]), 2)
        self.assertLessEqual(max(mode["layer_ready_ms"]), mode["phases_ms"]["loads_waited"])
        self.assertNotIn("loads_waited", modes["layerwise"]["phases_ms"])
        jobs = mode["load_jobs"]
        self.assertEqual([j["layers"] for j in jobs], [[0, 1], [1, 1]])
        self.assertLessEqual(jobs[0]["waited_ms"], jobs[1]["called_ms"])
        self.assertIn("layerjobs/bound", data["sizes"]["64"]["ratios"])

    def test_llmd_mode_loads_the_prefix_through_the_engine_it_is_given(self):
        with tempfile.TemporaryDirectory() as mod:
            with open(os.path.join(mod, "storage_offload.py"), "w") as f:
                f.write(STAND_IN)  # llm-d's engine as test_peer_llmd_script stands it in: real files
            out, lines, data = self.bench("--llmd", mod, "--llmd-threads", "2", "--modes", "recompute,llmd")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertEqual(sorted(lines), ["llmd", "recompute"], out.stdout)
        self.assertEqual(lines["llmd"].group(6), "True", out.stdout)
        self.assertEqual(data["sizes"]["64"]["modes"]["llmd"]["loaded_tokens"], 64)

    def test_daemon_trace_takes_an_execution_trace_of_the_layer_wise_loads(self):
        tmp = tempfile.mkdtemp(prefix="kvhost-ttft-trace-")
        self.addCleanup(shutil.rmtree, tmp, True)
        path = os.path.join(tmp, "daemon.trace")
        out, lines, data = self.bench("--modes", "suffix,layerwise", "--lookups", "0", "--daemon-trace", path,
                                      "--daemon-trace-seconds", "1")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertEqual(sorted(lines), ["layerwise", "recompute", "suffix"], out.stdout)
        self.assertIn(f"trace P 64 mode layerwise file {path} bytes ", out.stdout)
        entry = data["sizes"]["64"]["modes"]["layerwise"]["daemon_trace"]
        self.assertEqual((entry["file"], entry["seconds"]), (path, 1.0))
        with open(path, "rb") as f:
            head = f.read(16)
        self.assertTrue(head.startswith(b"go 1."), f"not a Go execution trace: {head!r}")
        self.assertEqual(entry["bytes"], os.path.getsize(path))
        if shutil.which("go"):  # the layer-wise jobs are its load tasks, one layer each
            got = subprocess.run([sys.executable, str(REPO / "scripts" / "trace-regions.py"), path],
                                 capture_output=True, text=True, timeout=120)
            self.assertEqual(got.returncode, 0, got.stderr)
            self.assertRegex(got.stdout, r"(?m)^task load layers \[0, 1\) n \d+")
            self.assertRegex(got.stdout, r"(?m)^region load: read n \d+")

    def test_daemon_trace_needs_a_daemon_started_here_and_the_layer_wise_mode(self):
        for args, why in [(["--socket", "/nonexistent", "--dir", ""], "a daemon started here"),
                          (["--modes", "suffix"], "add it to --modes")]:
            with self.subTest(why):
                out = subprocess.run([sys.executable, str(REPO / "scripts" / "ttft-bench.py"), "--dir", "/nonexistent",
                                      *TINY, "--daemon-trace", "/nonexistent/t", *args],
                                     capture_output=True, text=True, timeout=120)
                self.assertEqual(out.returncode, 2, out.stdout + out.stderr)
                self.assertIn(why, out.stderr)

    def test_a_corrupted_stored_file_fails_the_run_instead_of_passing(self):
        out, lines, data = self.bench("--corrupt-stored", "--modes", "recompute,whole,layerwise")
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("detail: corrupted ", out.stdout)
        self.assertEqual(lines["recompute"].group(6), "True", out.stdout)
        for mode in ("whole", "layerwise"):
            with self.subTest(mode):
                self.assertEqual(lines[mode].group(6), "False", out.stdout)
                self.assertNotEqual(data["sizes"]["64"]["modes"][mode]["errors"], [])


if __name__ == "__main__":
    unittest.main()


def load_bench():
    """scripts/ttft-bench.py as a module, for its functions and classes."""
    import importlib.util
    sys.path[:0] = [os.path.join(REPO, "scripts"), os.path.join(REPO, "client", "python", "tests")]
    spec = importlib.util.spec_from_file_location("ttft_bench", os.path.join(REPO, "scripts", "ttft-bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@unittest.skipUnless(HAVE_TORCH, "needs torch (python3-torch)")
class TestArguments(unittest.TestCase):
    """The bench refuses a run whose figures would mislead."""

    def test_split_without_half_is_refused_naming_the_missing_mode(self):
        mod = load_bench()
        err = io.StringIO()
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(err):
            mod.parse_args(["--dir", "/tmp/x", "--modes", "recompute,suffix,whole,split"])
        self.assertIn("add half to --modes", err.getvalue())
        a = mod.parse_args(["--dir", "/tmp/x", "--modes", "recompute,suffix,half,whole,split"])
        self.assertEqual(a.modes, ["recompute", "suffix", "half", "whole", "split"])


@unittest.skipUnless(HAVE_TORCH, "needs torch (python3-torch)")
class TestSettle(unittest.TestCase):
    """The bench's settle: it waits for the daemon's work after a store
    (spare files made ahead, GPU registrations queued) to end."""

    @classmethod
    def setUpClass(cls):
        cls.mod = load_bench()

    def test_a_reading_sums_each_metric_over_its_series_and_reads_0_where_it_is_missing(self):
        text = ("# HELP kvhost_spare_files_made_total x\nkvhost_spare_files_made_total 12\n"
                'kvhost_mount_spare_bytes{mount="/a"} 1024\nkvhost_mount_spare_bytes{mount="/b"} 2048\n'
                "kvhost_other 5\n")
        self.assertEqual(self.mod.settle_reading(text), (12.0, 3072.0, 0.0))

    def test_settle_waits_for_the_queue_to_empty_and_the_spares_to_stop_changing(self):
        readings = iter([(1, 10, 3), (2, 20, 2), (3, 30, 0)] + [(4, 40, 0)] * 1000)
        reads = []

        def read():
            reads.append(next(readings))
            return reads[-1]
        waited = self.mod.settle("addr", still_s=0.1, limit_s=10, read=read)
        self.assertIsNotNone(waited)
        self.assertGreaterEqual(waited, 0.1)
        self.assertEqual(reads[3], (4, 40, 0))  # still changing: waited on
        self.assertTrue(all(r == (4, 40, 0) for r in reads[3:]))

    def test_settle_gives_up_after_its_limit_and_says_so(self):
        n = iter(range(10 ** 6))
        self.assertIsNone(self.mod.settle("addr", still_s=0.05, limit_s=0.2, read=lambda: (next(n), 0, 0)))
        self.assertIsNone(self.mod.settle(None))


@unittest.skipUnless(HAVE_TORCH, "needs torch (python3-torch)")
class TestLoadReaders(unittest.TestCase):
    """The bench reads a disk mount's load readers, and every arm tuning
    measured, from the daemon's metrics page."""

    def test_each_mount_gets_its_readers_and_every_arm_it_measured_ordered(self):
        text = ('kvhost_mount_load_readers{mount="/d"} 8\nkvhost_mount_load_buffered{mount="/d"} 1\n'
                'kvhost_mount_load_reader_changes_total{mount="/d"} 5\n'
                'kvhost_mount_load_rate_bytes_per_second{mount="/d"} 2.1e+09\n'
                'kvhost_mount_load_arm_rate_bytes_per_second{home="0",io="buffered",mount="/d",readers="16"} 2.05e+09\n'
                'kvhost_mount_load_arm_rate_bytes_per_second{home="1",io="buffered",mount="/d",readers="8"} 2.1e+09\n'
                'kvhost_mount_load_arm_rate_bytes_per_second{home="0",io="direct",mount="/d",readers="8"} 1.5e+09\n'
                'kvhost_mount_load_readers{mount="/e"} 16\nkvhost_mount_used_bytes{mount="/d"} 7\n')
        got = load_bench().load_readers_of(text)
        self.assertEqual(got, {"/d": [8, 1, 5, 2.1, [[8, 0, 1.5, 0], [8, 1, 2.1, 1], [16, 1, 2.05, 0]]],
                               "/e": [16, 0, 0, 0.0, []]})


@unittest.skipUnless(HAVE_TORCH, "needs torch (python3-torch)")
class TestRequestHashes(unittest.TestCase):
    """The connector's requests carry block hashes made once per size,
    outside the timed request, chained as vLLM chains them."""

    @classmethod
    def setUpClass(cls):
        cls.mod = load_bench()

    def connector(self):
        """A Connector without a daemon: what hashes reads of it."""
        conn = self.mod.Connector.__new__(self.mod.Connector)
        conn.bench = types.SimpleNamespace(cfg=types.SimpleNamespace(block_tokens=16), run_id="seed0")
        conn._hashes = {}
        return conn

    def test_a_sizes_hashes_are_made_once_and_chained_over_its_block_names(self):
        conn = self.connector()
        first = conn.hashes(64, 80)  # 4 prefix blocks and 1 of the suffix
        self.assertIs(conn.hashes(64, 80), first)  # made once: a timed request only looks them up
        names = ["seed0-64-0", "seed0-64-1", "seed0-64-2", "seed0-64-3", "seed0-64-suffix-4"]
        prev, want = b"", []
        for n in names:
            prev = hashlib.sha256(prev + n.encode()).digest()
            want.append(prev)
        self.assertEqual(first, want)
        self.assertEqual(conn.hashes(64, 64), want[:4])

    def test_a_request_copies_the_hashes_it_is_given(self):
        hashes = [b"a", b"b"]
        req = self.mod.Request("r", hashes, 32)
        req.block_hashes.append(b"c")  # as vLLM appends a request's new blocks' hashes
        self.assertEqual(hashes, [b"a", b"b"])
