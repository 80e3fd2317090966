"""The ``tandem`` command (``tandem/cli.py``): the one package above all the others, so
that none of them imports it. ``python -m tandem`` is the same command."""
