"""Build of the optional C accelerators (``urc._native._walk``, ``urc._native._pages``,
``urc._native._gckeys``); metadata is in pyproject.toml.

``optional=True``: without a C compiler or Python headers the install still succeeds and
``urc.fastpath`` / ``urc.pools.pageops`` fall back to their pure-Python twins.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "urc._native._walk",
            sources=["urc/_native/walk.c"],
            optional=True,
        ),
        Extension("urc._native._pages", sources=["urc/_native/pages.c"], optional=True),
        Extension("urc._native._gckeys", sources=["urc/_native/gckeys.c"], optional=True),
        Extension("urc._native._pack", sources=["urc/_native/pack.c"], optional=True),
    ]
)
