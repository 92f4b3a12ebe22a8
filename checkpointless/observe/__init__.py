"""Everything that turns events into something to read: the report, the timeline plot, the
console line and table, the Prometheus feed. Nothing in the core imports this."""
