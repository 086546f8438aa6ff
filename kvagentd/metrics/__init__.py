"""Prometheus: the daemon's registry and core metrics (`registry`), the metrics-only TCP
listener (`http`) and the per-scrape collector (`scrape`)."""
