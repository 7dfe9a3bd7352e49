"""Weight sync from the trainer into rollout engines: versioned, checksummed, all-or-nothing."""
