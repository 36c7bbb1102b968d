"""pallas."""
