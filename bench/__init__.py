"""rpcnb's benchmarks: ``python -m bench.run`` (see docs/benchmarks.md)."""
