"""Zero-copy views of torch tensors, sparge device handles, and the CUDA stream hand-off."""
import contextlib
import ctypes
import threading

import torch

from . import _lib

_DTYPES = {torch.float32: _lib.F32, torch.float16: _lib.F16, torch.bfloat16: _lib.BF16}
LAYOUTS = ("bhnd", "bnhd")


class Device:
    """An open sparge device ("cpu", "cuda:0", ...), kept for the life of the process and shared by every
    call. torch_device is where its tensors live. The lock serialises the stream hand-off and the call that
    follows it, since a sparge handle has one stream."""

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


_devices = {}
_devices_lock = threading.Lock()


def open_device(name, torch_device=None):
    """The shared sparge Device for a name such as "cpu", "cpu-ref", "cuda:1", "cuda-generic:0"; torch_device
    (where its tensors live) is read from the name unless given."""
    if torch_device is None:
        backend, _, index = name.partition(":")
        if backend == "auto":
            raise ValueError("sparge: name the device ('cpu', 'cuda:0', ...); 'auto' is for the C API")
        torch_device = torch.device("cpu") if backend.startswith("cpu") else torch.device("cuda", int(index or 0))
    with _devices_lock:
        dev = _devices.get(name)
        if dev is None:
            dev = _devices[name] = Device(name, torch_device)
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
    if layout not in LAYOUTS:
        raise ValueError(f"sparge: layout must be 'bhnd' ([B,H,N,D]) or 'bnhd' ([B,N,H,D]), got {layout!r}")


def same_device(role_tensors):
    """Every tensor must be on the first one's device: sparge cannot tell a host pointer from a device one."""
    first_role, first = role_tensors[0]
    for role, t in role_tensors[1:]:
        if t.device != first.device:
            raise ValueError(f"sparge: {role} is on {t.device} but {first_role} is on {first.device}")


def view(t, layout, role):
    """sparge_tensor over t's memory: [B,H,N,D] for layout 'bhnd', or t = [B,N,H,D] seen as [B,H,N,D] for
    'bnhd'. Element strides are passed through, so no copy is made for any strided tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"sparge: {role} must be a torch.Tensor, got {type(t).__name__}")
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"sparge: {role} has dtype {t.dtype}; sparge takes float32, float16 and bfloat16")
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

