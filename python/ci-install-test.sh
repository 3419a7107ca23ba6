#!/usr/bin/env bash
# The Python package's install paths on a fresh machine, each checked from an empty directory with no
# LD_LIBRARY_PATH and none of sparge's variables:
#   1. `pip install --no-build-isolation ./python` in a venv (--system-site-packages: Debian's torch), the
#      library found through pkg-config (PKG_CONFIG_PATH=<prefix>/lib/pkgconfig, as for any prefix);
#   2. `make install-python`: the package under the prefix, the library found at the libdir it recorded;
#   3. `make python-wheel`: the wheel in a second venv, the library found inside the package.
# Each imports sparge, checks where the library came from and the version, and runs attention and its
# backward through torch. The package built without a library to find must fail with the lookup's message.
#
#   python/ci-install-test.sh [BUILD_DIR]
# BUILD_DIR: a configured build whose prefix is a scratch directory (its `make install` is run here);
# without it the script configures a CPU-only build (--without-cuda --without-hip) into a temporary prefix.
# PY picks the interpreter (default /usr/bin/python3, which has Debian's python3-torch).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-/usr/bin/python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/sparge-py-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
say() { printf '  -- %s\n' "$*"; }
fail() { printf 'ci-install-test: FAILED: %s\n' "$*" >&2; exit 1; }

# The interpreter's modules first: the Debian packages for any that is missing.
missing=()
for pair in pip:python3-pip venv:python3-venv setuptools:python3-setuptools wheel:python3-wheel \
            torch:python3-torch ensurepip:python3-venv; do
    "$py" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
command -v pkg-config >/dev/null || missing+=(pkg-config)
if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null ||
        fail "$py lacks ${missing[*]} (Debian packages); install them and run again"
    say "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
version=$(sed -n 's/^AC_INIT(\[sparge\], *\[\([^]]*\)\].*/\1/p' "$root/configure.ac")
[ -n "$version" ] || fail "no AC_INIT version in configure.ac"

if [ $# -ge 1 ]; then
    build=$(cd "$1" && pwd)
else
    build=$work/build
    mkdir -p "$build"
    say "configuring a CPU build into $work/prefix"
    (cd "$build" && "$root/configure" --without-cuda --without-hip --prefix="$work/prefix" >/dev/null)
fi
prefix=$(sed -n 's/^prefix=//p' "$build/sparge.pc")
libdir=$(cd "$build" && PKG_CONFIG_PATH=. pkg-config --variable=libdir sparge)
say "make install into $prefix"
make -C "$build" -j"$(nproc)" install >/dev/null

# Runs python from an empty directory with a plain environment plus "$@" (VAR=value ...).
clean_python() {
    local python=$1; shift
    mkdir -p "$work/elsewhere"
    (cd "$work/elsewhere" && env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$work" "$@" "$python" -c "$check")
}
check='
import os, sys
import sparge, torch
want_dir, want_version = os.environ["WANT_DIR"], os.environ["WANT_VERSION"]
assert "LD_LIBRARY_PATH" not in os.environ
path = sparge.library_path
print(f"     sparge {sparge.__version__} from {sparge.__file__}, library {path}")
assert os.path.dirname(path) == want_dir, (path, want_dir)
assert sparge.__version__ == want_version == sparge.library_version(), (sparge.__version__, want_version)
q, k, v = (torch.randn(1, 2, 300, 64, requires_grad=True) for _ in range(3))
out = sparge.sparge_attention(q, k, v, layout="bhnd")
out.sum().backward()
assert out.shape == q.shape and torch.isfinite(q.grad).all()
'

# 1. pip install of the source package in a venv; the library through pkg-config.
say "1. pip install --no-build-isolation ./python in a venv; the library through pkg-config"
mkdir -p "$work/src"
cp -r "$root/python" "$root/configure.ac" "$work/src/"  # builds write build/ and *.egg-info beside the sources
rm -rf "$work/src/python/build" "$work/src/python/"*.egg-info "$work/src/python/sparge/_config.py" \
       "$work/src/python/sparge/"libsparge*
"$py" -m venv --system-site-packages "$work/venv1"
"$work/venv1/bin/python" -m pip install -q --no-build-isolation --no-deps "$work/src/python"
clean_python "$work/venv1/bin/python" PKG_CONFIG_PATH="$libdir/pkgconfig" WANT_DIR="$libdir" \
    WANT_VERSION="$version" || fail "the pip-installed package did not find $libdir through pkg-config"
if (cd "$work/elsewhere" && env -i PATH=/usr/bin:/bin HOME="$work" "$work/venv1/bin/python" \
        -c 'import sparge; sparge.backends()') 2>"$work/err"; then
    say "   (a libsparge is installed where the loader finds it: the not-found message is not checked)"
else
    grep -q "cannot find libsparge" "$work/err" && grep -q "PKG_CONFIG_PATH=<prefix>/lib/pkgconfig" "$work/err" ||
        { cat "$work/err"; fail "without pkg-config's help the error does not say what was tried"; }
    say "   without PKG_CONFIG_PATH: LibraryNotFoundError listing what was looked at"
fi

# 2. make install-python: the package under the prefix, the library at the recorded libdir.
say "2. make install-python; the library at the libdir it recorded"
make -C "$build" install-python PY="$py" >"$work/log" 2>&1 || { cat "$work/log"; fail "make install-python"; }
sitedir=$("$py" -c 'import sys, sysconfig; print(sysconfig.get_path("purelib", "posix_prefix",
    {"base": sys.argv[1], "platbase": sys.argv[1]}))' "$prefix")
[ -f "$sitedir/sparge/_config.py" ] || fail "make install-python left no package in $sitedir"
clean_python "$py" PYTHONPATH="$sitedir" WANT_DIR="$libdir" WANT_VERSION="$version" ||
    fail "the package from make install-python did not find $libdir"
make -C "$build" install-python PY="$py" DESTDIR="$work/stage" >"$work/log" 2>&1 ||
    { cat "$work/log"; fail "make install-python DESTDIR=..."; }
[ -f "$work/stage$sitedir/sparge/__init__.py" ] || fail "make install-python ignored DESTDIR"

# 3. make python-wheel: the bundled library, in a fresh venv.
say "3. make python-wheel, installed in a venv; the library bundled in the package"
make -C "$build" python-wheel PY="$py" >"$work/log" 2>&1 || { cat "$work/log"; fail "make python-wheel"; }
wheel=$(ls "$build"/python-dist/sparge-"$version"-py3-none-*.whl)
case $wheel in *-any.whl) fail "the wheel with a bundled library is tagged for any platform: $wheel";; esac
"$py" -m venv --system-site-packages "$work/venv2"
"$work/venv2/bin/python" -m pip install -q --no-deps "$wheel"
bundled=$("$work/venv2/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')/sparge
clean_python "$work/venv2/bin/python" WANT_DIR="$bundled" WANT_VERSION="$version" ||
    fail "the wheel's package did not load its bundled library"
echo "ci-install-test: passed (sparge $version: pip + pkg-config, make install-python, make python-wheel)"
