"""KvhostConnector under pipeline parallelism, in vLLM's real modules:
the scheduler built by vLLM's KVConnectorFactory from stage 0's
KVCacheConfig (vLLM's generate_scheduler_kv_cache_config copies worker
0's), each stage's workers from their own stage's (the same groups and
specs, the stage's layers; a group may hold no layer of a stage, as
vLLM's _project_kv_cache_groups_to_worker leaves it), and the workers'
handshake metadata handed to the scheduler as vLLM's EngineCore does
({(pp rank, tp rank): metadata}, pickled across the process boundary,
into set_xfer_handshake_metadata_pp_aware), against a real kvhost daemon
on host-memory tensors.

Needs a vLLM source tree: `make test-vllm VLLM_SRC=DIR`; without one every
test here reports itself skipped.
"""

import pickle
import unittest
from unittest import mock

import test_vllm_real_hybrid as rh
from test_vllm_real_hybrid import BLOCK, BPC, CHUNK, HybridCase

NO_TREE = rh.NO_TREE

# Per stage, the layers of each KV-cache group (in the order of the kinds
# the engine is built of): stage 0 holds no layer of the window group nor
# of the Mamba group.
L = "model.layers.{}.self_attn.attn"
HYBRID_STAGES = (([L.format(0)], [], []), ([L.format(2)], [L.format(1), L.format(3)], list(rh.MAMBA)))
# One group (full attention or MLA): a layer on stage 0, three on stage 1.
FULL_STAGES = (([L.format(0)],), ([L.format(i) for i in (1, 2, 3)],))


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class StagesCase(HybridCase):
    """An engine of pipeline stages through vLLM's factory."""

    def vllm_config(self, tp=1, rank=0, mla=False, pp=1, **extra):
        vc = super().vllm_config(tp=tp, rank=rank, mla=mla, **extra)
        vc.parallel_config.pipeline_parallel_size = pp
        vc.parallel_config.world_size = tp * pp
        return vc

    def stage_config(self, layers, kinds):
        """vLLM's KVCacheConfig of one stage (layers: per group of kinds,
        its layer names there) and its {layer name: spec}."""
        k = self.kci
        specs = [g.kv_cache_spec for g in self.specs(kinds)[0]]
        groups = [k.KVCacheGroupSpec(layer_names=list(names), kv_cache_spec=spec) for names, spec in zip(layers, specs)]
        mine = {n: spec for names, spec in zip(layers, specs) for n in names}
        kvc = k.KVCacheConfig(num_blocks=rh.NBLOCKS,
                              kv_cache_tensors=[k.KVCacheTensor(size=rh.NBLOCKS * s.page_size_bytes, shared_by=[n])
                                                for n, s in mine.items()],
                              kv_cache_groups=groups)
        return kvc, mine

    def stages(self, stages=HYBRID_STAGES, kinds=("full", "window", "mamba"), tp=1, seed=0, handshake=True,
               mla=False, **extra):
        """The scheduler (of stage 0's config) and, per stage and shard,
        (stage, worker, caches); the workers' handshake handed to the
        scheduler where handshake."""
        pp, role = len(stages), self.base.KVConnectorRole
        configs = [self.stage_config(s, kinds) for s in stages]
        sched = self.factory.KVConnectorFactory.create_connector(
            self.vllm_config(tp=tp, pp=pp, mla=mla, **extra), role.SCHEDULER, configs[0][0])
        self.closers.append(sched.shutdown)
        workers = []
        for s, (kvc, mine) in enumerate(configs):
            for r in range(tp):
                w = self.factory.KVConnectorFactory.create_connector(
                    self.vllm_config(tp=tp, rank=s * tp + r, pp=pp, mla=mla, **extra), role.WORKER, kvc)
                self.closers.append(w.shutdown)
                kv = self.caches(mine, seed + 10 * s + r)
                w.register_kv_caches(kv)
                workers.append((s, w, kv))
        if handshake:
            self.handshake(sched, workers)
        return sched, workers

    @staticmethod
    def handshake(sched, workers, only=None):
        """EngineCore's collection of the workers' handshake metadata (of
        the stages in only; None: all): per worker {(pp rank, tp rank):
        metadata}, pickled as the executor's RPC does, merged."""
        content, seen = {}, {}
        for s, w, _ in workers:
            if only is not None and s not in only:
                continue
            r = seen[s] = seen.get(s, -1) + 1
            content.update(pickle.loads(pickle.dumps({(s, r): w.get_handshake_metadata()})))
        sched.set_xfer_handshake_metadata_pp_aware(content)

    def save_on(self, sched, pairs, req, ids):
        """req computed in ids (one list per group) and saved by the
        workers of pairs only (the others' stores did not happen), nothing
        claimed; stepped until they report its stores ended."""
        sched.update_state_after_alloc(req, self.group_blocks(ids), 0)
        self.step(sched, pairs, self.group_output(new=[(req, ids)], scheduled={req.request_id: req.num_tokens}))
        sched.request_finished_all_groups(req, tuple([] for _ in ids))
        finished = {req.request_id}

        def stored():
            done, _ = self.step(sched, pairs, self.group_output(finished=finished))
            finished.clear()
            return req.request_id in done
        rh.rk.d.wait_for(stored, what=f"{req.request_id}'s stores ended")

    @staticmethod
    def pairs(workers, stages=None):
        """(worker, caches) of the stages in stages (None: every one), as
        HybridCase's steps take them."""
        return [(w, kv) for s, w, kv in workers if stages is None or s in stages]

    def model_of(self, worker, group=0):
        """The namespace (model id) of worker's group at its shard."""
        from kvhost.vllm import connector
        return connector.geometry(worker._ident, worker._worker.shard, None, group).model


class PipelineStagesTest(StagesCase):
    def test_a_prefix_saved_by_every_stage_loads_byte_for_byte_on_every_stage(self):
        sched, workers = self.stages(seed=3, load_split="all")
        nblk = 4 * BPC + 1
        src = [list(range(1, 1 + nblk)), list(range(20, 20 + nblk)), list(range(40, 40 + nblk))]
        before = self.namespaces()
        self.save_prompt(sched, self.pairs(workers), self.request("a", "pp-hybrid", nblk), src)
        # Stage 0: full attention's 4 keys; stage 1 those, the window's and
        # a state per chunk boundary; four namespaces, none shared.
        got = self.stored_since(before)
        self.assertEqual(sorted(k for _, k, _ in got), [4] * 4, got)
        (_, w0, kv0), (_, w1, kv1) = workers
        self.assertEqual({m for m, _, _ in got}, {self.model_of(w0, 0), self.model_of(w1, 0), self.model_of(w1, 1),
                                                  self.model_of(w1, 2)})
        claimed = 4 * BPC
        full, window, mamba = range(3)

        def pages(kv, stage, ids):
            return {n: [self.page(kv, n, b) for b in ids[g][:claimed]]
                    for g, names in enumerate(HYBRID_STAGES[stage]) for n in names}
        want = [pages(kv0, 0, src), pages(kv1, 1, src)]
        dst = [list(range(60, 60 + nblk)), list(range(70, 70 + nblk)), list(range(80, 80 + nblk))]
        old = [pages(kv0, 0, dst), pages(kv1, 1, dst)]
        errors = self.load(sched, self.pairs(workers), self.request("b", "pp-hybrid", nblk), dst, claimed * BLOCK)
        self.assertEqual(errors, set())
        first_window_block = (claimed * BLOCK - rh.WINDOW + 1) // BLOCK
        for stage, kv in ((0, kv0), (1, kv1)):
            got = pages(kv, stage, dst)
            for n in HYBRID_STAGES[stage][full]:
                self.assertEqual(got[n], want[stage][n], (stage, n))
            for n in HYBRID_STAGES[stage][window]:
                self.assertEqual(got[n][first_window_block:], want[stage][n][first_window_block:], (stage, n))
                self.assertEqual(got[n][:first_window_block], old[stage][n][:first_window_block], (stage, n))
            for n in HYBRID_STAGES[stage][mamba]:
                self.assertEqual(got[n][claimed - 1], want[stage][n][claimed - 1], (stage, n))
        # The two stages' tensors hold different bytes: each loaded its own.
        self.assertNotEqual(want[0][L.format(0)], want[1][L.format(2)])

    def test_a_hybrid_claim_is_priced_by_every_stages_own_groups(self):
        from kvhost.vllm import _conn_groups as G
        sched, workers = self.stages(seed=9)  # load_split "auto": the split prices the claim
        nblk = 4 * BPC + 1
        src = [list(range(1, 1 + nblk)), list(range(20, 20 + nblk)), list(range(40, 40 + nblk))]
        self.save_prompt(sched, self.pairs(workers), self.request("a", "pp-priced", nblk), src)
        sched.get_num_new_matched_tokens(self.request("b", "pp-priced", nblk), 0)
        hit, want = 4 * CHUNK, []
        for s, w, _ in workers:  # per stage its groups' bytes of the 4-chunk hit, and its layers
            gs = G.groups(w._ident)
            want.append((G.load_bytes(gs, hit, CHUNK) / hit, sum(len(g.layer_names) for g in gs)))
        self.assertEqual(sched.cost_model.stages, tuple(want))
        # Stage 1 holds the window's and the Mamba group's layers too.
        self.assertGreater(want[1][0], want[0][0])

    def test_no_stage_loads_another_stages_layers(self):
        sched, workers = self.stages(FULL_STAGES, ("full",), seed=5, load_split="all")
        nblk = 3 * BPC + 1
        before = self.namespaces()
        self.save_prompt(sched, self.pairs(workers), self.request("a", "pp-layers", nblk), [list(range(1, 1 + nblk))])
        page = self.specs(("full",))[1][rh.FULL[0]].page_size_bytes
        payload = 3 * BPC * page
        got = {m: (k, b) for m, k, b in self.stored_since(before)}
        for s, w, _ in workers:  # each stage's namespace holds its own layers' pages, of 3 keys
            keys, nbytes = got[self.model_of(w)]
            layers = len(FULL_STAGES[s][0])
            self.assertEqual(w._ident["stage"], s)
            self.assertEqual(keys, 3)
            self.assertGreaterEqual(nbytes, layers * payload)
            self.assertLess(nbytes, (layers + 1) * payload)
        dst = [list(range(40, 40 + nblk))]
        self.assertEqual(self.load(sched, self.pairs(workers), self.request("b", "pp-layers", nblk), dst,
                                   3 * BPC * BLOCK), set())
        for s, w, kv in workers:  # its own layers' bytes, from its own layers' pages
            self.assertEqual(w.counters()["bytes_loaded"], len(FULL_STAGES[s][0]) * payload, s)
            for n in FULL_STAGES[s][0]:
                self.assertEqual([self.page(kv, n, b) for b in dst[0][:3 * BPC]],
                                 [self.page(kv, n, b) for b in range(1, 1 + 3 * BPC)], (s, n))

    def test_a_prefix_held_by_one_stage_only_is_not_a_hit(self):
        sched, workers = self.stages(FULL_STAGES, ("full",), seed=6, load_split="all")
        both, stage0 = self.pairs(workers), self.pairs(workers, {0})
        before = self.namespaces()
        # Both stages hold the first 2 chunks of prompt x; stage 0 alone
        # holds its next 2 (stage 1's stores did not happen) and all of y.
        self.save_prompt(sched, both, self.request("a", "pp-x", 2 * BPC + 1), [list(range(1, 2 + 2 * BPC))])
        for rid, tag in (("b", "pp-x"), ("c", "pp-y")):
            self.save_on(sched, stage0, self.request(rid, tag, 4 * BPC + 1), [list(range(30, 31 + 4 * BPC))])
        (_, w0, _), (_, w1, _) = workers
        got = {m: k for m, k, _ in self.stored_since(before)}
        self.assertEqual(w0.counters()["store_keys"], 2 + 4 + 4)
        self.assertEqual(w1.counters()["store_keys"], 2)
        self.assertEqual((got[self.model_of(w0)], got[self.model_of(w1)]), (4 + 4, 2))
        self.assertEqual(sched.get_num_new_matched_tokens(self.request("d", "pp-x", 4 * BPC + 1), 0),
                         (2 * CHUNK, False))
        self.assertEqual(sched.get_num_new_matched_tokens(self.request("e", "pp-y", 4 * BPC + 1), 0), (0, False))

    def test_a_claims_keys_are_pinned_in_every_stages_namespace_until_loaded(self):
        sched, workers = self.stages(FULL_STAGES, ("full",), seed=8, load_split="all")
        nblk = 2 * BPC + 1
        self.save_prompt(sched, self.pairs(workers), self.request("a", "pp-pins", nblk), [list(range(1, 1 + nblk))])
        req = self.request("b", "pp-pins", nblk)
        n, _ = sched.get_num_new_matched_tokens(req, 0)
        self.assertEqual(n, 2 * CHUNK)
        client = sched._scheduler._client
        with mock.patch.object(client, "pin_later", wraps=client.pin_later) as pin:
            sched.update_state_after_alloc(req, self.group_blocks([list(range(40, 40 + nblk))]), n)
        self.assertEqual({c.args[0].geometry.model for c in pin.call_args_list},
                         {self.model_of(w) for _, w, _ in workers})
        req.num_computed_tokens = n
        self.step(sched, self.pairs(workers), self.group_output(new=[(req, [list(range(40, 40 + nblk))])],
                                                                scheduled={"b": BLOCK}))
        # The pins' replies, taken as the step's output released them.
        self.assertEqual(sched.counters().get("pin_missed_keys", 0), 0)
        self.assertEqual(sched.counters().get("pin_errors", 0), 0)
        self.assertEqual(sched.counters()["pinned_steps"], 0)

    def test_the_scheduler_claims_nothing_until_every_stage_has_told_it_its_layers(self):
        sched, workers = self.stages(FULL_STAGES, ("full",), seed=7, handshake=False, load_split="all")
        nblk = 2 * BPC + 1
        self.save_prompt(sched, self.pairs(workers), self.request("a", "pp-late", nblk), [list(range(1, 1 + nblk))])
        self.assertEqual(sched.get_num_new_matched_tokens(self.request("b", "pp-late", nblk), 0), (0, False))
        self.handshake(sched, workers, only={0})
        self.assertEqual(sched.get_num_new_matched_tokens(self.request("c", "pp-late", nblk), 0), (0, False))
        self.assertGreaterEqual(sched.counters()["stages_unknown"], 2)
        self.handshake(sched, workers)
        self.assertEqual(sched.get_num_new_matched_tokens(self.request("d", "pp-late", nblk), 0),
                         (2 * CHUNK, False))

    def test_a_stage_whose_identity_differs_beyond_its_layers_is_refused_by_name(self):
        sched, workers = self.stages(FULL_STAGES, ("full",), handshake=False)
        metas = {(s, 0): w.get_handshake_metadata() for s, w, _ in workers}
        metas[(1, 0)].ident["fields"]["dtype"] = "float16"
        with self.assertRaisesRegex(ValueError, r"stage 1.*fields\.dtype"):
            sched.set_xfer_handshake_metadata_pp_aware(metas)

    def test_another_connectors_handshake_metadata_is_ignored(self):
        # vLLM's MultiConnector hands every connector every worker's.
        sched, workers = self.stages(FULL_STAGES, ("full",), handshake=False)
        metas = {(s, 0): w.get_handshake_metadata() for s, w, _ in workers}
        metas[(0, 1)] = self.base.KVConnectorHandshakeMetadata()
        sched.set_xfer_handshake_metadata_pp_aware(metas)
        nblk = 2 * BPC + 1
        self.save_prompt(sched, self.pairs(workers), self.request("a", "pp-multi", nblk), [list(range(1, 1 + nblk))])
        self.assertEqual(sched.get_num_new_matched_tokens(self.request("b", "pp-multi", nblk), 0), (2 * CHUNK, False))

    def test_no_handshake_metadata_without_pipeline_stages(self):
        _, workers, _ = self.engine(kinds=("full",))
        self.assertIsNone(workers[0][0].get_handshake_metadata())

    def test_pp2_tp2_every_worker_loads_its_stage_and_shard_byte_for_byte(self):
        sched, workers = self.stages(FULL_STAGES, ("full",), tp=2, seed=9, load_split="all")
        nblk = 3 * BPC + 1
        src = [list(range(1, 1 + nblk))]
        before = self.namespaces()
        self.save_prompt(sched, self.pairs(workers), self.request("a", "pp-tp", nblk), src)
        got = self.stored_since(before)
        self.assertEqual(sorted(k for _, k, _ in got), [3] * 4, got)  # a namespace per stage and shard
        self.assertEqual(len({self.model_of(w) for _, w, _ in workers}), 4)
        want = [{n: [self.page(kv, n, b) for b in src[0][:3 * BPC]] for n in FULL_STAGES[s][0]}
                for s, _, kv in workers]
        dst = [list(range(40, 40 + nblk))]
        self.assertEqual(self.load(sched, self.pairs(workers), self.request("b", "pp-tp", nblk), dst,
                                   3 * BPC * BLOCK), set())
        for i, (s, _, kv) in enumerate(workers):
            for n in FULL_STAGES[s][0]:
                self.assertEqual([self.page(kv, n, b) for b in dst[0][:3 * BPC]], want[i][n], (s, i, n))

    def test_mla_at_pp2_tp2_stores_one_copy_per_stage(self):
        sched, workers = self.stages(FULL_STAGES, ("mla",), tp=2, seed=11, mla=True, load_split="all")
        nblk = 2 * BPC + 1
        before = self.namespaces()
        self.save_prompt(sched, self.pairs(workers), self.request("a", "pp-mla", nblk), [list(range(1, 1 + nblk))])
        got = self.stored_since(before)
        self.assertEqual(sorted(k for _, k, _ in got), [2, 2], got)  # one namespace per stage, shard 0's
        dst = [list(range(40, 40 + nblk))]
        self.assertEqual(self.load(sched, self.pairs(workers), self.request("b", "pp-mla", nblk), dst,
                                   2 * BPC * BLOCK), set())
        for s in (0, 1):
            (k0, k1) = [kv for st, _, kv in workers if st == s]
            for n in FULL_STAGES[s][0]:  # shard 1 loads shard 0's copy
                want = [self.page(k0, n, b) for b in range(1, 1 + 2 * BPC)]
                self.assertEqual([self.page(k1, n, b) for b in dst[0][:2 * BPC]], want, (s, n))


if __name__ == "__main__":
    unittest.main()
