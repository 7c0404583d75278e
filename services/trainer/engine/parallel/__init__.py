"""Parallelism of the training engine over torch.distributed: the layout (dims.py: ParallelDims and its named
DeviceMesh) and how each dimension is applied to a model built on the meta device."""
from services.trainer.engine.parallel.dims import KNOBS, ParallelDims, build_mesh, from_mapping

__all__ = ["KNOBS", "ParallelDims", "build_mesh", "from_mapping"]
