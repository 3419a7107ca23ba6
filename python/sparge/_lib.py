"""ctypes mirror of src/sparge.h: library lookup, structures, prototypes and status checks.

Nothing here needs torch; the torch layer lives in the other modules of the package.
"""
import ctypes
import ctypes.util
import os

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


class SpargeError(RuntimeError):
    """A sparge call failed. `status` is the sparge_status value, `status_name` its name
    ("SPARGE_ERR_SHAPE"), and the message is sparge_last_error() of the failing call."""

    def __init__(self, status, status_name, message, function):
        self.status = status
        self.status_name = status_name
        self.function = function
        super().__init__(f"{function}: {status_name}: {message}")


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
    ]


_LIB_NAMES = ("libsparge.so.0", "libsparge.so", "libsparge.dylib")


def _candidates():
    """Where libsparge is looked for, in order (each entry: (path, how it was found))."""
    env = os.environ.get("SPARGE_LIBRARY")
    if env:
        yield env, "SPARGE_LIBRARY"
        return  # an explicit choice must not be silently replaced by another library
    build = os.environ.get("SPARGE_BUILD_DIR")
    if build:
        for sub in (".libs", ""):
            for name in _LIB_NAMES:
                yield os.path.join(build, sub, name), "SPARGE_BUILD_DIR"
    # python/sparge/ sits two levels below the source root; an in-tree build puts the library in .libs/.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in _LIB_NAMES:
        yield os.path.join(root, ".libs", name), "source tree"
    found = ctypes.util.find_library("sparge")
    if found:
        yield found, "ctypes.util.find_library"
    for d in ("/usr/local/lib", "/usr/local/lib64", "/usr/lib", "/usr/lib64", "/usr/lib/x86_64-linux-gnu",
              "/usr/lib/aarch64-linux-gnu"):
        for name in _LIB_NAMES:
            yield os.path.join(d, name), "system library directories"


def _load():
    tried = []
    for path, how in _candidates():
        if os.sep in path and not os.path.exists(path):
            if how == "SPARGE_LIBRARY":
                tried.append(f"{path} ({how}): no such file")
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append(f"{path} ({how}): {e}")
    detail = ("; tried " + "; ".join(tried)) if tried else ""
    raise OSError(
        "sparge: libsparge.so not found. Set SPARGE_LIBRARY=/path/to/libsparge.so, or SPARGE_BUILD_DIR to a "
        "build directory (the library is in its .libs/), or install sparge (make install) into a directory the "
        "dynamic loader searches (ldconfig, LD_LIBRARY_PATH)" + detail)


lib, library_path = _load()

_P = ctypes.c_void_p
_T = ctypes.POINTER(sparge_tensor)
_I64 = ctypes.c_int64
_S = ctypes.c_int
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
    "sparge_mask_params_default": (sparge_mask_params, []),
    "sparge_mask_create": (_S, [_P, _I64, _I64, _I64, _I64, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_P)]),
    "sparge_mask_destroy": (None, [_P]),
    "sparge_mask_get_shape": (_S, [_P, ctypes.POINTER(sparge_mask_shape)]),
    "sparge_mask_predict": (_S, [_P, _T, _T, ctypes.POINTER(sparge_mask_params), _P]),
    "sparge_mask_select": (_S, [_P, _T, ctypes.POINTER(sparge_mask_params), _P]),
    "sparge_mask_set_dense": (_S, [_P, _P]),
    "sparge_mask_get_csr": (_S, [_P, _P, _P, _P, _P]),
    "sparge_mask_get_dense": (_S, [_P, _P]),
    "sparge_mask_get_pooled_map": (_S, [_P, _P]),
    "sparge_mask_get_stats": (_S, [_P, ctypes.POINTER(sparge_mask_stats), _P, _P]),
    "sparge_attention_forward": (_S, [_P, _T, _T, _T, _P, ctypes.POINTER(sparge_attn_params), _T, _P]),
    "sparge_attention_backward": (_S, [_P, _T, _T, _T, _T, _T, _P, _P, ctypes.POINTER(sparge_attn_params), _T, _T,
                                       _T]),
    "sparge_attention": (_S, [_P, _T, _T, _T, ctypes.POINTER(sparge_mask_params), _T, _P, _P]),
    "sparge_build_info": (ctypes.c_char_p, []),
    "sparge_topology_info": (ctypes.c_char_p, []),
}
for _name, (_restype, _argtypes) in _PROTOTYPES.items():
    _fn = getattr(lib, _name)
    _fn.restype = _restype
    _fn.argtypes = _argtypes

def status_name(status):
    return lib.sparge_status_name(status).decode()


def check(status, function):
    """Raise SpargeError carrying sparge_last_error() if status is not SPARGE_OK."""
    if status != OK:
        message = lib.sparge_last_error().decode(errors="replace")
        raise SpargeError(status, status_name(status), message, function)


def call(name, *args):
    """Call a status-returning sparge function and raise on failure."""
    check(getattr(lib, name)(*args), name)


def backends():
    """Backends compiled into the loaded library ("cpu-ref", "cpu", "cuda", ...)."""
    return [lib.sparge_backend_name(i).decode() for i in range(lib.sparge_backend_count())]


def backend_device_count(backend):
    return lib.sparge_backend_device_count(backend.encode())


def build_info():
    return lib.sparge_build_info().decode()


def dtype_name(dtype):
    return lib.sparge_dtype_name(dtype).decode()
