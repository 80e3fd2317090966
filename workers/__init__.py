"""What the worker actors share: ``WorkerBase`` (``workers/base.py``), an engine
stepping in its thread joined to a KV transfer backend.

Each role builds on it in its own package: ``prefill_worker/`` and ``decode_worker/``.
"""
