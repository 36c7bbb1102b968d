"""Native CPU kernels called from compiled steps through XLA's FFI (see linear.cc)."""
