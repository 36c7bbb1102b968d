"""Scale-out: the device mesh, logical-axis sharding rules, multi-host start-up."""
