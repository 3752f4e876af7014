"""Bounded waits on a frozen daemon inside vLLM's own code (issue 86, K1
and K3): vLLM's TieringOffloadingManager with KvhostTier, its
reset_cache (reset_prefix_cache's path: OffloadingConnector.reset_cache
-> OffloadingConnectorScheduler.reset_cache -> this) with the daemon
stopped (SIGSTOP) under store and promotion jobs, then resumed: the call
returns within daemon_wait_s, and no byte the resumed daemon writes lands
in a row vLLM handed out again (checked by content). Start and shutdown
with a frozen daemon return within the bound too.

Each call's duration is printed ("kvhost-timing: ...") for the record;
the tests assert only that it is within the bound (plus a scheduling
margin on this shared machine).

Needs a vLLM source tree: `make test-vllm VLLM_SRC=DIR`.
"""

import sys
import time
import unittest

import numpy as np

import daemon as d
import test_vllm_real_kvconnector as rk
import test_vllm_real_spec as rs
from test_vllm_real_tier import NO_TREE, RealTieringCase, key

BOUND = 0.5     # daemon_wait_s in these tests
MARGIN = 1.0    # scheduling slack on a loaded 2-core machine: not part of the claim
BLOCKS = 16


_UNOBSERVED = rs.unobserved()  # the spec worker's layout, as test_vllm_real_spec's


def setUpModule():
    _UNOBSERVED.start()


def tearDownModule():
    _UNOBSERVED.stop()


def vllm_tree_unlink(engine_id):
    """Removes the /dev/shm file of engine_id's CPU region, if left."""
    import os
    import vllm_tree
    try:
        os.unlink(vllm_tree.shm_path(engine_id))
    except FileNotFoundError:
        pass


def timed(what, fn):
    """fn()'s value and its duration, printed for the record."""
    t0 = time.monotonic()
    out = fn()
    took = time.monotonic() - t0
    print(f"kvhost-timing: {what}: {took * 1000:.1f} ms", file=sys.stderr)
    return out, took


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class FrozenDaemonUnderTheTier(RealTieringCase):
    """Each engine on a daemon of its own, frozen and thawed by the test."""

    PATHS = ("on", "off")  # zero-copy (vLLM's /dev/shm region), and the copy through a memfd

    def own_daemon(self):
        dm = d.Daemon()
        self.addCleanup(dm.stop)
        return dm

    def engine_on(self, dm, zero_copy, **tier):
        opts = {"socket": dm.socket, "reconnect_s": 0.05, "zero_copy": zero_copy, "daemon_wait_s": BOUND,
                "lookup_ttl_s": 60.0}
        opts.update(tier)
        h = self.engine(tier=opts, blocks=BLOCKS)
        m, ctx = h.manager, self.ctx()
        m.on_new_request(ctx)
        return h, m, ctx, m.secondary_tiers[0]

    def test_reset_cache_returns_within_the_bound_and_no_late_byte_lands_in_a_reused_row(self):
        for zc in self.PATHS:
            with self.subTest(zero_copy=zc):
                dm = self.own_daemon()
                h, m, ctx, tier = self.engine_on(dm, zc)
                self.frozen_reset(dm, h, ctx, tier, zc, m.reset_cache, "TieringOffloadingManager.reset_cache")

    def test_offloading_connectors_reset_cache_returns_within_the_bound_and_no_late_byte_lands_in_a_reused_row(self):
        # reset_prefix_cache's path from vLLM's scheduler on: vLLM's own
        # OffloadingConnector (scheduler role) over TieringOffloadingSpec
        # with KvhostTier, its reset_cache through OffloadingConnectorScheduler.
        import importlib
        import types
        import test_vllm_real_connector as rc
        base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        oc = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector")
        kci = importlib.import_module("vllm.v1.kv_cache_interface")
        import torch
        spec = kci.FullAttentionSpec(block_size=rc.BLOCK, num_kv_heads=rc.HEADS, head_size=rc.HEAD,
                                     dtype=torch.bfloat16)
        kvc = kci.KVCacheConfig(
            num_blocks=rc.BLOCKS,
            kv_cache_tensors=[kci.KVCacheTensor(size=rc.BLOCKS * spec.page_size_bytes, shared_by=[n])
                              for n in rc.NAMES],
            kv_cache_groups=[kci.KVCacheGroupSpec(layer_names=rc.NAMES, kv_cache_spec=spec)])
        for zc in self.PATHS:
            with self.subTest(zero_copy=zc):
                dm = self.own_daemon()
                vc = rc.vllm_config(dm.socket, v2=True)
                vc.kv_transfer_config.engine_id = f"kvhost-waits-oc-{zc}"
                vc.scheduler_config = types.SimpleNamespace(disable_hybrid_kv_cache_manager=True)
                vc.speculative_config = None
                row = spec.page_size_bytes * len(rc.NAMES)
                extra = vc.kv_transfer_config.kv_connector_extra_config
                extra.clear()
                extra.update({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": BLOCKS * row,
                              "secondary_tiers": [{"type": "KvhostTier", "module_path": "kvhost.vllm",
                                                   "socket": dm.socket, "reconnect_s": 0.05, "zero_copy": zc,
                                                   "daemon_wait_s": BOUND, "lookup_ttl_s": 60.0}]})
                conn = oc.OffloadingConnector(vc, base.KVConnectorRole.SCHEDULER, kvc)
                self.addCleanup(vllm_tree_unlink, f"kvhost-waits-oc-{zc}")
                self.addCleanup(conn.shutdown)
                m = conn.connector_scheduler.manager
                self.assertEqual(m.primary_tier._num_blocks, BLOCKS)
                h, ctx = types.SimpleNamespace(manager=m), self.ctx()
                m.on_new_request(ctx)
                self.frozen_reset(dm, h, ctx, m.secondary_tiers[0], zc, conn.reset_cache,
                                  "OffloadingConnector.reset_cache")

    def frozen_reset(self, dm, h, ctx, tier, zc, reset, what):
        """A promotion and a cascade in flight on the frozen daemon, then
        reset() (vLLM's reset_cache by what): it returns within the bound,
        the rows vLLM hands out again keep the pattern written into them
        after the give-up once the daemon resumed and ended both jobs, and
        the rows held go back to vLLM then."""
        R = self.api.LookupResult
        m = h.manager
        self.assertEqual(tier.data_path, "zero-copy" if zc == "on" else "copy")
        promo = [key(i, f"frozen-promo-{zc}") for i in range(3)]
        want_promo = self.offload(h, promo, ctx, seed=1)
        m.reset_cache()  # the daemon answers: the promotions below come from kvhost
        d.wait_for(lambda: all(tier.lookup(k, ctx) == R.HIT for k in promo), what="the tier's HITs")
        cascade = [key(i, f"frozen-cascade-{zc}") for i in range(4)]
        dm.freeze()
        try:
            # A promotion (the daemon writes vLLM's rows) and a
            # cascade (it reads them) in flight on the frozen daemon.
            self.assertEqual([m.lookup(k, ctx) for k in promo], [R.HIT_PENDING] * 3)
            self.step(m)  # vLLM submits the promotion
            out = m.prepare_store(cascade, ctx)
            rows = self.rows(h)
            want_cascade = np.random.default_rng(2).integers(0, 256, size=(4, rows.shape[1]), dtype=np.uint8)
            for i, b in enumerate(out.store_spec.block_ids):
                rows[int(b)] = want_cascade[i]
            m.complete_store(cascade, ctx)
            d.wait_for(lambda: len(tier._runs) == 2 and all(r.started for r in tier._runs.values()),
                       what="the promotion and the cascade sent to the frozen daemon")
            job_rows = {r.load: list(r.rows) for r in tier._runs.values()}
            _, took = timed(f"{what}, frozen daemon, zero_copy={zc}", reset)
            self.assertLess(took, BOUND + MARGIN, "reset_cache waited on the frozen daemon")
            self.assertEqual(tier.counters()["given_up_jobs"], 2)
            held = set(job_rows[True] + job_rows[False]) if zc == "on" else set()
            # vLLM reuses every row it can: each gets a pattern of its own.
            reuse = [key(i, f"frozen-reuse-{zc}") for i in range(BLOCKS - len(held))]
            got = m.prepare_store(reuse, ctx)
            self.assertIsNotNone(got, "rows not held were kept from vLLM")
            reused = [int(b) for b in got.store_spec.block_ids]
            self.assertEqual(set(reused) & held, set(), "a held row was handed out again")
            self.assertIsNone(m.prepare_store([key(99, f"frozen-one-more-{zc}")], ctx),
                              "vLLM had a row beyond those: a held row is free")
            pattern = {b: np.full(rows.shape[1], (0x5A + 7 * b) & 0xFF, dtype=np.uint8) for b in reused}
            for b in reused:
                rows[b] = pattern[b]
        finally:
            dm.thaw()
        d.wait_for(lambda: tier.counters().get("given_up_jobs_ended", 0) == 2,
                   what="the resumed daemon to end the given-up jobs")
        for b in reused:
            np.testing.assert_array_equal(rows[b], pattern[b], f"the resumed daemon wrote reused row {b}")
        if zc == "on":  # the late promotion landed, in the rows held for it
            np.testing.assert_array_equal(np.stack([rows[b] for b in job_rows[True]]), want_promo)
        del rows
        # Once the daemon ended them, the held rows go back to vLLM.
        m.complete_store(reuse, ctx, False)
        self.step(m)
        self.assertIsNotNone(m.prepare_store([key(i, f"frozen-all-{zc}") for i in range(BLOCKS)], ctx),
                             "rows still held after the daemon ended their jobs")
        h.manager.complete_store([key(i, f"frozen-all-{zc}") for i in range(BLOCKS)], ctx, False)
        # The given-up cascade, finished by the resumed daemon, holds
        # its own bytes; the promotion's keys promote byte for byte.
        m.reset_cache()
        np.testing.assert_array_equal(self.promote_and_read(h, cascade, ctx), want_cascade)
        np.testing.assert_array_equal(self.promote_and_read(h, promo, ctx), want_promo)

    def test_two_kvhost_tiers_given_up_on_the_same_rows_hold_them_until_both_jobs_end(self):
        dm = self.own_daemon()
        opts = {"socket": dm.socket, "zero_copy": "on", "daemon_wait_s": BOUND}
        h = self.engine(tiers=[opts, dict(opts, client_name="vllm-tier-b")], blocks=BLOCKS)
        m, ctx = h.manager, self.ctx()
        m.on_new_request(ctx)
        tiers = m.secondary_tiers
        ks = [key(i, "two-tiers") for i in range(3)]
        out = m.prepare_store(ks, ctx)
        held = {int(b) for b in out.store_spec.block_ids}
        dm.freeze()
        try:
            m.complete_store(ks, ctx)  # one cascade per tier, on the same rows
            d.wait_for(lambda: all(len(t._runs) == 1 and all(r.started for r in t._runs.values()) for t in tiers),
                       what="both cascades sent to the frozen daemon")
            _, took = timed("reset_cache, two tiers, frozen daemon", m.reset_cache)
            self.assertLess(took, 2 * BOUND + MARGIN, "a tier's drain_jobs waited past its bound")
            got = m.prepare_store([key(i, "two-tiers-reuse") for i in range(BLOCKS - len(held))], ctx)
            self.assertIsNotNone(got)
            self.assertEqual({int(b) for b in got.store_spec.block_ids} & held, set())
        finally:
            dm.thaw()
        d.wait_for(lambda: all(t.counters().get("given_up_jobs_ended", 0) == 1 for t in tiers),
                   what="both given-up cascades ended")
        self.step(m)
        self.assertIsNotNone(m.prepare_store([key(i, "two-tiers-after") for i in range(len(held))], ctx),
                             "rows still held once both jobs ended")

    def test_start_with_a_frozen_daemon_returns_within_the_bound_then_connects_once_it_resumes(self):
        R = self.api.LookupResult
        for zc in self.PATHS:
            with self.subTest(zero_copy=zc):
                dm = self.own_daemon()
                dm.freeze()
                try:
                    (h, m, ctx, tier), took = timed(f"tier start, frozen daemon, zero_copy={zc}",
                                                    lambda: self.engine_on(dm, zc))
                    self.assertLess(took, BOUND + MARGIN, "start waited on the frozen daemon")
                    self.assertFalse(tier.counters()["connected"])
                    self.assertEqual(m.lookup(key(0, f"frozen-start-{zc}"), ctx), R.MISS)
                finally:
                    dm.thaw()
                d.wait_for(lambda: tier.counters()["connected"], what="the tier to connect once the daemon resumes")
                self.assert_round_trip(h, [key(i, f"frozen-start-{zc}") for i in range(2)], ctx, seed=3)

    def test_shutdown_with_a_frozen_daemon_returns_within_the_bound(self):
        for zc in self.PATHS:
            with self.subTest(zero_copy=zc):
                dm = self.own_daemon()
                h, m, ctx, tier = self.engine_on(dm, zc)
                ks = [key(i, f"frozen-stop-{zc}") for i in range(4)]
                m.prepare_store(ks, ctx)
                dm.freeze()
                try:
                    m.complete_store(ks, ctx)  # a cascade the daemon never answers
                    d.wait_for(lambda: tier.counters()["inflight_jobs"] == 1, what="the store in flight")
                    self.handles.remove(h)
                    _, took = timed(f"shutdown, frozen daemon, zero_copy={zc}", h.close)
                    self.assertLess(took, BOUND + MARGIN, "shutdown waited on the frozen daemon")
                finally:
                    dm.thaw()


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class FrozenDaemonUnderTheSpec(rs.RealSpecCase):
    """KvhostOffloadingSpec's manager and worker, each on a daemon of its
    own frozen by the test."""

    def own_daemon(self):
        dm = d.Daemon()
        self.addCleanup(dm.stop)
        return dm

    def test_start_with_a_frozen_daemon_returns_within_the_bound_then_connects_once_it_resumes(self):
        dm = self.own_daemon()
        dm.freeze()
        try:
            spec = self.spec(socket=dm.socket, reconnect_s=0.05, daemon_wait_s=BOUND)
            m, took_m = timed("spec manager start, frozen daemon", lambda: self.manager(spec))
            (w, _), took_w = timed("spec worker start, frozen daemon", lambda: self.worker(spec, seed=1))
            self.assertLess(took_m, BOUND + MARGIN, "the manager's start waited on the frozen daemon")
            self.assertLess(took_w, BOUND + MARGIN, "the worker's start waited on the frozen daemon")
            self.assertFalse(m.counters()["connected"] or w.counters()["connected"])
        finally:
            dm.thaw()
        d.wait_for(lambda: m.counters()["connected"] and w.counters()["connected"],
                   what="the manager and the worker to connect once the daemon resumes")
        ctx = self.api.ReqContext(req_id="thawed")
        ks = [rs.key(i, "frozen-spec-start") for i in range(2)]
        out = d.wait_for(lambda: (lambda o: o if o is not None and o.keys_to_store else None)(m.prepare_store(ks, ctx)),
                         what="stores let through")
        self.assertTrue(self.transfer(w, True, out.store_spec, [1, 2]).success)
        m.complete_store(out.keys_to_store, ctx)
        for k in ks:
            self.assertEqual(self.settle(m, k, ctx), self.api.LookupResult.HIT)

    def test_shutdown_with_a_frozen_daemon_returns_within_the_bound(self):
        dm = self.own_daemon()
        spec = self.spec(socket=dm.socket, reconnect_s=0.05, daemon_wait_s=BOUND)
        m = self.manager(spec)
        w, _ = self.worker(spec, seed=2)
        ctx = self.api.ReqContext(req_id="stopping")
        ks = [rs.key(i, "frozen-spec-stop") for i in range(2)]
        out = d.wait_for(lambda: (lambda o: o if o is not None and o.keys_to_store else None)(m.prepare_store(ks, ctx)),
                         what="stores let through")
        dm.freeze()
        try:
            self.assertTrue(w.submit_store(99, self.gpu([1, 2]), out.store_spec))  # never answered
            d.wait_for(lambda: w.counters()["unsent_jobs"] == 0, what="the store sent to the frozen daemon")
            m.lookup(rs.key(9, "frozen-spec-stop"), ctx)  # a pin round the frozen daemon never answers
            _, took_w = timed("spec worker shutdown, frozen daemon", w.shutdown)
            _, took_m = timed("spec manager shutdown, frozen daemon", m.shutdown)
            self.assertLess(took_w, BOUND + MARGIN, "the worker's shutdown waited on the frozen daemon")
            self.assertLess(took_m, BOUND + MARGIN, "the manager's shutdown waited on the frozen daemon")
        finally:
            dm.thaw()


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class FrozenDaemonUnderTheKvConnector(rk.RealKvConnectorCase):
    """KvhostConnector's scheduler and worker (vLLM's factory, vLLM's
    KV-connector classes) on the class's daemon, frozen by the test."""

    def test_a_load_the_frozen_daemon_does_not_end_is_given_up_within_the_bound_and_its_blocks_held(self):
        torch = self.torch
        sched, worker, kv = self.engine(seed=11, load_split="all", daemon_wait_s=BOUND)
        nblk = 2 * rk.BPC + 1
        src = list(range(1, 1 + nblk))
        self.save_prompt(sched, worker, self.request("a", "kvc-frozen", nblk), src)
        want = self.rows(kv, src[:2 * rk.BPC])
        dst = list(range(30, 30 + nblk))
        loaded = dst[:2 * rk.BPC]
        req = self.request("b", "kvc-frozen", nblk)
        n, _ = sched.get_num_new_matched_tokens(req, 0)
        self.assertEqual(n, 2 * rk.BPC * rk.BLOCK)
        sched.update_state_after_alloc(req, self.blocks(dst), n)
        req.num_computed_tokens = n
        meta = sched.build_connector_meta(self.output(new=[(req, dst)], scheduled={req.request_id: rk.BLOCK}))
        others = list(range(40, rk.NBLOCKS))  # blocks vLLM hands to other requests meanwhile
        self.daemon.freeze()
        try:
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)

            def layers():
                for name in rk.NAMES:
                    worker.wait_for_layer_load(name)
                    worker.save_kv_layer(name, None, None)
                worker.wait_for_save()
            _, took = timed("a step's layer loads, frozen daemon", layers)
            self.assertLess(took, BOUND + MARGIN, "the step's loads waited on the frozen daemon")
            sending, _ = worker.get_finished(set())
            errors = worker.get_block_ids_with_load_errors()
            worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            self.assertEqual(set(errors), set(loaded), "the given-up load's blocks are not recomputed")
            # The request ends (vLLM's "fail" policy, or it finishes): vLLM
            # keeps its blocks until a worker reports it.
            req.status = self.req_mod.RequestStatus.FINISHED_ABORTED
            self.assertEqual(sched.request_finished(req, dst), (True, None))
            out = self.step(sched, worker, self.output(finished={req.request_id}))
            self.assertNotIn(req.request_id, out.finished_sending or set(), "reported while the daemon may write")
            for b in others:
                for name in rk.NAMES:
                    kv[name][b].view(torch.int8).fill_((b * 7) % 251 - 125)
            pattern = self.rows(kv, others)
        finally:
            self.daemon.thaw()

        def reported():
            out = self.step(sched, worker, self.output())
            return req.request_id in (out.finished_sending or set())
        d.wait_for(reported, what="the request reported once the daemon ended its given-up load")
        self.assertEqual(self.rows(kv, others), pattern, "the resumed daemon wrote a block vLLM handed out")
        self.assertEqual(self.rows(kv, loaded), want, "the late load landed outside the blocks held for it")

    def test_the_release_of_a_steps_pins_never_waits_on_a_frozen_daemon_and_a_later_call_finds_it_unanswered(self):
        # vLLM's update_connector_output releases the pins of a step whose
        # loads ended: the unpins are sent without waiting for their
        # replies, and the first call daemon_wait_s after them finds them
        # unanswered; nothing is claimed until the daemon answers again.
        sched, worker, kv = self.engine(seed=15, load_split="all", daemon_wait_s=BOUND, reconnect_s=0.05)
        nblk = 2 * rk.BPC + 1
        self.save_prompt(sched, worker, self.request("a", "kvc-frozen-unpin", nblk), list(range(1, 1 + nblk)))
        req = self.request("b", "kvc-frozen-unpin", nblk)
        n, _ = sched.get_num_new_matched_tokens(req, 0)
        self.assertEqual(n, 2 * rk.BPC * rk.BLOCK)
        dst = list(range(30, 30 + nblk))
        sched.update_state_after_alloc(req, self.blocks(dst), n)
        req.num_computed_tokens = n
        so = self.output(new=[(req, dst)], scheduled={req.request_id: rk.BLOCK})
        sending, errors, wm = rk.worker_step(worker, sched.build_connector_meta(so), so.finished_req_ids)
        self.assertEqual(set(errors), set(), "the step's load failed")
        out = self.outputs.KVConnectorOutput(finished_sending=sending, finished_recving=None,
                                             invalid_block_ids=errors, kv_connector_worker_meta=wm)
        self.daemon.freeze()
        try:
            _, took = timed("update_connector_output (the step's unpins), frozen daemon",
                            lambda: sched.update_connector_output(out))
            released = time.monotonic()
            self.assertLess(took, MARGIN, "the unpins waited on the frozen daemon")
            calls = []

            def unclaimed():
                got, took = timed("get_num_new_matched_tokens, frozen daemon, unpins unanswered",
                                  lambda: sched.get_num_new_matched_tokens(self.request("c", "kvc-frozen-unpin", nblk), 0))
                calls.append((time.monotonic() - released, took))
                return got == (0, False)
            d.wait_for(unclaimed, what="a call to find the unpins unanswered and claim nothing")
            self.assertGreater(calls[-1][0], BOUND, "found unanswered before daemon_wait_s")
            self.assertFalse(sched.counters()["answering"])
            self.assertLess(max(took for _, took in calls), BOUND, "a call waited on the frozen daemon")
        finally:
            self.daemon.thaw()
        d.wait_for(lambda: sched.counters()["answering"], what="the probe to find the daemon answering")
        self.assertEqual(sched.get_num_new_matched_tokens(self.request("d", "kvc-frozen-unpin", nblk), 0),
                         (2 * rk.BPC * rk.BLOCK, False))

    def test_the_schedulers_calls_never_wait_on_a_frozen_daemons_pin_and_find_it_unanswered(self):
        # The pin is sent without waiting for its reply: the scheduler's
        # call returns at once. The first call daemon_wait_s after it
        # finds it unanswered, and from then on nothing is claimed until
        # the daemon answers.
        sched, worker, kv = self.engine(seed=14, load_split="all", daemon_wait_s=BOUND, reconnect_s=0.05)
        nblk = 2 * rk.BPC + 1
        self.save_prompt(sched, worker, self.request("a", "kvc-frozen-sched", nblk), list(range(1, 1 + nblk)))
        first, again = self.request("b", "kvc-frozen-sched", nblk), self.request("c", "kvc-frozen-sched", nblk)
        self.daemon.freeze()
        try:
            (n, _), took_lookup = timed("get_num_new_matched_tokens, frozen daemon (the lookup table answers)",
                                        lambda: sched.get_num_new_matched_tokens(first, 0))
            _, took_pin = timed("update_state_after_alloc (a pin, not waited for), frozen daemon",
                                lambda: sched.update_state_after_alloc(first, self.blocks(list(range(30, 30 + nblk))), n))
            pinned = time.monotonic()
            self.assertLess(took_lookup, BOUND + MARGIN)
            self.assertLess(took_pin, MARGIN, "the pin waited on the frozen daemon")
            calls = []

            def unclaimed():
                got, took = timed("get_num_new_matched_tokens, frozen daemon, pin unanswered",
                                  lambda: sched.get_num_new_matched_tokens(again, 0))
                calls.append((time.monotonic() - pinned, took))
                return got == (0, False)
            d.wait_for(unclaimed, what="a call to find the pin unanswered and claim nothing")
            self.assertGreater(calls[-1][0], BOUND, "found unanswered before daemon_wait_s")
            self.assertFalse(sched.counters()["answering"])
            self.assertLess(max(took for _, took in calls), BOUND, "a call waited on the frozen daemon")
            got, took = timed("get_num_new_matched_tokens once found unanswered, frozen daemon",
                              lambda: sched.get_num_new_matched_tokens(self.request("e", "kvc-frozen-sched", nblk), 0))
            self.assertEqual(got, (0, False))
            self.assertLess(took, BOUND, "a call waited on the daemon again")
        finally:
            self.daemon.thaw()
        d.wait_for(lambda: sched.counters()["answering"], what="the probe to find the daemon answering")
        self.assertEqual(sched.get_num_new_matched_tokens(self.request("d", "kvc-frozen-sched", nblk), 0),
                         (2 * rk.BPC * rk.BLOCK, False))

    def test_start_with_a_frozen_daemon_returns_within_the_bound_then_connects_once_it_resumes(self):
        vc, kvc = self.vllm_config(daemon_wait_s=BOUND, reconnect_s=0.05), self.kv_cache_config()
        role = self.base.KVConnectorRole
        self.daemon.freeze()
        try:
            sched, took_s = timed("connector scheduler start, frozen daemon",
                                  lambda: self.factory.KVConnectorFactory.create_connector(vc, role.SCHEDULER, kvc))
            self.closers.append(sched.shutdown)
            worker = self.factory.KVConnectorFactory.create_connector(vc, role.WORKER, kvc)
            self.closers.append(worker.shutdown)
            kv = rk.layer_caches(self.torch, self.closers, 12, rk.NBLOCKS)
            _, took_w = timed("connector worker register_kv_caches, frozen daemon",
                              lambda: worker.register_kv_caches(kv))
            self.assertLess(took_s, BOUND + MARGIN, "the scheduler's start waited on the frozen daemon")
            self.assertLess(took_w, BOUND + MARGIN, "the worker's start waited on the frozen daemon")
            self.assertFalse(sched.counters()["connected"] or worker.counters()["connected"])
        finally:
            self.daemon.thaw()
        d.wait_for(lambda: sched.counters()["connected"] and worker.counters()["connected"],
                   what="both halves to connect once the daemon resumes")

    def test_shutdown_with_a_frozen_daemon_returns_within_the_bound(self):
        sched, worker, _ = self.engine(seed=13, daemon_wait_s=BOUND)
        nblk = 2 * rk.BPC + 1
        req = self.request("s", "kvc-frozen-stop", nblk)
        ids = list(range(1, 1 + nblk))
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (0, False))
        sched.update_state_after_alloc(req, self.blocks(ids), 0)
        self.daemon.freeze()
        try:
            self.step(sched, worker, self.output(new=[(req, ids)], scheduled={req.request_id: req.num_tokens}))
            d.wait_for(lambda: worker.counters()["stores_in_flight"] > 0, what="a save sent to the frozen daemon")
            _, took_w = timed("connector worker shutdown, frozen daemon", worker.shutdown)
            _, took_s = timed("connector scheduler shutdown, frozen daemon", sched.shutdown)
            self.assertLess(took_w, BOUND + MARGIN, "the worker's shutdown waited on the frozen daemon")
            self.assertLess(took_s, BOUND + MARGIN, "the scheduler's shutdown waited on the frozen daemon")
        finally:
            self.daemon.thaw()


if __name__ == "__main__":
    unittest.main()
