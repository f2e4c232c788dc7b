"""What travels between the engine and the stages, and how: the P x T layout, the transport, the messages,
block-table deltas. Imports nothing of tdpipe outside this package."""
