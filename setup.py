"""The one compiled part: the integer-dot mat-vec kernel (runtime/_qdot.c). Everything else is in
pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "kimistream.runtime._qdot", ["runtime/_qdot.c"],
    extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno", "-ffp-contract=off"],
)])
