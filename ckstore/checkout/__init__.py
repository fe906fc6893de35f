"""Checkout: shard resolution, the read planner (frozen plans, no I/O) and the executor that fetches and assembles."""
