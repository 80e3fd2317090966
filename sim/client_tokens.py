"""When the simulated clients got their tokens, and what the routers' latency window saw.

``sim/simulator.py`` hands over every token that reaches a client: one from a step or a
KV hand-off (``token``), or a decode run's steps at once (``ran``: ``sim.worker``'s runs,
taken as one event). Each token's time is kept on its request's ``Record``
(``sim/records.py``). With autoscaling they also wait here, in the order the clients got
them, until the controller reads the routers' latency window (``report``, after the
simulator's ``cut_runs``).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

from sim.records import Record

if TYPE_CHECKING:
    from router.latency import LatencyWindow


class ClientTokens:
    """The clients' tokens of one run, and with autoscaling (``window``: the routers'
    ``LatencyWindow``) their first-token times and gaps waiting for the controller."""

    def __init__(self, window: LatencyWindow | None) -> None:
        self.window = window
        # (when, order, seconds) of first tokens and of the gaps after, until ``report``.
        self._ttft_feed: list[tuple[float, int, float]] = []
        self._itl_feed: list[tuple[float, int, float]] = []
        self._feed_order = itertools.count()

    def token(self, rec: Record, now: float) -> None:
        """A token reached the client ``now`` (counted in the routers' latency window with autoscaling)."""
        times = rec.token_times
        if self.window is not None:
            if times:
                self._itl_feed.append((now, next(self._feed_order), now - times[-1]))
            else:
                self._ttft_feed.append((now, next(self._feed_order), now - rec.req.arrival_s))
        times.append(now)

    def ran(self, records: list[Record], requests, ends: np.ndarray) -> None:
        """A decode run's steps ended at ``ends``: each of its ``requests`` (whose records
        ``records`` holds, by request id) got a token at each."""
        times = ends.tobytes()
        feed = ends.tolist() if self.window is not None else None  # the latency window's, with autoscaling
        for request in requests:
            rec = records[int(request.request_id)]
            if feed is not None:
                self._feed_run(rec, feed)
            rec.token_times.frombytes(times)

    def _feed_run(self, rec: Record, ends) -> None:
        """``rec``'s tokens at ``ends`` (a run's steps) for the latency window. The first may
        be its first token: a prompt whose last token was left to a step of its own (a
        chunk that ended one short) decodes in the run from there."""
        order, last = self._feed_order, rec.token_times[-1] if rec.token_times else None
        for end in ends:
            if last is None:
                self._ttft_feed.append((end, next(order), end - rec.req.arrival_s))
            else:
                self._itl_feed.append((end, next(order), end - last))
            last = end

    def report(self, now: float):
        """What the routers' clients saw lately (``LatencyWindow.report``), every token up to
        ``now`` in the window, in the order the clients got them (the simulator's runs cut
        first: ``Simulator.cut_runs``). The window keeps only its last ``max_samples`` of
        each kind, so only those are handed to it."""
        window = self.window
        for feed, add in ((self._ttft_feed, window.first_token),
                          (self._itl_feed, lambda seconds, when: window.tokens(1, seconds, when))):
            feed.sort()
            for when, _, seconds in feed[-window.max_samples:]:
                add(seconds, when)
            feed.clear()
        return window.report(now)
