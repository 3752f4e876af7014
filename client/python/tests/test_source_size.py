"""The client's source files stay small enough to read whole: none under
src/kvhost is over MAX_LINES lines (issue 96 split the ones that had
grown to 1,200). A file that reaches the limit is split by concern, as
client.py, tier.py, spec.py and the connector's halves were, not the
limit raised."""

import pathlib
import tempfile
import unittest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "kvhost"
MAX_LINES = 600
SUFFIXES = (".py", ".c", ".h")


def source_files():
    """Every source file under src/kvhost (build output and caches left out)."""
    return sorted(f for f in SRC.rglob("*") if f.is_file() and f.suffix in SUFFIXES
                  and "__pycache__" not in f.parts)


def lines_of(path):
    with open(path, "rb") as f:
        return sum(1 for _ in f)


class TestSourceSize(unittest.TestCase):

    def test_no_source_file_under_src_kvhost_is_over_600_lines(self):
        files = source_files()
        # The walk itself: it found the package (client.py, the vLLM
        # integrations), so an empty or moved tree cannot pass.
        self.assertIn(SRC / "client.py", files)
        self.assertIn(SRC / "vllm" / "tier.py", files)
        over = {str(f.relative_to(SRC)): n for f in files if (n := lines_of(f)) > MAX_LINES}
        self.assertEqual(over, {}, f"files under {SRC} over {MAX_LINES} lines (split them by concern)")

    def test_a_file_over_the_limit_is_counted_over_it(self):
        # lines_of counts what the limit is checked against: a file of
        # MAX_LINES + 1 lines is over, one of MAX_LINES is not.
        with tempfile.TemporaryDirectory() as d:
            at, over = pathlib.Path(d, "at.py"), pathlib.Path(d, "over.py")
            at.write_text("x = 1\n" * MAX_LINES)
            over.write_text("x = 1\n" * (MAX_LINES + 1))
            self.assertEqual(lines_of(at), MAX_LINES)
            self.assertEqual(lines_of(over), MAX_LINES + 1)


if __name__ == "__main__":
    unittest.main()
