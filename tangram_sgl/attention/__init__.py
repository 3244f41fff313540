"""The tangram attention path: per-layer attention + K/V writes through ``TangramKVManager`` (shared by the
SGLang attention backend and the CPU reference engine), and SGLang's ``TangramAttnBackend``."""
