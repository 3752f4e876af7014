"""The connector's KV-cache group rules (_conn_groups), without vLLM: what
a claim needs of each kind of group, which blocks a load fills and a
save takes, what a load costs the split, and the namespaces of pipeline
stages."""

import pathlib
import pickle
import sys
import unittest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import kvhost  # noqa: E402
import test_vllm_connector as dc  # noqa: E402
from kvhost import protocol as p  # noqa: E402
from kvhost.vllm import _conn_groups as G  # noqa: E402
from kvhost.vllm import connector as C  # noqa: E402
from test_vllm_connector import BLOCK, NAMES, PAGE, offloading_config  # noqa: E402
from vllm_specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec, kv_cache_config  # noqa: E402

BPC = 2
CHUNK = BPC * BLOCK


def group(kind, index=0, layers=2, window=0, page=PAGE):
    return G.KVGroup(index=index, kind=kind, layer_names=tuple(f"l{index}.{i}" for i in range(layers)),
                     tokens_per_block=BLOCK, page_bytes=page, window=window)


class ClaimNeeds(unittest.TestCase):
    def test_each_kind_needs_its_own_chunks_of_a_claim(self):
        end = 8 * CHUNK
        cases = [
            (group(G.FULL), range(2, 8)),                    # every chunk from the first claimed
            (group(G.MLA), range(2, 8)),
            (group(G.WINDOW, window=BLOCK + 1), range(7, 8)),  # the window's 17 tokens: the last chunk
            (group(G.WINDOW, window=CHUNK + 1), range(7, 8)),  # 33: the token and the 32 before it
            (group(G.WINDOW, window=CHUNK + 2), range(6, 8)),  # 34 tokens reach into the chunk before
            (group(G.WINDOW, window=100 * CHUNK), range(2, 8)),  # a window longer than the claim: all of it
            (group(G.STATE), range(7, 8)),                   # the state at the end
        ]
        for g, want in cases:
            with self.subTest(kind=g.kind, window=g.window):
                self.assertEqual(G.claim_needs(g, 2, end, CHUNK), want)


class LoadAndSaveBlocks(unittest.TestCase):
    def test_a_window_load_leaves_out_the_blocks_before_the_window_and_on_the_gpu(self):
        g = group(G.WINDOW, window=2 * BLOCK + 1)
        ids = list(range(100, 108))
        end = 4 * BLOCK  # token 64 attends to tokens 32-64: blocks 2 and 3
        got = G.load_blocks(g, [1], ids, BPC, skip=0, end=end)
        self.assertEqual(got, [(1, [102, 103])])
        got = G.load_blocks(g, [1], ids, BPC, skip=3, end=end)  # block 2 is on the GPU already
        self.assertEqual(got, [(1, [p.NO_BLOCK, 103])])

    def test_a_window_load_is_refused_where_vllm_gave_a_null_block_inside_the_window(self):
        g = group(G.WINDOW, window=2 * BLOCK + 1)
        self.assertIsNone(G.load_blocks(g, [1], [100, 101, 0, 103], BPC, skip=0, end=4 * BLOCK))
        # A null block outside the window is vLLM's, and left out.
        self.assertEqual(G.load_blocks(g, [1], [0, 0, 102, 103], BPC, skip=0, end=4 * BLOCK), [(1, [102, 103])])

    def test_a_full_load_names_each_keys_blocks_and_leaves_out_keys_needing_none(self):
        g = group(G.FULL)
        ids = [100, 101, 102, 103, 104, 105]
        cases = [  # chunks, skip (blocks on the GPU), want
            ([0, 1, 2], 0, [(0, [100, 101]), (1, [102, 103]), (2, [104, 105])]),
            ([0, 1, 2], 3, [(1, [p.NO_BLOCK, 103]), (2, [104, 105])]),  # key 0 all on the GPU: left out
            ([2, 0], 0, [(2, [104, 105]), (0, [100, 101])]),  # the chunks' order is kept
            ([3], 0, None),  # past the request's blocks
        ]
        for chunks, skip, want in cases:
            with self.subTest(chunks=chunks, skip=skip):
                self.assertEqual(G.load_blocks(g, chunks, ids, BPC, skip=skip, end=6 * BLOCK), want)
        # A key whose needed ids are all NO_BLOCK moves nothing: left out too.
        self.assertEqual(G.load_blocks(g, [0, 1], [7, p.NO_BLOCK, p.NO_BLOCK, 9], BPC, skip=1, end=4 * BLOCK),
                         [(1, [p.NO_BLOCK, 9])])

    def test_a_state_load_fills_only_the_block_at_the_claims_end(self):
        g = group(G.STATE)
        ids = [0, 0, 0, 7, 0, 0]
        self.assertEqual(G.load_blocks(g, [1], ids, BPC, skip=0, end=4 * BLOCK), [(1, [7])])
        self.assertIsNone(G.load_blocks(g, [2], ids, BPC, skip=0, end=6 * BLOCK))  # no block for the state

    def test_saves_take_what_vllm_holds_and_nothing_it_freed(self):
        full, win, state = group(G.FULL), group(G.WINDOW, window=2 * BLOCK + 1), group(G.STATE)
        self.assertEqual(G.save_blocks(full, 1, [1, 2, 3, 4], BPC), [3, 4])
        self.assertEqual(G.save_blocks(win, 1, [0, 0, 3, 4], BPC), [3, 4])
        self.assertIsNone(G.save_blocks(win, 0, [0, 0, 3, 4], BPC))  # freed outside the window
        self.assertEqual(G.save_blocks(state, 1, [0, 0, 0, 9], BPC), [9])
        self.assertIsNone(G.save_blocks(state, 0, [0, 0, 0, 9], BPC))  # no state kept at that boundary


class SplitCost(unittest.TestCase):
    def test_a_window_group_costs_its_window_not_the_prompt(self):
        full, win = group(G.FULL), group(G.WINDOW, index=1, window=128)
        per_block = PAGE * 2
        for tokens in (CHUNK, 1024, 8192, 32768):
            with self.subTest(tokens=tokens):
                window_part = G.load_bytes([win], tokens, CHUNK)
                self.assertLessEqual(window_part, (128 // BLOCK + CHUNK // BLOCK) * per_block)
                self.assertEqual(G.load_bytes([full, win], tokens, CHUNK),
                                 tokens // BLOCK * per_block + window_part)
        # Per token, the window's share falls as the claim grows.
        self.assertGreater(G.bytes_per_token([full, win], 1024, CHUNK), G.bytes_per_token([full, win], 32768, CHUNK))
        self.assertAlmostEqual(G.bytes_per_token([full], 32768, CHUNK), per_block / BLOCK)

    def test_a_state_group_costs_one_state_per_layer(self):
        state = group(G.STATE, layers=3, page=6144)
        for tokens in (CHUNK, 8192):
            self.assertEqual(G.load_bytes([state], tokens, CHUNK), 3 * 6144)
        self.assertEqual(G.load_bytes([state], 0, CHUNK), 0)


    def test_a_claims_state_and_window_are_priced_per_claim_not_spread_over_the_hit(self):
        full, win = group(G.FULL), group(G.WINDOW, index=1, window=128)
        state = group(G.STATE, index=2, layers=6, page=1 << 20)  # 6 MiB of state: a hybrid's linear layers
        gs, hit = [full, win, state], 16 * CHUNK
        per, fixed = G.claim_costs(gs, hit, CHUNK)
        self.assertAlmostEqual(per, PAGE * 2 / BLOCK)  # the full group's alone
        self.assertEqual(fixed, G.load_bytes([win, state], hit, CHUNK))
        for n in (CHUNK, 4 * CHUNK, hit):
            with self.subTest(claim=n):
                true = G.load_bytes(gs, n, CHUNK)
                priced = n * per + fixed
                # Never under the claim's bytes, and a window's chunks over at most.
                self.assertGreaterEqual(priced, true)
                self.assertLessEqual(priced - true, G.load_bytes([win], hit, CHUNK))
                if n < hit:  # the old price: the hit's bytes per token, a state spread over tokens it does not load
                    self.assertLess(n * G.bytes_per_token(gs, hit, CHUNK), true)

    def test_a_short_claim_pays_its_whole_state_in_the_split(self):
        # From a slow mount, a hybrid's claim of a chunk costs its state
        # whole: priced per token of the hit, it looked cheap.
        from kvhost.vllm._split import CostModel
        state_bytes, per_token, hit = 64 << 20, 4096.0, 8192
        kw = dict(prefill_s_per_token=1e-4, prefill_s_per_token2=0.0, clock=lambda: 0.0)
        m = CostModel(per_token, 0.2, **kw)
        m.claim_bytes = float(state_bytes)
        spread = CostModel(per_token + state_bytes / hit, 0.2, **kw)
        self.assertAlmostEqual(m.load_s(256), (256 * per_token + state_bytes) / 0.2e9)
        self.assertGreater(m.load_s(256), 10 * spread.load_s(256))
        self.assertAlmostEqual(m.load_s(hit), spread.load_s(hit))  # the whole hit: the same bytes
        k, k_spread = m.split(hit + 256, 0, hit, 256), spread.split(hit + 256, 0, hit, 256)
        self.assertLess(k, k_spread)
        self.assertLess(m.ttft_s(hit + 256, 0, k), m.ttft_s(hit + 256, 0, k_spread))


class Stages(unittest.TestCase):
    def test_pipeline_stages_keep_their_layers_in_namespaces_of_their_own(self):
        o = C.options({"socket": "/nonexistent"})
        half = len(NAMES) // 2

        def stage(s):
            cfg = offloading_config("/nonexistent", rank=2 * s + 1, tp=2)
            cfg.parallel.pp_size, cfg.parallel.world_size = 2, 4
            names = tuple(NAMES[s * half:(s + 1) * half])
            cfg.groups = (type(cfg.groups[0])(tokens_per_block=BLOCK, layer_names=names),)
            cfg.worker_kv_bytes_per_block = half * PAGE
            return cfg
        places = [G.place(stage(s)) for s in (0, 1)]
        self.assertEqual(places, [(0, 1), (1, 1)])
        geos = [C.geometry(C.identity(stage(s), o), 1) for s in (0, 1)]
        self.assertNotEqual(geos[0].model, geos[1].model)
        self.assertEqual([g.layers for g in geos], [half, half])

    def stage_idents(self):
        """The identities of two stages of a PP=2 engine (each its half of
        NAMES)."""
        return [C.identity(cfg, C.options({"socket": "/nonexistent"})) for cfg in self.stage_configs((2, 2))]

    @staticmethod
    def stage_configs(split, **extra):
        """The configs of a PP engine's stages, stage s holding the next
        split[s] layers of NAMES."""
        out, first = [], 0
        for s, n in enumerate(split):
            cfg = offloading_config("/nonexistent", rank=s, **extra)
            cfg.parallel.pp_size, cfg.parallel.world_size = len(split), len(split)
            cfg.groups = (type(cfg.groups[0])(tokens_per_block=BLOCK, layer_names=tuple(NAMES[first:first + n])),)
            cfg.worker_kv_bytes_per_block = n * PAGE
            out.append(cfg)
            first += n
        return out

    def test_the_scheduler_prices_every_stages_layers_once_it_knows_them(self):
        # A 4-layer model from a slow mount (a worker's load of all four
        # slower than their prefill): the claim of a 2,048-token hit,
        # priced at the rate itself (the stages' pricing alone, where two
        # equal stages' claim is barely worth its load).
        from kvhost.vllm._conn_stages import StageIdentity
        total, hit, slow = 2048 + 256, 2048, {"load_gbps": 0.05, "load_latency_ms": 0.0, "split_rate_margin": 0.0}
        o = C.options({"socket": "/nonexistent", **slow})
        cls = C.connector_class(dc.NS(KVConnectorBase_V1=None))

        def claim(split):
            cfgs = self.stage_configs(split, **slow)
            sched = cls(None, "scheduler", config=cfgs[0])  # connects later
            self.addCleanup(sched.shutdown)
            sched.set_xfer_handshake_metadata_pp_aware(
                {(s, 0): StageIdentity(s, 0, C.identity(cfg, o)) for s, cfg in enumerate(cfgs)})
            return sched.cost_model.split(total, 0, hit, BPC * BLOCK)

        def alone(layers):  # one worker of these layers: what stage 0's alone would claim
            return C.cost_model(o, layers * PAGE / BLOCK, layers).split(total, 0, hit, BPC * BLOCK)
        cases = [  # (why, the engine or worker that claims fewer tokens, the one that claims more)
            ("stage 1's three layers claim less than stage 0's one priced alone", claim((1, 3)), alone(1)),
            ("three layers on stage 0 claim less than three on stage 1", claim((3, 1)), claim((1, 3))),
            ("equal stages load in parallel: more than one worker of all four", alone(4), claim((2, 2))),
        ]
        for why, fewer, more in cases:
            with self.subTest(why):
                self.assertLess(fewer, more)
                self.assertGreater(fewer, 0)

    def test_the_scheduler_learns_every_stage_or_none(self):
        from kvhost.vllm._conn_stages import StageIdentity, stage_identities
        i0, i1 = self.stage_idents()
        self.assertEqual((i0["stage"], i1["stage"]), (0, 1))
        metas = [StageIdentity(0, 0, i0), StageIdentity(1, 0, i1), object()]  # another connector's: ignored
        metas = pickle.loads(pickle.dumps(metas[:2])) + metas[2:]
        self.assertEqual(stage_identities(i0, 2, metas), [i0, i1])
        self.assertIsNone(stage_identities(i0, 2, metas[:1]))  # stage 1 never said

    def test_stages_that_disagree_beyond_their_layers_are_refused_by_name(self):
        import copy
        from kvhost.vllm._conn_stages import StageIdentity, stage_identities
        i0, i1 = self.stage_idents()
        other_dtype = copy.deepcopy(i1)
        other_dtype["fields"]["dtype"] = "float16"
        other_layers = copy.deepcopy(i1)
        other_layers["fields"]["kv_cache_groups"][0]["layer_names"] = ["x"]
        cases = [
            ("another dtype", [StageIdentity(1, 0, other_dtype)], r"stage 1, shard 0.*fields\.dtype"),
            ("a stage the engine has not", [StageIdentity(2, 0, i1)], "stage 2; the engine has 2"),
            ("the stage's shards name other layers", [StageIdentity(1, 0, i1), StageIdentity(1, 1, other_layers)],
             "stage 1 name different layers"),
            ("a stage its identity does not name", [StageIdentity(0, 0, i1)], "stage 0 names stage 1"),
        ]
        for what, metas, want in cases:
            with self.subTest(what), self.assertRaisesRegex(ValueError, want):
                stage_identities(i0, 2, [StageIdentity(0, 0, i0)] + metas)


# -- a hybrid model's round trip without vLLM -----------------------------------------


HYBRID = {"full": ["f.0", "f.1"], "window": ["w.0", "w.1"], "state": ["m.0"]}
WINDOW = BLOCK + 1
STATE_PAGE = 6144  # a conv state of 2,048 bytes and an SSM state of 4,096


@unittest.skipUnless(dc.HAVE_TORCH, "needs torch (CPU)")
class HybridWithoutVLLM(unittest.TestCase):
    """A full-attention, a sliding-window and a state group through both
    halves against a real daemon, vLLM's KVCacheConfig and specs stood in
    for (what the connector reads of them): host memory here, CUDA tensors
    in HybridOnGpu."""

    cuda = False

    @classmethod
    def setUpClass(cls):
        import torch
        cls.torch = torch
        cls.daemon = dc.d.Daemon()
        cls.Connector = C.connector_class(dc.NS(KVConnectorBase_V1=None))

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    setUp, tearDown = dc.DaemonTest.setUp, dc.DaemonTest.tearDown

    def hybrid(self, seed=0, **extra):
        cfg = offloading_config(self.daemon.socket, load_split="all", **extra)
        cfg.groups = tuple(type(cfg.groups[0])(tokens_per_block=BLOCK, layer_names=tuple(n)) for n in HYBRID.values())
        specs = [FullAttentionSpec(PAGE), SlidingWindowSpec(PAGE, WINDOW), MambaSpec(STATE_PAGE)]
        kvc = kv_cache_config(zip(HYBRID.values(), specs))
        sched = self.Connector(None, "scheduler", kv_cache_config=kvc, config=cfg)
        self.closers.append(sched.shutdown)
        worker = self.Connector(None, "worker", kv_cache_config=kvc, config=cfg)
        self.closers.append(worker.shutdown)
        torch, kv, raw = self.torch, {}, {}
        gen = torch.Generator().manual_seed(seed)
        for names, page in zip(HYBRID.values(), (PAGE, PAGE, STATE_PAGE)):
            for n in names:
                bits = torch.randint(-128, 128, (dc.NBLOCKS, page), generator=gen, dtype=torch.int8)
                if self.cuda:
                    t = bits.to("cuda")
                else:
                    t, buf = kvhost.torch_host_tensor((dc.NBLOCKS, page), torch.int8, name="hybrid-groups-test")
                    self.closers.append(buf.close)
                    t.copy_(bits)
                raw[n] = t
                if page == STATE_PAGE:  # vLLM's list of a Mamba layer's state views into one page per block
                    flat = t.view(torch.bfloat16)
                    kv[n] = [torch.as_strided(flat, (dc.NBLOCKS, 4, 256), (page // 2, 256, 1), flat.storage_offset()),
                             torch.as_strided(flat, (dc.NBLOCKS, 2, 16, 64), (page // 2, 1024, 64, 1),
                                              flat.storage_offset() + 1024)]
                else:
                    kv[n] = t.view(torch.bfloat16)
        worker.register_kv_caches(kv)
        return sched, worker, raw

    def step(self, sched, worker, so, finished=()):
        meta = pickle.loads(pickle.dumps(sched.build_connector_meta(so)))  # it travels to the workers
        sending, errors, wm = dc.worker_step(worker, meta, finished)
        sched.update_connector_output(dc.NS(kv_connector_worker_meta=wm, finished_sending=sending))
        return sending or set(), errors

    def output(self, req, ids, computed, scheduled):
        so = dc.new_output(req, [], computed, scheduled)
        so.scheduled_new_reqs[0].block_ids = tuple(list(b) for b in ids)
        return so

    def test_a_prefix_round_trips_per_group_within_the_window_and_to_the_saved_state(self):
        sched, worker, raw = self.hybrid(seed=11)
        nblk = 4 * BPC + 1
        state = [0] * nblk
        state[2 * BPC - 1], state[4 * BPC - 1] = 45, 46  # states vLLM kept at chunks 1 and 3's ends
        src = [list(range(1, 1 + nblk)), list(range(20, 20 + nblk)), state]
        req = dc.Request("a", "hybrid-standalone", nblk)
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (0, False))
        blocks = tuple(list(b) for b in src)
        sched.update_state_after_alloc(req, blocks, 0)
        self.step(sched, worker, self.output(req, src, 0, req.num_tokens))
        self.assertEqual(sched.request_finished_all_groups(req, blocks), (True, None))
        done = {"a"}
        dc.d.wait_for(lambda: "a" in self.step(sched, worker, dc.empty_output(done), done)[0],
                      what="a's stores ended")

        def page(n, b):
            return bytes(raw[n][b].cpu().numpy().tobytes())
        end = 4 * CHUNK
        first = (end - WINDOW + 1) // BLOCK
        dst = [list(range(30, 30 + nblk)), [0] * first + list(range(50 + first, 50 + nblk)), [0] * nblk]
        dst[2][4 * BPC - 1] = 60
        before = {n: [page(n, b) for b in dst[1][first - 2:first]] for n in HYBRID["window"]}
        want = {n: [page(n, b) for b in src[i][:4 * BPC]] for i, k in enumerate(HYBRID) for n in HYBRID[k]}
        req = dc.Request("b", "hybrid-standalone", nblk)
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (end, False))
        sched.update_state_after_alloc(req, tuple(list(b) for b in dst), end)
        _, errors = self.step(sched, worker, self.output(req, dst, end, BLOCK))
        self.assertEqual(errors, set())
        for n in HYBRID["full"]:
            self.assertEqual([page(n, b) for b in dst[0][:4 * BPC]], want[n], n)
        for n in HYBRID["window"]:
            self.assertEqual([page(n, b) for b in dst[1][first:4 * BPC]], want[n][first:], n)
            self.assertEqual([page(n, b) for b in dst[1][first - 2:first]], before[n], n)  # null: block 0
        self.assertEqual(page("m.0", 60), page("m.0", 46))


class HybridOnGpu(HybridWithoutVLLM):
    """HybridWithoutVLLM with CUDA tensors, registered by CUDA IPC with a
    daemon serving GPU memory (a kvhost built with cgo: $KVHOST_BIN)."""

    cuda = True

    @classmethod
    def setUpClass(cls):
        if dc.NO_GPU is not None:
            raise unittest.SkipTest(dc.NO_GPU)
        import torch
        cls.torch = torch
        cls.daemon = dc.d.Daemon(capacity="4GiB", extra_toml='[gpu]\nmode = "on"\n')
        cls.Connector = C.connector_class(dc.NS(KVConnectorBase_V1=None))


if __name__ == "__main__":
    unittest.main()
