"""Discrete-event simulation of tdpipe's engine at the papers' scale (TD-Pipe §4): hardware and model tables,
a roofline cost model and a virtual clock under the real engine, scheduler and block manager."""
