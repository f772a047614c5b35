"""Forewarn: predict GPU failures and live-migrate training ranks before they happen.

This top-level package is deliberately tiny. It holds what every room shares — the wire
schema (:mod:`forewarn.wire`), the error tree (:mod:`forewarn.errors`) and the ``forewarn``
command line (:mod:`forewarn.cli`) — and imports nothing heavy, so that the node collector and
the in-job migrator can import it without the server's dependencies.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
