# cython: language_level=3
"""_selective built for the baseline instruction set alone (no clones): the path LAMINA_ISA=baseline
loads, so that path is tested on every machine."""
include "_selective.pyx"
