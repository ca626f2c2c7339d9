"""safetensors files with numpy: `read_safetensors`, `safetensors_keys`, `write_safetensors` (and the built-in
`read_builtin` / `write_builtin` they fall back to).

The `safetensors` package (`jaxattn[models]`) is used when installed and able to read the file; a small reader and
writer of the format (an 8-byte little-endian header length, a JSON header of names, dtypes, shapes and byte
offsets, then the raw little-endian data) stands in otherwise, so the loader also works where `safetensors` is
missing or too old for bfloat16 through numpy (bfloat16 comes from `ml_dtypes`, which jax depends on).
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _header(path):
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > os.path.getsize(path) - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {n} exceeds the file)")
        header = json.loads(f.read(n))
    return header, 8 + n


def safetensors_keys(path) -> list[str]:
    """The tensor names of a safetensors file (its header only)."""
    header, _ = _header(path)
    return [k for k in header if k != "__metadata__"]


def read_builtin(path) -> dict[str, np.ndarray]:
    """The file's tensors through the built-in reader (what `read_safetensors` falls back to)."""
    header, start = _header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which this reader does not know")
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]].newbyteorder("<")
        out[name] = np.frombuffer(data[start + begin : start + end], dtype=dtype).reshape(info["shape"])
    return out


def read_safetensors(path) -> dict[str, np.ndarray]:
    """{name: array} of a safetensors file (memory-mapped where possible)."""
    try:
        from safetensors.numpy import load_file
    except ImportError:
        return read_builtin(path)
    try:
        return load_file(path)
    except (TypeError, KeyError, ValueError):  # e.g. an older safetensors without bfloat16 through numpy
        return read_builtin(path)


def write_safetensors(path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes {name: array} as a safetensors file (`metadata`: the header's string map, e.g. {"format": "pt"})."""
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    try:
        from safetensors.numpy import save_file
    except ImportError:
        save_file = None
    if save_file is not None:
        try:
            save_file(tensors, str(path), metadata=metadata)
            return
        except (TypeError, KeyError, ValueError):
            pass
    write_builtin(path, tensors, metadata)


def write_builtin(path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes `tensors` through the built-in writer (what `write_safetensors` falls back to)."""
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = dict(metadata)
    for name in sorted(tensors):
        array = tensors[name]
        if array.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} cannot be written to safetensors here")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            f.write(tensors[name].astype(tensors[name].dtype.newbyteorder("<"), copy=False).tobytes())
