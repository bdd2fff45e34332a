"""A compile cache that travels: bundles of compiled artifacts keyed by what invalidates them (``session``)."""
