"""lamina's benchmarks against its peers; run `python -m bench --help`."""
