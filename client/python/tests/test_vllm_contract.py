"""The contract kvhost.vllm keeps with vLLM (vllm_contract.CONTRACT): the CI
stand-ins always, and vLLM's own classes when a tree is configured
(`make test-vllm VLLM_SRC=DIR`; without one those tests say so by name).

Run: cd client/python && PYTHONPATH=src:tests /usr/bin/python3 -m unittest tests.test_vllm_contract
"""

import dataclasses
import importlib
import pathlib
import sys
import unittest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import vllm_contract as C  # noqa: E402
import vllm_standins as S  # noqa: E402
import vllm_tree  # noqa: E402

NO_TREE = vllm_tree.skip_reason()


def standin(use):
    return getattr(S, use.name, None)


def real(use):
    try:
        return getattr(importlib.import_module(use.module), use.name, None)
    except ImportError:
        return None


class StandinsKeepTheContract(unittest.TestCase):

    def test_every_standin_has_what_kvhost_uses_of_vllm(self):
        probs = [p for use in C.CONTRACT for p in C.problems(use, standin(use))]
        self.assertEqual(probs, [], "the stand-ins drifted from the contract")

    def test_the_standin_spec_and_tier_base_set_what_kvhost_reads(self):
        spec = S.fake_spec()
        use = {u.name: u for u in C.CONTRACT}
        for a in use["OffloadingSpec"].attrs:
            self.assertTrue(hasattr(spec, a), a)

    def test_a_contract_problem_is_reported_by_name(self):
        # The checker itself: a class lacking a field, a member and an
        # abstract method kvhost does not implement is reported, each by name.
        import abc
        import enum

        @dataclasses.dataclass
        class Job:
            job_id: int

        class R(enum.Enum):
            HIT = 1

        class Base(abc.ABC):
            @abc.abstractmethod
            def prefetch(self): ...
        probs = C.problems(C.Use("m", "Job", fields=("job_id", "keys")), Job)
        probs += C.problems(C.Use("m", "R", members=("HIT", "MISS")), R)
        probs += C.problems(C.Use("m", "Base", abstract=("lookup",)), Base)
        self.assertEqual(len(probs), 3, probs)
        self.assertIn("'keys'", probs[0])
        self.assertIn("MISS", probs[1])
        self.assertIn("prefetch", probs[2])


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class VllmKeepsTheContract(unittest.TestCase):
    """vLLM's own classes, from the configured tree, against the contract."""

    @classmethod
    def setUpClass(cls):
        cls.api = vllm_tree.load()

    def supported(self):
        from kvhost import vllm as kv
        try:
            kv.detect()
            return None
        except kv.UnsupportedVLLM as e:
            return e

    def test_vllm_has_everything_kvhost_uses(self):
        probs = [p for use in C.CONTRACT for p in C.problems(use, real(use))]
        refused = self.supported()
        if refused is None:
            self.assertEqual(probs, [], f"{self.api.name} drifted from the contract")
        else:
            # kvhost refuses this vLLM; the contract must see why too.
            self.assertNotEqual(probs, [], f"kvhost refuses {self.api.name} ({refused}) but the contract holds")
            print(f"\n{self.api.name}: refused by kvhost; contract gaps: {probs}", file=sys.stderr)

    def test_the_standins_have_every_field_vllm_requires(self):
        # A stand-in that could be built without a field vLLM's class
        # requires would let CI pass on a shape vLLM never produces.
        gaps = []
        for use in C.CONTRACT:
            r, s = real(use), standin(use)
            if r is None or not dataclasses.is_dataclass(r):
                continue
            required = [f.name for f in dataclasses.fields(r)
                        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
            have = C.field_names(s)
            gaps += [f"{use.name}.{f}" for f in required if f not in have]
        self.assertEqual(gaps, [], f"stand-ins lack fields {self.api.name} requires")


if __name__ == "__main__":
    unittest.main()
