"""ctypes mirror of src/sparge.h: library lookup, structures, prototypes and status checks.

Nothing here needs torch. The library is loaded on first use (`lib`, `library_path`), so importing the package
works without it and the failure, when there is one, says what was looked at.
"""
import ctypes
import ctypes.util
import os
import shutil
import subprocess
import threading

# ---------------------------------------------------------------- status codes (sparge_status)
OK = 0
ERR_NULL = 1
ERR_INVALID = 2
ERR_SHAPE = 3
ERR_DTYPE = 4
ERR_OVERFLOW = 5
ERR_MASK = 6
ERR_UNSUPPORTED = 7
ERR_NO_DEVICE = 8
ERR_OUT_OF_MEMORY = 9
ERR_RUNTIME = 10

# ---------------------------------------------------------------- dtypes (sparge_dtype)
F32 = 0
F16 = 1
BF16 = 2
F64 = 3  # cpu-ref only, in libraries that have it (has_f64)

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


class SpargeError(RuntimeError):
    """A sparge call failed. `status` is the sparge_status value, `status_name` its name
    ("SPARGE_ERR_SHAPE"), and the message is sparge_last_error() of the failing call."""

    def __init__(self, status, status_name, message, function):
        self.status = status
        self.status_name = status_name
        self.function = function
        super().__init__(f"{function}: {status_name}: {message}")


class LibraryNotFoundError(OSError):
    """No loadable libsparge was found; the message lists every place looked at and what to do."""


class sparge_tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("shape", ctypes.c_int64 * 4),  # B, H, N, D
        ("stride", ctypes.c_int64 * 4),  # in elements
    ]


class sparge_mask_params(ctypes.Structure):
    _fields_ = [
        ("block_q", ctypes.c_int),
        ("block_k", ctypes.c_int),
        ("topk", ctypes.c_double),
        ("topp", ctypes.c_double),
        ("scale", ctypes.c_float),
        ("causal", ctypes.c_int),
    ]


class sparge_mask_layout(ctypes.Structure):
    _fields_ = [
        ("B", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("Nq", ctypes.c_int64),
        ("Nk", ctypes.c_int64),
        ("block_q", ctypes.c_int),
        ("block_k", ctypes.c_int),
        ("causal", ctypes.c_int),
        ("cu_seqlens_q", ctypes.c_void_p),  # const int32_t *, host memory
        ("cu_seqlens_k", ctypes.c_void_p),
    ]


class sparge_mask_shape(ctypes.Structure):
    _fields_ = [
        ("B", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("Nq", ctypes.c_int64),
        ("Nk", ctypes.c_int64),
        ("block_q", ctypes.c_int),
        ("block_k", ctypes.c_int),
        ("Nqb", ctypes.c_int64),
        ("Nkb", ctypes.c_int64),
        ("causal", ctypes.c_int),
        ("varlen", ctypes.c_int),
    ]


class sparge_mask_stats(ctypes.Structure):
    _fields_ = [
        ("kept_blocks", ctypes.c_int64),
        ("total_blocks", ctypes.c_int64),
        ("sparsity", ctypes.c_double),
        ("token_density", ctypes.c_double),
        ("mean_row_mass", ctypes.c_double),
        ("min_row_blocks", ctypes.c_int32),
        ("max_row_blocks", ctypes.c_int32),
    ]


class sparge_attn_params(ctypes.Structure):
    _fields_ = [
        ("scale", ctypes.c_float),
        ("deterministic", ctypes.c_int),
        ("causal", ctypes.c_int),
    ]


# sparge_op
OP_POOL = 0
OP_POOLED_MAP = 1
OP_MASK_SELECT = 2
OP_MASK_PREDICT = 3
OP_FORWARD = 4
OP_BACKWARD = 5
OP_COUNT = 6


class sparge_op_desc(ctypes.Structure):
    _fields_ = [
        ("op", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("head_dim", ctypes.c_int64),
        ("block_q", ctypes.c_int),
        ("block_k", ctypes.c_int),
        ("B", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("Nq", ctypes.c_int64),
        ("Nk", ctypes.c_int64),
        ("rows_aligned", ctypes.c_int),
        ("deterministic", ctypes.c_int),
        ("kv_heads", ctypes.c_int64),
        ("causal", ctypes.c_int),
        ("varlen", ctypes.c_int),
    ]


_LIB_NAMES = ("libsparge.so.0", "libsparge.so", "libsparge.0.dylib", "libsparge.dylib")
_PREFIX_DIRS = ("/usr/local/lib", "/usr/local/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                "/usr/lib64", "/usr/lib")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _installed_libdir():
    """The libdir recorded by `make install-python` (None for other installs and for the source tree)."""
    try:
        from . import _config
    except ImportError:
        return None
    return getattr(_config, "libdir", None)


def _pkg_config_libdir():
    """(libdir or None, why not) from `pkg-config --variable=libdir sparge`."""
    exe = shutil.which("pkg-config")
    if exe is None:
        return None, "pkg-config is not installed"
    try:
        run = subprocess.run([exe, "--variable=libdir", "sparge"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"pkg-config failed ({e})"
    libdir = run.stdout.strip()
    if run.returncode != 0 or not libdir:
        where = os.environ.get("PKG_CONFIG_PATH")
        return None, "pkg-config knows no 'sparge'" + (f" (PKG_CONFIG_PATH={where})" if where else
                                                       " (PKG_CONFIG_PATH is unset)")
    return libdir, None


def _search_plan():
    """[(source, [paths or loader names], note)] in lookup order. An empty path list carries the reason in note."""
    env = os.environ.get("SPARGE_LIBRARY")
    if env:
        # An explicit choice must not be silently replaced by another library.
        return [("SPARGE_LIBRARY", [env], None)]
    plan = [("SPARGE_LIBRARY", [], "unset")]
    build = os.environ.get("SPARGE_BUILD_DIR")
    if build:
        plan.append(("SPARGE_BUILD_DIR", [os.path.join(build, sub, n) for sub in (".libs", "") for n in _LIB_NAMES],
                     None))
    else:
        plan.append(("SPARGE_BUILD_DIR", [], "unset"))
    plan.append(("the copy bundled in the package", [os.path.join(_PACKAGE_DIR, n) for n in _LIB_NAMES], None))
    libdir = _installed_libdir()
    if libdir:
        plan.append(("the libdir recorded by make install-python", [os.path.join(libdir, n) for n in _LIB_NAMES],
                     None))
    # An in-tree build of a source checkout (python/sparge sits two levels below the source root).
    root = os.path.dirname(os.path.dirname(_PACKAGE_DIR))
    plan.append(("an in-tree build", [os.path.join(root, ".libs", n) for n in _LIB_NAMES], None))
    libdir, why = _pkg_config_libdir()
    plan.append(("pkg-config", [os.path.join(libdir, n) for n in _LIB_NAMES] if libdir else [], why))
    found = ctypes.util.find_library("sparge")
    plan.append(("ctypes.util.find_library (ldconfig)", [found] if found else [], None if found else "nothing"))
    plan.append(("the usual prefixes", [os.path.join(d, n) for d in _PREFIX_DIRS for n in _LIB_NAMES], None))
    return plan


def _load():
    tried = []
    for source, paths, note in _search_plan():
        if not paths:
            tried.append(f"{source}: {note}")
            continue
        missing = []
        for path in paths:
            if os.sep in path and not os.path.exists(path):
                missing.append(path)
                continue
            try:
                cdll = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"{source}: {path} does not load ({e})")
                continue
            lacking = _bind(cdll)
            if lacking is None:
                return cdll, os.path.abspath(path) if os.sep in path else path
            tried.append(f"{source}: {path} is not the libsparge this package needs: it lacks {lacking} (an older "
                         "build? install the library of the same sparge version)")
        if missing and len(missing) == len(paths):
            if source == "SPARGE_LIBRARY":
                tried.append(f"SPARGE_LIBRARY={paths[0]}: no such file")
                continue
            dirs = list(dict.fromkeys(os.path.dirname(p) for p in missing))
            tried.append(f"{source}: no {paths[0].rsplit(os.sep, 1)[-1]} in {', '.join(dirs)}")
    raise LibraryNotFoundError(
        "sparge: cannot find libsparge. Looked at, in order:\n  - " + "\n  - ".join(tried) +
        "\nTo fix: install the library (./configure && make && make install; run ldconfig for a system prefix), "
        "or point sparge at it: SPARGE_LIBRARY=/path/to/libsparge.so.0, or SPARGE_BUILD_DIR=<a build directory>; "
        "a prefix the loader does not search is found through pkg-config "
        "(PKG_CONFIG_PATH=<prefix>/lib/pkgconfig), or install the package with `make install-python`, which "
        "records the library's directory, or install the wheel from `make python-wheel`, which bundles it.")


_P = ctypes.c_void_p
_T = ctypes.POINTER(sparge_tensor)
_I64 = ctypes.c_int64
_S = ctypes.c_int
_STR = ctypes.c_char_p
_OUT_STR = ctypes.POINTER(ctypes.c_char_p)
_PROTOTYPES = {
    "sparge_status_name": (ctypes.c_char_p, [_S]),
    "sparge_last_error": (ctypes.c_char_p, []),
    "sparge_dtype_size": (ctypes.c_size_t, [_S]),
    "sparge_dtype_name": (ctypes.c_char_p, [_S]),
    "sparge_tensor_bhnd": (sparge_tensor, [_P, _S, _I64, _I64, _I64, _I64]),
    "sparge_tensor_bnhd": (sparge_tensor, [_P, _S, _I64, _I64, _I64, _I64]),
    "sparge_tensor_span_bytes": (ctypes.c_size_t, [_T]),
    "sparge_backend_count": (ctypes.c_int, []),
    "sparge_backend_name": (ctypes.c_char_p, [ctypes.c_int]),
    "sparge_backend_device_count": (ctypes.c_int, [ctypes.c_char_p]),
    "sparge_device_open": (_S, [ctypes.c_char_p, ctypes.POINTER(_P)]),
    "sparge_device_close": (None, [_P]),
    "sparge_device_name": (ctypes.c_char_p, [_P]),
    "sparge_device_backend": (ctypes.c_char_p, [_P]),
    "sparge_device_description": (ctypes.c_char_p, [_P]),
    "sparge_synchronize": (_S, [_P]),
    "sparge_timer_start": (_S, [_P]),
    "sparge_timer_stop": (_S, [_P, ctypes.POINTER(ctypes.c_double)]),
    "sparge_set_stream": (_S, [_P, _P]),
    "sparge_op_name": (_STR, [_S]),
    "sparge_device_supports": (_S, [_P, ctypes.POINTER(sparge_op_desc), _OUT_STR]),
    "sparge_device_option_count": (ctypes.c_int, [_P]),
    "sparge_device_option": (_S, [_P, ctypes.c_int, _OUT_STR, _OUT_STR, _OUT_STR, _OUT_STR, _OUT_STR]),
    "sparge_device_get_option": (_S, [_P, _STR, _OUT_STR]),
    "sparge_device_set_option": (_S, [_P, _STR, _STR]),
    "sparge_mask_params_default": (sparge_mask_params, []),
    "sparge_mask_create": (_S, [_P, _I64, _I64, _I64, _I64, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_P)]),
    "sparge_mask_create_ex": (_S, [_P, ctypes.POINTER(sparge_mask_layout), ctypes.POINTER(_P)]),
    "sparge_mask_destroy": (None, [_P]),
    "sparge_mask_get_shape": (_S, [_P, ctypes.POINTER(sparge_mask_shape)]),
    "sparge_mask_predict": (_S, [_P, _T, _T, ctypes.POINTER(sparge_mask_params), _P]),
    "sparge_mask_select": (_S, [_P, _T, ctypes.POINTER(sparge_mask_params), _P]),
    "sparge_mask_set_dense": (_S, [_P, _P]),
    "sparge_mask_get_csr": (_S, [_P, _P, _P, _P, _P]),
    "sparge_mask_get_dense": (_S, [_P, _P]),
    "sparge_mask_get_pooled_map": (_S, [_P, _P]),
    "sparge_mask_get_stats": (_S, [_P, ctypes.POINTER(sparge_mask_stats), _P, _P]),
    "sparge_pool": (_S, [_P, _T, ctypes.c_int, _T]),
    "sparge_pooled_map": (_S, [_P, _T, _T, ctypes.c_float, _T]),
    "sparge_attention_forward": (_S, [_P, _T, _T, _T, _P, ctypes.POINTER(sparge_attn_params), _T, _P]),
    "sparge_attention_backward": (_S, [_P, _T, _T, _T, _T, _T, _P, _P, ctypes.POINTER(sparge_attn_params), _T, _T,
                                       _T]),
    "sparge_attention": (_S, [_P, _T, _T, _T, ctypes.POINTER(sparge_mask_params), _T, _P, _P]),
    "sparge_build_info": (ctypes.c_char_p, []),
    "sparge_topology_info": (ctypes.c_char_p, []),
    "sparge_dtype_tolerance": (ctypes.c_double, [_S]),
}

_state = {}
_state_lock = threading.Lock()


def _bind(cdll):
    """Set the prototypes of every function the package calls; returns the first one cdll lacks, or None."""
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(cdll, name)
        except AttributeError:
            return name
        fn.restype = restype
        fn.argtypes = argtypes
    return None


def _loaded():
    """(CDLL, path), loading and binding the library on first use."""
    state = _state.get("lib")
    if state is None:
        with _state_lock:
            state = _state.get("lib")
            if state is None:
                state = _state["lib"] = _load()
    return state


def __getattr__(name):
    # `_lib.lib` and `_lib.library_path` load the library when first read.
    if name == "lib":
        return _loaded()[0]
    if name == "library_path":
        return _loaded()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def status_name(status):
    return _loaded()[0].sparge_status_name(status).decode()


def check(status, function):
    """Raise SpargeError carrying sparge_last_error() if status is not SPARGE_OK."""
    if status != OK:
        message = _loaded()[0].sparge_last_error().decode(errors="replace")
        raise SpargeError(status, status_name(status), message, function)


def call(name, *args):
    """Call a status-returning sparge function and raise on failure."""
    check(getattr(_loaded()[0], name)(*args), name)


def backends():
    """Backends compiled into the loaded library ("cpu-ref", "cpu", "cuda", ...)."""
    lib = _loaded()[0]
    return [lib.sparge_backend_name(i).decode() for i in range(lib.sparge_backend_count())]


def backend_device_count(backend):
    if not isinstance(backend, str):
        raise TypeError(f"sparge: backend must be a str, got {type(backend).__name__}")
    return _loaded()[0].sparge_backend_device_count(backend.encode())


def tolerance(dtype_code):
    """The relative L2 error against cpu-ref that every backend is held to for outputs of this sparge dtype
    (F32, F16, BF16, F64): the library's one table (docs/DESIGN.md §2.1)."""
    return _loaded()[0].sparge_dtype_tolerance(dtype_code)


def build_info():
    return _loaded()[0].sparge_build_info().decode()


def library_version():
    """The loaded library's version ("0.1.0"): the first line of sparge_build_info() is "sparge <version>"."""
    first = build_info().split("\n", 1)[0].split()
    return first[1] if len(first) == 2 and first[0] == "sparge" else None


def dtype_name(dtype):
    return _loaded()[0].sparge_dtype_name(dtype).decode()


def has_f64():
    """Whether the library knows SPARGE_F64 (fp64 tensors on cpu-ref): its dtype name is "f64"."""
    flag = _state.get("f64")
    if flag is None:
        flag = _state["f64"] = dtype_name(F64) == "f64"
    return flag
