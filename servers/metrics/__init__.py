"""What a server tells about itself: counters, recent errors and the monitor snapshot (`telemetry`), Prometheus
`/metrics` (`prometheus`), and `metrics.jsonl` / TensorBoard per step (`training_record`)."""
