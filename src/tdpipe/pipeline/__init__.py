"""The pipeline runtime (TD-Pipe §3.2, SiPipe §4): the wire at the bottom (layout, transport, messages,
block-table sync); above it the engine side (executor.py: the data path; processes.py: the stage processes'
lifecycle) and the stage side (stage.py)."""
