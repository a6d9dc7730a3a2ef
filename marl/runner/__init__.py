"""The run's machinery: `marl run` (run.py), the local servers it starts and supervises (launch.py, or
ray_cluster.py on Ray), how the coordinator reaches each server (endpoints.py), and what watches
the trainable servers while games play (server_watch.py, stall_watch.py)."""
