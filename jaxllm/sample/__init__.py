"""On-device sampling inside the compiled step: per-request parameters as arrays."""
