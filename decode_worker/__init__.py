"""The decode worker: receives prompt KV into its pool and streams tokens."""

from decode_worker.worker import ColocatedWorker, DecodeWorker

__all__ = ["ColocatedWorker", "DecodeWorker"]
