"""tangram_sgl: non-uniform per-attention-head KV-cache compression for multi-turn serving in SGLang."""

__version__ = "0.1.0"
