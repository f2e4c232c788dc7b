"""Where the processes of a run sit: the P x T layout (ranks, groups, peers)."""
