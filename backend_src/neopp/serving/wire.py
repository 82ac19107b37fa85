"""How a model's stub and the stub that runs its mode's engine talk: messages over a Unix socket.

A message is a 4-byte little-endian length, a JSON header of that length, then the raw byte
blobs the header lists (``"blobs": [sizes]``); file descriptors may ride along with its first
bytes (``SCM_RIGHTS``). Large tensors (a KV prefix, a ``NOISE``) travel as a memory file
(``memfd``) the sender fills once and the receiver maps, so their bytes cross no socket.
Both ends are this package's own stubs of one server, reachable only through a 0700 folder of
the server's user; every header and size is still checked before anything is allocated.

This module imports no torch (a stub that only forwards requests stays small); the owner's
side turns a BF16 prefix into a torch tensor where it unpacks one.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import socket
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..contract.statuses import ErrorClass

MAX_HEADER = 1 << 20
MAX_BLOB = 1 << 31
MAX_FDS = 16
INLINE_BYTES = 1 << 16  # a tensor this big or bigger goes through a memory file
# An error's text is cut to this many characters (a JSON character is at most 12 bytes, so any cut
# text fits a header many times over, and a client reads a refusal, not a listing of megabytes).
MAX_ERROR_TEXT = 8192
PREFIX = struct.Struct("<I")

# The data types the contract uses, and the numpy dtype of each that has one.
TRITON_TYPES = ("UINT8", "INT64", "FP32", "BOOL", "BYTES", "BF16")
NUMPY_OF = {"UINT8": np.uint8, "INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_}
BF16_CODE, BF16_BITS = 4, 16  # DLPack's kDLBfloat, 16 bits


class WireError(Exception):
    """The other end broke the protocol, or went away."""


# ---------------------------------------------------------------- messages

def fit_text(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """``text``, or its start with a note of how much was cut, so that every message can be sent."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... (cut: {len(text) - limit} more characters)"


def error_header(job: int, status: str, reason: str, message: str) -> dict[str, Any]:
    """The last message of a request that failed; its text cut to fit the framing."""
    return {"type": "error", "job": job, "status": status, "reason": reason, "message": fit_text(message)}


def failure_header(cls: ErrorClass, message: str) -> dict[str, Any]:
    """The last message of a request that failed on this side of the socket (its entry knows the job)."""
    return {"type": "error", "status": cls.status, "reason": cls.reason, "message": fit_text(message)}


def send_message(sock: socket.socket, header: dict[str, Any], blobs: Sequence[bytes | memoryview] = (),
                 fds: Sequence[int] = ()) -> None:
    """One message; the caller serialises writers (one lock per socket)."""
    head = json.dumps({**header, "blobs": [len(b) for b in blobs]}, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER:
        raise WireError(f"header of {len(head)} bytes is over the limit of {MAX_HEADER}")
    first = PREFIX.pack(len(head)) + head
    if fds:
        sent = socket.send_fds(sock, [first], list(fds))
        first = first[sent:]
    if first:
        sock.sendall(first)
    for blob in blobs:
        sock.sendall(blob)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError("the other end closed the connection")
        got += k
    return bytes(buf)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[bytes], list[int]]:
    """(header, blobs, received fds); the caller owns (and closes) the fds."""
    data, fds, _flags, _addr = socket.recv_fds(sock, PREFIX.size, MAX_FDS)
    if not data:
        _close_all(fds)
        raise WireError("the other end closed the connection")
    try:
        data += _recv_exact(sock, PREFIX.size - len(data))
        (size,) = PREFIX.unpack(data)
        if size > MAX_HEADER:
            raise WireError(f"header of {size} bytes is over the limit of {MAX_HEADER}")
        header = json.loads(_recv_exact(sock, size), parse_constant=_no_constant)
        sizes = header.get("blobs") if isinstance(header, dict) else None
        if not isinstance(sizes, list) or not all(type(s) is int and 0 <= s <= MAX_BLOB for s in sizes):
            raise WireError("a message must be a JSON object listing its blob sizes")
        return header, [_recv_exact(sock, s) for s in sizes], list(fds)
    except BaseException:
        _close_all(fds)
        raise


def _no_constant(name: str) -> Any:
    raise WireError(f"{name} is not JSON")


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# ---------------------------------------------------------------- tensors, front side (no torch)

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def bf16_view(capsule: Any) -> tuple[int, tuple[int, ...], int]:
    """(address, shape, byte count) of a CPU, compact BF16 tensor handed over as a DLPack capsule.

    The capsule stays the producer's (it is not marked used): its memory lives as long as the
    caller holds the capsule, and the producer frees it when the capsule goes."""
    tensor = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    if tensor.device.device_type != 1:
        raise WireError("a BF16 input must be in CPU memory")
    if (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) != (BF16_CODE, BF16_BITS, 1):
        raise WireError("the tensor is not BF16")
    shape = tuple(int(tensor.shape[i]) for i in range(tensor.ndim))
    if tensor.strides:
        expected, step = [], 1
        for dim in reversed(shape):
            expected.insert(0, step)
            step *= dim
        if any(int(tensor.strides[i]) != expected[i] for i in range(tensor.ndim) if shape[i] > 1):
            raise WireError("a BF16 input must be contiguous")
    return int(tensor.data or 0) + int(tensor.byte_offset), shape, math.prod(shape) * 2


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
_DLTENSOR = b"dltensor"
_EXPORTED: dict[int, tuple[Any, ...]] = {}  # what an exported tensor's memory lives in, until its consumer lets go


@_DELETER
def _let_go(managed: Any) -> None:
    _EXPORTED.pop(ctypes.addressof(managed.contents), None)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_gone(capsule: int) -> None:
    """A capsule nobody consumed (still named "dltensor") lets its memory go with it."""
    if _capsule_valid(capsule, _DLTENSOR):
        _EXPORTED.pop(_capsule_address(capsule, _DLTENSOR), None)


# Own prototypes: setting argtypes on ctypes.pythonapi's shared functions would change them for everyone.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_capsule_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_address = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def bf16_capsule(data: bytes, shape: Sequence[int]) -> Any:
    """``data`` as a CPU BF16 tensor [shape] in a DLPack capsule: what ``pb_utils.Tensor.from_dlpack``
    (or ``torch.from_dlpack``) takes, made without torch. The bytes are copied once, into memory the
    consumer releases through the capsule's deleter."""
    if len(data) != math.prod(shape) * 2:
        raise WireError(f"{len(data)} bytes are not a BF16 tensor of shape {list(shape)}")
    memory = (ctypes.c_uint8 * max(len(data), 1)).from_buffer_copy(data.ljust(1, b"\0"))
    dims = (ctypes.c_int64 * len(shape))(*shape)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = ctypes.addressof(memory)
    managed.dl_tensor.device = _DLDevice(1, 0)  # kDLCPU
    managed.dl_tensor.ndim = len(shape)
    managed.dl_tensor.dtype = _DLDataType(BF16_CODE, BF16_BITS, 1)
    managed.dl_tensor.shape = dims
    managed.deleter = _let_go
    address = ctypes.addressof(managed)
    _EXPORTED[address] = (managed, memory, dims)
    return _capsule_new(address, _DLTENSOR, ctypes.cast(_capsule_gone, ctypes.c_void_p))


def exported_tensors() -> int:
    """How many exported tensors are still held (for tests: each is let go once consumed and freed)."""
    return len(_EXPORTED)


def memory_file(address: int, nbytes: int, name: str) -> int:
    """A memfd holding a copy of ``nbytes`` at ``address`` (the one copy a large tensor makes)."""
    fd = os.memfd_create(f"neopp-{name}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        with mmap.mmap(fd, max(nbytes, 1)) as target:
            ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(target)), address, nbytes)
        return fd
    except BaseException:
        os.close(fd)
        raise


def bytes_blob(items: np.ndarray) -> bytes:
    """A BYTES tensor as Triton serialises one: each element as a 4-byte length and its bytes."""
    parts = []
    for item in items.reshape(-1):
        data = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts += [PREFIX.pack(len(data)), data]
    return b"".join(parts)


@dataclass
class Packed:
    """Tensors ready to send: their descriptions (header), inline blobs and memory files."""

    specs: list[dict[str, Any]]
    blobs: list[bytes]
    fds: list[int]

    def close(self) -> None:
        _close_all(self.fds)
        self.fds = []


def pack_tensors(tensors: Sequence[Any]) -> Packed:
    """Triton tensors (``pb_utils.Tensor``) as the wire carries them, no value read or checked:
    the engine's stub parses them, once."""
    out = Packed([], [], [])
    try:
        for t in tensors:
            out.specs.append(_pack_one(t, out))
    except BaseException:
        out.close()
        raise
    return out


def _pack_one(t: Any, out: Packed) -> dict[str, Any]:
    name = t.name()
    try:
        arr = t.as_numpy()
    except Exception:  # noqa: BLE001 - numpy has no bfloat16: the one type that reaches us through DLPack
        capsule = t.to_dlpack()
        address, shape, nbytes = bf16_view(capsule)
        out.fds.append(memory_file(address, nbytes, name))
        return {"name": name, "datatype": "BF16", "shape": list(shape), "fd": len(out.fds) - 1}
    if arr.dtype == np.object_:
        out.blobs.append(bytes_blob(arr))
        return {"name": name, "datatype": "BYTES", "shape": list(arr.shape), "blob": len(out.blobs) - 1}
    datatype = next((k for k, v in NUMPY_OF.items() if arr.dtype == v), None)
    if datatype is None:
        raise WireError(f"{name}: datatype {arr.dtype} is not one the contract uses")
    arr = np.ascontiguousarray(arr)
    if arr.nbytes >= INLINE_BYTES:
        out.fds.append(memory_file(arr.ctypes.data, arr.nbytes, name))
        return {"name": name, "datatype": datatype, "shape": list(arr.shape), "fd": len(out.fds) - 1}
    out.blobs.append(arr.tobytes())
    return {"name": name, "datatype": datatype, "shape": list(arr.shape), "blob": len(out.blobs) - 1}


# ---------------------------------------------------------------- tensors, engine side

def declared_sizes(specs: Any, blobs: Sequence[bytes]) -> dict[str, int]:
    """name -> bytes each tensor's description declares (a BYTES tensor: its blob's length), read
    before anything is mapped, so a request over its limit is refused for what it is."""
    if not isinstance(specs, list) or len(specs) > 64:
        raise WireError("the tensors must be a list of at most 64 descriptions")
    sizes: dict[str, int] = {}
    for spec in specs:
        name, datatype, shape = _description(spec)
        if name in sizes:
            raise WireError(f"{name}: given twice")
        if datatype == "BYTES":
            index = spec.get("blob")
            sizes[name] = len(blobs[index]) if type(index) is int and 0 <= index < len(blobs) else 0
        else:
            sizes[name] = _size(datatype, shape)
    return sizes


def unpack_tensors(specs: Any, blobs: Sequence[bytes], fds: Sequence[int], max_bytes: int,
                   capsules: bool = False) -> dict[str, Any]:
    """name -> numpy array (a torch bfloat16 tensor for BF16; with ``capsules``, a DLPack capsule
    instead, and no torch), each checked against its description and all of them together against
    ``max_bytes``; the fds are the caller's to close."""
    if sum(declared_sizes(specs, blobs).values()) > max_bytes:
        raise WireError(f"the request's tensors are over {max_bytes} bytes")
    out: dict[str, Any] = {}
    for spec in specs:
        name, datatype, shape = _description(spec)
        if capsules and datatype == "BF16" and "blob" in spec:
            index = spec["blob"]
            if type(index) is not int or not 0 <= index < len(blobs):
                raise WireError(f"{name}: no such blob")
            out[name] = bf16_capsule(blobs[index], shape)
        else:
            out[name] = _unpack_one(spec, name, datatype, shape, _size(datatype, shape), blobs, fds)
    return out


def _size(datatype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * (2 if datatype == "BF16" else np.dtype(NUMPY_OF.get(datatype, np.uint8)).itemsize)


def _description(spec: Any) -> tuple[str, str, tuple[int, ...]]:
    if not isinstance(spec, dict):
        raise WireError("a tensor description must be an object")
    name, datatype, shape = spec.get("name"), spec.get("datatype"), spec.get("shape")
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise WireError("a tensor needs a name of at most 64 characters")
    if datatype not in TRITON_TYPES:
        raise WireError(f"{name}: unknown datatype")
    if not isinstance(shape, list) or len(shape) > 8 or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
        raise WireError(f"{name}: shape must be a list of at most 8 sizes")
    return name, datatype, tuple(shape)


def _unpack_one(spec: dict, name: str, datatype: str, shape: tuple[int, ...], size: int,
                blobs: Sequence[bytes], fds: Sequence[int]) -> Any:
    if "fd" in spec:
        index = spec["fd"]
        if type(index) is not int or not 0 <= index < len(fds) or datatype == "BYTES":
            raise WireError(f"{name}: no such memory file")
        if os.fstat(fds[index]).st_size < size:
            raise WireError(f"{name}: its memory file is smaller than its shape")
        view = mmap.mmap(fds[index], max(size, 1), flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)  # private: writes stay in this process
    else:
        index = spec.get("blob")
        if type(index) is not int or not 0 <= index < len(blobs):
            raise WireError(f"{name}: no such blob")
        view = blobs[index]
        if datatype == "BYTES":
            return _bytes_tensor(name, view, shape)
        if len(view) != size:
            raise WireError(f"{name}: {len(view)} bytes for shape {list(shape)}")
    if datatype == "BF16":
        import torch

        if not size:
            return torch.empty(shape, dtype=torch.bfloat16)
        with warnings.catch_warnings():  # a received blob is immutable bytes: read here, never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(view, dtype=torch.bfloat16, count=size // 2).view(shape)
    return np.frombuffer(view, dtype=NUMPY_OF[datatype], count=size // np.dtype(NUMPY_OF[datatype]).itemsize
                         ).reshape(shape)


def _bytes_tensor(name: str, data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    items, pos = [], 0
    for _ in range(math.prod(shape)):
        if pos + PREFIX.size > len(data):
            raise WireError(f"{name}: its BYTES are cut short")
        (n,) = PREFIX.unpack_from(data, pos)
        pos += PREFIX.size
        if pos + n > len(data):
            raise WireError(f"{name}: its BYTES are cut short")
        items.append(data[pos:pos + n])
        pos += n
    if pos != len(data):
        raise WireError(f"{name}: bytes left over after {len(items)} elements")
    return np.array(items, dtype=np.object_).reshape(shape)
