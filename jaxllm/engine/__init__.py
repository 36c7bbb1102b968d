"""The engine: the step loop, its sync and async drivers, and output processing."""
