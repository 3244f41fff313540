"""SGLang hooks, one module per SGLang seam (installed as ``tangram_sgl.patches``)."""
