"""The decode worker: receives prompt KV into its pool and streams tokens."""

from decode_worker.worker import DecodeLoad, DecodeWorker, StreamDelta

__all__ = ["DecodeLoad", "DecodeWorker", "StreamDelta"]
