"""The pipeline runtime (TD-Pipe §3.2, SiPipe §4): the wire at the bottom (layout, transport, messages,
block-table sync), the engine side (executor.py) and the stage side (stage.py) above it."""
