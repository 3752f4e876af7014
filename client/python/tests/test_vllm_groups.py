"""The connector's KV-cache group rules (_conn_groups), without vLLM: what
a claim needs of each kind of group, which blocks a load fills and a
save takes, what a load costs the split, and the namespaces of pipeline
stages."""

import pathlib
import sys
import unittest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from kvhost import protocol as p  # noqa: E402
from kvhost.vllm import _conn_groups as G  # noqa: E402
from kvhost.vllm import connector as C  # noqa: E402
from test_vllm_connector import BLOCK, NAMES, offloading_config  # noqa: E402

PAGE = 8192
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


if __name__ == "__main__":
    unittest.main()
