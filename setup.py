"""Build of the optional C accelerator (``urc._native._walk``); metadata is in pyproject.toml.

``optional=True``: without a C compiler or Python headers the install still succeeds and
``urc.fastpath`` falls back to its pure-Python twin.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "urc._native._walk",
            sources=["urc/_native/walk.c"],
            optional=True,
        )
    ]
)
