"""What every family shares: the blocks (blocks.py: RMSNorm, grouped-query attention, SwiGLU MLP, the pre-norm
decoder layer), the one decoder and causal-LM head (decoder.py), and pipeline stages of it (pipeline.py). A family
(models/families.py) supplies only what differs."""

from trainyard.lazy import lazy_exports

_EXPORTS = {"MLP": "models.common.blocks", "Attention": "models.common.blocks", "DecoderLayer": "models.common.blocks",
            "RMSNorm": "models.common.blocks", "CausalLM": "models.common.decoder",
            "pipeline_stage": "models.common.pipeline"}

__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
