"""Offline profiling: calibration data, scorers, budgets, grouping and AOT split tables."""
