"""The node agent: reads GPU health from a source and pushes it to the service.

Imports the wire schema (:mod:`forewarn.wire`) and nothing of the server, nor torch: it must
run on a GPU node with only ``pydantic`` and ``httpx`` installed.
"""
