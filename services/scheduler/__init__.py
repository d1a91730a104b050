"""Gyre's control plane: placement policies (elastic, async, colocate) and the cluster simulator."""
