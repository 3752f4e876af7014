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
REPO = PKG.parents[1]


def readme_pip_command():
    """The arguments after "pip" of the top-level README's command that
    installs the client, with the client's path last. Where the line makes
    the virtual environment first, it must make it as this test does
    (python3 -m venv --system-site-packages), so that the test runs what
    the README says."""
    for line in (REPO / "README.md").read_text().splitlines():
        words = line.split()
        if not words or not words[-1].rstrip("/").endswith("client/python"):
            continue
        for i in range(len(words) - 1):
            if (words[i] == "pip" or words[i].endswith("/pip")) and words[i + 1] == "install":
                if "venv" in words[:i]:
                    if "--system-site-packages" not in words[:i]:
                        raise AssertionError(f"README.md's venv lacks --system-site-packages: {line.strip()}")
                return words[i + 1:]
    raise AssertionError("README.md has no pip install ... ./client/python line")


def readme_example():
    """The first ```python block of README.md."""
    text = (PKG / "README.md").read_text()
    m = re.search(r"```python\n(.*?)```", text, re.S)
    if not m:
        raise AssertionError("README.md has no python example")
    return m.group(1)


def files_under(root):
    """The files under root, relative to it (build/ and *.egg-info
    included)."""
    return {str(p.relative_to(root)) for p in pathlib.Path(root).rglob("*") if p.is_file()}


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
        # is downloaded; --no-cache-dir: the wheel pip builds is not kept
        # in the user's ~/.cache/pip (a new one each run: its key is the
        # temporary source directory).
        # From a copy: setuptools builds in the source tree (build/,
        # *.egg-info), which must stay clean.
        src = os.path.join(self.tmp, "client-python")
        # Without a probe built in place (make python-ext): pip builds it.
        shutil.copytree(PKG, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so"))
        before = files_under(src)
        # The command the top-level README gives, on the copy.
        args = readme_pip_command()
        r = subprocess.run([py, "-m", "pip", "--isolated", "--no-cache-dir", *args[:-1], src], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, f"offline install ({' '.join(args)}) failed:\n{r.stdout}\n{r.stderr}")
        # What the build left in the copy would be left in the checkout:
        # git must ignore it (git status stays clean).
        made = sorted(files_under(src) - before)
        if shutil.which("git") and (REPO / ".git").exists():
            rel = [str(pathlib.Path("client/python") / f) for f in made]
            if rel:
                ig = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", "--stdin"],
                                    input="\n".join(rel) + "\n", capture_output=True, text=True)
                untracked = sorted(set(rel) - set(ig.stdout.split()))
                self.assertEqual(untracked, [], "the install leaves files git does not ignore in the checkout")

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
        # pip built the C lookup probe (a compiler and Python's headers are
        # here: scripts/ensure-python.sh).
        native = subprocess.run([py, "-c", "from kvhost import lookuptable; print(lookuptable.NATIVE)"],
                                capture_output=True, text=True, env=env, cwd=self.tmp, check=True).stdout.strip()
        self.assertIn(native, ("sha-ni", "portable"), "pip install did not build kvhost._lookup")


if __name__ == "__main__":
    unittest.main()
