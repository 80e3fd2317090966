"""Topology config, worker pools, the controller actor, the whole service and the ``tandem`` CLI."""
