"""What crosses a process boundary: sampling parameters, the messages between router and
workers, the token channel and its frames, the workers' call protocols and the typed clients
that make those calls, and the metric definitions. Imports nothing else of the engine (and
no torch), so the router can take it alone (``tests/unit/test_boundaries.py``)."""
