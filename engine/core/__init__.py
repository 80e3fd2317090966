"""The engine's pure core: requests and their queues, the paged block pool and its prefix
hashes, and the token-budget scheduler. Plain Python on plain data (no torch), strictly
typed, and driven by the simulator as well as by the engine."""
