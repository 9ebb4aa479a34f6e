"""Benchmarks, each runnable as ``python -m bench.NAME``; they print a table and write JSON.

They are not tests: they start their own redis-server and measure threadlog beside raw redis-py
in one run. Results are recorded in ``bench/RESULTS.md``.
"""
