"""Device-independent measurement of the tensor memory an op allocates (used by tests and bench/).

TensorMemoryTracker is a TorchDispatchMode: every tensor an aten op returns while the mode is active has its
storage counted once (views share their base's storage and add nothing) until that storage is freed, so `peak_bytes`
is the most memory the code under the mode held at once in storages it allocated itself, forward and backward
alike. Tensors that existed before (inputs, parameters) are not counted; scratch space a single kernel allocates and
frees internally is invisible to it, as it is to autograd.
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemoryTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}  # StorageImpl address -> bytes, for storages allocated under the mode
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_bytes = 0  # the largest single storage allocated

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:  # not a view or in-place
                self._count(t.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.largest_bytes = max(self.largest_bytes, nbytes)
        # A storage's Python object lives exactly as long as the storage itself (PyObject preservation), so the
        # finalizer runs when the memory is released.
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key)
