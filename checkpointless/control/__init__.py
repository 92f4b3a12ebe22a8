"""Control plane: coordinator, worker-side client and the control-store wire format."""
