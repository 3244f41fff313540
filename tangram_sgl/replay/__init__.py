"""Multi-turn conversation replay: workloads, an OpenAI-endpoint driver, the CPU reference engine, reports."""
