"""Build glue for pyproject.toml: the version from configure.ac, and a platform wheel when libsparge is bundled.

The version has one source, AC_INIT in configure.ac. A staged copy (make python-wheel, make install-python)
carries it in sparge/_config.py, written by make from the same AC_INIT; a source checkout has configure.ac
one level up, and the build writes _config.py into the built package. A libsparge.so.0 placed in sparge/
(make python-wheel does) is packaged, and the wheel is then tagged for this platform, not "any".
"""
import glob
import os
import re

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "sparge", "_config.py")
BUNDLED = sorted(os.path.basename(p) for p in glob.glob(os.path.join(HERE, "sparge", "libsparge*")))


def read_version():
    if os.path.exists(CONFIG):
        with open(CONFIG) as f:
            match = re.search(r"^version\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
        if match:
            return match.group(1)
    configure_ac = os.path.join(HERE, os.pardir, "configure.ac")
    if os.path.exists(configure_ac):
        with open(configure_ac) as f:
            match = re.search(r"AC_INIT\(\[sparge\],\s*\[([^\]]+)\]", f.read())
        if match:
            return match.group(1)
    raise RuntimeError("sparge: cannot tell the version: build from the source tree (python/ beside configure.ac) "
                       "or from a copy staged by `make python-wheel` / `make install-python` (sparge/_config.py)")


VERSION = read_version()


class BuildPy(build_py):
    """Writes sparge/_config.py into the built package when the sources have none (a source checkout)."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "sparge", "_config.py")
        if not os.path.exists(CONFIG):
            self.mkpath(os.path.dirname(target))
            with open(target, "w") as f:
                f.write(f'"""Written by setup.py from configure.ac."""\nversion = "{VERSION}"\nlibdir = None\n')


class BinaryDistribution(Distribution):
    """A bundled shared library makes the package platform-specific (it has no Python extension)."""

    def has_ext_modules(self):
        return bool(BUNDLED)


cmdclass = {"build_py": BuildPy}
try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

if bdist_wheel is not None:
    class BdistWheel(bdist_wheel):
        """ctypes, no Python ABI: py3-none-<platform> with a bundled library, py3-none-any without."""

        def get_tag(self):
            python, abi, plat = super().get_tag()
            return ("py3", "none", plat) if BUNDLED else (python, abi, plat)

    cmdclass["bdist_wheel"] = BdistWheel

setup(
    version=VERSION,
    cmdclass=cmdclass,
    distclass=BinaryDistribution,
    package_data={"sparge": BUNDLED},
)
