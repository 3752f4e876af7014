"""KvhostConnector with vLLM's hybrid KV-cache manager on: KVCacheConfigs
of several groups built from vLLM's own specs (FullAttentionSpec,
SlidingWindowSpec, MambaSpec in "align" mode, MLAAttentionSpec), the
connector built by vLLM's KVConnectorFactory with
disable_hybrid_kv_cache_manager False (which vLLM allows only for a
SupportsHMA connector), driven in vLLM's call order with per-group block
ids (KVCacheBlocks and NewRequestData of one list per group) against a
real kvhost daemon, on per-layer host-memory tensors (a Mamba layer as
vLLM hands it: a list of state views into one page per block).

vLLM's null block is block 0: a sliding-window group's blocks outside
the window, and a state group's blocks at boundaries whose state vLLM
did not keep, are 0 in the block lists, as vLLM's managers give them.

Needs a vLLM source tree: `make test-vllm VLLM_SRC=DIR`; without one every
test here reports itself skipped.
"""

import collections
import pathlib
import sys
import unittest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import test_vllm_real_kvconnector as rk  # noqa: E402
import vllm_tree  # noqa: E402
from test_vllm_connector import worker_step  # noqa: E402

NO_TREE = vllm_tree.skip_reason()
BLOCK, HEADS, HEAD = 16, 2, 64
BPC = 2                        # blocks per key: "block_size": 32 tokens
CHUNK = BPC * BLOCK
NBLOCKS = 96
WINDOW = BLOCK + 1             # 17 tokens: a token and the 16 before it, one block of a 2-block key
CONV, SSM = (4, 256), (2, 16, 64)  # a Mamba layer's conv and SSM states (bf16): 6,144 bytes a block

FULL = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
SWA = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
MAMBA = ["model.layers.4.mixer"]


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class HybridCase(rk.RealKvConnectorCase):
    """An engine of several KV-cache groups through vLLM's factory."""

    def setUp(self):
        super().setUp()
        self.raws = {}  # id(caches) -> {layer name: its (NBLOCKS, page) int8 memory}
        self.reports = collections.Counter()  # request id -> workers that reported it finished

    def vllm_config(self, tp=1, rank=0, mla=False, **extra):
        vc = super().vllm_config(**extra)
        from test_vllm_real_connector import vllm_config
        base = vllm_config(self.daemon.socket, tp=tp, rank=rank)
        vc.parallel_config = base.parallel_config
        vc.model_config.use_mla = mla
        vc.scheduler_config.disable_hybrid_kv_cache_manager = False
        return vc

    def specs(self, kinds):
        """vLLM's KVCacheGroupSpecs of kinds ("full", "window", "mamba",
        "mla") and {layer name: spec}."""
        k, bf16 = self.kci, self.torch.bfloat16
        made = {
            "full": (FULL, k.FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=bf16)),
            "window": (SWA, k.SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=bf16,
                                                sliding_window=WINDOW)),
            "mamba": (MAMBA, k.MambaSpec(block_size=BLOCK, shapes=(CONV, SSM), dtypes=(bf16, bf16),
                                         mamba_cache_mode="align")),
            "mla": (FULL, k.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=bf16)),
        }
        groups = [k.KVCacheGroupSpec(layer_names=list(made[x][0]), kv_cache_spec=made[x][1]) for x in kinds]
        return groups, {n: made[x][1] for x in kinds for n in made[x][0]}

    def kv_cache_config(self, kinds=("full", "window", "mamba")):
        k = self.kci
        groups, per = self.specs(kinds)
        return k.KVCacheConfig(num_blocks=NBLOCKS,
                               kv_cache_tensors=[k.KVCacheTensor(size=NBLOCKS * s.page_size_bytes, shared_by=[n])
                                                 for n, s in per.items()],
                               kv_cache_groups=groups)

    def caches(self, per, seed):
        """{layer name: tensor} in host memory, random bits from seed: an
        attention layer (NBLOCKS, page / 2) bf16, a Mamba layer vLLM's
        list of its conv and SSM views into one page per block."""
        import kvhost
        torch, kv, raws = self.torch, {}, {}
        for i, (n, spec) in enumerate(per.items()):
            page = spec.page_size_bytes
            raw, buf = kvhost.torch_host_tensor((NBLOCKS, page), torch.int8, name="hybrid-test")
            self.closers.append(buf.close)
            raw.copy_(torch.randint(-128, 128, raw.shape, generator=torch.Generator().manual_seed(seed * 100 + i),
                                    dtype=torch.int8))
            raws[n] = raw
            if hasattr(spec, "shapes"):
                views, off = [], 0
                for shape in spec.shapes:
                    n_el = 1
                    for d in shape:
                        n_el *= d
                    flat = raw.view(torch.bfloat16)
                    views.append(torch.as_strided(flat, (NBLOCKS, *shape),
                                                  (page // 2, *self._strides(shape)), off // 2))
                    off += 2 * n_el
                kv[n] = views
            else:
                kv[n] = raw.view(torch.bfloat16)
        self.raws[id(kv)] = raws
        return kv

    @staticmethod
    def _strides(shape):
        out, s = [], 1
        for d in reversed(shape):
            out.append(s)
            s *= d
        return tuple(reversed(out))

    def engine(self, seed=0, kinds=("full", "window", "mamba"), tp=1, ranks=(0,), mla=False, **extra):
        """The scheduler and a worker per rank of ranks, from vLLM's
        factory; returns (scheduler, [(worker, caches)], per-layer specs)."""
        kvc = self.kv_cache_config(kinds)
        _, per = self.specs(kinds)
        role = self.base.KVConnectorRole
        sched = self.factory.KVConnectorFactory.create_connector(
            self.vllm_config(tp=tp, mla=mla, **extra), role.SCHEDULER, kvc)
        self.closers.append(sched.shutdown)
        workers = []
        for r in ranks:
            w = self.factory.KVConnectorFactory.create_connector(
                self.vllm_config(tp=tp, rank=r, mla=mla, **extra), role.WORKER, kvc)
            self.closers.append(w.shutdown)
            kv = self.caches(per, seed + r)
            w.register_kv_caches(kv)
            workers.append((w, kv))
        return sched, workers, per

    # -- vLLM's scheduler objects, one block list per group ------------------------

    # (Not blocks/output: RealKvConnectorCase.setUpClass sets those, of one group.)

    def group_blocks(self, per_group):
        return self.kcm.KVCacheBlocks(tuple([self.kcu.KVCacheBlock(b) for b in ids] for ids in per_group))

    def group_output(self, new=(), scheduled=None, finished=()):
        so = self.sched_out.SchedulerOutput.make_empty()
        so.scheduled_new_reqs = [
            self.sched_out.NewRequestData(
                req_id=r.request_id, prompt_token_ids=r.prompt_token_ids, mm_features=[],
                sampling_params=None, pooling_params=None, block_ids=tuple(list(b) for b in ids),
                num_computed_tokens=r.num_computed_tokens, lora_request=None)
            for r, ids in new]
        so.num_scheduled_tokens = dict(scheduled or {})
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        so.finished_req_ids = set(finished)
        return so

    def step(self, sched, workers, so):
        """One engine step on every worker; (requests every worker has now
        reported finished, in this step or an earlier one, as vLLM's
        output aggregator counts them; invalid block ids of any)."""
        meta = sched.build_connector_meta(so)
        done, errors, metas = set(), set(), []
        for w, _ in workers:
            sending, errs, wm = worker_step(w, meta, so.finished_req_ids)
            for rid in sending or ():
                self.reports[rid] += 1
                if self.reports[rid] == len(workers):
                    done.add(rid)
            errors |= set(errs)
            metas.append(wm)
        wm = None
        for m in metas:
            wm = m if wm is None else (wm if m is None else wm.aggregate(m))
        sched.update_connector_output(self.outputs.KVConnectorOutput(
            finished_sending=done or None, finished_recving=None, invalid_block_ids=errors,
            kv_connector_worker_meta=wm))
        return done or set(), errors

    def save_prompt(self, sched, workers, req, ids):
        """req computed in ids (one list per group) and saved, stepped until
        every worker reports its stores ended; vLLM's finish call is
        request_finished_all_groups."""
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (0, False))
        sched.update_state_after_alloc(req, self.group_blocks(ids), 0)
        self.step(sched, workers, self.group_output(new=[(req, ids)], scheduled={req.request_id: req.num_tokens}))
        req.num_computed_tokens = req.num_tokens
        req.status = self.req_mod.RequestStatus.FINISHED_STOPPED
        self.assertEqual(sched.request_finished_all_groups(req, tuple(list(b) for b in ids)), (True, None))
        finished = {req.request_id}

        def stored():
            done, _ = self.step(sched, workers, self.group_output(finished=finished))
            finished.clear()
            return req.request_id in done
        rk.d.wait_for(stored, what=f"{req.request_id}'s stores ended")

    def load(self, sched, workers, req, ids, want_tokens):
        """A step loading req's claim into ids (one list per group);
        returns the invalid block ids."""
        n, load_async = sched.get_num_new_matched_tokens(req, 0)
        self.assertEqual((n, load_async), (want_tokens, False))
        sched.update_state_after_alloc(req, self.group_blocks(ids), n)
        req.num_computed_tokens = n
        return self.step(sched, workers, self.group_output(new=[(req, ids)], scheduled={req.request_id: BLOCK}))[1]

    def page(self, kv, name, b):
        """Layer name's page of block b (bytes): a Mamba layer's whole page."""
        return bytes(self.raws[id(kv)][name][b].numpy().tobytes())

    def namespaces(self):
        """{model id: (keys, bytes)} of the daemon's namespaces (the class's
        daemon keeps the earlier tests' keys too)."""
        import kvhost
        with kvhost.Client(self.daemon.socket) as c:
            return {n["model"]: (n["keys"], n["bytes"]) for n in c.stats()["namespaces"]["list"]}

    def stored_since(self, before):
        """[(model id, keys, bytes)] each namespace gained since before."""
        out = []
        for m, (k, b) in self.namespaces().items():
            k0, b0 = before.get(m, (0, 0))
            if k > k0:
                out.append((m, k - k0, b - b0))
        return out


class HybridConnectorTest(HybridCase):
    def test_vllms_factory_builds_it_with_the_hybrid_kv_cache_manager_on(self):
        sched, workers, _ = self.engine()
        for c in (sched, workers[0][0]):
            self.assertIsInstance(c, self.base.SupportsHMA)
            self.assertFalse(c.requires_kv_delivery)

    def test_a_prefix_is_saved_and_loaded_byte_for_byte_per_group_and_groups_never_mix(self):
        sched, workers, _ = self.engine(seed=3, load_split="all")
        (worker, kv), = workers
        nblk = 4 * BPC + 1  # 4 whole keys and a block
        src = [list(range(1, 1 + nblk)), list(range(20, 20 + nblk)), list(range(40, 40 + nblk))]
        before = self.namespaces()
        self.save_prompt(sched, workers, self.request("a", "hybrid", nblk), src)
        # One namespace per group, each with its own keys: 4 chunks of full
        # attention and of the window, a state per chunk boundary.
        got = self.stored_since(before)
        self.assertEqual(sorted(k for _, k, _ in got), [4, 4, 4], got)
        claimed = 4 * BPC
        want = {n: [self.page(kv, n, b) for b in ids[:claimed]]
                for ids, names in zip(src, (FULL, SWA, MAMBA)) for n in names}
        dst = [list(range(60, 60 + nblk)), list(range(70, 70 + nblk)), list(range(80, 80 + nblk))]
        before = {n: [self.page(kv, n, b) for b in ids[:claimed]]
                  for ids, names in zip(dst, (FULL, SWA, MAMBA)) for n in names}
        errors = self.load(sched, workers, self.request("b", "hybrid", nblk), dst, claimed * BLOCK)
        self.assertEqual(errors, set())
        got = {n: [self.page(kv, n, b) for b in ids[:claimed]]
               for ids, names in zip(dst, (FULL, SWA, MAMBA)) for n in names}
        for n in FULL:  # every block of the prefix
            self.assertEqual(got[n], want[n], n)
        end = claimed * BLOCK
        first_window_block = (end - WINDOW + 1) // BLOCK
        for n in SWA:  # the window before the end, and nothing before it
            self.assertEqual(got[n][first_window_block:], want[n][first_window_block:], n)
            self.assertEqual(got[n][:first_window_block], before[n][:first_window_block], n)
        for n in MAMBA:  # the state at the end's boundary, and no other block
            self.assertEqual(got[n][claimed - 1], want[n][claimed - 1], n)
            self.assertEqual(got[n][:claimed - 1], before[n][:claimed - 1], n)

    def test_a_sliding_window_group_loads_only_its_windows_keys(self):
        sched, workers, _ = self.engine(seed=4, load_split="all")
        nblk = 8 * BPC + 1
        src = [list(range(1, 1 + nblk)), list(range(20, 20 + nblk)), [0] * (nblk - 1) + [39]]
        src[2][BPC * 8 - 1] = 40  # the state at the last whole chunk's boundary
        self.save_prompt(sched, workers, self.request("a", "window", nblk), src)
        before = sched.counters()["load_keys"]
        dst = [list(range(60, 60 + nblk)), [0] * nblk, [0] * nblk]
        end = 8 * BPC * BLOCK
        first = (end - WINDOW + 1) // BLOCK
        for j in range(first, nblk):  # vLLM allocates the window's blocks, the rest are null
            dst[1][j] = 70 + j
        dst[2][8 * BPC - 1] = 90
        self.assertEqual(self.load(sched, workers, self.request("b", "window", nblk), dst, end), set())
        # 8 keys of full attention, the window's one key, one state.
        self.assertEqual(sched.counters()["load_keys"] - before, 8 + 1 + 1)
        _, kv = workers[0]
        for n in SWA:
            for j in range(first, 8 * BPC):
                self.assertEqual(self.page(kv, n, dst[1][j]), self.page(kv, n, src[1][j]), (n, j))

    def test_window_and_state_stores_end_within_the_step_that_computed_them(self):
        # vLLM frees a window's blocks, and a state group's earlier states,
        # while the request runs: their stores end before wait_for_save
        # returns, not after the request (as full attention's may).
        from kvhost.vllm import connector
        sched, workers, _ = self.engine(seed=8)
        nblk = 4 * BPC + 1
        src = [list(range(1, 1 + nblk)), list(range(20, 20 + nblk)), list(range(40, 40 + nblk))]
        req = self.request("a", "sync-stores", nblk)
        before = self.namespaces()
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (0, False))
        sched.update_state_after_alloc(req, self.group_blocks(src), 0)
        self.step(sched, workers, self.group_output(new=[(req, src)], scheduled={req.request_id: req.num_tokens}))
        got = {m: k for m, k, _ in self.stored_since(before)}
        for g in (1, 2):
            self.assertEqual(got.get(connector.geometry(sched._ident, 0, None, g).model), 4, (g, got))

    def test_a_window_group_loads_its_window_where_full_attention_loads_the_prompt(self):
        nblk = 16 * BPC + 1  # a 512-token prefix of 16 keys
        loaded = {}
        for kinds in (("full",), ("window",)):
            sched, workers, _ = self.engine(seed=6, kinds=kinds, load_split="all")
            (worker, _), = workers
            tag = f"bytes-{kinds[0]}"
            self.save_prompt(sched, workers, self.request(f"a-{kinds[0]}", tag, nblk), [list(range(1, 1 + nblk))])
            dst = [list(range(40, 40 + nblk))]
            end = 16 * BPC * BLOCK
            self.assertEqual(self.load(sched, workers, self.request(f"b-{kinds[0]}", tag, nblk), dst, end), set())
            loaded[kinds[0]] = worker.counters()["bytes_loaded"]
        page = self.specs(("full",))[1][FULL[0]].page_size_bytes
        self.assertEqual(loaded["full"], 16 * BPC * page * len(FULL))
        # The window's one key (the daemon reads a key whole), not 16.
        self.assertLessEqual(loaded["window"], BPC * page * len(SWA))
        print(f"\n{self.api.name}: a {end}-token prefix, 2 layers of {page}-byte pages: full attention loads "
              f"{loaded['full']} bytes, a {WINDOW}-token window {loaded['window']}", file=sys.stderr)

    def test_a_state_groups_claim_stops_at_its_last_saved_boundary(self):
        sched, workers, _ = self.engine(seed=5, load_split="all")
        nblk = 4 * BPC + 1
        state = [0] * nblk
        state[2 * BPC - 1] = 45  # vLLM kept the state at chunk 1's end only (align mode)
        src = [list(range(1, 1 + nblk)), list(range(20, 20 + nblk)), state]
        before = self.namespaces()
        self.save_prompt(sched, workers, self.request("a", "state", nblk), src)
        self.assertEqual(sorted(k for _, k, _ in self.stored_since(before)), [1, 4, 4])
        dst = [list(range(60, 60 + nblk)), list(range(70, 70 + nblk)), [0] * nblk]
        dst[2][2 * BPC - 1] = 85
        errors = self.load(sched, workers, self.request("b", "state", nblk), dst, 2 * BPC * BLOCK)
        self.assertEqual(errors, set())
        _, kv = workers[0]
        self.assertEqual(self.page(kv, MAMBA[0], 85), self.page(kv, MAMBA[0], 45))

    def test_mla_at_tp2_stores_one_copy_that_every_rank_loads(self):
        sched, workers, _ = self.engine(seed=7, kinds=("mla",), tp=2, ranks=(0, 1), mla=True, load_split="all")
        nblk = 3 * BPC + 1
        src = [list(range(1, 1 + nblk))]
        (w0, kv0), (w1, kv1) = workers
        want = [self.page(kv0, n, b) for n in FULL for b in src[0][:3 * BPC]]
        before = self.namespaces()
        self.save_prompt(sched, workers, self.request("a", "mla", nblk), src)
        got = self.stored_since(before)
        self.assertEqual([k for _, k, _ in got], [3], got)  # one namespace, one copy of each key
        payload = 3 * BPC * self.specs(("mla",))[1][FULL[0]].page_size_bytes * len(FULL)
        self.assertGreaterEqual(got[0][2], payload)
        self.assertLess(got[0][2], 2 * payload)
        self.assertEqual(w0.counters()["store_keys"], 3)
        self.assertEqual(w1.counters().get("store_keys", 0), 0)
        dst = [list(range(40, 40 + nblk))]
        self.assertEqual(self.load(sched, workers, self.request("b", "mla", nblk), dst, 3 * BPC * BLOCK), set())
        for kv in (kv0, kv1):  # rank 1 loads rank 0's copy
            self.assertEqual([self.page(kv, n, b) for n in FULL for b in dst[0][:3 * BPC]], want)

    def test_groups_of_different_block_sizes_are_refused_by_name(self):
        k = self.kci
        groups, _ = self.specs(("full",))
        other = k.SlidingWindowSpec(block_size=2 * BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                                    dtype=self.torch.bfloat16, sliding_window=WINDOW)
        groups.append(k.KVCacheGroupSpec(layer_names=list(SWA), kv_cache_spec=other))
        kvc = k.KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
        with self.assertRaisesRegex(ValueError, "block size"):
            self.factory.KVConnectorFactory.create_connector(
                self.vllm_config(block_size=None, blocks_per_chunk=1), self.base.KVConnectorRole.SCHEDULER, kvc)


if __name__ == "__main__":
    unittest.main()
