"""Models of the top layer (the core never imports this package)."""
