"""Group layer: topology, fabric transport and the (pure) save planner."""
