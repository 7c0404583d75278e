"""TensorData (wire) <-> torch, with checks that name the offending field."""
from __future__ import annotations

import numpy as np
import torch

from services.common.errors import InvalidArgument
from trainyard.v1 import trainer_pb2 as pb

DTYPES = {pb.TensorData.DTYPE_FLOAT32: (np.float32, torch.float32), pb.TensorData.DTYPE_INT64: (np.int64, torch.int64)}


def to_torch(t: pb.TensorData, field: str) -> torch.Tensor:
    if t.dtype not in DTYPES:
        raise InvalidArgument("dtype must be DTYPE_FLOAT32 or DTYPE_INT64", field=f"{field}.dtype")
    np_dtype, _ = DTYPES[t.dtype]
    shape = tuple(int(s) for s in t.shape)
    if any(s < 0 for s in shape):
        raise InvalidArgument(f"negative dimension in shape {list(shape)}", field=f"{field}.shape")
    count = int(np.prod(shape)) if shape else 1
    itemsize = np.dtype(np_dtype).itemsize
    if len(t.data) != count * itemsize:
        raise InvalidArgument(f"{len(t.data)} bytes do not hold shape {list(shape)} of "
                              f"{pb.TensorData.DType.Name(t.dtype)} ({count * itemsize} bytes)", field=f"{field}.data")
    arr = np.frombuffer(t.data, dtype=np.dtype(np_dtype).newbyteorder("<")).reshape(shape)
    return torch.from_numpy(arr.astype(np_dtype, copy=True))


def from_torch(x: torch.Tensor) -> pb.TensorData:
    x = x.detach().cpu()
    if x.is_floating_point():
        arr, dtype = x.to(torch.float32).numpy().astype("<f4"), pb.TensorData.DTYPE_FLOAT32
    else:
        arr, dtype = x.to(torch.int64).numpy().astype("<i8"), pb.TensorData.DTYPE_INT64
    return pb.TensorData(dtype=dtype, shape=list(arr.shape), data=arr.tobytes())
