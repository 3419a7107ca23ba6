"""How the package finds libsparge and its version, each in a fresh interpreter run from an empty directory with
none of sparge's variables set: the bundled copy, the libdir recorded at install, pkg-config, SPARGE_LIBRARY,
and the error that lists what was looked at. Needs the build's library (SPARGE_BUILD_DIR), not torch."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(HERE, "..", "sparge")
CONFIGURE_AC = os.path.join(HERE, "..", "..", "configure.ac")
sys.path.insert(0, os.path.join(HERE, ".."))

import sparge  # noqa: E402  (after the path set-up)


def configure_version():
    with open(CONFIGURE_AC) as f:
        return re.search(r"AC_INIT\(\[sparge\],\s*\[([^\]]+)\]", f.read()).group(1)


class Lookup(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.library = os.path.realpath(sparge.library_path)  # this build's, as the suite found it

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="sparge-package-")
        self.addCleanup(shutil.rmtree, self.tmp)
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("SPARGE_LIBRARY", "SPARGE_BUILD_DIR", "PKG_CONFIG_PATH", "LD_LIBRARY_PATH",
                                 "PYTHONPATH")}
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"

    def copy_package(self, config=None, bundle=False):
        """The package copied to <tmp>/site/sparge (away from any source tree); returns <tmp>/site."""
        site = os.path.join(self.tmp, "site")
        shutil.copytree(PACKAGE, os.path.join(site, "sparge"), ignore=shutil.ignore_patterns("__pycache__",
                                                                                            "libsparge*"))
        if config is not None:
            with open(os.path.join(site, "sparge", "_config.py"), "w") as f:
                f.write(config)
        if bundle:
            shutil.copy(self.library, os.path.join(site, "sparge", "libsparge.so.0"))
        return site

    def run_python(self, code, site=None, **env):
        environment = dict(self.env, **env)
        if site:
            environment["PYTHONPATH"] = site
        cwd = os.path.join(self.tmp, "elsewhere")
        os.makedirs(cwd, exist_ok=True)
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=environment,
                              capture_output=True, text=True, timeout=120)

    def library_found(self, site, **env):
        result = self.run_python("import sparge; print(sparge.library_path); print(sparge.backends())", site, **env)
        self.assertEqual(result.returncode, 0, result.stderr)
        return result.stdout.splitlines()[0]

    def test_bundled_copy(self):
        site = self.copy_package(config='version = "0.1.0"\nlibdir = None\n', bundle=True)
        self.assertEqual(self.library_found(site), os.path.join(site, "sparge", "libsparge.so.0"))

    def test_libdir_recorded_by_install(self):
        libdir = os.path.dirname(self.library)
        site = self.copy_package(config=f'version = "0.1.0"\nlibdir = {libdir!r}\n')
        self.assertEqual(os.path.dirname(self.library_found(site)), libdir)

    @unittest.skipIf(shutil.which("pkg-config") is None, "skipped: no pkg-config")
    def test_pkg_config(self):
        libdir = os.path.dirname(self.library)
        pcdir = os.path.join(self.tmp, "pkgconfig")
        os.makedirs(pcdir)
        with open(os.path.join(pcdir, "sparge.pc"), "w") as f:
            f.write(f"libdir={libdir}\n\nName: sparge\nDescription: test\nVersion: 0\nLibs: -L${{libdir}} -lsparge\n")
        site = self.copy_package()
        self.assertEqual(os.path.dirname(self.library_found(site, PKG_CONFIG_PATH=pcdir)), libdir)

    def test_sparge_library_wins_and_is_not_replaced(self):
        site = self.copy_package(bundle=True)
        other = os.path.join(self.tmp, "libsparge-other.so")
        shutil.copy(self.library, other)
        self.assertEqual(self.library_found(site, SPARGE_LIBRARY=other), other)
        missing = os.path.join(self.tmp, "nowhere", "libsparge.so.0")
        result = self.run_python("import sparge; sparge.backends()", site, SPARGE_LIBRARY=missing)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(f"SPARGE_LIBRARY={missing}: no such file", result.stderr)
        self.assertNotIn("bundled", result.stderr)

    def test_a_library_without_sparge_functions_is_passed_over(self):
        # Any shared object that loads but is no libsparge (as an older build lacks the newer functions).
        import _ctypes
        libdir = os.path.dirname(self.library)
        site = self.copy_package(config=f'version = "0.1.0"\nlibdir = {libdir!r}\n')
        stale = os.path.join(site, "sparge", "libsparge.so.0")
        shutil.copy(_ctypes.__file__, stale)
        self.assertEqual(os.path.dirname(self.library_found(site)), libdir)  # the next place in the order
        result = self.run_python("""
            import sparge
            try:
                sparge.backends()
            except sparge.LibraryNotFoundError as e:
                print(e)
            """, site, SPARGE_LIBRARY=stale)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn(f"{stale} is not the libsparge this package needs: it lacks sparge_status_name",
                      result.stdout)

    def test_not_found_says_what_was_tried_and_what_to_do(self):
        site = self.copy_package(config='version = "0.1.0"\nlibdir = "/nonexistent/lib"\n')
        result = self.run_python("""
            import sparge
            print(sparge.__version__)  # importing needs no library
            try:
                sparge.backends()
            except sparge.LibraryNotFoundError as e:
                print(e)
            """, site, PKG_CONFIG_PATH=os.path.join(self.tmp, "empty"))
        self.assertEqual(result.returncode, 0, result.stderr)
        out = result.stdout
        if "cannot find libsparge" not in out:
            self.skipTest("skipped: a libsparge is installed where the loader or the usual prefixes find it")
        for fragment in ("SPARGE_LIBRARY: unset", "SPARGE_BUILD_DIR: unset", "the copy bundled in the package: no "
                         "libsparge.so.0 in " + os.path.join(site, "sparge"),
                         "the libdir recorded by make install-python: no libsparge.so.0 in /nonexistent/lib",
                         "ctypes.util.find_library (ldconfig): nothing", "/usr/local/lib", "To fix:",
                         "PKG_CONFIG_PATH=<prefix>/lib/pkgconfig", "make python-wheel"):
            self.assertIn(fragment, out)
        self.assertTrue("pkg-config knows no 'sparge'" in out or "pkg-config is not installed" in out, out)

    def test_version_from_config_and_from_configure_ac(self):
        site = self.copy_package(config='version = "9.8.7"\nlibdir = None\n', bundle=True)
        result = self.run_python("import sparge; print(sparge.__version__)", site)
        self.assertEqual(result.stdout.strip(), "9.8.7", result.stderr)
        if os.path.exists(CONFIGURE_AC):
            self.assertEqual(sparge.__version__, configure_version())  # the source tree reads configure.ac
            self.assertEqual(sparge.library_version(), configure_version())


if __name__ == "__main__":
    unittest.main()
