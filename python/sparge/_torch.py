"""Zero-copy views of torch tensors, sparge device handles, and the CUDA stream hand-off."""
import contextlib
import ctypes
import threading

import torch

from . import _checks, _lib

_DTYPES = {torch.float32: _lib.F32, torch.float16: _lib.F16, torch.bfloat16: _lib.BF16}
LAYOUTS = _checks.LAYOUTS


def tolerance(dtype):
    """Relative L2 error against cpu-ref that every backend is held to for outputs of this torch dtype
    (float32 1e-5, float16 3e-3, bfloat16 1e-2, float64 on cpu-ref 1e-12): the library's one table."""
    code = {**_DTYPES, torch.float64: _lib.F64}.get(dtype)
    if code is None:
        raise TypeError(f"sparge: no tolerance for {dtype} (sparge stores float32, float16, bfloat16 and float64)")
    return _lib.tolerance(code)


class Device:
    """An open sparge device handle ("cpu", "cuda:0", ...), kept for the life of the process. torch_device is
    where its tensors live. The lock serialises the stream hand-off and the call that follows it, since a sparge
    handle has one stream."""

    def __init__(self, name, torch_device):
        self.torch_device = torch_device
        self.lock = threading.RLock()
        handle = ctypes.c_void_p()
        with self.guard():
            _lib.call("sparge_device_open", name.encode(), ctypes.byref(handle))
        self.handle = handle
        self.name = _lib.lib.sparge_device_name(handle).decode()
        self.backend = _lib.lib.sparge_device_backend(handle).decode()
        self.description = _lib.lib.sparge_device_description(handle).decode()

    def __repr__(self):
        return f"sparge.Device({self.name!r}: {self.description})"

    @contextlib.contextmanager
    def guard(self):
        """Hold the device for a call. sparge makes its GPU the current device; torch.cuda.device gives the
        caller's current device back afterwards."""
        with self.lock:
            if self.torch_device.type == "cuda":
                with torch.cuda.device(self.torch_device):
                    yield
            else:
                yield

    @contextlib.contextmanager
    def bound(self):
        """Hold the device and point it at torch's current stream, so that sparge's work is ordered with
        PyTorch's without a synchronization. Yields the stream (None on the CPU)."""
        with self.guard():
            if self.torch_device.type != "cuda":
                yield None
                return
            stream = torch.cuda.current_stream(self.torch_device).cuda_stream
            _lib.call("sparge_set_stream", self.handle, ctypes.c_void_p(stream))
            yield stream

    def synchronize(self):
        with self.bound():
            _lib.call("sparge_synchronize", self.handle)

    # ------------------------------------------------------------ options and limits
    def options(self):
        """{name: {"value", "values", "env", "help"}} of the device's tuning switches (kernel variants, the CPU's
        SIMD tier, "strict"); "values" lists the accepted ones, "auto" first."""
        out = {}
        for i in range(_lib.lib.sparge_device_option_count(self.handle)):
            fields = [ctypes.c_char_p() for _ in range(5)]
            _lib.call("sparge_device_option", self.handle, i, *[ctypes.byref(f) for f in fields])
            name, value, values, env, help_ = (f.value.decode() if f.value is not None else None for f in fields)
            out[name] = {"value": value, "values": values.split("|"), "env": env, "help": help_}
        return out

    def get_option(self, name):
        value = ctypes.c_char_p()
        _lib.call("sparge_device_get_option", self.handle, str(name).encode(), ctypes.byref(value))
        return value.value.decode()

    def set_option(self, name, value):
        """Set a tuning switch for later calls; an unknown name or value raises SpargeError and changes nothing."""
        with self.guard():
            _lib.call("sparge_device_set_option", self.handle, str(name).encode(), str(value).encode())

    def supports(self, op, *, dtype=torch.float32, head_dim=64, block_q=0, block_k=0, B=1, H=1, Nq=1, Nk=1,
                 kv_heads=0, causal=False, varlen=False, rows_aligned=True, deterministic=False):
        """The tier of this device that would run the call described (sparge_op_desc: op one of "pool",
        "pooled_map", "mask_select", "mask_predict", "forward", "backward"; block sizes 0 for dense attention,
        kv_heads 0 for H), or SpargeError (SPARGE_ERR_UNSUPPORTED) saying why each tier refuses it. The sizes are
        checked as sparge's arguments are (TypeError / ValueError)."""
        codes = {"pool": _lib.OP_POOL, "pooled_map": _lib.OP_POOLED_MAP, "mask_select": _lib.OP_MASK_SELECT,
                 "mask_predict": _lib.OP_MASK_PREDICT, "forward": _lib.OP_FORWARD, "backward": _lib.OP_BACKWARD}
        if op not in codes:
            raise ValueError(f"sparge: op must be one of {', '.join(codes)}, got {op!r}")
        code = {**_DTYPES, torch.float64: _lib.F64}.get(dtype)
        if code is None:
            raise TypeError(f"sparge: no sparge dtype for {dtype}")
        # ctypes would wrap out-of-range integers silently, and the answer would be about another call.
        head_dim = _checks.integer(head_dim, "head_dim", 1, _lib.INT64_MAX)
        block_q, block_k = (_checks.integer(b, name, 0, _lib.INT32_MAX) for b, name in ((block_q, "block_q"),
                                                                                      (block_k, "block_k")))
        B, H, Nq, Nk = (_checks.integer(n, name, 1, _lib.INT64_MAX) for n, name in ((B, "B"), (H, "H"), (Nq, "Nq"),
                                                                                   (Nk, "Nk")))
        kv_heads = _checks.integer(kv_heads, "kv_heads", 0, _lib.INT64_MAX)
        flags = [int(_checks.flag(f, name)) for f, name in ((rows_aligned, "rows_aligned"),
                                                            (deterministic, "deterministic"), (causal, "causal"),
                                                            (varlen, "varlen"))]
        desc = _lib.sparge_op_desc(codes[op], code, head_dim, block_q, block_k, B, H, Nq, Nk, flags[0], flags[1],
                                   kv_heads, flags[2], flags[3])
        tier = ctypes.c_char_p()
        with self.guard():
            _lib.call("sparge_device_supports", self.handle, ctypes.byref(desc), ctypes.byref(tier))
        return tier.value.decode()


_devices = {}
_devices_lock = threading.Lock()


def current_stream(torch_device):
    return torch.cuda.current_stream(torch_device).cuda_stream if torch_device.type == "cuda" else None


def check_compiled_in(backend):
    available = _lib.backends()
    if backend not in available:
        raise ValueError(f"sparge: backend '{backend}' is not compiled into {_lib.library_path} (it has "
                         f"{', '.join(available)})")


def open_device(name, torch_device=None):
    """The sparge Device for a name such as "cpu", "cpu-ref", "cuda:1", "cuda-generic:0" on torch's current
    stream; torch_device (where its tensors live) is read from the name unless given.

    GPU handles are kept one per stream: a handle switching streams waits for the old one (its scratch memory
    serves both), which a CUDA graph capture must not see, so work captured on a stream only ever uses the
    handle that the same stream's warm-up runs opened and sized."""
    if not isinstance(name, str):
        raise TypeError(f"sparge: device name must be a str, got {type(name).__name__}")
    backend, _, index = name.partition(":")
    if torch_device is None:
        if backend == "auto":
            raise ValueError("sparge: name the device ('cpu', 'cuda:0', ...); 'auto' is for the C API")
        if backend.startswith("cpu"):
            torch_device = torch.device("cpu")
        else:
            if index and not index.isdigit():
                raise ValueError(f"sparge: bad device index in {name!r}")
            torch_device = torch.device("cuda", int(index or 0))
    try:
        stream = current_stream(torch_device)
    except (AssertionError, RuntimeError) as e:  # a torch without CUDA asserts; name what is missing instead
        check_compiled_in(backend)
        raise ValueError(f"sparge: cannot open {name!r}: torch says: {e}") from None
    key = (name, stream)
    with _devices_lock:
        dev = _devices.get(key)
        if dev is None:
            check_compiled_in(backend)
            dev = _devices[key] = Device(name, torch_device)
        return dev


def sparge_device_name(torch_device, backend=None):
    """sparge's name for the device a tensor lives on: "cpu" for CPU tensors, "cuda:N" (or "hip:N" under a
    ROCm build of torch) for GPU tensors. backend replaces the backend part ("cpu-ref", "cuda-generic")."""
    # A backend of the other kind would hand host pointers to GPU kernels or device pointers to the CPU.
    if torch_device.type == "cpu":
        if backend in ("cuda", "cuda-generic", "hip"):
            raise ValueError(f"sparge: backend '{backend}' needs CUDA tensors, these are on the CPU")
        return backend or "cpu"
    if torch_device.type == "cuda":
        if backend is not None and backend.startswith("cpu"):
            raise ValueError(f"sparge: backend '{backend}' needs CPU tensors, these are on {torch_device}")
        index = torch_device.index if torch_device.index is not None else torch.cuda.current_device()
        default = "hip" if getattr(torch.version, "hip", None) else "cuda"
        return f"{backend or default}:{index}"
    raise ValueError(f"sparge: tensors on device type '{torch_device.type}' are not supported (cpu or cuda)")


def device_for(tensor, backend=None):
    return open_device(sparge_device_name(tensor.device, backend), tensor.device)


def check_layout(layout):
    _checks.layout(layout)


def same_device(role_tensors):
    """Every tensor on the first one's device (sparge cannot tell a host pointer from a device one)."""
    _checks.same_device(role_tensors)


def sparge_dtype(t, device_backend, role):
    """sparge's dtype for t on a device of backend device_backend. float64 is cpu-ref's, in libraries with
    SPARGE_F64: gradcheck needs real fp64 arithmetic end to end, which only the fp64 oracle has."""
    dtype = _DTYPES.get(t.dtype)
    if dtype is not None:
        return dtype
    if t.dtype == torch.float64:
        if device_backend != "cpu-ref":
            raise TypeError(f"sparge: {role} is float64, which only backend='cpu-ref' computes (this call runs on "
                            f"'{device_backend}')")
        if not _lib.has_f64():
            raise TypeError(f"sparge: {role} is float64, but {_lib.library_path} has no SPARGE_F64 (a libsparge "
                            "whose cpu-ref takes fp64 tensors is needed)")
        return _lib.F64
    raise TypeError(f"sparge: {role} has dtype {t.dtype}; sparge takes float32, float16 and bfloat16")


def view(t, layout, role, device_backend="cpu"):
    """sparge_tensor over t's memory: [B,H,N,D] for layout 'bhnd', or t = [B,N,H,D] seen as [B,H,N,D] for
    'bnhd'. Element strides are passed through, so no copy is made for any strided tensor."""
    _checks.strided(t, role)
    dtype = sparge_dtype(t, device_backend, role)
    if t.dim() != 4:
        expected = "[B,H,N,D]" if layout == "bhnd" else "[B,N,H,D]"
        raise ValueError(f"sparge: {role} must be 4-D {expected} (layout '{layout}'), got shape {list(t.shape)}")
    shape, stride = list(t.shape), list(t.stride())
    if layout == "bnhd":
        shape = [shape[0], shape[2], shape[1], shape[3]]
        stride = [stride[0], stride[2], stride[1], stride[3]]
    return _lib.sparge_tensor(t.data_ptr(), dtype, (ctypes.c_int64 * 4)(*shape), (ctypes.c_int64 * 4)(*stride))


def bhnd_shape(t, layout):
    """(B, H, N, D) of a 4-D tensor in the given layout."""
    B, X, Y, D = t.shape
    return (B, X, Y, D) if layout == "bhnd" else (B, Y, X, D)


def empty_in_layout(B, H, N, D, layout, dtype, device):
    """A contiguous tensor of logical shape [B,H,N,D] stored as the layout says (shape [B,N,H,D] for 'bnhd')."""
    shape = (B, H, N, D) if layout == "bhnd" else (B, N, H, D)
    return torch.empty(shape, dtype=dtype, device=device)
