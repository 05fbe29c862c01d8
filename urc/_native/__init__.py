"""Compiled accelerators (optional C extensions built at install time; see ``urc.fastpath``)."""
