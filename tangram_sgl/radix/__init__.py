"""Radix tree over token ids whose nodes own compressed head-group segments (+ the SGLang adapter)."""
