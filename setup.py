"""Builds the one compiled piece: the ggml eval callback that taps a shard's last block output."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ggufswarm.runtime.llamacpp._graph_tap", ["src/ggufswarm/runtime/llamacpp/_graph_tap.c"])])
