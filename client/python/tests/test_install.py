"""The client installs with no package index (a fresh virtual environment,
pip --no-index --no-build-isolation) and the README example runs, as
pasted, against a real daemon."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

from daemon import Daemon

PKG = pathlib.Path(__file__).resolve().parents[1]


def readme_example():
    """The first ```python block of README.md."""
    text = (PKG / "README.md").read_text()
    m = re.search(r"```python\n(.*?)```", text, re.S)
    if not m:
        raise AssertionError("README.md has no python example")
    return m.group(1)


class OfflineInstallTest(unittest.TestCase):
    def setUp(self):
        try:
            import ensurepip  # noqa: F401 (python3-venv on Debian)
        except ImportError:
            self.skipTest("python3 -m venv needs ensurepip (Debian: apt install python3-venv)")
        self.tmp = tempfile.mkdtemp(prefix="kvhost-venv-")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def test_offline_install_then_readme_example_against_daemon(self):
        venv = os.path.join(self.tmp, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
        py = os.path.join(venv, "bin", "python")
        # --isolated: no pip configuration or PIP_* variables of this
        # machine (find-links, an index) take part; --no-index: nothing
        # is downloaded.
        # From a copy: setuptools builds in the source tree (build/,
        # *.egg-info), which must stay clean.
        src = os.path.join(self.tmp, "client-python")
        shutil.copytree(PKG, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        r = subprocess.run([py, "-m", "pip", "--isolated", "install", "--no-index", "--no-build-isolation", src],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, f"offline install failed:\n{r.stdout}\n{r.stderr}")

        d = Daemon()
        self.addCleanup(d.stop)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["KVHOST_SOCKET"] = d.socket
        script = os.path.join(self.tmp, "example.py")
        with open(script, "w") as f:
            f.write(readme_example())
        # Run from the temp dir: the installed package, not the source tree.
        r = subprocess.run([py, script], capture_output=True, text=True, env=env, cwd=self.tmp, timeout=120)
        self.assertEqual(r.returncode, 0, f"README example failed:\n{r.stdout}\n{r.stderr}\n{d.logs()}")
        out = r.stdout
        self.assertIn("store: ['stored']", out)
        self.assertIn("lookup: 1", out)
        self.assertIn("load: ['loaded', 'missing']", out)
        where = subprocess.run([py, "-c", "import kvhost; print(kvhost.__file__)"], capture_output=True, text=True,
                               env=env, cwd=self.tmp, check=True).stdout
        self.assertIn(venv, where, "the example did not use the installed package")


if __name__ == "__main__":
    unittest.main()
