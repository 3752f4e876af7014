"""Builds the client's one C module, kvhost._lookup (the shared lookup
table's probe), where a C compiler and Python's headers are at hand; the
client works without it (kvhost.lookuptable falls back to Python), so a
failed build only warns. Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvhost._lookup",
            sources=["src/kvhost/_lookup.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
            optional=True,
        )
    ]
)
