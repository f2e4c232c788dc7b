"""Pictures of tdpipe runs: the pipeline timeline (TD-Pipe Fig. 2) and KV cache usage (Fig. 12)."""
