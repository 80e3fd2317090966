"""Topology, worker pools and the ``tandem`` command line."""
