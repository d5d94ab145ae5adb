"""``gpupool demo``: a whole pool on loopback (etcd, coordinator, simulated agent) and small Lightning jobs."""
