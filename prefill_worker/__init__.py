"""The prefill worker: computes prompt KV and ships it to a decode worker."""

from prefill_worker.worker import PrefillWorker

__all__ = ["PrefillWorker"]
