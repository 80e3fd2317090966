"""The prefill worker: computes prompt KV and ships it to a decode worker."""

from prefill_worker.worker import PrefillLoad, PrefillResult, PrefillWorker

__all__ = ["PrefillLoad", "PrefillResult", "PrefillWorker"]
