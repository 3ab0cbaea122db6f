"""cuBLASLt called directly (ctypes), so a product can run a kernel other than cuBLAS's own pick.

``torch.mm`` takes cuBLAS's one pick per shape. At a decode step's shapes that pick can leave SMs idle
(too few output tiles for one wave, or 1.7 waves), while cuBLASLt offers the same kernels with other
tiles, cluster shapes and options. This module asks cuBLASLt for its candidates (its heuristic list,
and every configuration it accepts beyond it: ``variants``), runs one, and reads what each is, for
``benchmarks/probes/lt_candidates.py``. The engine keeps ``torch.mm``: the kernels that won alone
gained nothing in whole steps (docs/kernels.md section 4). The library is the one PyTorch already
loaded; nothing is built here.

Row-major ``out[M, N] = x[M, K] @ weight[N, K].T`` is column-major ``out.T = weight @ x.T``: cuBLASLt's
A is the weight (transposed), its B is x, and its D is ``out`` (the layout ``F.linear`` uses too).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

_SUCCESS = 0
_OP_N, _OP_T = 0, 1
_COMPUTE_32F = 68  # cublasComputeType_t
_R_32F = 0  # cudaDataType
_DATA_TYPES = {torch.float16: 2, torch.bfloat16: 14, torch.float32: 0}
_DESC_TRANSA, _DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
_PREF_MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
# cublasLtMatmulAlgoConfigAttributes_t: name -> (value, byte width)
_CONFIG = {
    "algo_id": (0, 4),
    "tile": (1, 4),
    "split_k": (2, 4),
    "reduction": (3, 4),
    "swizzle": (4, 4),
    "custom": (5, 4),
    "stages": (6, 4),
    "inner_shape": (7, 2),
    "cluster": (8, 2),
}
WORKSPACE_BYTES = 32 * 1024 * 1024  # what split-K candidates may use; one buffer a device


class Algo(ctypes.Structure):
    """``cublasLtMatmulAlgo_t``: opaque, 64 bytes."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t``."""

    _fields_ = [
        ("algo", Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class BlasLtError(RuntimeError):
    """A cuBLASLt call returned an error status."""


def _loaded_path() -> str | None:
    """The libcublasLt this process already mapped (PyTorch's), so both use one library."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "libcublasLt.so" in path:
            return path
    return None


@functools.cache
def _lib() -> ctypes.CDLL:
    # cuBLAS loads lazily: one product makes PyTorch map the library it links against
    torch.mm(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))
    path = _loaded_path()
    if path is None:
        raise BlasLtError("libcublasLt is not loaded in this process; cuBLASLt cannot be called directly")
    lib = ctypes.CDLL(path)
    p, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(p), i, i],
        "cublasLtMatmulDescSetAttribute": [p, i, p, sz],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), i, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, sz],
        "cublasLtMatmulAlgoGetHeuristic": [*[p] * 7, i, ctypes.POINTER(_Heuristic), ctypes.POINTER(i)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(Algo), i, p, sz, ctypes.POINTER(sz)],
        "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(Algo), i, p, sz],
        "cublasLtMatmulAlgoCapGetAttribute": [ctypes.POINTER(Algo), i, p, sz, ctypes.POINTER(sz)],
        "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, ctypes.POINTER(Algo), ctypes.POINTER(_Heuristic)],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(Algo), p, sz, p],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


def _check(status: int, what: str) -> None:
    if status != _SUCCESS:
        raise BlasLtError(f"{what} failed with cuBLAS status {status}")


def available() -> bool:
    """Whether cuBLASLt can be called here (a CUDA device and PyTorch's library found)."""
    if not torch.cuda.is_available():
        return False
    try:
        _lib()
    except (BlasLtError, OSError, AttributeError):
        return False
    return True


@dataclass
class _DeviceState:
    handle: ctypes.c_void_p
    workspace: torch.Tensor
    preference: ctypes.c_void_p


_states: dict[int, _DeviceState] = {}
_lock = threading.Lock()


def _state(device: torch.device) -> _DeviceState:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _states:
            lib = _lib()
            handle = ctypes.c_void_p()
            _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", index))
            pref = ctypes.c_void_p()
            _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
            size = ctypes.c_uint64(WORKSPACE_BYTES)
            _check(
                lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(size), 8),
                "cublasLtMatmulPreferenceSetAttribute",
            )
            _states[index] = _DeviceState(handle, workspace, pref)
        return _states[index]


@dataclass(frozen=True)
class Problem:
    """One product's shape and layout: ``out[m, n] = x[m, k] @ weight[n, k].T`` with row strides."""

    m: int
    n: int
    k: int
    dtype: torch.dtype
    x_stride: int
    weight_stride: int
    out_stride: int

    @staticmethod
    def of(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> Problem:
        """The problem of ``out = x @ weight.T`` (``out`` None: a new contiguous tensor)."""
        out_stride = weight.shape[0] if out is None else out.stride(0)
        return Problem(
            x.shape[0], weight.shape[0], x.shape[1], x.dtype, x.stride(0), weight.stride(0), out_stride
        )


def supported(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """Whether ``matmul_into`` takes these tensors (``out`` None: a new contiguous one): CUDA, one
    16-bit dtype, unit column strides, 16-byte aligned rows."""
    ok = (
        x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and x.dim() == weight.dim() == 2
        and x.stride(1) == weight.stride(1) == 1
        and x.shape[1] == weight.shape[1]
        and x.stride(0) % 8 == weight.stride(0) % 8 == weight.shape[0] % 8 == 0
    )
    if out is None or not ok:
        return ok
    return (
        out.dtype == x.dtype
        and out.dim() == 2
        and out.stride(1) == 1
        and out.stride(0) % 8 == 0
        and out.shape == (x.shape[0], weight.shape[0])
    )


class _Descriptors:
    """The matmul and matrix-layout descriptors of one Problem (made once, kept for the process)."""

    def __init__(self, problem: Problem) -> None:
        lib = _lib()
        dtype = _DATA_TYPES[problem.dtype]
        self.desc = ctypes.c_void_p()
        _check(
            lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate"
        )
        for attribute, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int32(op)
            _check(
                lib.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value), 4), "DescSet"
            )
        self.a, self.b, self.d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        layouts = (
            (self.a, problem.k, problem.n, problem.weight_stride),  # the weight, column-major K x N
            (self.b, problem.k, problem.m, problem.x_stride),  # x, column-major K x M
            (self.d, problem.n, problem.m, problem.out_stride),  # out, column-major N x M
        )
        for layout, rows, cols, ld in layouts:
            _check(
                lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "LayoutCreate"
            )

    def operands(self) -> tuple[ctypes.c_void_p, ...]:
        """(matmul, A, B, C, D) as cuBLASLt's calls take them (C is D: beta is 0)."""
        return self.desc, self.a, self.b, self.d, self.d


@functools.lru_cache(maxsize=4096)
def _descriptors(problem: Problem) -> _Descriptors:
    return _Descriptors(problem)


def candidates(
    problem: Problem, device: torch.device, limit: int = 32, max_workspace: int = WORKSPACE_BYTES
) -> list[Algo]:
    """cuBLASLt's heuristic list for this problem (best guess first), at most ``limit``, each usable
    within this module's workspace."""
    lib, state, descs = _lib(), _state(device), _descriptors(problem)
    results = (_Heuristic * limit)()
    count = ctypes.c_int(0)
    _check(
        lib.cublasLtMatmulAlgoGetHeuristic(
            state.handle,
            *descs.operands(),
            state.preference,
            limit,
            results,
            ctypes.byref(count),
        ),
        "cublasLtMatmulAlgoGetHeuristic",
    )
    found = []
    for result in results[: count.value]:
        if result.state == _SUCCESS and result.workspace_size <= max_workspace:
            algo = Algo()
            ctypes.memmove(ctypes.byref(algo), ctypes.byref(result.algo), ctypes.sizeof(Algo))
            found.append(algo)
    return found


def describe(algo: Algo) -> dict[str, int]:
    """What a candidate is: its algorithm id, tile, split K, reduction, swizzle, stages, cluster."""
    lib = _lib()
    out = {}
    for name, (attribute, width) in _CONFIG.items():
        value = ctypes.c_uint32(0) if width == 4 else ctypes.c_uint16(0)
        written = ctypes.c_size_t(0)
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(
            ctypes.byref(algo), attribute, ctypes.byref(value), width, ctypes.byref(written)
        )
        out[name] = int(value.value) if status == _SUCCESS else -1
    return out


_CAP_TILE_IDS, _CAP_CUSTOM_OPTION_MAX = 6, 7  # cublasLtMatmulAlgoCapAttributes_t
_REDUCTION_COMPUTE_TYPE = 2  # split-K partials in the fp32 workspace
CLUSTERS = (0, 2, 3, 4, 5, 6, 7, 9)  # cublasLtClusterShape_t ids tried (0: the library's choice)


def _tile_ids(algo: Algo) -> list[int]:
    lib, size = _lib(), ctypes.c_size_t(0)
    lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), _CAP_TILE_IDS, None, 0, ctypes.byref(size))
    ids = (ctypes.c_uint32 * max(1, size.value // 4))()
    lib.cublasLtMatmulAlgoCapGetAttribute(
        ctypes.byref(algo), _CAP_TILE_IDS, ids, size.value, ctypes.byref(size)
    )
    return list(ids[: size.value // 4])


def _set(algo: Algo, name: str, value: int) -> None:
    attribute, width = _CONFIG[name]
    buf = ctypes.c_uint32(value) if width == 4 else ctypes.c_uint16(value)
    _check(
        _lib().cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attribute, ctypes.byref(buf), width),
        name,
    )


def variants(
    problem: Problem,
    device: torch.device,
    seeds: list[Algo],
    split_ks: tuple[int, ...] = (1, 2),
    tiles: tuple[int, ...] | None = None,
    customs: tuple[int, ...] | None = None,
    max_workspace: int = WORKSPACE_BYTES,
) -> list[Algo]:
    """Every configuration cuBLASLt accepts for this problem that differs from a seed (a heuristic
    candidate) in tile, custom option, cluster shape or split K: the search space beyond the
    heuristic's short list (``tiles`` and ``customs`` narrow it to those the seed offers among them).
    Checked with ``cublasLtMatmulAlgoCheck``; duplicates dropped."""
    seen: set[tuple[int, ...]] = set()
    found = []
    for seed in seeds:
        offered_tiles = [t for t in _tile_ids(seed) if tiles is None or t in tiles]
        offered_customs = [c for c in range(_custom_max(seed) + 1) if customs is None or c in customs]
        for tile, custom, cluster, split_k in itertools.product(
            offered_tiles, offered_customs, CLUSTERS, split_ks
        ):
            algo = Algo()
            ctypes.memmove(ctypes.byref(algo), ctypes.byref(seed), ctypes.sizeof(Algo))
            try:
                _set(algo, "tile", tile)
                _set(algo, "custom", custom)
                _set(algo, "cluster", cluster)
                _set(algo, "split_k", split_k)
                _set(algo, "reduction", _REDUCTION_COMPUTE_TYPE if split_k > 1 else 0)
            except BlasLtError:
                continue
            if not _accepted(problem, device, algo, max_workspace):
                continue
            key = tuple(describe(algo).values())
            if key not in seen:
                seen.add(key)
                found.append(algo)
    return found


def _custom_max(algo: Algo) -> int:
    """The largest custom option the algorithm offers (at most 15: the search stays bounded)."""
    value = ctypes.c_int32(0)
    _lib().cublasLtMatmulAlgoCapGetAttribute(
        ctypes.byref(algo), _CAP_CUSTOM_OPTION_MAX, ctypes.byref(value), 4, ctypes.byref(ctypes.c_size_t())
    )
    return min(value.value, 15)


def _accepted(problem: Problem, device: torch.device, algo: Algo, max_workspace: int) -> bool:
    """Whether cuBLASLt runs this configuration for the problem within ``max_workspace`` bytes."""
    result = _Heuristic()
    status = _lib().cublasLtMatmulAlgoCheck(
        _state(device).handle, *_descriptors(problem).operands(), ctypes.byref(algo), ctypes.byref(result)
    )
    return status == _SUCCESS and result.state == _SUCCESS and result.workspace_size <= max_workspace


_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)


def matmul_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, algo: Algo) -> torch.Tensor:
    """``out = x @ weight.T`` by one cuBLASLt candidate, on the current stream (graph-capturable:
    the scalars are host values read at the call, the workspace is a fixed buffer)."""
    if not supported(x, weight, out):
        raise ValueError(
            "cuBLASLt product needs 2-D CUDA fp16/bf16 x [M, K], weight [N, K] and out [M, N] of one "
            f"dtype, unit column strides and 8-element rows: got x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}, out {tuple(out.shape)} {out.dtype}"
        )
    problem = Problem.of(x, weight, out)
    lib, state, descs = _lib(), _state(x.device), _descriptors(problem)
    stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
    _check(
        lib.cublasLtMatmul(
            state.handle,
            descs.desc,
            ctypes.byref(_ONE),
            ctypes.c_void_p(weight.data_ptr()),
            descs.a,
            ctypes.c_void_p(x.data_ptr()),
            descs.b,
            ctypes.byref(_ZERO),
            ctypes.c_void_p(out.data_ptr()),
            descs.d,
            ctypes.c_void_p(out.data_ptr()),
            descs.d,
            ctypes.byref(algo),
            ctypes.c_void_p(state.workspace.data_ptr()),
            WORKSPACE_BYTES,
            stream,
        ),
        "cublasLtMatmul",
    )
    return out
