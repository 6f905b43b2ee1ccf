"""Benchmarks: measuring functions return records; bench/report.py prints them."""
